"""Pipeline bubble: a training step at ``--pipeline-parallel 2`` (two CPU ranks over gloo,
1F1B, one thread each) against one process (one thread) doing the same global batch as
gradient accumulation over the same ``M`` microbatches, for M = 2, 4, 8.

Run: ``hatch run dev:python benchmarks/bench_pipeline.py`` (``--quick`` for a smoke run).
With the stages balanced and communication free, two stages take ``T1/2`` of work each and
the schedule idles a fraction ``(p−1)/(m+p−1)`` of the time (the bubble), so the ideal
speed-up is ``p·m/(m+p−1)``: 1.33 at M 2, 1.6 at M 4, 1.78 at M 8. The table sets the
measured speed-up beside it; what falls short is gloo's send/recv, the schedule's own
work and an uneven cut (the embedding on stage 0, the head and loss on stage 1). Each
figure is the median of the timed steps (warm-up dropped) of a fresh launch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import print_table, write_json
from k3_model import K3Model, preset

PIPELINE = 2


def _model(quick: bool) -> K3Model:
    return K3Model(preset("tiny", d_model=64 if quick else 128, n_layers=4, max_seq_len=128))


def _worker(args: argparse.Namespace) -> None:
    """One timed run: the reference (one process) or one rank of the pipeline."""
    from k3_trainer import build_optimizer
    from k3_trainer.config import TrainConfig
    from k3_trainer.distributed import init_parallel, shutdown
    from k3_trainer.models import get_model_spec
    from k3_trainer.pipeline import Pipeline

    torch.set_num_threads(1)
    torch.manual_seed(0)
    m, rows, seq = args.microbatches, args.batch, args.seq
    config = TrainConfig(batch_size=rows, seq_len=seq, pp_schedule="1f1b",
                         pipeline_parallel=1 if args.reference else PIPELINE,
                         pp_microbatches=None if args.reference else m)
    model = _model(args.quick)
    model.train()
    parallel, pipeline = None, None
    if not args.reference:
        parallel, _ = init_parallel("fsdp", torch.device("cpu"), PIPELINE)
        assert parallel is not None
        hooks = get_model_spec("k3").pipeline
        assert hooks is not None
        pipeline = Pipeline(model, hooks, parallel, config)
        parallel.wrap(model, pipeline.modules)
        pipeline.start()
    optimizer = build_optimizer(model, config, stage=pipeline is not None)
    vocab = model.config.vocab_size
    seconds = []
    for _ in range(args.warmup + args.steps):
        x = torch.randint(0, vocab, (rows, seq))
        y = torch.randint(0, vocab, (rows, seq))
        if parallel is not None:
            parallel.barrier()
        start = time.perf_counter()
        if pipeline is not None:
            pipeline.train(x, y, m)
        else:
            for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
                _, loss = model(xs, targets=ys)
                (loss / m).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if parallel is not None:
            parallel.barrier()
        seconds.append(time.perf_counter() - start)
    if parallel is None or parallel.rank == 0:
        Path(args.out).write_text(json.dumps(statistics.median(seconds[args.warmup:])))
    shutdown(parallel)


def _launch(script: Path, out: Path, reference: bool, settings: list[str]) -> float:
    if reference:
        command = [sys.executable, str(script), "--worker", "--reference", *settings]
    else:
        command = [str(Path(sys.executable).with_name("torchrun")), "--standalone",
                   "--nproc_per_node", str(PIPELINE), str(script), "--worker", *settings]
    done = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True,
                          timeout=900)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return float(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer steps")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--microbatches", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, default=128, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=6, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    steps = ["--steps", "2", "--warmup", "1", "--quick"] if args.quick else []
    rows, results = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for m in (2,) if args.quick else (2, 4, 8):  # --quick: the smoke run, one row
            settings = ["--microbatches", str(m), *steps]
            one = _launch(Path(__file__), Path(scratch) / "one", True, settings)
            staged = _launch(Path(__file__), Path(scratch) / "pp", False, settings)
            bubble = (PIPELINE - 1) / (m + PIPELINE - 1)
            ideal = PIPELINE * m / (m + PIPELINE - 1)
            results.append({"microbatches": m, "one_process_s": one, "pp2_s": staged,
                            "speedup": one / staged, "ideal_speedup": ideal,
                            "bubble": bubble})
            rows.append([str(m), f"{one * 1e3:.0f}", f"{staged * 1e3:.0f}",
                         f"{one / staged:.2f}", f"{ideal:.2f}", f"{bubble:.2f}"])
    print_table("Step time, one process (1 thread) vs --pipeline-parallel 2 (1F1B, "
                "2 ranks × 1 thread, gloo), same global batch and microbatches",
                ["M", "one process ms", "PP 2 ms", "speed-up", "ideal p·m/(m+p−1)",
                 "bubble (p−1)/(m+p−1)"], rows)
    write_json(args.json, {"results": results})


if __name__ == "__main__":
    main()
