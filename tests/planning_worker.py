"""One rank of tests/test_planning_ranks.py (``torchrun --nproc_per_node 2
planning_worker.py OUT``): builds the small MoE model the way the trainer does under
FSDP2 (``Parallel.shard_experts`` then ``Parallel.wrap``, then ``build_optimizer``), once
without expert parallelism and once with ``--expert-parallel 2``, takes one real
MuonAdamW step and writes this rank's local parameter, gradient and optimizer-state
bytes to ``OUT/rank{R}.json`` for the test to hold the plan to.

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
from k3_trainer.planning.measure import state_nbytes

LAYOUTS = {"fsdp2": 1, "fsdp2+ep2": 2}
OVERRIDES = {"vocab_size": 251}
"""An odd vocabulary: FSDP2 gives rank 0 one more embedding and head row than rank 1."""


def _measure(expert_parallel: int, normuon: bool) -> dict[str, int]:
    torch.manual_seed(0)
    model = K3Model(preset("tiny", **OVERRIDES))
    parallel = Parallel("fsdp", torch.device("cpu"))
    parallel.shard_experts(model, expert_parallel, get_model_spec("k3").expert_parallel)
    parallel.wrap(model)
    optimizer = build_optimizer(model, TrainConfig(muon_normuon=normuon))
    tokens = torch.randint(0, model.config.vocab_size, (2, 17),
                           generator=torch.Generator().manual_seed(dist.get_rank()))
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    parallel.finish_gradients(model)
    optimizer.step()
    return state_nbytes(model, optimizer)


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    result = {f"{name}{'+normuon' if normuon else ''}": _measure(degree, normuon)
              for name, degree in LAYOUTS.items() for normuon in (False, True)}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
