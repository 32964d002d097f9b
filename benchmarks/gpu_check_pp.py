"""The ``pipeline`` section of ``gpu_check.py``: two pipeline stages on two GPUs (NCCL).

Written without a GPU to run it on (tests/test_pipeline_parallel.py proves the same path
on gloo). The ``small`` preset at ``--pipeline-parallel 2`` (1F1B, one stage per GPU,
``torch.distributed.pipelining``) against one process on one GPU doing the same global
batch as gradient accumulation over the same microbatches: the first step's loss in fp32
(the two must agree as on CPU), then the median step time in bf16 autocast and each
rank's peak memory against the one process's. Smoke: 2 gloo CPU ranks, a shrunk model.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gpu_check_k3 import Context

STAGES = 2


def _settings(smoke: bool) -> dict[str, Any]:
    if smoke:
        return {"preset": "tiny", "model": dict(d_model=64, n_layers=4, max_seq_len=64),
                "batch": 4, "seq_len": 32, "microbatches": 2, "warmup": 1, "steps": 2}
    return {"preset": "small", "model": {}, "batch": 16, "seq_len": 1024, "microbatches": 8,
            "warmup": 2, "steps": 5}


def _measure(settings: dict[str, Any], device: torch.device, rank: int | None
             ) -> tuple[dict[str, Any], Any]:
    """One process (``rank`` None) or one rank of the 2-stage pipeline: the first step's
    fp32 loss (the last stage's; zero on the first), then timed bf16 steps; and the
    rank's ``Parallel`` (None for one process), for the caller to shut down."""
    from k3_model import K3Model, preset
    from k3_trainer import build_optimizer
    from k3_trainer.config import TrainConfig
    from k3_trainer.distributed import init_parallel
    from k3_trainer.models import get_model_spec
    from k3_trainer.pipeline import Pipeline

    m, rows, seq = settings["microbatches"], settings["batch"], settings["seq_len"]
    staged = rank is not None
    config = TrainConfig(batch_size=rows, seq_len=seq, pp_schedule="1f1b",
                         pipeline_parallel=STAGES if staged else 1,
                         pp_microbatches=m if staged else None)
    torch.manual_seed(0)
    model = K3Model(preset(settings["preset"], **settings["model"])).to(device).train()
    parallel, pipeline = None, None
    if staged:
        parallel, device = init_parallel("fsdp", device, STAGES)
        assert parallel is not None and get_model_spec("k3").pipeline is not None
        pipeline = Pipeline(model, get_model_spec("k3").pipeline, parallel, config)
        parallel.wrap(model, pipeline.modules)
        pipeline.start()
    optimizer = build_optimizer(model, config, stage=staged)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    cuda = device.type == "cuda"

    def step(bf16: bool) -> float:
        x = torch.randint(0, vocab, (rows, seq), generator=gen).to(device)
        y = torch.randint(0, vocab, (rows, seq), generator=gen).to(device)
        with torch.autocast(device.type, torch.bfloat16, enabled=bf16 and cuda):
            if pipeline is not None:
                loss = float(pipeline.train(x, y, m))
            else:
                loss = 0.0
                for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
                    part = model(xs, targets=ys)[1] / m
                    part.backward()
                    loss += float(part.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    first = step(bf16=False)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(settings["warmup"] + settings["steps"]):
        if parallel is not None:
            parallel.barrier()
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step(bf16=True)
        if cuda:
            torch.cuda.synchronize(device)
        if parallel is not None:
            parallel.barrier()
        seconds.append(time.perf_counter() - start)
    return {"first_loss_fp32": first,
            "step_s": statistics.median(seconds[settings["warmup"]:]),
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
            }, parallel


def _worker(rank: int, port: int, settings: dict[str, Any], cuda: bool, out: str) -> None:
    from k3_trainer.distributed import shutdown

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(STAGES),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not cuda:
        torch.set_num_threads(1)
    result, parallel = _measure(settings, torch.device("cuda" if cuda else "cpu"), rank)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    shutdown(parallel)


def pipeline(ctx: Context, out: dict[str, Any]) -> None:
    """PP 2 (one stage per GPU, NCCL) against one process on one GPU, same batch and
    microbatches: first-step fp32 loss agreement, bf16 step time, peak memory per rank."""
    import torch.multiprocessing as mp

    cuda = ctx.device.type == "cuda"
    if cuda and torch.cuda.device_count() < STAGES:
        out["skipped"] = f"needs {STAGES} or more GPUs (one stage per GPU)"
        ctx.log(f"pipeline: skipped: {out['skipped']}")
        return
    settings = _settings(ctx.smoke)
    if not cuda:
        torch.set_num_threads(1)
    one, _ = _measure(settings, ctx.device, None)
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
        probe.close()
        mp.spawn(_worker, args=(port, settings, cuda, tmp), nprocs=STAGES)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(STAGES)]
    staged_loss = ranks[-1]["first_loss_fp32"]
    out.update(settings=settings, one_process=one, ranks=ranks,
               first_loss_rel_diff=abs(staged_loss - one["first_loss_fp32"])
               / abs(one["first_loss_fp32"]),
               speedup=one["step_s"] / max(r["step_s"] for r in ranks),
               ideal_speedup=STAGES * settings["microbatches"]
               / (settings["microbatches"] + STAGES - 1))
    if cuda:
        out["peak_memory_ratio"] = (max(r["peak_memory_gib"] for r in ranks)
                                    / one["peak_memory_gib"])
    ctx.log(f"pipeline: PP {STAGES} vs one process, first fp32 loss rel diff "
            f"{out['first_loss_rel_diff']:.1e}, bf16 step speed-up {out['speedup']:.2f}× "
            f"(ideal {out['ideal_speedup']:.2f}×)"
            + (f", peak memory {out['peak_memory_ratio']:.2f}× one process's" if cuda else ""))
