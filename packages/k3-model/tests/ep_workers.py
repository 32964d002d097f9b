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
from conftest import small_config, tokens

from k3_model import K3Model
from k3_model.expert_parallel import shard_experts
from k3_model.moe import MoE

BATCH, SEQ = 4, 16


def build(_first_two_experts: bool = False, **overrides):
    torch.manual_seed(0)
    config = small_config("k3", n_experts=4, moe_top_k=2, **overrides)
    model = K3Model(config).double()
    if _first_two_experts:  # a selection bias no sigmoid score can overcome
        for layer in model.modules():
            if isinstance(layer, MoE):
                layer.balancer.bias.copy_(torch.tensor([2.0, 2.0, 0.0, 0.0]))
    return model


def batch():
    return tokens(b=BATCH, t=SEQ + 1, seed=3)


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


def worker(rank: int, world: int, init: str, out: str, overrides: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        model = build(**overrides)
        model.set_balancer_gather(gather_rows)
        shard_experts(model)
        chosen = record_routing(model)
        data = batch()
        rows = data[rank * BATCH // world:(rank + 1) * BATCH // world]
        _, loss = model(rows[:, :-1], targets=rows[:, 1:])
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        biases = {n: m.balancer.bias.clone() for n, m in model.named_modules()
                  if isinstance(m, MoE)}
        torch.save({"loss": loss.detach(), "grads": grads, "chosen": chosen, "biases": biases,
                    "experts": {n: (m.experts.first, m.experts.per_rank)
                                for n, m in model.named_modules() if isinstance(m, MoE)}},
                   Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
