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


@pytest.fixture
def ep_config(make_config):
    """The small K3 hybrid with 4 experts, top-2 (2 per rank), with overrides."""
    def config(overrides: dict):
        return make_config("k3", n_experts=4, moe_top_k=2,
                           **{k: v for k, v in overrides.items() if not k.startswith("_")})
    return config


def _spawn(tmp_path: Path, config, overrides: dict) -> list[dict]:
    first_two = overrides.get("_first_two_experts", False)
    ctx = mp.start_processes(ep_workers.worker,
                             args=(WORLD, str(tmp_path / "init"), str(tmp_path),
                                   config, first_two),
                             nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"expert-parallel workers did not finish in {TIMEOUT_S} s")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _one_process(config, overrides: dict):
    model = ep_workers.build(config, overrides.get("_first_two_experts", False))
    chosen = ep_workers.record_routing(model)
    data = ep_workers.batch()
    _, loss = model(data[:, :-1], targets=data[:, 1:])
    loss.backward()
    return model, loss.detach(), chosen


def _compare(ranks: list[dict], config, overrides: dict) -> None:
    model, loss, chosen = _one_process(config, overrides)
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
    # The traffic meter: every row that crossed to the other rank, both exchanges, forward
    # and backward (each assignment's row goes to its expert's rank and comes back).
    width, per_rank = config.moe_width, config.n_experts // WORLD
    for r, rank in enumerate(ranks):
        rows = 0
        for name in rank["chosen"]:
            mine = rank["chosen"][name][0] // per_rank
            other = ranks[1 - r]["chosen"][name][0] // per_rank
            rows += int((mine != r).sum()) + int((other == r).sum())  # out + in
        assert rank["moved"] == 2 * rows * width * 8  # fp64 rows
    full = dict(model.named_parameters())
    for rank in ranks:
        for name, grad in rank["grads"].items():
            if ".experts." in name:  # every rank's tokens, divided by the world size
                layer = name.split(".experts.")[0]
                first, count = rank["experts"][layer]
                want = full[name].grad[first:first + count]
                torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-8, msg=name)
            else:  # replicated: data parallelism would average them (fp32-level, as above)
                mean = sum(r["grads"][name] for r in ranks) / WORLD
                torch.testing.assert_close(mean, full[name].grad, rtol=1e-5, atol=1e-8,
                                           msg=name)


def test_expert_parallel_equals_one_process(tmp_path, ep_config):
    config = ep_config({})
    ranks = _spawn(tmp_path, config, {})
    expert_grads = [n for n in ranks[0]["grads"] if ".experts." in n]
    assert expert_grads and ranks[0]["experts"] != ranks[1]["experts"]
    _compare(ranks, config, {})


def test_a_rank_whose_experts_get_no_tokens(tmp_path, ep_config):
    """With the balancer frozen and biased towards experts 0 and 1 (both on rank 0), rank
    1's experts receive no row in either direction, and the result is still exact."""
    overrides = {"moe_balance": False, "_first_two_experts": True}
    config = ep_config(overrides)
    ranks = _spawn(tmp_path, config, overrides)
    _compare(ranks, config, overrides)
    for rank in ranks:
        for chosen in rank["chosen"].values():
            assert chosen[0].max() < 2  # experts 0 and 1 only
    idle = {n: g for n, g in ranks[1]["grads"].items() if ".experts." in n}
    assert idle and all(torch.count_nonzero(g) == 0 for g in idle.values())  # zero, not None


@pytest.mark.parametrize(("args", "message"), [
    ((4, 3, "cpu"), "needs a world size divisible by it, got 4"),
    ((4, 4, "cpu", 2), "needs each stage's 2 ranks divisible by it"),
    ((4, 2, "cpu", 3), "3 pipeline stages need a world size divisible by them"),
])
def test_an_expert_mesh_that_cannot_be_carved_is_refused_before_any_group(args, message):
    """Checked before ``init_device_mesh``: no process group is needed to be told."""
    from k3_model.expert_parallel import expert_mesh

    with pytest.raises(ValueError, match=message):
        expert_mesh(*args)
