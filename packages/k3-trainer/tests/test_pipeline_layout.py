"""The pipeline layouts refused before any process group (``check_layout``), one line
each naming the flag and the fix, and the stage cut."""

from __future__ import annotations

import pytest

from k3_trainer.config import ConfigError, TrainConfig
from k3_trainer.pipeline import check_layout, microbatches, stage_ranges


def _config(**fields) -> TrainConfig:
    return TrainConfig(**{"batch_size": 8, "pipeline_parallel": 2, **fields})


@pytest.mark.parametrize(("fields", "mode", "world", "layers", "message"), [
    ({}, "ddp", 2, 4, "--pipeline-parallel 2 needs --parallel fsdp"),
    ({}, "none", 1, 4, "--pipeline-parallel 2 needs --parallel fsdp"),
    ({}, "fsdp", 3, 4, "the world size 3 is not a multiple of it"),
    ({"expert_parallel": 2}, "fsdp", 2, 4, "--pipeline-parallel with --expert-parallel"),
    ({}, "fsdp", 2, 1, "2 stages, but the model has 1 decoder blocks"),
    ({}, "fsdp", 2, None, "but the model has 0 decoder blocks"),
    ({"pp_schedule": "interleaved-1f1b", "pp_stages_per_rank": 2}, "fsdp", 2, 3,
     "4 stages, but the model has 3 decoder blocks"),
    ({"pp_schedule": "interleaved-1f1b"}, "fsdp", 2, 4, "needs --pp-stages-per-rank 2"),
    ({"pp_stages_per_rank": 2}, "fsdp", 2, 4, "needs --pp-schedule interleaved-1f1b"),
    ({"pp_microbatches": 1}, "fsdp", 2, 4, "--pp-microbatches 1 is fewer than the 2 stages"),
    ({"pp_microbatches": 3}, "fsdp", 2, 4, "--batch-size 8 is not divisible into"),
    ({"pipeline_parallel": 1, "pp_microbatches": 2}, "fsdp", 2, 4,
     "need --pipeline-parallel 2 or more"),
])
def test_a_layout_that_cannot_work_is_refused_with_one_line(fields, mode, world, layers,
                                                            message):
    with pytest.raises(ConfigError) as refused:
        check_layout(_config(**fields), mode, world, layers)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(("fields", "world", "layers"), [
    ({}, 2, 2), ({}, 4, 4), ({"pp_schedule": "gpipe", "pp_microbatches": 1}, 2, 4),
    ({"pp_schedule": "interleaved-1f1b", "pp_stages_per_rank": 2, "pp_microbatches": 4},
     2, 4),
    ({"pipeline_parallel": 1}, 1, 1),
])
def test_a_layout_that_works_passes(fields, world, layers):
    check_layout(_config(**fields), "fsdp" if world > 1 else "none", world, layers)


def test_the_default_microbatches_are_the_stage_count_and_the_cut_is_balanced():
    assert microbatches(_config()) == 2
    assert microbatches(_config(pp_stages_per_rank=2)) == 4
    assert microbatches(_config(pp_microbatches=8)) == 8
    assert stage_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
