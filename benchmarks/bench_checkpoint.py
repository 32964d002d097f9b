"""k3-checkpoint save, load+validate and resume memory against plain torch.save / torch.load.

One table. Both sides handle the same model and AdamW state dicts in one process, interleaved
(the order alternates every repeat), from the page cache; a row gives each side's median
with its min-max, the ratio of medians and the min-max of the per-repeat ratios (a slow
mode on one side shows in its max, which a median hides). The candidate's save includes fsync of
the file and the directory, so its target is against ``torch.save + fsync``; the load target
is against torch.load plus load_state_dict into the model and optimizer, the work
load_checkpoint also does. Rows without a target show where the cost goes: the price of
durability, the verified payload alone, the checksum hashed before ``torch.load`` against
beside it (the payload size from which load_checkpoint overlaps them), a load of small
tensors packed against one record per tensor, a resume in a fresh process (one subprocess
per measurement, where every page is a first touch) with the peak resident memory each side
adds, and checksum algorithms over the large file.

    python benchmarks/bench_checkpoint.py            # small and large state, 9 repeats
    python benchmarks/bench_checkpoint.py --quick    # small state, 3 repeats (smoke test)
    python benchmarks/bench_checkpoint.py --states huge   # a 384 MiB state
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from torch import nn

from k3_checkpoint import load_checkpoint, packing, read_payload, save_checkpoint
from k3_checkpoint import payload as payload_module

TARGET = 1.15  # save vs torch.save + fsync; load+validate vs torch.load + load_state_dict
MEMORY_TARGET = 1.10  # a fresh resume's peak memory vs torch.load + load_state_dict's


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.mlp_norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)


class Decoder(nn.Module):
    """Parameters shaped like a small decoder; the benchmark never runs it forward."""

    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)


class Holder:
    """A loader cursor or a set of counters: plain state behind state_dict()."""

    def __init__(self, **state: object) -> None:
        self.state = state

    def state_dict(self) -> dict[str, object]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.state = dict(state)


@dataclass
class State:
    name: str
    model: Decoder
    optimizer: torch.optim.Optimizer
    loaders: dict[str, Holder]
    counters: Holder

    def plain_state(self) -> dict[str, object]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def plain_resume(self, path: Path) -> None:
        """What most training loops do: torch.load, then load_state_dict of both."""
        loaded = torch.load(path, weights_only=True)
        self.model.load_state_dict(loaded["model"])
        self.optimizer.load_state_dict(loaded["optimizer"])

    def mmap_resume(self, path: Path, copy: bool) -> None:
        """torch.load(mmap=True), the alternative k3-checkpoint turned down: the optimizer
        state either keeps views of the mapping or, with ``copy``, is copied out of it."""
        loaded = torch.load(path, mmap=True, weights_only=True)
        optimizer = loaded["optimizer"]
        if copy:
            state = {k: {n: v.clone() for n, v in s.items()} for k, s in optimizer["state"].items()}
            optimizer = {**optimizer, "state": state}
        self.model.load_state_dict(loaded["model"])
        self.optimizer.load_state_dict(optimizer)

    def k3_resume(self, path: Path) -> None:
        load_checkpoint(path, **self.k3_kwargs())  # type: ignore[arg-type]

    def k3_kwargs(self) -> dict[str, object]:
        return {
            "components": {
                "model": self.model,
                "optimizer": self.optimizer,
                "counters": self.counters,
                "loaders": self.loaders,
            },
            "metadata": {
                "train_config": {"lr": 3e-4, "max_steps": 1000, "lr_schedule": "cosine"},
                "model_config": {"name": self.name},
                "vocab_size": self.model.embed.num_embeddings,
                "qk_clip": {"policy": {"tau": 100.0}, "geometry": {"heads": 4}},
            },
        }


SIZES = {  # vocab, width, layers
    "small": (2048, 64, 2),  # 4 MiB
    "large": (4096, 256, 8),  # 96 MiB
    "huge": (8192, 512, 8),  # 384 MiB, only with --states: how the ratios move with size
}


def build(name: str, vocab: int, width: int, layers: int, *, trained: bool = True) -> State:
    """The state; ``trained=False`` is what a resuming process has: an optimizer with no
    moments yet."""
    torch.manual_seed(0)
    model = Decoder(vocab, width, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    if trained:
        for parameter in model.parameters():  # one step so AdamW holds its moments
            parameter.grad = torch.randn_like(parameter)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    loaders = {
        "train": Holder(offset=123_456, manifest_digest="a" * 64),
        "val": Holder(offset=0, manifest_digest="b" * 64),
    }
    counters = Holder(step=1000, tokens_seen=10**9, skipped_updates=0)
    return State(name, model, optimizer, loaders, counters)


def timed(function: Callable[[], object]) -> float:
    gc.collect()
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def fsynced_torch_save(state: dict[str, object], path: Path) -> None:
    with open(path, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())


@dataclass
class Comparison:
    """Paired measurements: ``baseline[i]`` and ``candidate[i]`` were taken side by side."""

    baseline: list[float]
    candidate: list[float]

    @property
    def ratio(self) -> float:
        """The ratio of the medians."""
        return statistics.median(self.candidate) / statistics.median(self.baseline)

    def cells(self, scale: float = 1e3, form: str = ".1f") -> tuple[str, str, str, str]:
        """(baseline, measured, ratio, spread) as the table prints them: each side's median
        (min-max), the ratio of medians and the min-max of the per-repeat ratios."""
        ratios = [c / b for b, c in zip(self.baseline, self.candidate)]
        return (spread(self.baseline, scale, form), spread(self.candidate, scale, form),
                f"{self.ratio:.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}")  # fmt: skip


def spread(values: list[float], scale: float, form: str) -> str:
    """``median (min-max)`` of ``values`` times ``scale``."""
    low, middle, high = (scale * v for v in (min(values), statistics.median(values), max(values)))
    return f"{middle:{form}} ({low:{form}}-{high:{form}})"


def compare(
    repeats: int, baseline: Callable[[], object], candidate: Callable[[], object]
) -> Comparison:
    """``repeats`` interleaved pairs of seconds, after one warm-up call of each."""
    baseline()  # warm-up: page cache, allocator, lazy imports
    candidate()
    base, cand = [], []
    for repeat in range(repeats):
        pair = (baseline, candidate) if repeat % 2 == 0 else (candidate, baseline)
        first, second = timed(pair[0]), timed(pair[1])
        base.append(first if repeat % 2 == 0 else second)
        cand.append(second if repeat % 2 == 0 else first)
    return Comparison(base, cand)


def bench_state(state: State, repeats: int, directory: Path) -> list[tuple[str, ...]]:
    plain_path, k3_path = directory / f"{state.name}.pt", directory / f"{state.name}.k3"
    kwargs = state.k3_kwargs()

    def plain_save() -> None:
        torch.save(state.plain_state(), plain_path)

    def k3_save() -> None:
        save_checkpoint(k3_path, **kwargs)  # type: ignore[arg-type]

    def plain_load() -> None:
        torch.load(plain_path, weights_only=True)

    def plain_resume() -> None:
        state.plain_resume(plain_path)

    def k3_load() -> None:
        state.k3_resume(k3_path)

    def k3_read() -> None:
        read_payload(k3_path)

    def hashed(overlap: bool) -> Callable[[], None]:
        def read() -> None:
            default = payload_module.OVERLAP_FROM
            payload_module.OVERLAP_FROM = 0 if overlap else 1 << 62
            try:
                read_payload(k3_path)
            finally:
                payload_module.OVERLAP_FROM = default

        return read

    unpacked_path = directory / f"{state.name}.unpacked.k3"

    def k3_load_unpacked() -> None:
        load_checkpoint(unpacked_path, **kwargs)  # type: ignore[arg-type]

    plain_save()
    k3_save()
    default = packing.PACK_AT_MOST
    packing.PACK_AT_MOST = 0  # one zip record per tensor, as before packing
    try:
        save_checkpoint(unpacked_path, **kwargs)  # type: ignore[arg-type]
    finally:
        packing.PACK_AT_MOST = default
    size = f"{k3_path.stat().st_size / 2**20:.1f} MiB"
    rows = [  # (measure, baseline, baseline fn, candidate fn, judged against TARGET)
        (
            "save ms",
            "torch.save + fsync",
            lambda: fsynced_torch_save(state.plain_state(), plain_path),
            k3_save,
            True,
        ),
        ("save ms", "torch.save", plain_save, k3_save, False),
        ("load+validate ms", "torch.load + load_state_dict", plain_resume, k3_load, True),
        ("load+validate ms", "torch.load", plain_load, k3_load, False),
        ("read_payload ms", "torch.load", plain_load, k3_read, False),
        ("read_payload ms, hashed beside torch.load", "hashed before it", hashed(False),
         hashed(True), False),
        ("load+validate ms, small tensors packed", "one record per tensor", k3_load_unpacked,
         k3_load, False),
    ]  # fmt: skip
    table: list[tuple[str, ...]] = []
    for measure, baseline_name, baseline, candidate, judged in rows:
        measured = compare(repeats, baseline, candidate)
        table.append((state.name, size, measure, baseline_name, *measured.cells(),
                      verdict(measured.ratio, TARGET) if judged else "-"))  # fmt: skip
    return table


def verdict(ratio: float, target: float) -> str:
    return f"<= {target}x {'met' if ratio <= target else 'missed'}"


def resume_once(kind: str, name: str, directory: Path) -> tuple[float, float]:
    """One resume in this (fresh) process, one of ``RESUMES``. Returns the seconds it took
    and the peak resident memory it added (MiB above the resident size before it; NaN off
    Linux)."""
    state = build(name, *SIZES[name], trained=False)
    resume: Callable[[Path], None] = {
        "plain": state.plain_resume,
        "k3": state.k3_resume,
        "mmap": lambda path: state.mmap_resume(path, copy=False),
        "mmap-copy": lambda path: state.mmap_resume(path, copy=True),
    }[kind]
    path = directory / f"{name}.{'k3' if kind == 'k3' else 'pt'}"
    gc.collect()
    before = _resident_mib()
    start = time.perf_counter()
    resume(path)
    seconds = time.perf_counter() - start
    return seconds, _peak_mib() - before


def _resident_mib() -> float:
    """Resident memory now, after resetting the kernel's high-water mark to it (Linux's
    ``/proc/self/clear_refs``), so ``_peak_mib`` sees only what comes after; NaN elsewhere."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_mib("VmRSS")
    except (OSError, ValueError):
        return float("nan")


def _peak_mib() -> float:
    """The resident high-water mark since ``_resident_mib`` (NaN off Linux)."""
    try:
        return _status_mib("VmHWM")
    except (OSError, ValueError):
        return float("nan")


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise ValueError(f"no {field} in /proc/self/status")


RESUMES = {  # kind: what the fresh-process rows call it
    "plain": "torch.load + load_state_dict",
    "k3": "load_checkpoint",
    "mmap": "torch.load(mmap=True), optimizer state left mapped",
    "mmap-copy": "torch.load(mmap=True), optimizer state copied",
}


def bench_fresh_resume(
    name: str, repeats: int, directory: Path, kinds: tuple[str, ...] = ("plain", "k3")
) -> list[tuple[str, ...]]:
    """A resume as it happens: once, in a new process, into memory it has never used (every
    page of the loaded state is a first touch). One subprocess per measurement, in an order
    that rotates every repeat. Rows: load_checkpoint's time and peak memory against torch's,
    then the peak memory of each other kind."""
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    peaks: dict[str, list[float]] = {kind: [] for kind in kinds}
    for repeat in range(repeats + 1):  # the first round warms the page cache and is dropped
        turn = repeat % len(kinds)
        for kind in kinds[turn:] + kinds[:turn]:
            command = [sys.executable, __file__, "--resume-once", kind, name, str(directory)]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            seconds, peak = map(float, output.split()[-2:])
            if repeat:
                times[kind].append(seconds)
                peaks[kind].append(peak)
    size = f"{(directory / f'{name}.k3').stat().st_size / 2**20:.1f} MiB"
    Measure = tuple[str, dict[str, list[float]], str, float, str, "float | None"]
    measures: list[Measure] = [("resume ms, fresh process", times, "k3", 1e3, ".1f", None)]
    measures += [
        (f"resume peak MiB added, fresh process{'' if kind == 'k3' else ', ' + RESUMES[kind]}",
         peaks, kind, 1.0, ".0f", MEMORY_TARGET if kind == "k3" else None)
        for kind in kinds[1:]
    ]  # fmt: skip
    rows: list[tuple[str, ...]] = []
    for measure, values, kind, scale, form, target in measures:
        measured = Comparison(values["plain"], values[kind])
        rows.append((name, size, measure, RESUMES["plain"], *measured.cells(scale, form),
                     verdict(measured.ratio, target) if target else "-"))  # fmt: skip
    return rows


def checksum_rates(name: str, path: Path, repeats: int) -> list[tuple[str, ...]]:
    """Checksum algorithms over the file in memory, each against torch.load of the state."""
    data = memoryview(path.read_bytes())
    size = f"{data.nbytes / 2**20:.1f} MiB"

    def load() -> None:
        torch.load(path.with_suffix(".pt"), weights_only=True)

    rows: list[tuple[str, ...]] = []
    for algorithm, function in (
        ("xxh3-128 (the checksum)", lambda: xxhash.xxh3_128_digest(data)),
        ("sha256 (0.1.x's digest)", lambda: hashlib.sha256(data).digest()),
        ("crc32", lambda: zlib.crc32(data)),
    ):
        measured = compare(repeats, load, function)
        rate = data.nbytes / statistics.median(measured.candidate) / 1e9
        rows.append((name, size, f"{algorithm} ms, in memory ({rate:.1f} GB/s)", "torch.load",
                     *measured.cells(), "-"))  # fmt: skip
    return rows


def print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small state, 3 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="timed pairs per row")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: temp)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument(
        "--states", default="small,large",
        help=f"comma-separated states among {', '.join(SIZES)} (default: small,large)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the table rows to this file")
    parser.add_argument("--resume-once", nargs=3, help=argparse.SUPPRESS)  # KIND NAME DIR
    args = parser.parse_args()
    if args.resume_once:
        kind, name, directory = args.resume_once
        print(*resume_once(kind, name, Path(directory)))
        return
    if args.threads:  # 1 steadies a shared machine: OpenMP copies stall when a core is taken
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (3 if args.quick else 9)
    names = ["small"] if args.quick else args.states.split(",")
    unknown = sorted(set(names) - set(SIZES))
    if unknown:
        parser.error(f"unknown states {unknown}: choose among {', '.join(SIZES)}")
    sizes = [(name, *SIZES[name]) for name in names]
    print(
        f"k3-checkpoint vs plain torch: torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads, {repeats} interleaved repeats (ms and MiB: median (min-max))"
    )
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        directory = Path(scratch)
        rows: list[tuple[str, ...]] = []
        for name, vocab, width, layers in sizes:
            rows += bench_state(build(name, vocab, width, layers), repeats, directory)
        fresh = 1 if args.quick else repeats  # a subprocess (torch import) per measurement
        for name, *_ in sizes:  # the mmap alternatives matter for the large state
            kinds = tuple(RESUMES) if name == "large" else ("plain", "k3")
            rows += bench_fresh_resume(name, fresh, directory, kinds)
        largest = sizes[-1][0]
        rows += checksum_rates(largest, directory / f"{largest}.k3", repeats)
        header = ("state", "file", "measure", "against", "baseline", "measured", "ratio",
                  "spread", "target")  # fmt: skip
        print_table(header, rows)
        if args.json:
            args.json.write_text(json.dumps([dict(zip(header, row)) for row in rows], indent=2))

if __name__ == "__main__":
    main()
