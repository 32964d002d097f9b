"""One rank of a pipeline-parallel test run (``torchrun ... pipeline_worker.py``), or the
one-process reference (``--reference``): a small K3 (KDA + MLA + Attention Residuals +
LatentMoE, documents kept apart) trained a few MuonAdamW steps with gradient clipping,
through ``k3_trainer.pipeline.Pipeline`` (its routed experts split over each stage's data
ranks with ``--expert-parallel``) or plain gradient accumulation over the same
microbatches. Saves the losses and this rank's weights and buffers to ``OUT/rank{R}.pt``.

Test code only; the package never imports it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from k3_model import K3Model, preset
from k3_trainer import build_optimizer
from k3_trainer.config import TrainConfig
from k3_trainer.data.documents import document_ids
from k3_trainer.distributed import clip_grad_norm, init_parallel, shutdown
from k3_trainer.models import get_model_spec
from k3_trainer.pipeline import Pipeline
from k3_trainer.torchrun import leave_worker

MODEL = preset("tiny", d_model=64, n_heads=2, kv_lora_rank=32, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=16, d_ff=96, moe_d_ff=32, moe_latent_dim=32,
               kda_chunk_size=16, max_seq_len=64)
BATCH, SEQ, BOUNDARY, MAX_NORM = 4, 32, 3, 0.05


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token ids in [0, 16) so that the boundary id 3 starts documents often."""
    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        row = torch.randint(0, 16, (BATCH, SEQ + 1), generator=generator)
        out.append((row[:, :-1].contiguous(), row[:, 1:].contiguous()))
    return out


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A plain copy of ``tensor``, gathered whole when FSDP2 shards it over data ranks."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()


def _microbatches(batch: torch.Tensor, m: int, data_ranks: int) -> list[torch.Tensor]:
    """One process's microbatches as ``data_ranks`` ranks compose them: microbatch k is
    every data rank's k-th slice of its rows, in rank order (what the balancer gathers)."""
    per_rank = [rows.chunk(m) for rows in batch.chunk(data_ranks)]
    return [torch.cat([chunks[k] for chunks in per_rank]) for k in range(m)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--stages-per-rank", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--float64", action="store_true",
                        help="parameters and Newton–Schulz in float64 (rounding out of the way)")
    parser.add_argument("--expert-parallel", type=int, default=1,
                        help="split each stage's routed experts over this many data ranks")
    parser.add_argument("--data-ranks", type=int, default=1,
                        help="reference: microbatches composed as D data ranks' would be")
    args = parser.parse_args()
    pipeline_degree = 1 if args.reference else 2
    data_ranks = 1 if args.reference else int(os.environ.get("WORLD_SIZE", "2")) // 2
    config = TrainConfig(batch_size=BATCH // data_ranks, seq_len=SEQ, peak_lr=args.lr,
                         max_steps=args.steps,
                         pipeline_parallel=pipeline_degree, pp_schedule=args.schedule,
                         pp_microbatches=None if args.reference else args.microbatches,
                         pp_stages_per_rank=1 if args.reference else args.stages_per_rank,
                         muon_ns_dtype="fp64" if args.float64 else "auto")
    # One thread, as torchrun gives each rank: a matmul's blocking (hence its rounding)
    # depends on the thread count.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = K3Model(MODEL)
    if args.float64:
        model.double()
    model.train()
    parallel, pipeline = None, None
    if not args.reference:
        parallel, _ = init_parallel("fsdp", torch.device("cpu"), pipeline_degree)
        assert parallel is not None
        hooks = get_model_spec("k3").pipeline
        assert hooks is not None
        pipeline = Pipeline(model, hooks, parallel, config)
        spec = get_model_spec("k3")
        parallel.shard_experts(model, args.expert_parallel, spec.expert_parallel)
        if spec.set_token_gather is not None:  # the balancer sees every data rank's rows
            spec.set_token_gather(model, parallel.gather_rows)
        parallel.wrap(model, pipeline.modules)
        pipeline.start()
    optimizer = build_optimizer(model, config)
    m, losses, norms = args.microbatches, [], []
    first: dict[str, torch.Tensor] | None = None
    for x, y in batches(args.steps):
        ids = document_ids(x, BOUNDARY)
        if pipeline is not None:
            assert parallel is not None
            rows = BATCH // parallel.data_parallel  # this data rank's rows of the batch
            mine = slice(parallel.data_rank * rows, (parallel.data_rank + 1) * rows)
            local = pipeline.train(x[mine], y[mine], m, document_ids=ids[mine])
            losses.append(float(parallel.sum_(local.reshape(1))[0]) / parallel.data_parallel)
        else:
            total = 0.0
            for xs, ys, ds in zip(*(_microbatches(t, m, args.data_ranks) for t in (x, y, ids)),
                                  strict=True):
                _, loss = model(xs, targets=ys, document_ids=ds)
                (loss / m).backward()
                total += float(loss.detach()) / m
            losses.append(total)
        if parallel is not None:  # the expert gradients become the data-parallel mean
            parallel.finish_gradients(model)
        norms.append(float(clip_grad_norm(list(model.parameters()), MAX_NORM, parallel,
                                          None if pipeline is None else pipeline.slots)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if first is None:
            first = {name: _whole(tensor) for name, tensor in model.state_dict().items()}
    state = {name: _whole(tensor) for name, tensor in model.state_dict().items()}
    if parallel is not None and parallel.data_rank:  # data ranks hold the same stages
        shutdown(parallel)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save({"losses": losses, "norms": norms, "state": state, "first": first},
               args.out / f"rank{0 if parallel is None else parallel.pipeline_rank}.pt")
    shutdown(parallel)


if __name__ == "__main__":
    main()
    leave_worker()
