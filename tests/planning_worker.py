"""One rank of tests/test_planning_ranks.py (``torchrun --nproc_per_node 2|4
planning_worker.py OUT``): builds the small MoE model the way the trainer does under
FSDP2 (``Parallel.shard_experts`` then ``Parallel.wrap``, then ``build_optimizer``): FSDP 2,
FSDP 2 with ``--expert-parallel 2``, two pipeline stages (``--pp 2``, one rank each) and
context parallelism 2 (FSDP2 over ``dp × cp``); on 4 ranks, two stages over two data
ranks and context parallelism 2 over two data ranks (with and without ``--expert-parallel
2``), and two stages each on two context-parallel ranks. Each takes one real MuonAdamW
step and writes this rank's local parameter, gradient and optimizer-state bytes to
``OUT/rank{R}.json`` for the test to hold the plan to.

Test code only; the package never imports it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from k3_model import K3Model
from k3_model.presets import preset
from k3_trainer.config import TrainConfig
from k3_trainer.distributed import Parallel
from k3_trainer.models import get_model_spec
from k3_trainer.optim import build_optimizer
from k3_trainer.pipeline import Pipeline
from k3_trainer.planning.measure import state_nbytes
from k3_trainer.torchrun import leave_worker

LAYOUTS = {
    2: {"fsdp2": (1, 1, 1), "fsdp2+ep2": (2, 1, 1), "pp2": (1, 2, 1), "cp2": (1, 1, 2)},
    4: {"pp2xdp2": (1, 2, 1), "pp2xdp2+ep2": (2, 2, 1), "cp2xdp2": (1, 1, 2),
        "cp2xdp2+ep2": (2, 1, 2), "pp2xcp2": (1, 2, 2)},
}
"""Per world size, name: (expert parallel, pipeline stages, context parallel)."""
OVERRIDES = {"vocab_size": 251}
"""An odd vocabulary: FSDP2 gives rank 0 one more embedding and head row than rank 1."""


def _measure(layout: tuple[int, int, int], normuon: bool) -> dict[str, int]:
    expert_parallel, stages, context = layout
    torch.manual_seed(0)
    spec = get_model_spec("k3")
    model = K3Model(preset("tiny", **OVERRIDES))
    parallel = Parallel("fsdp", torch.device("cpu"), pipeline=stages, context=context)
    config = TrainConfig(muon_normuon=normuon, batch_size=2, seq_len=16,
                         pipeline_parallel=stages, context_parallel=context)
    pipeline = Pipeline(model, spec.pipeline, parallel, config) if stages > 1 else None
    if context > 1:
        spec.context_parallel.set_group(model, parallel.context_group)
    parallel.shard_experts(model, expert_parallel, spec.expert_parallel)
    parallel.wrap(model, None if pipeline is None else pipeline.modules)
    optimizer = build_optimizer(model, config)
    tokens = torch.randint(0, model.config.vocab_size, (2, 17),
                           generator=torch.Generator().manual_seed(parallel.data_rank))
    x, y = tokens[:, :-1], tokens[:, 1:]
    if pipeline is not None:
        pipeline.start()
        pipeline.train(x, y, scale=pipeline.count)
    else:
        if context > 1:  # this rank's contiguous slice of the rows
            x, y = (t.chunk(context, dim=1)[parallel.context_rank] for t in (x, y))
        _, loss = model(x, y)
        loss.backward()
    parallel.finish_gradients(model)
    optimizer.step()
    return state_nbytes(model, optimizer)


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    layouts = LAYOUTS[dist.get_world_size()]
    result = {f"{name}{'+normuon' if normuon else ''}": _measure(layout, normuon)
              for name, layout in layouts.items() for normuon in (False, True)}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave_worker()
