"""Worker processes for test_distributed.py (a module, so spawned children can import it).

Each worker joins a 2-rank gloo group, trains a tiny fp64 model for a few steps under DDP
or FSDP2 with distributed Muon, and saves what the parent needs to replay the same steps
in one process: the reduced (full) gradients of every step, the full parameters after
them, and how many matrices Newton–Schulz orthogonalized on this rank.
"""

from __future__ import annotations

import copy
import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import k3_optim.muon
from k3_optim import MuonAdamW

HP = dict(lr=0.05, weight_decay=0.1, momentum=0.9, ns_dtype="fp64")
# NorMuon (its per-row state sharded like the rows, its per-matrix sums reduced across
# ranks) and cautious decay in both halves, with Gram Newton–Schulz forced everywhere.
HP_VARIANTS = dict(HP, normuon=True, normuon_beta2=0.9, cautious_weight_decay=True,
                   ns_method="gram")


class TinyNet(nn.Module):
    """Shapes that do not split evenly over 2 ranks, a tall matrix, a per-head projection
    (whose head boundary a 2-rank row split cuts through) and an expert stack."""

    def __init__(self) -> None:
        super().__init__()
        kw = dict(dtype=torch.float64)
        self.q = nn.Linear(4, 6, bias=False, **kw)  # 3 heads of 2 rows; ranks get 3 | 3
        self.up = nn.Linear(6, 5, **kw)  # 5 rows over 2 ranks: 3 | 2
        self.tall = nn.Linear(5, 9, bias=False, **kw)  # 9 × 5: iterated on its right side
        self.down = nn.Linear(9, 4, bias=False, **kw)
        self.experts = nn.Parameter(torch.randn(3, 4, 4, **kw) / 2)  # 3 experts: 2 | 1
        self.norm = nn.LayerNorm(4, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(torch.tanh(self.q(x))))
        h = self.down(torch.tanh(self.tall(h)))
        h = h + torch.einsum("bi,eoi->bo", h, self.experts)
        return self.norm(h).pow(2).mean()


def build(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def groups(model: nn.Module) -> list[dict]:
    named = dict(model.named_parameters())
    muon = ["up.weight", "tall.weight", "down.weight", "experts"]
    vectors = [n for n, p in named.items() if p.ndim == 1]
    return [
        {"params": [named["q.weight"]], "param_names": ["q.weight"], "use_muon": True,
         "num_heads": 3},
        {"params": [named[n] for n in muon], "param_names": muon, "use_muon": True},
        {"params": [named[n] for n in vectors], "param_names": vectors, "use_muon": False,
         "weight_decay": 0.0},
    ]


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, 4, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(100 * step + rank))


def count_ns_matrices() -> list[int]:
    """Wrap the Newton–Schulz iteration Muon runs; the returned list grows by the number
    of matrices in each call."""
    counts: list[int] = []
    real = k3_optim.muon.iterate

    def spy(X: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        counts.append(X.shape[0])
        return real(X, *args, **kwargs)

    k3_optim.muon.iterate = spy  # type: ignore[assignment]
    return counts


def _init(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def ddp_worker(rank: int, world: int, init_file: str, out_dir: str, steps: int,
               hp: dict | None = None) -> None:
    _init(rank, world, init_file)
    try:
        model = build()
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = MuonAdamW(groups(model), distributed=True, **(hp or HP))
        counts = count_ns_matrices()
        grads = []
        for step in range(steps):
            ddp(batch(rank, step)).backward()  # DDP averages the gradients over ranks
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.save({"grads": grads, "params": dict(model.named_parameters()),
                    "ns_matrices": sum(counts)}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def ddp_variants_worker(rank: int, world: int, init_file: str, out_dir: str,
                        steps: int) -> None:
    ddp_worker(rank, world, init_file, out_dir, steps, HP_VARIANTS)


def fsdp_variants_worker(rank: int, world: int, init_file: str, out_dir: str,
                         steps: int) -> None:
    fsdp_worker(rank, world, init_file, out_dir, steps, HP_VARIANTS)


def fsdp_worker(rank: int, world: int, init_file: str, out_dir: str, steps: int,
                hp: dict | None = None) -> None:
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    _init(rank, world, init_file)
    try:
        hp = hp or HP
        model = build()
        fully_shard(model)
        opt = MuonAdamW(groups(model), **hp)  # DTensor parameters: distributed by default
        counts = count_ns_matrices()
        grads = []
        for step in range(steps):
            model(batch(rank, step)).backward()  # reduce-scatter averages over ranks
            grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
        momentum = {n: opt.state[p]["momentum_buffer"] for n, p in model.named_parameters()
                    if "momentum_buffer" in opt.state[p]}
        rows = {n: opt.state[p]["row_second_moment"] for n, p in model.named_parameters()
                if "row_second_moment" in opt.state[p]}
        named = dict(model.named_parameters())
        result = {
            "grads": grads,
            "params": {n: _full(p).clone() for n, p in named.items()},
            "momentum": {n: _full(b) for n, b in momentum.items()},
            "row_second_moment": {n: _full(v) for n, v in rows.items()},
            "sharded_state": all(type(b).__name__ == "DTensor"
                                 and b.placements == named[n].placements
                                 for n, b in (momentum | rows).items()),
            "local_rows": {n: p.to_local().shape[0] for n, p in named.items()},
            "ns_matrices": sum(counts),
        }

        # State-dict round trips, through the optimizer's own state_dict() and through
        # torch.distributed.checkpoint's sharded optimizer state dict: fresh sharded
        # models and optimizers loaded from this one continue exactly like it. (Loading
        # does not copy same-device tensors, hence the deep copies.)
        twins = []
        for via_dcp in (False, True):
            twin = build(seed=1)
            fully_shard(twin)
            twin.load_state_dict(model.state_dict())
            twin_opt = MuonAdamW(groups(twin), **hp)
            if via_dcp:
                state = copy.deepcopy(get_optimizer_state_dict(model, opt))
                set_optimizer_state_dict(twin, twin_opt, state)
            else:
                twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            twins.append((twin, twin_opt))
        model(batch(rank, steps)).backward()
        opt.step()
        result["round_trip"] = []
        for twin, twin_opt in twins:
            for p, q in zip(model.parameters(), twin.parameters()):
                q.grad = p.grad.clone()
            twin_opt.step()
            result["round_trip"].append(all(
                torch.equal(_full(p), _full(q))
                for p, q in zip(model.parameters(), twin.parameters())))
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


EXPERTS = (4, 5, 3)  # (E, out, in): a tall stack, iterated on its right side


def expert_grads(steps: int) -> list[torch.Tensor]:
    """The full (global) gradient of the expert stack at each step, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    return [torch.randn(*EXPERTS, dtype=torch.float64, generator=g) for _ in range(steps)]


def expert_start() -> torch.Tensor:
    return torch.randn(*EXPERTS, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(8))


def ep_worker(rank: int, world: int, init_file: str, out_dir: str, steps: int) -> None:
    """Muon on an expert stack sharded by expert (``Shard(0)`` on the mesh's last dim,
    ``Replicate()`` on the first), for mesh shapes (1, world) (expert parallelism over every
    rank) and (world, 1) (every rank a replica): this rank's slice after each run, the
    matrices it orthogonalized and the all-to-alls the optimizer made."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    _init(rank, world, init_file)
    try:
        result = {}
        for shape in ((1, world), (world, 1)):
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replica", "ep"))
            per_rank = EXPERTS[0] // shape[1]
            mine = slice(mesh.get_local_rank(1) * per_rank, (mesh.get_local_rank(1) + 1) * per_rank)
            placements = [Replicate(), Shard(0)]
            p = nn.Parameter(DTensor.from_local(expert_start()[mine].clone(), mesh, placements,
                                                run_check=False))
            opt = MuonAdamW([{"params": [p], "param_names": ["experts"], "use_muon": True}],
                            **HP)
            counts = count_ns_matrices()
            exchanges = []
            real = dist.all_to_all_single

            def spy(*args, real=real, exchanges=exchanges, **kwargs):
                exchanges.append(1)
                return real(*args, **kwargs)

            dist.all_to_all_single = spy
            try:
                for grad in expert_grads(steps):
                    p.grad = DTensor.from_local(grad[mine].clone(), mesh, placements,
                                                run_check=False)
                    opt.step()
            finally:
                dist.all_to_all_single = real
            result[shape] = {"slice": (mine.start, mine.stop), "local": p.to_local().clone(),
                             "ns_matrices": sum(counts), "all_to_alls": len(exchanges),
                             "buffer_is_dtensor": isinstance(
                                 opt.state[p]["momentum_buffer"], DTensor)}
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        # Both ranks done before gloo is torn down: a rank that leaves while its peer
        # still finishes the last exchange can abort it (seen once in CI, SIGABRT).
        dist.barrier()
    finally:
        dist.destroy_process_group()
