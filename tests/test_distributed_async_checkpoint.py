"""Checkpoints written in the background (``--async-checkpoint``) on 2 CPU processes
(torchrun, gloo).

Under DDP rank 0's worker thread writes the one file; under FSDP2 DCP's ``async_save``
writes every rank's shards on a gloo group of its own. Either way every checkpoint of the
run is bitwise the one a synchronous run writes at that step (the snapshot is the update
boundary, whatever training does meanwhile). A background write that fails on one rank
stops every rank at the same update with ``CheckpointWriteError``, without a hang, and
leaves the previous checkpoint as ``latest``, whole. Deselect with ``-m 'not distributed'``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from harness import assert_bitwise_equal, k3_train, rank_errors, toml_text
from test_distributed_training import (
    BATCH,
    STEPS,
    TAU,
    TESTS,
    _run,
    distributed,
    needs_torchrun,
    one_launch_at_a_time,
    torchrun,
)

from k3_checkpoint import read_payload
from k3_trainer import read_events
from k3_trainer.checkpoint import find_checkpoint

pytestmark = [distributed, needs_torchrun, one_launch_at_a_time]
INTERVAL = 2  # checkpoints at steps 2, 4, 6, 8, 10


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "small.toml"
    path.write_text(toml_text(train={"batch_size": BATCH // 2, "checkpoint_interval": INTERVAL,
                                     "qk_clip_tau": TAU}))
    return path


def _torchrun(program: list[object], parallel: str, data_dir: Path, config: Path,
              run_dir: Path, *extra: object, steps: int = STEPS,
              env: dict[str, str] | None = None, ok: bool = True):
    """``k3-train train`` on 2 ranks (``program``: ``-m k3_trainer.cli`` or a worker
    script; ``ok``: meant to succeed, see ``torchrun``); a run that hangs fails the test
    after 120 s, every process it started gone."""
    return _run(torchrun(2, *program, "train", "--parallel", parallel, "--data", data_dir,
                         "--config", config, "--device", "cpu", "--decay-steps", steps,
                         "--max-steps", steps, "--run-dir", run_dir, *extra, forked=ok),
                env=env)


def _history(run_dir: Path) -> list[str]:
    """The entries of the run's checkpoint history, hidden ones included."""
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def _checkpoint_state(folder: Path, scratch: Path) -> dict:
    """A checkpoint folder as one payload: ``k3.ckpt``, and a sharded one's components
    gathered from DCP in place of its shard-file index (DCP's metadata is not byte-stable).
    Whether it was written in the background is no part of the checkpoint."""
    payload = read_payload(folder / "k3.ckpt")
    if (folder / ".metadata").is_file():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        assert payload.pop("components") == ["shards"]
        payload.pop("shards")
        dcp_to_torch_save(folder, scratch / "gathered.pt")
        components = torch.load(scratch / "gathered.pt", weights_only=True)
        assert not set(components) & set(payload)
        payload.update(components)
    else:
        assert sorted(p.name for p in folder.iterdir()) == ["k3.ckpt"], folder
    payload["train_config"].pop("async_checkpoint", None)
    return payload


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_background_checkpoints_are_bitwise_the_synchronous_ones(parallel, config, tmp_path,
                                                                 data_dir):
    """Every checkpoint is kept (``--keep-last``), so each one written in the background,
    while training went on, is compared with the synchronous run's of the same step."""
    runs = {}
    for mode, extra in (("sync", ()), ("async", ("--async-checkpoint",))):
        runs[mode] = tmp_path / mode
        done = _torchrun(["-m", "k3_trainer.cli"], parallel, data_dir, config, runs[mode],
                         "--keep-last", STEPS, *extra)
        assert done.returncode == 0, done.stderr[-4000:]
    names = [f"step-{step:08d}" for step in range(INTERVAL, STEPS + 1, INTERVAL)]
    for run_dir in runs.values():
        assert _history(run_dir) == sorted(["latest", *names])  # nothing staged is left
        assert os.readlink(run_dir / "checkpoints" / "latest") == names[-1]
    for name in names:
        sync, background = (_checkpoint_state(run_dir / "checkpoints" / name, tmp_path)
                            for run_dir in runs.values())
        assert background["counters"]["step"] == int(name.removeprefix("step-"))
        assert background["data_parallel"] == {"mode": parallel, "world_size": 2}
        assert_bitwise_equal(sync, background, name)
    events = {mode: read_events(run_dir / "metrics.jsonl") for mode, run_dir in runs.items()}
    written = [e for e in events["async"] if e["event"] == "checkpoint"]
    assert [e["step"] for e in written] == [int(n.removeprefix("step-")) for n in names]
    assert all(e["background"] and e["digest"] for e in written), written
    assert not any(e.get("background") for e in events["sync"] if e["event"] == "checkpoint")
    # training itself is the same, update for update
    assert [e["loss"] for e in events["sync"] if e["event"] == "train"] == \
        [e["loss"] for e in events["async"] if e["event"] == "train"]


@pytest.mark.parametrize(("parallel", "fault", "reason"), [
    ("ddp", "0:2", "No space left on device"),  # rank 0 writes the one file
    ("fsdp", "1:2", "Input/output error"),  # rank 1 hashing its share of the shards
])
def test_a_background_write_failing_on_one_rank_stops_every_rank_at_one_step(
        parallel, fault, reason, config, tmp_path, data_dir):
    """Checkpoints at steps 5 (written), 10 (fails on one rank, on its writer thread) and
    15 (the last). The rank that finds the failure at a boundary asks every rank to stop
    on the next update's loss all-reduce: both ranks stop after the same update, before
    the next save would have waited for the write, with CheckpointWriteError; the CLI exits
    1 with a one-line error per rank, step 5 stays the latest checkpoint, whole, and the
    failed write's staging folder is gone."""
    run_dir, out = tmp_path / "run", tmp_path / "out"
    failed = _torchrun([TESTS / "async_fault_worker.py"], parallel, data_dir, config, run_dir,
                       "--async-checkpoint", "--checkpoint-interval", 5, steps=15,
                       env={"K3_TEST_ASYNC_FAULT": fault, "K3_TEST_ASYNC_OUT": str(out)},
                       ok=False)
    assert failed.returncode != 0
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    faulty = int(fault.split(":")[0])
    other = 1 - faulty
    # the fault fired on the faulty rank's writer thread, never on the training thread
    assert ranks[faulty].get("fault_in"), ranks
    assert ranks[faulty]["fault_thread"] != "MainThread", ranks
    assert "fault_in" not in ranks[other]
    stopped = ranks[0]["step"]
    assert ranks[1]["step"] == stopped and 10 < stopped < 15, ranks
    failed_write = f"cannot write checkpoint {run_dir / 'checkpoints' / 'step-00000010'}: "
    for record in ranks:
        assert record["error"]["type"] == "CheckpointWriteError", ranks
        assert record["error"]["message"].startswith("cannot write checkpoint "), ranks
    assert ranks[faulty]["error"]["message"].startswith(failed_write), ranks
    assert reason in ranks[faulty]["error"]["message"], ranks
    if parallel == "ddp":  # rank 1 wrote nothing: it names rank 0's failure
        assert "another rank's checkpoint write failed" in ranks[other]["error"]["message"]
    else:  # every rank wrote shards, and learnt of rank 1's failure inside the write
        assert ranks[other]["error"]["message"].startswith(failed_write), ranks
        assert reason in ranks[other]["error"]["message"], ranks
    # Each rank says so in one line, unless torchrun, seeing the other rank exit first, has
    # already terminated it (which rank exits first is a race); either way no rank dies of
    # an unhandled exception.
    said = rank_errors(failed.stderr)
    terminated = "Signal 15 (SIGTERM) received" in failed.stderr
    assert said and (len(said) == 2 or terminated), failed.stderr[-4000:]
    if faulty in said:
        assert said[faulty].startswith(failed_write) and reason in said[faulty], \
            failed.stderr[-4000:]
    if other in said:
        assert said[other].startswith("cannot write checkpoint "), failed.stderr[-4000:]
    # (torchrun's own ChildFailedError traceback is the launcher's, not a rank's)
    assert "/k3_trainer/" not in failed.stderr and "Error: cannot write" not in failed.stderr, \
        failed.stderr[-4000:]
    # Every rank stopped where the log says, before max_steps; step 5 is the latest.
    events = read_events(run_dir / "metrics.jsonl")
    assert [e["step"] for e in events if e["event"] == "train"] == list(range(1, stopped + 1))
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [5]
    end = [e for e in events if e["event"] == "session_end"]
    assert len(end) == 1 and end[0]["step"] == stopped, end
    assert reason in end[0]["checkpoint_failed"], end  # rank 0's own error
    assert _history(run_dir) == ["latest", "step-00000005"]
    assert find_checkpoint(run_dir) == run_dir / "checkpoints" / "step-00000005"
    shown = k3_train("inspect", run_dir)
    assert shown.returncode == 0, shown.stderr
    assert "step=5," in shown.stdout
    if parallel == "fsdp":
        assert "every checksum verified" in shown.stdout
    assert _checkpoint_state(find_checkpoint(run_dir), tmp_path)["counters"]["step"] == 5
