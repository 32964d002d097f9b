"""Trainer overhead: ``Trainer.fit()`` per step vs a bare hand-written loop, same
model/optimizer/data.

Run: ``hatch run bench:trainer`` (``--quick`` for a smoke run). Each candidate owns an
identical model (tiny preset), MuonAdamW and loader; their steps are interleaved one by
one (trainer, bare, bare+QK-Clip, trainer, ...) so machine noise hits all alike.
``Trainer.fit()`` runs with log/eval/checkpoint intervals beyond the run, as the target asks.
"""

from __future__ import annotations

import argparse
import itertools
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
    args = parser.parse_args()
    warmup = 3
    total = warmup + (args.steps or (5 if args.quick else 60))
    config = TrainConfig(max_steps=total, log_interval=10 * total, eval_interval=10 * total,
                         checkpoint_interval=10 * total)
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
    write_json(args.json, {**{t.name: {"median_s": t.median, "seconds": t.seconds}
                              for t in timings.values()}, "diagnostics": diagnostics})


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


if __name__ == "__main__":
    main()
