"""``k3-train plan``'s model-state bytes against what each of 2 ranks really holds (torchrun,
gloo, FSDP2; with and without ``--expert-parallel 2``, two pipeline stages, context
parallelism 2; Muon and NorMuon): parameters, gradients and optimizer state to the byte,
for rank 0 (the plan's most loaded rank) and rank 1. One torchrun launch
(tests/planning_worker.py). Deselect with
``-m 'not distributed'``.
"""

from __future__ import annotations

import json

import pytest
from planning_worker import OVERRIDES
from test_distributed_training import (
    TESTS,
    TORCHRUN,
    _run,
    distributed,
    needs_torchrun,
    one_launch_at_a_time,
)

from k3_model.presets import preset
from k3_trainer.planning import Options, ParallelLayout, gpu, inventory, make_plan
from k3_trainer.planning.inventory import FIRST, LAST
from k3_trainer.planning.memory import state_bytes

pytestmark = [distributed, needs_torchrun, one_launch_at_a_time]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("planning")
    done = _run([TORCHRUN, "--standalone", "--nproc_per_node", "2",
                 TESTS / "planning_worker.py", out], timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


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
