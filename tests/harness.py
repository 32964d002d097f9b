"""Shared pieces of the reliability tests: a small model, the CLI in a new process, bitwise
comparison of checkpoints, a checkpoint forger, fingerprints and fault injectors, and the
warm torchrun the successful launches go through.

Everything here is test code; nothing in it is imported by the packages.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import math
import os
import random
import signal
import struct
import subprocess
import sys
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from torch import nn

from k3_checkpoint import capture_rng
from k3_model import K3Model
from k3_model import preset as model_preset
from k3_trainer import TokenDataLoader, TrainConfig, build_optimizer

TESTS = Path(__file__).resolve().parent
DRIVER = TESTS / "cli_driver.py"

# The tiny preset shrunk to a couple of milliseconds per step: MLA attention observed by
# QK-Clip, one dense layer and one quantile-balanced MoE layer.
NARROW_TINY_OVERRIDES: dict[str, Any] = dict(
    d_model=32, n_layers=2, n_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=8, n_experts=4, moe_d_ff=32, d_ff=64,
)
NARROW_TINY_MODEL = model_preset("tiny", **NARROW_TINY_OVERRIDES)
# The [train] fields every harness run starts from (config files and train_config alike).
BASE_TRAIN: dict[str, Any] = dict(batch_size=4, seq_len=16, log_interval=1, eval_interval=3,
                                   eval_batches=2, peak_lr=3e-3)


def toml_text(*, model: Mapping[str, Any] | None = NARROW_TINY_OVERRIDES,
              train: Mapping[str, Any] | None = None, preset: str = "tiny") -> str:
    """A ``k3-train --config`` file: the preset, ``[model]`` overrides and ``[train]`` fields."""
    lines = [f'preset = "{preset}"']
    for table, values in (("model", model), ("train", {**BASE_TRAIN, **(train or {})})):
        if values:
            lines.append(f"[{table}]")
            lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


# -- the command line in a new process --------------------------------------------------


def k3_train(*args: Any, env: Mapping[str, str] | None = None, driver: bool = False,
             timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``python -m k3_trainer.cli ARGS``: a fork of the warm launch server
    (launch_server.py), which has imported torch and the k3 packages, with this call's
    streams, environment and exit status. A fresh interpreter where a fork cannot stand in
    for one: ``driver`` (``cli_driver.py``'s test-only fault injection around the same
    ``main``), another ``OMP_NUM_THREADS`` than the server's (torch read it on import), or
    where the server cannot run (it listens on a Linux abstract socket and imports
    torch.distributed)."""
    environment = subprocess_env(env)
    command = [sys.executable, "-m", "k3_trainer.cli"]
    if driver:
        command = [sys.executable, str(DRIVER)]
    elif sys.platform == "linux" and torch.distributed.is_available():
        server = launch_server()
        if environment["OMP_NUM_THREADS"] == _launcher_threads:
            command = [sys.executable, "-S", str(TESTS / "launch_client.py"), server,
                       "k3-train"]
    return subprocess.run([*command, *map(str, args)], capture_output=True, text=True,
                          env=environment, timeout=timeout)


def subprocess_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment and torch thread count (so a checkpoint written here and
    one written there share the runtime signature), with the built-in-corpus cache pointed
    away from the home directory."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    env.setdefault("K3_TRAIN_CACHE", str(Path(os.environ.get("TMPDIR", "/tmp")) / "k3-cache"))
    env.update(extra or {})
    return env


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it. The tree is read from ``/proc`` before
    anything is killed: an orphan is adopted by init, and its parent link to the tree is
    lost. Without ``/proc`` (not Linux), only ``pid``'s process group."""
    if not Path("/proc/self/stat").exists():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        return
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(proc_stat(int(entry.name))[1])
        except (ValueError, OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    tree, index = [pid], 0
    while index < len(tree):
        tree += children.get(tree[index], [])
        index += 1
    for member in tree:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(member, signal.SIGKILL)


_launcher: subprocess.Popen[bytes] | None = None
_launcher_threads: str | None = None  # the OMP_NUM_THREADS it imported torch with


def launch_server() -> str:
    """The name of this pytest process's launch server (launch_server.py), started on
    first use (its imports take a few seconds, once) and ended when this process ends.
    Here, not in a test module: pytest's importlib mode imports a test module once as a
    test and again for each module importing from it, each copy with its own globals."""
    global _launcher, _launcher_threads
    name = f"k3-launch-{os.getpid()}"
    if _launcher is not None and _launcher.poll() is None:
        return name
    env = subprocess_env()
    _launcher_threads = env["OMP_NUM_THREADS"]
    _launcher = subprocess.Popen([sys.executable, "-u", TESTS / "launch_server.py", name],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                 start_new_session=True)
    assert _launcher.stdout is not None
    if _launcher.stdout.readline() != b"ready\n":
        raise RuntimeError(f"the launch server did not start (exit {_launcher.wait()})")
    atexit.register(_stop_launcher, _launcher)
    return name


def _stop_launcher(server: subprocess.Popen[bytes]) -> None:
    assert server.stdin is not None
    server.stdin.close()  # its cue to end, taking any launch still running with it
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        kill_tree(server.pid)


def proc_stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name: state, ppid, ... (comm may
    hold spaces and parentheses, so they are the ones after its last ")"). Linux only."""
    return Path("/proc", str(pid), "stat").read_text().rsplit(")", 1)[1].split()


PROGRESS = ("k3-train: resumed from step", "k3-train: plan: ")
"""The progress lines a session prints before a later failure: a resume's "resumed from
step N" and the planner's memory line."""


def refusal_lines(stderr: str) -> list[str]:
    """stderr's non-blank lines less the progress lines (the refusals are what remains)."""
    return [line for line in stderr.splitlines()
            if line.strip() and not line.startswith(PROGRESS)]


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    """A finished command's stderr, less its progress lines."""
    return refusal_lines(result.stderr)


def rank_errors(stderr: str) -> dict[int, str]:
    """``{rank: message}`` of a torchrun launch's ``k3-train[rank R]: error: message`` lines
    (two ranks writing to one pipe at once may run their lines together). A rank can be
    missing: when one rank exits first, torchrun terminates the others, so which ranks
    report a refusal every rank makes is a race."""
    said = {}
    for part in stderr.split("k3-train[rank ")[1:]:
        rank, _, rest = part.partition("]: error: ")
        if rank.isdigit() and rest:
            said[int(rank)] = rest.split("\n", 1)[0]
    return said


def assert_one_line_error(result: subprocess.CompletedProcess[str], match: str,
                          code: int | None = None) -> str:
    """Non-zero exit, exactly one stderr line starting with ``k3-train:``, no traceback."""
    lines = error_lines(result)
    assert result.returncode != 0, result.stdout + result.stderr
    if code is not None:
        assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 and lines[0].startswith("k3-train:"), result.stderr
    assert match in lines[0], (match, lines[0])
    return lines[0]


# -- bitwise comparison ------------------------------------------------------------------


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def assert_bitwise_equal(a: Any, b: Any, where: str = "payload") -> None:
    """``a`` and ``b`` hold the same structure, the same types and the same bits
    (tensors by their bytes, floats by their hex form, so -0.0 and NaN payloads count)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (where, a.dtype, a.shape, b.dtype,
                                                          b.shape)
        assert torch.equal(_bits(a), _bits(b)), f"{where}: tensors differ"
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping), where
        assert sorted(map(str, a)) == sorted(map(str, b)), (where, sorted(map(str, a)),
                                                             sorted(map(str, b)))
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{index}]")
    elif isinstance(a, float):
        assert type(b) is float and a.hex() == b.hex(), (where, a, b)
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


# -- forging checkpoint files (the documented k3-checkpoint file format) -------------------

MAGIC = b"\x89K3CKPT\n"
_FIELDS = struct.Struct("<8sIIQ16s20x")


def k3_trailer(body: bytes, format_version: int = 7) -> bytes:
    """The 64-byte trailer the README documents: magic, format, checksum scheme 2, length,
    the XXH3-128 of every byte before it, twenty zero bytes, crc32 of the rest."""
    fields = _FIELDS.pack(MAGIC, format_version, 2, len(body), xxhash.xxh3_128_digest(body))
    return fields + struct.pack("<I", zlib.crc32(fields))


def forge(path: Path, payload: Any, format_version: int = 7) -> None:
    """Write ``payload`` as a careful forger would: torch.save's zip, its comment the valid
    trailer that follows it."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    body = bytearray(buffer.getvalue())
    body[-2:] = (64).to_bytes(2, "little")  # the zip's end record: comment length
    path.write_bytes(bytes(body) + k3_trailer(bytes(body), format_version))


class Evil:
    """A pickle that runs a command when unpickled (never, under weights_only=True)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


# -- library-level runs --------------------------------------------------------------------


def train_config(**overrides: Any) -> TrainConfig:
    return TrainConfig(**{**BASE_TRAIN, "max_steps": 6, "checkpoint_interval": 3,
                          **overrides})


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_run(config: TrainConfig, data_dir: Path, model_config=NARROW_TINY_MODEL,
              seed: int | None = None):
    """Seed, then model, optimizer and both loaders, in the order the CLI builds them."""
    seed_all(config.seed if seed is None else seed)
    model = K3Model(model_config)
    optimizer = build_optimizer(model, config)
    train_loader = TokenDataLoader(data_dir, "train", config.batch_size, config.seq_len)
    val_loader = TokenDataLoader(data_dir, "val", config.batch_size, config.seq_len)
    return model, optimizer, train_loader, val_loader


def tree_digest(value: Any) -> str:
    """sha256 over a nested structure of tensors and plain values."""
    hasher = hashlib.sha256()

    def feed(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            hasher.update(f"T{item.dtype}{list(item.shape)}".encode())
            hasher.update(_bits(item).numpy().tobytes())
        elif isinstance(item, Mapping):
            for key in sorted(item, key=str):
                hasher.update(f"K{key!r}".encode())
                feed(item[key])
        elif isinstance(item, (list, tuple)):
            hasher.update(f"L{len(item)}".encode())
            for element in item:
                feed(element)
        else:
            hasher.update(f"V{item!r}".encode())

    feed(value)
    return hasher.hexdigest()


def state_fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer,
                      loaders) -> dict[str, str]:
    """Hashes of what a refused load must leave alone: weights and buffers, optimizer
    state, loader cursors, and every global RNG."""
    return {
        "model": tree_digest(model.state_dict()),
        "optimizer": tree_digest(optimizer.state_dict()),
        "loaders": tree_digest([loader.state_dict() for loader in loaders]),
        "rng": tree_digest(capture_rng()),
    }


def moved(config: TrainConfig, data_dir: Path, model_config=NARROW_TINY_MODEL,
          data: Path | None = None):
    """A live run that differs from any checkpoint everywhere (one real step, cursors and
    RNG advanced), so that a partial restore would show in its fingerprint."""
    model, optimizer, train_loader, val_loader = build_run(config, data or data_dir,
                                                           model_config, seed=4242)
    x, y = train_loader.next_batch()
    model(x, targets=y)[1].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    val_loader.next_batch()
    torch.rand(3)
    np.random.rand()
    random.random()
    return model, optimizer, train_loader, val_loader


class Inject(nn.Module):
    """Wraps a model and, on chosen training forwards (1-based, counted per instance),
    injects a fault: ``inf`` (the gradient overflows, as under FP16), ``nan_loss`` (the
    loss is NaN), ``qk_inf``/``qk_nan`` (an attention module reports a non-finite max
    logit through QK-Clip's public observer). ``noise``: every training forward draws from
    Python's, NumPy's and torch's global generators and lets the draws scale the loss, so
    a resume that restored any of them wrongly would diverge."""

    def __init__(self, inner: nn.Module, calls=(), kind: str = "inf",
                 noise: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.calls, self.kind, self.noise, self.count = set(calls), kind, noise, 0

    def forward(self, x, targets=None):
        logits, loss = self.inner(x, targets=targets)
        if not self.training:
            return logits, loss
        self.count += 1
        if self.noise:
            draw = torch.rand(()) + float(np.random.rand()) + random.random()
            loss = loss * (1.0 + 1e-2 * draw)
        if self.count in self.calls:
            if self.kind == "nan_loss":
                loss = loss * float("nan")
            elif self.kind == "inf":
                loss.register_hook(lambda g: g * float("inf"))
            else:
                value = math.inf if self.kind == "qk_inf" else math.nan
                observers = [m.qk_observer for m in self.inner.modules()
                             if getattr(m, "qk_observer", None) is not None]
                assert observers, "QK-Clip is not observing this model"
                observers[0].record(torch.full((observers[0].n_heads,), value))
        return logits, loss


def latest_checkpoint(run_dir: Path) -> Path:
    """The run directory's latest checkpoint file, ``checkpoints/latest/k3.ckpt`` (``latest``
    a symlink naming a ``step-NNNNNNNN`` folder beside it)."""
    link = Path(run_dir) / "checkpoints" / "latest"
    assert link.is_symlink(), f"{link} is not the symlink of a checkpoint history"
    assert os.readlink(link).startswith("step-"), os.readlink(link)
    return link / "k3.ckpt"


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path → content) and every symlink (→ ``b"-> "``
    and its target, e.g. a history's ``latest``): "nothing changed" is equality."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (b"-> " + os.fsencode(os.readlink(p)) if p.is_symlink()
                                       else p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_symlink() or p.is_file()}
