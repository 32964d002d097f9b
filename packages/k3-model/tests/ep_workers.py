"""Worker processes for test_expert_parallel.py (a module, so spawned children import it).

Each rank of a 2-rank gloo group builds the same fp64 model, shards its routed experts,
runs a forward and backward on its half of one global batch with the balancer fed the
global batch, and saves its loss, the experts each MoE layer chose, and its gradients.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from k3_model import K3Model
from k3_model.expert_parallel import (
    expert_mesh,
    pop_moved_bytes,
    reduce_gradients,
    shard_experts,
)
from k3_model.moe import MoE

BATCH, SEQ = 4, 16


def build(config, _first_two_experts: bool = False):
    """The fp64 model every rank (and the one-process reference) starts from. ``config``
    comes from the test (the conftest helpers are not importable under that name in a
    spawned child when several packages' suites run together)."""
    torch.manual_seed(0)
    model = K3Model(config).double()
    if _first_two_experts:  # a selection bias no sigmoid score can overcome
        for layer in model.modules():
            if isinstance(layer, MoE):
                layer.balancer.bias.copy_(torch.tensor([2.0, 2.0, 0.0, 0.0]))
    return model


def batch():
    return torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))


def record_routing(model) -> dict:
    """Wrap each MoE layer's route() to keep what it chose."""
    chosen: dict[str, list] = {}
    for name, layer in model.named_modules():
        if isinstance(layer, MoE):
            route = layer.route

            def spy(x, route=route, name=name):
                experts, gates = route(x)
                chosen.setdefault(name, []).append(experts.detach().clone())
                return experts, gates

            layer.route = spy
    return chosen


def gather_rows(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def worker(rank: int, world: int, init: str, out: str, config, first_two: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        model = build(config, first_two)
        model.set_balancer_gather(gather_rows)
        shard_experts(model, expert_mesh(world, world, "cpu"))
        chosen = record_routing(model)
        data = batch()
        rows = data[rank * BATCH // world:(rank + 1) * BATCH // world]
        _, loss = model(rows[:, :-1], targets=rows[:, 1:])
        loss.backward()
        reduce_gradients(model)  # the data-parallel mean: divided by the world size
        grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
                 for n, p in model.named_parameters() if p.grad is not None}
        biases = {n: m.balancer.bias.clone() for n, m in model.named_modules()
                  if isinstance(m, MoE)}
        torch.save({"loss": loss.detach(), "grads": grads, "moved": pop_moved_bytes(model),
                    "chosen": chosen, "biases": biases,
                    "experts": {n: (m.experts.first, m.experts.per_rank)
                                for n, m in model.named_modules() if isinstance(m, MoE)}},
                   Path(out) / f"rank{rank}.pt")
        dist.barrier()  # both ranks done before gloo is torn down (a peer leaving early
        # while the other finishes its last exchange can abort that one)
    finally:
        dist.destroy_process_group()
