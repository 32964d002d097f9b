"""Trainer step time on 1 process vs 2 data-parallel ranks (DDP, FSDP2, FSDP2 with expert
parallelism) at equal global batch, and the expert traffic of FSDP2 against EP.

Run: ``hatch run bench:distributed`` (``--quick`` for a smoke run). The 2 ranks run on CPU
over gloo with per-rank batch B/2; the one process reads the whole global batch B, so
every candidate trains on the same tokens per step (issue #17's "1 vs 2 ranks at equal
global batch"). On a 2-core machine the fair pairing is 2 ranks × 1 thread against 1
process × 2 threads (the same cores); 1 process × 1 thread is shown for scale, and is
the steadier baseline on a loaded machine, where 2 OpenMP threads that wait on each other
lose whole time slices to other processes.

Each round launches the one-process candidates in a fresh process, then both 2-rank
candidates in one fresh pair of processes (DDP, then FSDP2), so rounds interleave the
candidates. A candidate's figure is the median over rounds of its per-round median step
time, the time between consecutive ``Trainer.fit()`` updates (warm-up steps dropped; no log,
eval or checkpoint inside the timed steps).

Expert traffic per rank and step, the second table: under FSDP2 alone each rank
all-gathers the other ranks' shards of every expert stack in the forward and again in the
backward and reduce-scatters their gradients, ``3·(W−1)/W`` of the stacks' bytes (computed
from their size: FSDP2 has no byte counter); with ``--expert-parallel 2`` the experts stay
put and the tokens move: the all-to-all bytes the trainer's MoE window counts, forward and
backward. FSDP2's traffic for the other parameters is the same in both.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from common import print_table, write_json
from k3_model import K3Model, preset
from k3_trainer import (
    Callback,
    MetricsLog,
    TokenDataLoader,
    TrainConfig,
    Trainer,
    build_optimizer,
    prepare_dataset,
)
from k3_trainer.distributed import Parallel, init_parallel, shutdown
from k3_trainer.models import get_model_spec

SINGLE = ("1 process × 2 threads", "1 process × 1 thread")
RANKED = ("2 ranks DDP × 1 thread", "2 ranks FSDP2 × 1 thread",
          "2 ranks FSDP2 + EP 2 × 1 thread")
RANKED_LAYOUTS = (("ddp", 1), ("fsdp", 1), ("fsdp", 2))  # (mode, expert-parallel degree)
QUICK_MODEL = dict(d_model=32, n_layers=2, n_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                   qk_rope_head_dim=8, v_head_dim=8, n_experts=4, moe_d_ff=32, d_ff=64)


def _settings(quick: bool) -> dict[str, Any]:
    """Model, global batch and step counts: the tiny preset at the trainer's default
    global batch (16 × 128), or a shrunk tiny model for the smoke run."""
    if quick:
        return {"model": QUICK_MODEL, "batch": 8, "seq_len": 32, "warmup": 2, "steps": 4}
    return {"model": {}, "batch": 16, "seq_len": 128, "warmup": 2, "steps": 8}


class _Stamps(Callback):
    """The time of every successful update."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_step_end(self, trainer: Trainer, stats: dict[str, float]) -> None:
        self.stamps.append(time.perf_counter())


def _step_seconds(data: Path, settings: dict[str, Any], parallel: Parallel | None,
                  expert_parallel: int = 1, traffic: dict[str, float] | None = None
                  ) -> list[float]:
    """Train a fresh model for warm-up + timed steps; the timed steps' durations. With
    ``traffic``, also this rank's expert bytes per step (see the module docstring)."""
    world = parallel.world_size if parallel is not None else 1
    rank = parallel.rank if parallel is not None else 0
    total = settings["warmup"] + settings["steps"]
    config = TrainConfig(batch_size=settings["batch"] // world, seq_len=settings["seq_len"],
                         max_steps=total, decay_steps=total, log_interval=10 * total,
                         eval_interval=10 * total, checkpoint_interval=10 * total,
                         eval_batches=1, expert_parallel=expert_parallel,
                         precision=settings.get("precision", "fp32"))
    torch.manual_seed(config.seed)
    device = parallel.device if parallel is not None else torch.device("cpu")
    model = K3Model(preset(settings.get("preset", "tiny"), **settings["model"])).to(device)
    expert_bytes = sum(layer.experts.w_gate.nbytes * 3 for layer in model.moe_layers().values())
    if parallel is not None:  # as the trainer's runner does
        parallel.shard_experts(model, config.expert_parallel,
                                get_model_spec("k3").expert_parallel)
        model.set_balancer_gather(parallel.gather_rows)
        parallel.wrap(model)
    optimizer = build_optimizer(model, config,
                                distributed=True if parallel and parallel.mode == "ddp" else None)
    loaders = [TokenDataLoader(data, split, config.batch_size, config.seq_len, rank=rank,
                               world_size=world) for split in ("train", "val")]
    stamps, log = _Stamps(), MetricsLog(None)
    Trainer(model, optimizer, loaders, config, parallel=parallel, callbacks=[log, stamps]).fit()
    if traffic is not None and parallel is not None:
        if expert_parallel > 1:  # counted by the trainer's MoE window, over every step
            last = [e for e in log.events if e["event"] == "train"][-1]
            traffic["bytes"] = last["moe_all_to_all_bytes_per_step"]
        else:
            traffic["bytes"] = 3 * expert_bytes * (world - 1) / world
    return [b - a for a, b in itertools.pairwise(stamps.stamps)][settings["warmup"] - 1:]


def _single_worker(index: int, data: str, settings: dict[str, Any], out: str) -> None:
    """One process, the whole global batch: 2 threads, then 1."""
    seconds = {}
    for name, threads in zip(SINGLE, (2, 1)):
        torch.set_num_threads(threads)
        seconds[name] = _step_seconds(Path(data), settings, None)
    Path(out).write_text(json.dumps(seconds))


def _ranked_worker(rank: int, world: int, port: int, data: str, settings: dict[str, Any],
                   out: str) -> None:
    """One of the 2 ranks, 1 thread, per-rank batch B/2: DDP, FSDP2, then FSDP2 with the
    experts split over both ranks, in one group."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    seconds, traffic = {}, {}
    parallel = None
    for name, (mode, degree) in zip(RANKED, RANKED_LAYOUTS):
        parallel, _ = init_parallel(mode, torch.device("cpu"))
        assert parallel is not None
        moved: dict[str, float] = {}
        seconds[name] = _step_seconds(Path(data), settings, parallel, degree,
                                      moved if mode == "fsdp" else None)
        if moved:
            traffic[name] = moved["bytes"]
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": seconds, "traffic": traffic}))
    shutdown(parallel)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="shrunk model, one round")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (quick: 1)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    settings = _settings(args.quick)
    rounds = args.rounds or (1 if args.quick else 3)
    per_round: dict[str, list[float]] = {name: [] for name in (*SINGLE, *RANKED)}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "builtin"
        prepare_dataset([], data)
        for index in range(rounds):
            out = Path(tmp) / f"round{index}"
            # Forked, not spawned: the workers start with torch and k3 imported (this
            # process runs no torch computation, so no OpenMP pool is copied half-alive).
            mp.start_processes(_single_worker, nprocs=1, start_method="fork",
                               args=(str(data), settings, f"{out}.single.json"))
            mp.start_processes(_ranked_worker, nprocs=2, start_method="fork",
                               args=(2, _free_port(), str(data), settings,
                                     f"{out}.ranked.json"))
            ranked = json.loads(Path(f"{out}.ranked.json").read_text())
            single = json.loads(Path(f"{out}.single.json").read_text())
            for name, seconds in {**single, **ranked["seconds"]}.items():
                per_round[name].append(statistics.median(seconds))
            traffic = ranked["traffic"]  # the same every round (the same tokens)
    medians = {name: statistics.median(values) for name, values in per_round.items()}
    best = {name: min(values) for name, values in per_round.items()}
    base = medians[SINGLE[0]]
    load = os.getloadavg()
    tokens = settings["batch"] * settings["seq_len"]
    rows = [[name, f"{m * 1e3:.1f}",
             f"{best[name] * 1e3:.1f}–{max(per_round[name]) * 1e3:.1f}",
             f"{m / base:.3f}", f"{best[name] / best[SINGLE[0]]:.3f}",
             f"{m / medians[SINGLE[1]]:.3f}", f"{tokens / m:,.0f}"]
            for name, m in medians.items()]
    model = "shrunk tiny" if args.quick else "tiny"
    print_table(f"Trainer step, {model} preset, global batch {settings['batch']} × "
                f"{settings['seq_len']} on CPU/gloo, {rounds} round(s) of "
                f"{settings['steps']} timed steps (load {load[0]:.2f})",
                ["candidate", "median ms", "round medians ms", "× 1 proc × 2 thr",
                 "× (best rounds)", "× 1 proc × 1 thr", "tokens/s"], rows)
    fsdp = traffic[RANKED[1]]
    print_table("Expert traffic per rank and step (bytes sent to the other rank)",
                ["candidate", "what moves", "MiB per step", "× FSDP2"],
                [[RANKED[1], "expert weights (all-gather ×2) and gradients (reduce-scatter)",
                  f"{fsdp / 2**20:.3f}", "1.000"],
                 [RANKED[2], "token rows (all-to-all ×2, forward and backward)",
                  f"{traffic[RANKED[2]] / 2**20:.3f}", f"{traffic[RANKED[2]] / fsdp:.3f}"]])
    write_json(args.json, {"settings": settings, "rounds": rounds, "median_s": medians,
                           "expert_bytes_per_step": traffic,
                           "per_round_s": per_round, "ratio_to_1_process_2_threads":
                           {name: m / base for name, m in medians.items()},
                           "best_round_ratio": {name: b / best[SINGLE[0]]
                                                for name, b in best.items()},
                           "loadavg": load})


if __name__ == "__main__":
    main()
