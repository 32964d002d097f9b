"""Trainer overhead: ``Trainer.fit()`` per step vs a bare hand-written loop, same
model/optimizer/data; and the training stall per checkpoint, synchronous vs background.

Run: ``hatch run bench:trainer`` (``--quick`` for a smoke run). Each candidate owns an
identical model (tiny preset), MuonAdamW and loader; their steps are interleaved one by
one (trainer, bare, bare+QK-Clip, trainer, ...) so machine noise hits all alike.
``Trainer.fit()`` runs with log/eval/checkpoint intervals beyond the run, as the target asks.

The checkpoint stall (``--stall-presets``): runs without checkpoints, with synchronous ones
and with ``async_checkpoint``, alternating, on the tiny and small presets. A checkpoint's
stall is the time the few steps after it took beyond the same run's other steps (their
median), so it holds the save itself for a synchronous save and, for a background one, the
snapshot plus whatever the write's thread took from training while it ran. The run without
checkpoints, measured the same way at the same steps, is the control: its "stall" is the
method's noise. Also reported: the time the training thread was blocked (the checkpoint
event's ``blocked_s``), the write's own duration and the host memory a background save
holds until written.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common import Timing, print_table, write_json
from k3_model import K3Model, preset
from k3_qkclip import QKClip
from k3_trainer import (
    Callback,
    MetricsLog,
    TokenDataLoader,
    TrainConfig,
    Trainer,
    TrainState,
    build_optimizer,
    learning_rate_at_step,
    prepare_dataset,
)
from k3_trainer.checkpoint import qk_clip_policy

FIT = "Trainer.fit()"


def _setup(config: TrainConfig, data: Path):
    torch.manual_seed(0)
    model = K3Model(preset("tiny"))
    return model, build_optimizer(model, config), TokenDataLoader(
        data, "train", config.batch_size, config.seq_len)


class _OnStep(Callback):
    """Calls ``hook(state, stats)`` after every successful update."""

    def __init__(self, hook: Callable[[TrainState, dict[str, float]], None]) -> None:
        self.hook = hook

    def on_step_end(self, trainer: Trainer, stats: dict[str, float]) -> None:
        self.hook(trainer.state, stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per loop")
    parser.add_argument("--json")
    parser.add_argument("--stall-presets", default="tiny,small",
                        help="presets of the checkpoint stall table ('' skips it)")
    args = parser.parse_args()
    warmup = 3
    total = warmup + (args.steps or (5 if args.quick else 60))
    batch, length = QUICK_SHAPE if args.quick else (16, 128)
    # The closing evaluation is never timed: one batch is enough of it.
    config = TrainConfig(max_steps=total, batch_size=batch, seq_len=length,
                         log_interval=10 * total, eval_interval=10 * total,
                         checkpoint_interval=10 * total, eval_batches=1)
    data = Path(tempfile.mkdtemp()) / "builtin"
    prepare_dataset([], data)

    trainer = _setup(config, data)
    bare = _setup(config, data)
    bare_qk = _setup(config, data)
    val = TokenDataLoader(data, "val", config.batch_size, config.seq_len)

    def bare_loop(parts, steps: int, step0: list[int], qk: QKClip | None) -> None:
        model, opt, loader = parts
        model.train()
        for _ in range(steps):
            step0[0] += 1
            for group in opt.param_groups:
                group["lr"] = learning_rate_at_step(config, step0[0])
            if qk:
                qk.reset()
            x, y = loader.next_batch()
            _, loss = model(x, targets=y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            if qk:
                qk.validate()
            opt.step()
            if qk:
                qk.apply()
            opt.zero_grad(set_to_none=True)

    # One Trainer.fit() run; after each of its updates, a callback runs one bare step and one
    # bare+QK-Clip step. The trainer's step time is the gap between callbacks, so the three
    # loops interleave step by step and the final step's eval/log is never timed.
    counters = {"bare": [0], "bare_qk": [0]}
    timings = {name: Timing(name) for name in
               (FIT, "bare loop", "bare loop + QK-Clip")}
    last_end = [0.0]

    with QKClip(bare_qk[0], qk_clip_policy(config)) as qk:
        def interleave(state: TrainState, stats: dict) -> None:
            now = time.perf_counter()
            if state.step > warmup:
                timings[FIT].seconds.append(now - last_end[0])
            for name, parts, key, clip in (("bare loop", bare, "bare", None),
                                           ("bare loop + QK-Clip", bare_qk, "bare_qk", qk)):
                start = time.perf_counter()
                bare_loop(parts, 1, counters[key], clip)
                if state.step > warmup:
                    timings[name].seconds.append(time.perf_counter() - start)
            last_end[0] = time.perf_counter()

        model, opt, loader = trainer
        last_end[0] = time.perf_counter()
        Trainer(model, opt, (loader, val), config,
                callbacks=[MetricsLog(None), _OnStep(interleave)]).fit()
    base = timings["bare loop"].median
    rows = [[t.name, f"{t.median * 1e3:.1f}", t.spread(), f"{t.median / base:.3f}"]
            for t in timings.values()]
    print_table(f"Step time, tiny preset, {config.batch_size}×{config.seq_len} tokens, fp32, "
                f"{total - warmup} interleaved steps each", ["loop", "median ms/step",
                                                            "min–max", "× bare loop"], rows)
    diagnostics = bench_diagnostics(config, data, val, chunks=2 if args.quick else 6)
    presets = [name for name in args.stall_presets.split(",") if name]
    stall = bench_checkpoint_stall(presets, data, **(
        {"repeats": 1, "checkpoints": 2, "interval": 4, "window": 2, "shape": QUICK_SHAPE}
        if args.quick else {"repeats": 3, "checkpoints": 3}))
    write_json(args.json, {**{t.name: {"median_s": t.median, "seconds": t.seconds}
                              for t in timings.values()}, "diagnostics": diagnostics,
                           "checkpoint_stall": stall})


def bench_diagnostics(config: TrainConfig, data: Path, val: TokenDataLoader,
                      chunks: int, chunk: int = 10) -> dict[str, float]:
    """Trainer.fit() with diagnostics (MoE routing stats, window QK summary) on vs off, in
    alternating chunks; per-step gaps between on_step_end calls, first gap of a chunk and
    the chunk's closing eval/log excluded (the profiler window is never on here). Each
    chunk is a new Trainer that continues the counters of the previous one."""
    runs = {True: (_setup(config, data), TrainState()), False: (_setup(config, data),
                                                                 TrainState())}
    timings = {True: Timing("diagnostics on"), False: Timing("diagnostics off")}
    for index in range(chunks + 1):  # chunk 0 warms up
        for flag, ((model, opt, loader), state) in runs.items():
            marks: list[float] = []
            trainer = Trainer(
                model, opt, (loader, val),
                config.replace(max_steps=state.step + chunk, eval_batches=1),
                callbacks=[MetricsLog(None), _OnStep(
                    lambda s, stats, marks=marks: marks.append(time.perf_counter()))])
            trainer.diagnostics = flag
            trainer.state.load_state_dict(state.state_dict())  # continue the counters
            state.load_state_dict(trainer.fit().state_dict())
            if index:
                timings[flag].seconds.extend(b - a for a, b in itertools.pairwise(marks))
    on, off = timings[True], timings[False]
    print_table(f"Diagnostics overhead, tiny preset, {chunks} alternating chunks of {chunk}",
                [FIT, "median ms/step", "min–max", "× off"],
                [[t.name, f"{t.median * 1e3:.1f}", t.spread(), f"{t.median / off.median:.3f}"]
                 for t in (off, on)])
    return {"on_median_s": on.median, "off_median_s": off.median,
            "ratio": on.median / off.median}


STALL_TARGET = 0.15  # a background save's stall against a synchronous one's
STALL_BATCH = {"tiny": (16, 128), "small": (4, 128)}  # small: CPU steps of a few seconds
QUICK_SHAPE = (4, 32)  # --quick: the smoke run's batch × sequence, every path at a toy size


class _Marks(Callback):
    """Step-end times and the checkpoint events, as they come."""

    def __init__(self) -> None:
        self.ends: dict[int, float] = {}
        self.saved: list[dict] = []

    def on_step_end(self, trainer, stats) -> None:  # type: ignore[no-untyped-def]
        self.ends[trainer.state.step] = time.perf_counter()

    def on_checkpoint_saved(self, trainer, record) -> None:  # type: ignore[no-untyped-def]
        self.saved.append(dict(record))


def _stall_run(name: str, data: Path, mode: str, interval: int, checkpoints: int,
               device: torch.device, shape: tuple[int, int]) -> _Marks:
    """One run with ``checkpoints`` saves ``interval`` steps apart and ``interval - 1`` steps
    after the last; ``mode``: none, sync, async (bf16 autocast on a GPU)."""
    from k3_trainer.checkpoint import CheckpointHistory

    batch, length = shape
    steps = interval * (checkpoints + 1) - 1
    config = TrainConfig(max_steps=steps, batch_size=batch, seq_len=length,
                         log_interval=10 * steps, eval_interval=10 * steps,
                         checkpoint_interval=interval, async_checkpoint=mode == "async",
                         eval_batches=1,  # the closing evaluation is no stall; keep it short
                         precision="bf16" if device.type == "cuda" else "fp32")
    torch.manual_seed(0)
    model = K3Model(preset(name)).to(device)
    loaders = (TokenDataLoader(data, "train", batch, length),
               TokenDataLoader(data, "val", batch, length))
    marks = _Marks()
    with tempfile.TemporaryDirectory() as folder:
        history = None if mode == "none" else CheckpointHistory(folder)
        Trainer(model, build_optimizer(model, config), loaders, config,
                checkpoint_path=history, callbacks=[MetricsLog(None), marks]).fit()
    return marks


def _stalls(marks: _Marks, interval: int, checkpoints: int, window: int) -> list[float]:
    """Per checkpoint step ``s``: steps ``s+1 .. s+window`` against the run's other steps
    (from the third on, the first two warming up)."""
    steps = {t: marks.ends[t] - marks.ends[t - 1] for t in marks.ends if t - 1 in marks.ends
             and t >= 3}
    saved = range(interval, interval * checkpoints + 1, interval)
    after = {s + k for s in saved for k in range(1, window + 1)}
    reference = statistics.median(d for t, d in steps.items() if t not in after)
    return [sum(steps[s + k] - reference for k in range(1, window + 1)) for s in saved]


def bench_checkpoint_stall(presets: list[str], data: Path, repeats: int,
                           checkpoints: int, interval: int = 6, window: int = 3,
                           device: torch.device | None = None,
                           shape: tuple[int, int] | None = None) -> dict[str, dict]:
    """Per preset: the stall per checkpoint of synchronous and background saves, the
    control's, the blocked time, the write time and the snapshot's memory (see the module
    docstring)."""
    results: dict[str, dict] = {}
    rows = []
    modes = ("none", "sync", "async")
    for name in presets:
        stalls: dict[str, list[float]] = {mode: [] for mode in modes}
        events: dict[str, list[dict]] = {mode: [] for mode in modes}
        steps: list[float] = []
        for _ in range(repeats):  # alternating, so drift hits every mode alike
            for mode in modes:
                marks = _stall_run(name, data, mode, interval, checkpoints,
                                   device or torch.device("cpu"),
                                   shape or STALL_BATCH.get(name, (16, 128)))
                stalls[mode] += _stalls(marks, interval, checkpoints, window)
                events[mode] += marks.saved[:checkpoints]
                ends = [marks.ends[t] for t in sorted(marks.ends) if t >= 2]
                steps += [b - a for a, b in itertools.pairwise(ends)]
        stall = {mode: statistics.median(values) for mode, values in stalls.items()}
        held = max(e.get("held_bytes", 0) for e in events["async"])
        blocked = {m: statistics.median(e["blocked_s"] for e in events[m]) for m in
                   ("sync", "async")}
        written = statistics.median(e["write_s"] for e in events["async"])
        ratio = stall["async"] / stall["sync"]
        results[name] = {"step_s": statistics.median(steps), "stall_s": stall,
                         "stalls_s": stalls, "blocked_s": blocked, "write_s": written,
                         "held_bytes": held, "ratio": ratio}
        spread = {m: f"{min(v) * 1e3:.0f}–{max(v) * 1e3:.0f}" for m, v in stalls.items()}
        rows.append([name, f"{results[name]['step_s'] * 1e3:.0f}",
                     f"{stall['none'] * 1e3:.1f} ({spread['none']})",
                     f"{stall['sync'] * 1e3:.1f} ({spread['sync']})",
                     f"{stall['async'] * 1e3:.1f} ({spread['async']})", f"{ratio:.3f}",
                     f"{blocked['sync'] * 1e3:.1f} / {blocked['async'] * 1e3:.1f}",
                     f"{blocked['async'] / blocked['sync']:.3f}",
                     f"{written * 1e3:.1f}", f"{held / 2**20:.1f}"])
    if rows:
        print_table(f"Training stall per checkpoint: {repeats}×{checkpoints} checkpoints per "
                    f"mode, every {interval} steps, the {window} steps after each against "
                    f"the run's others (target: background ≤ {STALL_TARGET} × synchronous)",
                    ["preset", "step ms", "control ms (min–max)", "sync stall ms",
                     "async stall ms", "async / sync", "blocked ms sync / async",
                     "blocked async / sync",
                     "async write ms", "async holds MiB"], rows)
    return results


if __name__ == "__main__":
    main()
