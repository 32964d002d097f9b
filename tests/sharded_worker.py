"""One rank of tests/test_sharded_dcp.py (``torchrun --nproc_per_node 2 sharded_worker.py
OUT ROOT``): an FSDP2-sharded model, its optimizer, counters and a stateful callback whose
state is a DTensor (a moving average of a sharded weight), written and read through
``k3_trainer.checkpoint.sharded`` by both ranks. Saves what the test checks to
``OUT/rank{R}.json``.

Test code only; the package never imports it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import k3_checkpoint
from k3_trainer.checkpoint import sharded
from k3_trainer.distributed import Parallel
from k3_trainer.torchrun import leave_worker

METADATA = {"run": "dcp"}
POLICY = k3_checkpoint.CompatibilityPolicy()


class Counter:
    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


class ShardedEma:
    """A moving average of one FSDP2 weight, kept sharded as the weight is."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.shadow = weight.detach().clone()  # a DTensor: this rank's rows only
        self.notes: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": self.shadow, "decay": 0.9, "notes": self.notes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shadow = state["shadow"]
        if not isinstance(shadow, DTensor) or shadow.placements != self.shadow.placements:
            raise ValueError(f"expected a DTensor sharded as {self.shadow.placements}")
        self.shadow, self.notes = shadow, dict(state["notes"])


def _local(states: dict[str, Any]) -> dict[str, torch.Tensor]:
    """This rank's part of every tensor the states hold, copied (no collective)."""
    out = {f"model.{k}": v.to_local().clone() for k, v in states["model"].state_dict().items()}
    for index, entry in states["optimizer"].state.items():
        for field, value in entry.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            out[f"optimizer.{id(index)}.{field}"] = local.clone()
    out["ema"] = states["callbacks"]["ema"].shadow.to_local().clone()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _perturb(states: dict[str, Any], by: float) -> None:
    with torch.no_grad():
        for p in states["model"].parameters():
            p.add_(by)
        states["callbacks"]["ema"].shadow.add_(by)
        for entry in states["optimizer"].state.values():
            entry["exp_avg"].add_(by)
    states["counters"].value += 100


def _folder(root: Path, name: str, parallel: Parallel) -> Path:
    folder = root / name
    if parallel.is_main:
        folder.mkdir()
    dist.barrier()
    return folder


def _tensors_in(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, dict):
        return sum(_tensors_in(item) for item in value.values())
    if isinstance(value, list):
        return sum(_tensors_in(item) for item in value)
    return 0


def main(out: Path, root: Path) -> None:
    dist.init_process_group("gloo")
    parallel = Parallel("fsdp", torch.device("cpu"))
    rank = parallel.rank
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    for block in (model[0], model[1], model):
        fully_shard(block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    states: dict[str, Any] = {"model": model, "optimizer": optimizer, "counters": Counter(1),
                              "callbacks": {"ema": ShardedEma(model[0].weight)}}
    result: dict[str, Any] = {"shadow_local": list(states["callbacks"]["ema"].shadow
                                                   .to_local().shape)}

    # 1. Synchronous write: every rank writes its rows of the callback's DTensor.
    folder = _folder(root, "sync", parallel)
    boundary = _local(states)
    result["digest"] = sharded.write_sharded(folder, states, METADATA, parallel)
    if parallel.is_main:
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        payload = k3_checkpoint.read_payload(folder / "k3.ckpt")
        result["k3_tensors"] = _tensors_in({k: v for k, v in payload.items() if k != "rng"})
        result["components"] = payload["shards"]["components"]
        entry = FileSystemReader(folder).read_metadata().state_dict_metadata[
            "callbacks.ema.shadow"]
        assert isinstance(entry, TensorStorageMetadata)
        result["shadow_size"] = list(entry.size)
        result["shadow_chunks"] = sorted([list(c.offsets), list(c.sizes)] for c in entry.chunks)
        result["files"] = sorted(p.name for p in folder.iterdir())

    # 2. Perturbed, then restored bitwise; the callback's tensor comes back sharded.
    _perturb(states, 1.0)
    sharded.read_sharded(folder, states, METADATA, POLICY, parallel)
    shadow = states["callbacks"]["ema"].shadow
    result["restored"] = _same(boundary, _local(states)) and states["counters"].value == 1
    result["restored_sharded"] = (isinstance(shadow, DTensor)
                                  and tuple(shadow.placements) == (Shard(0),))
    wanted = {"model": model, "counters": Counter()}
    sharded.read_sharded(folder, wanted, METADATA, POLICY, parallel, subset=True)
    result["subset_counters"] = wanted["counters"].value

    # 3. Background write while the default group keeps running collectives and training
    # changes the state in place.
    folder = _folder(root, "background", parallel)
    boundary = _local(states)
    write = sharded.start_sharded_write(folder, states, METADATA, parallel)
    sums = []
    for _ in range(5):
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)
        sums.append(value.item())
    _perturb(states, 5.0)
    result["sums"] = sums
    result["background_digest"] = write.result()
    sharded.read_sharded(folder, states, METADATA, POLICY, parallel)
    result["background_restored"] = (_same(boundary, _local(states))
                                     and states["counters"].value == 1)

    # 4. A background write that fails on rank 1 only fails on both.
    folder = _folder(root, "failing", parallel)
    real = k3_checkpoint.file_checksum
    if rank == 1:
        def full(path: Any) -> str:
            raise OSError(28, "No space left on device")

        k3_checkpoint.file_checksum = full  # type: ignore[assignment]
    write = sharded.start_sharded_write(folder, states, METADATA, parallel)
    try:
        write.result()
        result["failure"] = None
    except OSError as error:
        result["failure"] = [error.errno, str(error)]
    k3_checkpoint.file_checksum = real
    result["failing_has_index"] = (folder / "k3.ckpt").exists()

    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    leave_worker()
