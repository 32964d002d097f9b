"""Expert parallelism on 2 CPU ranks (gloo) equals the one-process layer.

Each rank holds half of every MoE layer's routed experts and half of one global batch;
tokens travel to their experts and back by all-to-all (ep_workers.py). Compared here with
one process running the whole batch through the unsharded model, in fp64: the loss, the
experts every token chose, the balancer's bias, and every gradient.
"""

from __future__ import annotations

import time
from pathlib import Path

import ep_workers
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3_model.moe import MoE

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")

WORLD, TIMEOUT_S = 2, 120


def _spawn(tmp_path: Path, overrides: dict) -> list[dict]:
    ctx = mp.start_processes(ep_workers.worker,
                             args=(WORLD, str(tmp_path / "init"), str(tmp_path), overrides),
                             nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"expert-parallel workers did not finish in {TIMEOUT_S} s")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _one_process(overrides: dict):
    model = ep_workers.build(**overrides)
    chosen = ep_workers.record_routing(model)
    data = ep_workers.batch()
    _, loss = model(data[:, :-1], targets=data[:, 1:])
    loss.backward()
    return model, loss.detach(), chosen


def _compare(ranks: list[dict], overrides: dict) -> None:
    model, loss, chosen = _one_process(overrides)
    # The loss over the global batch: the mean of the ranks' (equal-sized) halves. The
    # router and the residual reads compute in fp32 by design, and a matmul over half the
    # rows may round differently there: fp32-level agreement, not fp64's.
    torch.testing.assert_close(sum(r["loss"] for r in ranks) / WORLD, loss, rtol=1e-6, atol=0)
    for name, layer in model.named_modules():
        if not isinstance(layer, MoE):
            continue
        # Every token went to the same experts, and the balancer agrees bitwise.
        assert torch.equal(torch.cat([r["chosen"][name][0] for r in ranks]), chosen[name][0])
        for r in ranks:
            assert torch.equal(r["biases"][name], layer.balancer.bias)
    full = dict(model.named_parameters())
    for rank in ranks:
        for name, grad in rank["grads"].items():
            if ".experts.local." in name:  # summed over every rank's tokens already
                layer = name.split(".experts.local.")[0]
                first, count = rank["experts"][layer]
                want = full[name.replace(".local.", ".")].grad[first:first + count]
                torch.testing.assert_close(grad / WORLD, want, rtol=1e-5, atol=1e-8, msg=name)
            else:  # replicated: data parallelism would average them (fp32-level, as above)
                mean = sum(r["grads"][name] for r in ranks) / WORLD
                torch.testing.assert_close(mean, full[name].grad, rtol=1e-5, atol=1e-8,
                                           msg=name)


def test_expert_parallel_equals_one_process(tmp_path):
    ranks = _spawn(tmp_path, {})
    expert_grads = [n for n in ranks[0]["grads"] if ".experts.local." in n]
    assert expert_grads and ranks[0]["experts"] != ranks[1]["experts"]
    _compare(ranks, {})


def test_a_rank_whose_experts_get_no_tokens(tmp_path):
    """With the balancer frozen and biased towards experts 0 and 1 (both on rank 0), rank
    1's experts receive no row in either direction, and the result is still exact."""
    overrides = {"moe_balance": False, "_first_two_experts": True}
    ranks = _spawn(tmp_path, overrides)
    _compare(ranks, overrides)
    for rank in ranks:
        for chosen in rank["chosen"].values():
            assert chosen[0].max() < 2  # experts 0 and 1 only
    idle = {n: g for n, g in ranks[1]["grads"].items() if ".experts.local." in n}
    assert idle and all(torch.count_nonzero(g) == 0 for g in idle.values())  # zero, not None
