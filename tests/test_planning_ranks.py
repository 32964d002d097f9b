"""``k3-train plan``'s model-state bytes against what each rank really holds (torchrun,
gloo, FSDP2; Muon and NorMuon): on 2 ranks FSDP 2 with and without ``--expert-parallel
2``, two pipeline stages, context parallelism 2; on 4 ranks two stages over two data
ranks and context parallelism 2 over two data ranks (each with and without EP 2), and two
stages over two context-parallel ranks each. Parameters,
gradients and optimizer state to the byte, for every rank. Two torchrun launches
(tests/planning_worker.py). Deselect with
``-m 'not distributed'``.
"""

from __future__ import annotations

import json

import pytest
from planning_worker import OVERRIDES
from test_distributed_training import (
    TESTS,
    _run,
    distributed,
    needs_torchrun,
    one_launch_at_a_time,
    torchrun,
)

from k3_model.presets import preset
from k3_trainer.planning import Options, ParallelLayout, gpu, inventory, make_plan
from k3_trainer.planning.inventory import FIRST, LAST
from k3_trainer.planning.layout import stage_blocks
from k3_trainer.planning.memory import state_bytes

pytestmark = [distributed, needs_torchrun, one_launch_at_a_time]


def _launch(out, ranks: int) -> list[dict]:
    done = _run(torchrun(ranks, TESTS / "planning_worker.py", out), timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("planning"), 2)


@pytest.fixture(scope="module")
def measured4(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("planning4"), 4)


@pytest.mark.parametrize("normuon", [False, True])
@pytest.mark.parametrize("name, ep", [("fsdp2", 1), ("fsdp2+ep2", 2)])
def test_state_bytes_of_each_rank_equal_a_real_step_to_the_byte(measured, name, ep, normuon):
    config = preset("tiny", **OVERRIDES)
    inv = inventory(config)
    options = Options(precision="fp32", normuon=normuon)
    plan = make_plan(inv, ParallelLayout(dp=2, ep=ep, seq_len=16), gpu("h100"), options)
    (stage,) = plan.stages
    key = name + ("+normuon" if normuon else "")
    real = [ranks[key] for ranks in measured]
    assert (stage.params_bytes, stage.grads_bytes, stage.optimizer_bytes) == (
        real[0]["params"], real[0]["grads"], real[0]["optimizer"])
    everything = set(range(config.n_layers)) | {FIRST, LAST}
    other = state_bytes(inv, everything, shard=2, ep=ep, precision="fp32",
                        normuon=normuon, rank=1)
    assert (other.params, other.grads, other.optimizer) == (
        real[1]["params"], real[1]["grads"], real[1]["optimizer"])
    # The two ranks' FSDP shards make the whole model; expert stacks are halved by EP.
    whole = state_bytes(inv, everything, shard=1, ep=1, precision="fp32", normuon=normuon)
    assert real[0]["params"] > real[1]["params"]  # the odd rows: rank 0 is the most loaded
    if ep == 1:
        assert real[0]["params"] + real[1]["params"] == whole.params


@pytest.mark.parametrize("normuon", [False, True])
def test_each_pipeline_stage_s_bytes_equal_its_rank_s_to_the_byte(measured, normuon):
    """``--pp 2`` on 2 ranks: stage s on rank s, whole (dp 1); the plan's stage s is
    rank s's parameters, gradients and optimizer state after a real step of the
    schedule."""
    config = preset("tiny", **OVERRIDES)
    options = Options(precision="fp32", normuon=normuon)
    plan = make_plan(inventory(config), ParallelLayout(pp=2, microbatches=2, batch_size=2,
                                                       seq_len=16), gpu("h100"), options)
    key = "pp2" + ("+normuon" if normuon else "")
    planned = [(s.params_bytes, s.grads_bytes, s.optimizer_bytes) for s in plan.stages]
    real = [(r[key]["params"], r[key]["grads"], r[key]["optimizer"]) for r in measured]
    assert planned == real
    whole = make_plan(inventory(config), ParallelLayout(seq_len=16), gpu("h100"), options)
    assert sum(p[0] for p in real) == whole.stages[0].params_bytes  # the cut loses nothing


@pytest.mark.parametrize("normuon", [False, True])
def test_context_parallel_ranks_hold_the_fsdp_shards_of_dp_times_cp(measured, normuon):
    """``--cp 2`` on 2 ranks: FSDP2 shards over ``dp × cp``, so each rank holds what the
    plan says (rank 0, the most loaded) and what FSDP 2 gives it."""
    config = preset("tiny", **OVERRIDES)
    plan = make_plan(inventory(config), ParallelLayout(cp=2, seq_len=16), gpu("h100"),
                     Options(precision="fp32", normuon=normuon))
    (stage,) = plan.stages
    suffix = "+normuon" if normuon else ""
    rank0 = measured[0]["cp2" + suffix]
    assert (stage.params_bytes, stage.grads_bytes, stage.optimizer_bytes) == (
        rank0["params"], rank0["grads"], rank0["optimizer"])
    assert [r["cp2" + suffix] for r in measured] == [r["fsdp2" + suffix] for r in measured]


def _held(ranks: list[dict], key: str) -> list[tuple[int, int, int]]:
    return [(r[key]["params"], r[key]["grads"], r[key]["optimizer"]) for r in ranks]


@pytest.mark.parametrize("normuon", [False, True])
@pytest.mark.parametrize("name, ep, dp, cp", [("pp2xdp2", 1, 2, 1), ("pp2xdp2+ep2", 2, 2, 1),
                                              ("pp2xcp2", 1, 1, 2)])
def test_four_ranks_two_stages_over_two_ranks_each_to_the_byte(measured4, name, ep, dp, cp,
                                                               normuon):
    """``--pp 2`` on 4 ranks (mesh ``(pp, dp, cp)``: ranks 0, 1 hold stage 0, sharded over
    its dp × cp = 2 ranks; ranks 2, 3 stage 1), over two data ranks with and without each
    stage's experts split over them, or over two context-parallel ranks: each stage's
    most loaded rank is the plan's stage, and every rank holds what ``state_bytes`` says
    for its stage and shard."""
    config = preset("tiny", **OVERRIDES)
    inv = inventory(config)
    options = Options(precision="fp32", normuon=normuon)
    plan = make_plan(inv, ParallelLayout(dp=dp, cp=cp, pp=2, ep=ep, microbatches=2,
                                         batch_size=2, seq_len=16), gpu("h100"), options)
    real = _held(measured4, name + ("+normuon" if normuon else ""))
    planned = [(s.params_bytes, s.grads_bytes, s.optimizer_bytes) for s in plan.stages]
    assert planned == [max(real[0:2]), max(real[2:4])]
    first, last = stage_blocks(config.n_layers, 2)
    halves = [set(first) | {FIRST}, set(last) | {LAST}]
    for rank, held in enumerate(real):
        stage, dp_rank = divmod(rank, 2)
        expected = state_bytes(inv, halves[stage], shard=2, ep=ep, precision="fp32",
                               normuon=normuon, rank=dp_rank)
        assert held == (expected.params, expected.grads, expected.optimizer), rank


@pytest.mark.parametrize("normuon", [False, True])
@pytest.mark.parametrize("name, ep", [("cp2xdp2", 1), ("cp2xdp2+ep2", 2)])
def test_four_ranks_context_parallel_over_two_data_ranks_to_the_byte(measured4, name, ep,
                                                                    normuon):
    """``--cp 2`` on 4 ranks: FSDP2 shards over ``dp × cp`` = 4 (experts split over
    ``ep`` and replicated over the rest); each rank holds its shard, rank 0 the plan's."""
    config = preset("tiny", **OVERRIDES)
    inv = inventory(config)
    options = Options(precision="fp32", normuon=normuon)
    (stage,) = make_plan(inv, ParallelLayout(dp=2, cp=2, ep=ep, seq_len=16), gpu("h100"),
                         options).stages
    real = _held(measured4, name + ("+normuon" if normuon else ""))
    assert (stage.params_bytes, stage.grads_bytes, stage.optimizer_bytes) == real[0]
    everything = set(range(config.n_layers)) | {FIRST, LAST}
    for rank, held in enumerate(real):
        expected = state_bytes(inv, everything, shard=4, ep=ep, precision="fp32",
                               normuon=normuon, rank=rank)
        assert held == (expected.params, expected.grads, expected.optimizer), rank
