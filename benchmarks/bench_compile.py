"""Eager vs ``compile=True`` (regional torch.compile of each decoder block): step time.

Run: ``hatch run bench:compile`` (``--quick`` for a smoke run). For each preset two
identical models, MuonAdamW optimizers and batches; one has its blocks compiled the way
``Trainer.fit()`` does with ``compile=True`` (``k3_trainer.compiling.prepare_model``).
A training step is forward + backward + optimizer step + zero_grad. Compilation happens during the
untimed warmup steps and is reported separately; the timed steps alternate eager and
compiled so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import time

import torch

from common import Timing, print_table, write_json
from k3_model import K3Model, preset
from k3_trainer import TrainConfig, build_optimizer
from k3_trainer.compiling import CompileClock, prepare_model


def _candidate(name: str, config: TrainConfig, overrides: dict[str, object]):
    torch.manual_seed(0)
    model = K3Model(preset(name, **overrides))
    prepare_model(model, config)
    model.train()
    return model, build_optimizer(model, config)


def _step(model, optimizer, x, y) -> None:
    _, loss = model(x, targets=y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=None, help="timed steps per candidate")
    parser.add_argument("--json")
    args = parser.parse_args()
    steps = args.steps or (2 if args.quick else 8)
    rows, results = [], {}
    for name in args.presets:
        batch, seq = (2, 32) if args.quick else ((16, 128) if name == "tiny" else (4, 256))
        overrides: dict[str, object] = {"n_layers": 2} if args.quick else {}
        if name != "tiny":
            overrides["vocab_size"] = 8192  # keeps the head from dominating a CPU step
        eager = _candidate(name, TrainConfig(), overrides)
        compiled = _candidate(name, TrainConfig(compile=True), overrides)
        vocab = eager[0].config.vocab_size
        x = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
        y = torch.roll(x, -1, dims=1)
        with CompileClock() as clock:
            start = time.perf_counter()
            for _ in range(2):  # compiles forward and backward of every block kind
                _step(*compiled, x, y)
            warm = time.perf_counter() - start
        _step(*eager, x, y)
        timings = {"eager": Timing("eager"), "compiled": Timing("compiled")}
        for _ in range(steps):
            for label, (model, optimizer) in (("eager", eager), ("compiled", compiled)):
                start = time.perf_counter()
                _step(model, optimizer, x, y)
                timings[label].seconds.append(time.perf_counter() - start)
        ratio = timings["compiled"].median / timings["eager"].median
        rows.append([name, f"{batch}×{seq}", f"{timings['eager'].median * 1e3:.1f}",
                     f"{timings['compiled'].median * 1e3:.1f}", f"{ratio:.3f}",
                     f"{clock.seconds:.1f}", f"{warm:.1f}"])
        results[name] = {"batch": batch, "seq": seq, "eager": timings["eager"],
                         "compiled": timings["compiled"], "ratio": ratio,
                         "compile_s": clock.seconds, "first_two_steps_s": warm}
    print_table("Training step: eager vs regional compile (fp32, CPU)",
                ["preset", "batch", "eager ms", "compiled ms", "compiled ÷ eager",
                 "compile s", "first 2 steps s"], rows)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
