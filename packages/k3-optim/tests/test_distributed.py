"""Distributed Muon on 2 CPU ranks (gloo): equal to the one-process update, NS run once.

Each test spawns two worker processes (tests/dist_workers.py), then replays the same
reduced gradients through a one-process MuonAdamW here and compares.
"""

from __future__ import annotations

import time
from pathlib import Path

import dist_workers
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3_optim import MuonAdamW, matrix_view_shape
from k3_optim.distributed import assign_owners, chunk_rows

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")

WORLD, STEPS, TIMEOUT_S = 2, 3, 120


def _spawn(worker, tmp_path: Path) -> list[dict]:
    """Run ``worker`` on WORLD ranks; kill them and fail if they take over TIMEOUT_S."""
    ctx = mp.start_processes(worker, args=(WORLD, str(tmp_path / "init"), str(tmp_path), STEPS),
                             nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"distributed workers did not finish in {TIMEOUT_S} s")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _one_process(grads: list[dict[str, torch.Tensor]],
                 hp: dict | None = None) -> tuple[dict, MuonAdamW, int]:
    """The same steps in one process; returns params, optimizer and NS matrix count."""
    model = dist_workers.build()
    opt = MuonAdamW(dist_workers.groups(model), **(hp or dist_workers.HP))
    counts = dist_workers.count_ns_matrices()
    for step_grads in grads:
        for name, p in model.named_parameters():
            p.grad = step_grads[name].clone()
        opt.step()
    return dict(model.named_parameters()), opt, sum(counts)


def _matrix_count(model: torch.nn.Module) -> int:
    total = 0
    for group in dist_workers.groups(model):
        if group["use_muon"]:
            total += sum(matrix_view_shape(p.shape, num_heads=group.get("num_heads"))[0]
                         for p in group["params"])
    return total


@pytest.fixture(autouse=True)
def _restore_newton_schulz(monkeypatch):
    # _one_process installs a counting spy; undo it for the other tests.
    import k3_optim.muon

    monkeypatch.setattr(k3_optim.muon, "iterate", k3_optim.muon.iterate)


def test_ddp_update_equals_one_process_and_ns_runs_once(tmp_path):
    ranks = _spawn(dist_workers.ddp_worker, tmp_path)
    params, _, single_count = _one_process(ranks[0]["grads"])
    per_step = _matrix_count(dist_workers.build())
    assert single_count == STEPS * per_step
    # Every matrix orthogonalized on exactly one rank, and both ranks did some of them.
    assert sum(r["ns_matrices"] for r in ranks) == single_count
    assert all(0 < r["ns_matrices"] < single_count for r in ranks)
    for name, p in params.items():
        for r in ranks:
            diff = (r["params"][name] - p).abs().max().item()
            assert diff <= 1e-10, (name, diff)
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name


def test_ddp_normuon_and_cautious_decay_equal_one_process(tmp_path):
    ranks = _spawn(dist_workers.ddp_variants_worker, tmp_path)
    params, opt, single_count = _one_process(ranks[0]["grads"], dist_workers.HP_VARIANTS)
    assert sum(r["ns_matrices"] for r in ranks) == single_count
    assert any("row_second_moment" in s for s in opt.state.values())
    for name, p in params.items():
        for r in ranks:
            diff = (r["params"][name] - p).abs().max().item()
            assert diff <= 1e-10, (name, diff)


def test_fsdp2_normuon_and_cautious_decay_equal_one_process_and_round_trip(tmp_path):
    """NorMuon's rows split over ranks (5 rows → 3 | 2, and per-head blocks cut inside a
    head): each rank normalizes its own rows, the per-matrix sums reduced across ranks."""
    ranks = _spawn(dist_workers.fsdp_variants_worker, tmp_path)
    params, opt, single_count = _one_process(ranks[0]["grads"], dist_workers.HP_VARIANTS)
    assert sum(r["ns_matrices"] for r in ranks) == single_count
    for name, p in params.items():
        for r in ranks:
            diff = (r["params"][name] - p).abs().max().item()
            assert diff <= 1e-10, (name, diff)
        if name in ranks[0]["row_second_moment"]:
            v = opt.state[p]["row_second_moment"]
            assert (ranks[0]["row_second_moment"][name] - v).abs().max().item() <= 1e-12, name
    assert set(ranks[0]["row_second_moment"]) == {"q.weight", "up.weight", "tall.weight",
                                                    "down.weight", "experts"}
    assert all(r["sharded_state"] for r in ranks)  # row state: DTensors sharded like p
    assert all(r["round_trip"] == [True, True] for r in ranks)


def test_fsdp2_update_equals_one_process_and_state_round_trips(tmp_path):
    ranks = _spawn(dist_workers.fsdp_worker, tmp_path)
    # The shapes really are split unevenly (5 rows → 3 | 2, 3 experts → 2 | 1).
    assert [r["local_rows"]["up.weight"] for r in ranks] == [3, 2]
    assert [r["local_rows"]["experts"] for r in ranks] == [2, 1]
    params, opt, single_count = _one_process(ranks[0]["grads"])
    assert sum(r["ns_matrices"] for r in ranks) == single_count
    assert all(0 < r["ns_matrices"] < single_count for r in ranks)
    for name, p in params.items():
        for r in ranks:
            diff = (r["params"][name] - p).abs().max().item()
            assert diff <= 1e-10, (name, diff)
        if name in ranks[0]["momentum"]:
            buf = opt.state[p]["momentum_buffer"]
            assert (ranks[0]["momentum"][name] - buf).abs().max().item() <= 1e-12, name
    assert all(r["sharded_state"] for r in ranks)  # momentum is a DTensor sharded like p
    # state_dict() → load, and DCP get/set_optimizer_state_dict → identical next step.
    assert all(r["round_trip"] == [True, True] for r in ranks)


def test_expert_sharded_stacks_are_orthogonalized_once_where_they_live(tmp_path):
    """Expert parallelism's stacks (Shard(0) over the expert group, Replicate() over the
    replicas) equal the one-process update. Over an expert group each rank orthogonalizes
    exactly its own experts with no exchange at all; over replicas each stack is
    orthogonalized by one replica and sent to the others."""
    ranks = _spawn(dist_workers.ep_worker, tmp_path)
    p = torch.nn.Parameter(dist_workers.expert_start())
    opt = MuonAdamW([{"params": [p], "use_muon": True}], **dist_workers.HP)
    for grad in dist_workers.expert_grads(STEPS):
        p.grad = grad.clone()
        opt.step()
    experts = dist_workers.EXPERTS[0]
    sharded, replicated = (1, WORLD), (WORLD, 1)
    for r in ranks:
        start, stop = r[sharded]["slice"]
        assert stop - start == experts // WORLD
        torch.testing.assert_close(r[sharded]["local"], p.detach()[start:stop], rtol=0,
                                   atol=1e-12)
        assert r[sharded]["ns_matrices"] == STEPS * (experts // WORLD)  # its own experts
        assert r[sharded]["all_to_alls"] == 0  # no other rank's expert was gathered
        torch.testing.assert_close(r[replicated]["local"], p.detach(), rtol=0, atol=1e-12)
        assert r[sharded]["buffer_is_dtensor"] and r[replicated]["buffer_is_dtensor"]
    assert sorted(r[sharded]["slice"] for r in ranks) == [(0, 2), (2, 4)]
    # Replicas: the whole stack orthogonalized once per step, on one rank of the two.
    assert sum(r[replicated]["ns_matrices"] for r in ranks) == STEPS * experts
    assert all(r[replicated]["all_to_alls"] > 0 for r in ranks)


def test_owner_assignment_balances_ns_work():
    loads = [0.0, 0.0]
    owners = assign_owners([8, 8, 8, 8, 1, 1], loads)
    assert owners == [0, 1, 0, 1, 0, 1] and loads == [17.0, 17.0]
    # Loads carry over between param groups of one step.
    assert assign_owners([5], loads) == [0] and assign_owners([3], loads) == [1]


def test_chunk_rows_match_torch_chunk():
    for n in range(0, 9):
        for world in (1, 2, 3, 4):
            ranges = chunk_rows(n, world)
            sizes = [c.shape[0] for c in torch.arange(n).chunk(world)] if n else []
            assert [e - s for s, e in ranges] == sizes + [0] * (world - len(sizes))
            assert ranges[0][0] == 0 and ranges[-1][1] == n


def test_distributed_true_needs_a_process_group():
    p = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="init_process_group"):
        MuonAdamW([{"params": [p], "use_muon": True}], distributed=True)
    with pytest.raises(ValueError, match="process_group"):
        MuonAdamW([{"params": [p], "use_muon": True}], process_group=object())


def test_layouts_distributed_muon_cannot_handle_raise(tmp_path):
    from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])

        def param(placement):
            p = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [placement]))
            p.grad = distribute_tensor(torch.randn(6, 4), mesh, [placement])
            return p

        def step(params, **kwargs):
            MuonAdamW([{"params": params, "use_muon": True}], **kwargs).step()

        with pytest.raises(ValueError, match=r"Shard\(0\).*shard_placement_fn"):
            step([param(Shard(1))])
        plain_one = torch.nn.Parameter(torch.randn(6, 4))
        plain_one.grad = torch.randn(6, 4)
        with pytest.raises(ValueError, match="mixes DTensor and plain"):
            step([param(Shard(0)), plain_one])
        with pytest.raises(ValueError, match="distributed=None"):
            step([param(Shard(0))], distributed=False)
        # A world of one takes the local path and matches plain tensors exactly.
        sharded, replicated = param(Shard(0)), param(Replicate())
        plain = [torch.nn.Parameter(p.full_tensor().clone()) for p in (sharded, replicated)]
        for p, q in zip(plain, (sharded, replicated)):
            p.grad = q.grad.full_tensor().clone()
        step([sharded, replicated])
        step(plain)
        for p, q in zip(plain, (sharded, replicated)):
            assert torch.equal(p, q.full_tensor())
    finally:
        dist.destroy_process_group()
