"""Every component of a sharded checkpoint through DCP, on 2 CPU processes (torchrun, gloo,
FSDP2): a stateful callback holding a DTensor is written by both ranks, each its own rows,
with nothing gathered onto rank 0 (whose ``k3.ckpt`` holds no tensor but the RNG's), and restored
bitwise and still sharded after the state was perturbed; a read-only load takes a subset; a
background write completes while the default process group keeps running collectives and
training changes the state in place, and a failure on one rank fails the write on both.
One torchrun launch (tests/sharded_worker.py). Deselect with ``-m 'not distributed'``.
"""

from __future__ import annotations

import json

from test_distributed_training import (
    TESTS,
    _run,
    distributed,
    needs_torchrun,
    one_launch_at_a_time,
    torchrun,
)

pytestmark = [distributed, needs_torchrun, one_launch_at_a_time]


def test_every_component_goes_through_dcp_on_two_ranks(tmp_path):
    out, root = tmp_path / "out", tmp_path / "checkpoints"
    out.mkdir()
    root.mkdir()
    done = _run(torchrun(2, TESTS / "sharded_worker.py", out, root), timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    main, other = ranks

    # Written by both ranks, each its half of the callback's [16, 8] tensor; no gather.
    assert all(r["shadow_local"] == [8, 8] for r in ranks)
    assert main["shadow_size"] == [16, 8]
    assert main["shadow_chunks"] == [[[0, 0], [8, 8]], [[8, 0], [8, 8]]]
    assert main["k3_tensors"] == 0  # beside the RNG states
    assert main["components"] == ["callbacks.ema", "counters", "model", "optimizer"]
    assert main["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "k3.ckpt"]
    assert len(main["digest"]) == 32 and other["digest"] == ""

    # Restored bitwise on both ranks, the callback's tensor still a sharded DTensor.
    assert all(r["restored"] and r["restored_sharded"] for r in ranks)
    assert all(r["subset_counters"] == 1 for r in ranks)

    # The background write: training's collectives ran meanwhile, the boundary was kept.
    assert all(r["sums"] == [3.0] * 5 for r in ranks)
    assert len(main["background_digest"]) == 32 and other["background_digest"] == ""
    assert all(r["background_restored"] for r in ranks)

    # Rank 1 failed to hash its share: its own error there, the agreement on rank 0.
    assert other["failure"][0] == 28 and "No space" in other["failure"][1]
    assert main["failure"] is not None and "rank 1" in main["failure"][1]
    assert not main["failing_has_index"]
