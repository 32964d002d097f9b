"""The layouts ``k3-train train`` refuses before any process group (``check_launch``): one
line each naming the flag and the fix, the geometry decided by the planner's own
``validate_layout``; and the pipeline's stage cut."""

from __future__ import annotations

import dataclasses

import pytest

from k3_trainer.config import ConfigError, TrainConfig
from k3_trainer.models import get_model_spec
from k3_trainer.planning import layout as planning_layout
from k3_trainer.planning.layout import check_launch, microbatches, stage_blocks, stage_rank

SPEC = get_model_spec("k3")


def _config(**fields) -> TrainConfig:
    return TrainConfig(**{"batch_size": 8, "pipeline_parallel": 2, **fields})


def _tiny():
    return SPEC.presets["tiny"]


@pytest.mark.parametrize(("fields", "mode", "world", "layers", "message"), [
    ({}, "ddp", 2, 4, "--pipeline-parallel 2 needs --parallel fsdp"),
    ({}, "none", 1, 4, "--pipeline-parallel 2 needs --parallel fsdp"),
    ({}, "fsdp", 3, 4, "the world size 3 is not dp·cp·pp = 1·1·2 = 2; the processes must be "
                       "a multiple of cp·pp = 2"),
    ({"expert_parallel": 2}, "fsdp", 2, 4, "ep (2) must divide dp·cp (1)"),  # per stage
    ({}, "fsdp", 2, 1, "2 stages but the model has 1 decoder blocks"),
    ({}, "fsdp", 2, None, "but the model has 0 decoder blocks"),
    ({"pp_schedule": "interleaved-1f1b", "pp_stages_per_rank": 2}, "fsdp", 2, 3,
     "4 stages but the model has 3 decoder blocks"),
    ({"pp_schedule": "interleaved-1f1b"}, "fsdp", 2, 4, "needs --pp-stages-per-rank 2"),
    ({"pp_stages_per_rank": 2}, "fsdp", 2, 4, "needs --pp-schedule interleaved-1f1b"),
    ({"pp_schedule": "zbv"}, "fsdp", 2, 4, "--pp-schedule zbv needs --pp-stages-per-rank 2"),
    ({"pp_schedule": "dualpipev", "pp_stages_per_rank": 3, "pp_microbatches": 6}, "fsdp", 2, 6,
     "dualpipev runs exactly 2 stages per rank, got 3"),
    ({"pp_schedule": "zbv", "pp_stages_per_rank": 2, "pp_microbatches": 2}, "fsdp", 2, 4,
     "microbatches (2) must be ≥ the stages (4) for zbv"),
    ({"pp_microbatches": 1}, "fsdp", 2, 4, "microbatches (1) must be ≥ pp (2) for 1F1B"),
    ({"pp_microbatches": 3}, "fsdp", 2, 4, "batch_size (8) does not split into 3 microbatches"),
    ({"pipeline_parallel": 1, "pp_microbatches": 2}, "fsdp", 2, 4,
     "need --pipeline-parallel 2 or more"),
    ({"pipeline_parallel": 1, "context_parallel": 2}, "ddp", 2, 4,
     "--context-parallel 2 needs --parallel fsdp"),
    ({"context_parallel": 2}, "fsdp", 2, 4, "the world size 2 is not dp·cp·pp = 1·2·2 = 4"),
    ({"pipeline_parallel": 1, "context_parallel": 2, "seq_len": 63}, "fsdp", 2, 4,
     "seq_len (63) is not divisible by cp (2)"),
    ({"pipeline_parallel": 1, "context_parallel": 2}, "fsdp", 3, 4,
     "the world size 3 is not dp·cp·pp = 1·2·1 = 2"),
    ({"pipeline_parallel": 1, "expert_parallel": 4}, "fsdp", 2, 4,
     "ep (4) must divide dp·cp (2)"),
    ({"pipeline_parallel": 1, "expert_parallel": 2, "downstream": "arc_easy"}, "fsdp", 2, 4,
     "--downstream scores each rank's share of the documents with every expert"),
])
def test_a_layout_that_cannot_work_is_refused_with_one_line(fields, mode, world, layers,
                                                            message):
    with pytest.raises(ConfigError) as refused:
        check_launch(_config(**fields), mode, world, n_blocks=layers)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(("fields", "world", "layers"), [
    ({}, 2, 2), ({}, 4, 4), ({"pp_schedule": "gpipe", "pp_microbatches": 1}, 2, 4),
    ({"pp_schedule": "interleaved-1f1b", "pp_stages_per_rank": 2, "pp_microbatches": 4},
     2, 4),
    ({"pipeline_parallel": 1}, 1, 1), ({"pipeline_parallel": 1}, 1, None),
    ({"pipeline_parallel": 1, "context_parallel": 2, "seq_len": 64}, 4, 4),
    ({"pipeline_parallel": 1, "context_parallel": 2, "expert_parallel": 4}, 4, 4),
    ({"expert_parallel": 2}, 4, 4),  # Kimi K2's shape: stages × experts × data
    ({"pp_schedule": "zbv", "pp_stages_per_rank": 2, "pp_microbatches": 4}, 2, 4),
    ({"pp_schedule": "dualpipev", "pp_stages_per_rank": 2, "pp_microbatches": 8}, 4, 4),
    ({"pipeline_parallel": 1, "context_parallel": 2, "seq_len": 64, "downstream": "arc_easy"},
     2, 4),
    ({"downstream": "arc_easy"}, 2, 4),  # scored forward only through the stages
    ({"context_parallel": 2, "seq_len": 64, "downstream": "arc_easy"}, 4, 4),  # on slices
    ({"context_parallel": 2, "seq_len": 64, "expert_parallel": 2}, 8, 4),
    ({"expert_parallel": 2, "downstream": "arc_easy"}, 4, 4),  # through the stages' experts
])
def test_a_layout_that_works_passes(fields, world, layers):
    check_launch(_config(**fields), "fsdp" if world > 1 else "none", world, n_blocks=layers)


def test_the_model_s_own_context_refusal_comes_through_the_same_check():
    config = _config(pipeline_parallel=1, context_parallel=4, seq_len=32)
    with pytest.raises(ConfigError, match="KDA chunk"):
        check_launch(config, "fsdp", 4, n_blocks=4, spec=SPEC, model_config=_tiny())
    check_launch(_config(pipeline_parallel=1, context_parallel=2, seq_len=128), "fsdp", 2,
                 n_blocks=4, spec=SPEC, model_config=_tiny())


def test_the_launch_geometry_is_the_planner_s_decision(monkeypatch):
    """Take the planner's check away and the trainer's geometric refusals go with it."""
    monkeypatch.setattr(planning_layout, "validate_layout", lambda *a, **k: None)
    check_launch(_config(pp_microbatches=3), "fsdp", 3, n_blocks=1)


def test_the_default_microbatches_are_the_stage_count_and_the_cut_is_balanced():
    assert microbatches(_config()) == 2
    assert microbatches(_config(pp_stages_per_rank=2)) == 4
    assert microbatches(_config(pp_microbatches=8)) == 8
    assert stage_blocks(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_blocks(4, 4) == [range(i, i + 1) for i in range(4)]


def test_v_shaped_schedules_hold_the_first_and_the_last_stage_on_rank_0():
    """ZBV and DualPipeV place stages in a V (as torch's ``generate_stage_to_rank_mapping``
    with ``style="v"``); the others loop."""
    assert [stage_rank(s, 2, "zbv") for s in range(4)] == [0, 1, 1, 0]
    assert [stage_rank(s, 3, "dualpipev") for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [stage_rank(s, 2, "interleaved-1f1b") for s in range(4)] == [0, 1, 0, 1]


def test_downstream_under_stages_needs_the_models_logits_hook():
    spec = get_model_spec("k3")
    assert spec.pipeline is not None and spec.pipeline.logits is not None
    check_launch(_config(downstream="arc_easy"), "fsdp", 2, n_blocks=4, spec=spec)
    without = dataclasses.replace(spec, pipeline=dataclasses.replace(spec.pipeline,
                                                                     logits=None))
    with pytest.raises(ConfigError) as refused:
        check_launch(_config(downstream="arc_easy"), "fsdp", 2, n_blocks=4, spec=without)
    assert "declares no logits hook for its last stage" in str(refused.value)
    check_launch(_config(), "fsdp", 2, n_blocks=4, spec=without)  # training needs none
