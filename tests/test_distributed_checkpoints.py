"""Data-parallel checkpoints on 2 CPU processes (torchrun, gloo).

A run's checkpoints go to its history, ``checkpoints/step-NNNNNNNN/`` with ``latest`` naming
the newest: under DDP the folder holds one format-7 ``k3.ckpt`` (rank 0 writes it); under
FSDP2 it is a sharded ``torch.distributed.checkpoint`` folder holding every component, with
a format-7 ``k3.ckpt`` of metadata, RNG and the shard index beside the shards, staged in
``checkpoints/.step-NNNNNNNN.tmp`` and published by a rename. Both resume bitwise at the
same world size; a rank killed with SIGKILL mid-run (inside a checkpoint write) costs only
the steps since the last published checkpoint and the restarted run ends bitwise equal to
an uninterrupted one; another world size or layout resumes only with
``--allow-runtime-change`` (DCP reshards) and is recorded as a ``runtime_changed`` event; a
checkpoint refused on one rank changes no rank; ``k3-train inspect`` reads both forms and
verifies every shard. Deselect with ``-m 'not distributed'``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from harness import assert_bitwise_equal, k3_train, latest_checkpoint, rank_errors, toml_text
from test_distributed_training import (
    BATCH,
    STEPS,
    TAU,
    TESTS,
    TORCHRUN,
    _run,
    _worker,
    distributed,
    needs_torchrun,
    one_launch_at_a_time,
    torchrun,
)

from k3_checkpoint import read_payload
from k3_trainer import read_events
from k3_trainer.checkpoint import find_checkpoint

pytestmark = [distributed, needs_torchrun, one_launch_at_a_time]
INTERVAL = 2  # checkpoints at steps 2, 4, 6


def _command(parallel: str, data_dir: Path, config: Path, run_dir: Path,
             *extra: object) -> list[object]:
    """``fsdp+ep``: FSDP2 with each MoE layer's experts split over the 2 ranks."""
    if parallel == "fsdp+ep":
        parallel, extra = "fsdp", ("--expert-parallel", 2, *extra)
    return ["train", "--parallel", parallel, "--data", data_dir, "--config", config,
            "--device", "cpu", "--decay-steps", STEPS, "--run-dir", run_dir, *extra]


def _torchrun(*args: object, env: dict[str, str] | None = None, ok: bool = True):
    result = _run(torchrun(2, *args, forked=ok), env=env)
    if ok:
        assert result.returncode == 0, result.stderr[-4000:]
    return result


def _sharded_components(folder: Path, scratch: Path) -> dict:
    """Every component a sharded checkpoint folder keeps in DCP (model, optimizer,
    counters, loaders, grad_scaler, callbacks), gathered whole by DCP's own converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    assert (folder / ".metadata").is_file(), f"{folder} is not a sharded checkpoint"
    out = scratch / "gathered.pt"
    dcp_to_torch_save(folder, out)
    gathered = torch.load(out, weights_only=True)
    out.unlink()
    return gathered


def _final_state(run_dir: Path, scratch: Path) -> dict:
    """The run's latest checkpoint as one payload: a sharded one's components gathered
    from DCP beside ``k3.ckpt``'s metadata and RNG, its shard-file index dropped (DCP's
    metadata is not byte-stable)."""
    found = find_checkpoint(run_dir)
    assert found is not None, run_dir
    assert found.resolve() == (run_dir / "checkpoints" / "latest").resolve(), found
    if not (found / ".metadata").is_file():  # one process or DDP: k3.ckpt alone
        assert sorted(p.name for p in found.iterdir()) == ["k3.ckpt"], found
        return read_payload(found / "k3.ckpt")
    payload = read_payload(found / "k3.ckpt")
    assert payload["components"] == ["shards"], payload["components"]
    index = payload.pop("shards")
    components = _sharded_components(found, scratch)
    assert sorted(components) == sorted({name.split(".")[0] for name in index["components"]})
    assert not set(components) & set(payload), set(components) & set(payload)
    return {**payload, **components}


def _checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the ``checkpoint`` events rank 0 logged, in order."""
    return [e["step"] for e in read_events(run_dir / "metrics.jsonl")
            if e["event"] == "checkpoint"]


def _history(run_dir: Path) -> list[str]:
    """The entries of the run's checkpoint history, hidden ones included."""
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "small.toml"
    path.write_text(toml_text(train={"batch_size": BATCH // 2, "checkpoint_interval": INTERVAL,
                                     "qk_clip_tau": TAU}))
    return path


@pytest.fixture(scope="module")
def continuous(tmp_path_factory, data_dir, config):
    """``{mode: run_dir}`` of uninterrupted 2-rank runs (forked launches: ``k3-train
    --nproc``, which runs the same torchrun command in new interpreters, is tested in
    test_interrupt_cli.py)."""
    runs = {}
    for parallel in ("ddp", "fsdp", "fsdp+ep"):
        run_dir = tmp_path_factory.mktemp(parallel) / "continuous"
        _torchrun("-m", "k3_trainer.cli",
                  *_command(parallel, data_dir, config, run_dir, "--max-steps", STEPS))
        runs[parallel] = run_dir
    return runs


@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "fsdp+ep"])
def test_resume_at_the_same_world_size_is_bitwise(parallel, continuous, config, tmp_path,
                                                  data_dir):
    run_dir = tmp_path / "interrupted"
    cli = ["-m", "k3_trainer.cli", *_command(parallel, data_dir, config, run_dir)]
    _torchrun(*cli, "--max-steps", 3)
    _torchrun(*cli, "--max-steps", STEPS, "--resume")
    a = _final_state(continuous[parallel], tmp_path)
    b = _final_state(run_dir, tmp_path)
    layout = {"mode": "fsdp", "world_size": 2, "expert_parallel": 2} if parallel == "fsdp+ep" \
        else {"mode": parallel, "world_size": 2}
    assert a["data_parallel"] == layout
    assert a["counters"]["tokens_seen"] == STEPS * BATCH * 16
    assert_bitwise_equal(a, b)
    # The published folder, no leftovers (keep_last 1: the newest step only).
    assert _history(run_dir) == ["latest", f"step-{STEPS:08d}"]
    assert os.readlink(run_dir / "checkpoints" / "latest") == f"step-{STEPS:08d}"
    assert not (run_dir / "checkpoint.pt").exists() and not (run_dir / "checkpoint.dcp").exists()
    if parallel != "ddp":  # every component is sharded in DCP
        folder = run_dir / "checkpoints" / "latest"
        shards = sorted(p.name for p in folder.iterdir() if p.suffix == ".distcp")
        assert shards == ["__0_0.distcp", "__1_0.distcp"], shards
        assert {"model", "optimizer", "counters", "loaders", "grad_scaler"} <= set(b)
        assert b["counters"]["step"] == STEPS


def test_a_rank_killed_inside_a_checkpoint_write_resumes_bitwise(continuous, config,
                                                                  tmp_path, data_dir):
    run_dir = tmp_path / "killed"
    cli = [TESTS / "cli_driver.py", *_command("fsdp", data_dir, config, run_dir,
                                              "--max-steps", STEPS)]
    # Rank 1 dies inside the second write (step 4): its shards are on disk, nothing is
    # published yet. torchrun then fails the whole job.
    killed = _torchrun(*cli, env={"K3_TEST_KILL_RANK": "1:sharded-write:2"}, ok=False)
    assert killed.returncode != 0
    assert "Signal 9 (SIGKILL)" in killed.stderr, killed.stderr[-3000:]  # the kill fired
    staged = run_dir / "checkpoints" / ".step-00000004.tmp"  # the unpublished write
    assert staged.is_dir() and any(p.suffix == ".distcp" for p in staged.iterdir())
    assert not (staged / "k3.ckpt").exists()
    assert _history(run_dir) == [".step-00000004.tmp", "latest", "step-00000002"]
    assert find_checkpoint(run_dir) == run_dir / "checkpoints" / "step-00000002"
    assert _checkpoint_steps(run_dir) == [2]
    assert _sharded_components(find_checkpoint(run_dir), tmp_path)["counters"]["step"] == 2
    _torchrun(*cli, "--resume")
    assert _history(run_dir) == ["latest", f"step-{STEPS:08d}"]  # the leftover is gone
    assert_bitwise_equal(_final_state(continuous["fsdp"], tmp_path),
                         _final_state(run_dir, tmp_path))
    steps = [json.loads(line).get("step") for line in
             (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["event"] == "train"]
    # Steps 1-4 ran, then the restart from step 2 trained 3, 4, ... again.
    assert steps == [1, 2, 3, 4, *range(3, STEPS + 1)]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_another_world_size_resumes_only_when_allowed(parallel, continuous, config,
                                                      tmp_path, data_dir):
    run_dir = tmp_path / "moved"
    shutil.copytree(continuous[parallel], run_dir, symlinks=True)
    args = ["train", "--run-dir", run_dir, "--resume", "--max-steps", STEPS + 2,
            "--device", "cpu", "--data", data_dir]
    strict = k3_train(*args)
    assert strict.returncode == 2 and "data_parallel" in strict.stderr
    assert strict.stderr.rstrip().endswith(
        f"; relaunch as the run was launched (--parallel {parallel} --nproc 2), or pass "
        "--allow-runtime-change to continue anyway (no bitwise promise)")
    assert find_checkpoint(run_dir) is not None and "runtime_changed" not in (
        run_dir / "metrics.jsonl").read_text()
    allowed = k3_train(*args, "--allow-runtime-change")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "no longer bitwise-identical" in allowed.stderr
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    changed = [e for e in events if e["event"] == "runtime_changed"]
    assert len(changed) == 1 and changed[0]["step"] == STEPS
    assert changed[0]["changes"]["data_parallel.world_size"]["saved"] == 2
    assert [e["step"] for e in events if e["event"] == "train"][-2:] == [STEPS + 1, STEPS + 2]
    # One process writes the single-file form, and the (sharded) one it resumed from is
    # pruned from the history.
    assert _history(run_dir) == ["latest", f"step-{STEPS + 2:08d}"]
    assert sorted(p.name for p in (run_dir / "checkpoints" / "latest").iterdir()) == ["k3.ckpt"]
    assert read_payload(latest_checkpoint(run_dir))["counters"]["step"] == STEPS + 2


def test_an_expert_parallel_run_resumes_in_another_layout_and_evaluates_in_one_process(
        continuous, config, tmp_path, data_dir):
    """The experts are saved under their global indices, whole-model shapes: the run
    resumes strictly only as it ran, with --allow-runtime-change under FSDP2 without
    expert parallelism (DCP reshards the experts), and one process evaluates it."""
    run_dir = tmp_path / "ep"
    shutil.copytree(continuous["fsdp+ep"], run_dir, symlinks=True)
    shown = k3_train("inspect", run_dir)
    assert shown.returncode == 0, shown.stderr
    experts = json.loads((run_dir / "run.json").read_text())["model_config"]["n_experts"]
    half = experts // 2
    assert (f"expert layout  1 expert group(s) of 2 ranks: rank r of a group held routed "
            f"experts [{half}·r, {half}·(r+1)) of {experts}") in shown.stdout
    # One process reads the sharded experts whole: the logged validation loss again.
    evaluated = k3_train("eval", "--run-dir", run_dir, "--device", "cpu")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    logged = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "eval"][-1]
    val_loss = float(evaluated.stdout.split("val_loss ")[1].split(",")[0].split()[0])
    assert val_loss == pytest.approx(logged["val_loss"], abs=6e-5)
    cli = ["-m", "k3_trainer.cli", "train", "--parallel", "fsdp", "--run-dir", run_dir,
           "--resume", "--device", "cpu", "--data", data_dir, "--max-steps", STEPS + 2,
           "--expert-parallel", 1]  # a resume keeps the recorded degree unless told
    strict = _torchrun(*cli, ok=False)
    assert strict.returncode != 0 and "data_parallel" in strict.stderr
    assert "(--parallel fsdp --nproc 2 --expert-parallel 2)" in strict.stderr
    _torchrun(*cli, "--allow-runtime-change")
    events = read_events(run_dir / "metrics.jsonl")
    changed = [e for e in events if e["event"] == "runtime_changed"]
    assert len(changed) == 1 and "data_parallel.expert_parallel" in changed[0]["changes"]
    trained = [e for e in events if e["event"] == "train"]
    assert [e["step"] for e in trained][-2:] == [STEPS + 1, STEPS + 2]
    assert "moe_all_to_all_bytes_per_step" not in trained[-1]  # no expert parallelism now
    assert trained[-1]["loss"] == pytest.approx(trained[STEPS - 1]["loss"], rel=0.2)
    # ...and in one process (another world size) from the expert-parallel checkpoint itself.
    alone_dir = tmp_path / "alone"
    shutil.copytree(continuous["fsdp+ep"], alone_dir, symlinks=True)
    alone = k3_train("train", "--run-dir", alone_dir, "--resume", "--device", "cpu", "--data",
                     data_dir, "--max-steps", STEPS + 1, "--expert-parallel", 1,
                     "--allow-runtime-change")
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert _history(alone_dir) == ["latest", f"step-{STEPS + 1:08d}"]
    assert not (alone_dir / "checkpoints" / "latest" / ".metadata").exists()
    assert read_payload(latest_checkpoint(alone_dir))["counters"]["step"] == STEPS + 1


def test_inspect_reads_a_sharded_checkpoint_and_verifies_every_shard(continuous, tmp_path):
    run_dir = tmp_path / "inspected"
    shutil.copytree(continuous["fsdp"], run_dir, symlinks=True)
    shown = k3_train("inspect", run_dir)
    assert shown.returncode == 0, shown.stderr
    assert "every checksum verified" in shown.stdout and "data_parallel  mode=fsdp" in shown.stdout
    assert f"step={STEPS}" in shown.stdout
    # One process evaluates the FSDP2 run (DCP reads the 2 ranks' shards whole), on the
    # run's global batch: the same tokens, so the same loss as the run logged.
    evaluated = k3_train("eval", "--run-dir", run_dir, "--device", "cpu")
    assert evaluated.returncode == 0 and evaluated.stdout.startswith(f"step {STEPS}: val_loss")
    logged = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "eval"][-1]
    val_loss = float(evaluated.stdout.split("val_loss ")[1].split(",")[0].split()[0])
    assert val_loss == pytest.approx(logged["val_loss"], abs=6e-5)  # printed to 4 decimals
    assert f"({logged['val_tokens']:,} tokens in " in evaluated.stdout
    folder = find_checkpoint(run_dir)
    assert folder == run_dir / "checkpoints" / f"step-{STEPS:08d}"
    shard = next(folder.glob("__1_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    corrupt = k3_train("inspect", folder)
    assert corrupt.returncode == 2 and shard.name in corrupt.stderr
    refused = k3_train("train", "--run-dir", run_dir, "--resume", "--max-steps", STEPS + 1,
                       "--device", "cpu", "--allow-runtime-change")
    assert refused.returncode == 2 and "checksum" in refused.stderr
    assert [l for l in refused.stderr.splitlines() if l.strip()][-1].startswith("k3-train")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_stateful_callback_is_saved_restored_bitwise_and_rolled_back(parallel, tmp_path,
                                                                       data_dir):
    """A toy stateful callback (an EMA of the weights, dist_worker's ``WeightEMA``) is one
    more list entry: checkpointed with the run, restored so that the resumed run's EMA is
    bitwise the uninterrupted one's on every rank, and put back by a rank that had accepted
    a checkpoint another rank refused. That refused resume (rank 1's config differs) changes
    no rank: weights, optimizer, counters, EMA, every RNG and the loaders' cursors."""
    half = STEPS // 2
    checkpoint = tmp_path / ("checkpoint.dcp" if parallel == "fsdp" else "checkpoint.pt")
    continuous = _worker(tmp_path / "continuous", data_dir, parallel, "--ema")
    _worker(tmp_path / "first", data_dir, parallel, "--ema", "--steps", half,
            "--decay-steps", STEPS, "--checkpoint", checkpoint)
    if parallel == "fsdp":  # a library path under FSDP2: a symlink to the sharded folder
        assert checkpoint.is_symlink() and (checkpoint / ".metadata").is_file()
        index = read_payload(checkpoint / "k3.ckpt")["shards"]
        assert "callbacks.ema" in index["components"]
        saved = _sharded_components(checkpoint, tmp_path)
    else:
        saved = read_payload(checkpoint)
    assert set(saved["callbacks"]["ema"]) == set(continuous[0]["ema"])
    assert saved["counters"]["step"] == half
    resumed = _worker(tmp_path / "resumed", data_dir, parallel, "--ema", "--resume", checkpoint)
    for rank in range(2):
        assert_bitwise_equal(continuous[rank]["ema"], resumed[rank]["ema"], f"rank {rank} ema")
        assert_bitwise_equal(continuous[rank]["weights"], resumed[rank]["weights"])
    refused = _worker(tmp_path / "refused", data_dir, parallel, "--ema", "--resume", checkpoint,
                      "--reject-on-rank", "1")
    assert "train_config.peak_lr" in refused[1]["refused"]
    assert "another rank refused" in refused[0]["refused"]  # rank 0 alone would accept it
    # the EMA was put back too, and every RNG (dist_worker's fingerprint covers them)
    assert refused[0]["unchanged"] and refused[1]["unchanged"]
    assert refused[0]["cursors"] == refused[1]["cursors"] == [0, 0]
    assert refused[0]["ema"] == {}


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_failed_checkpoint_write_stops_every_rank(parallel, config, tmp_path, data_dir):
    """The disk fills during the first checkpoint (no file may grow past 400 KB): the ranks
    agree that the write failed and stop with a one-line error each, with no traceback,
    instead of rank 1 waiting for a writer that is gone; nothing is published."""
    run_dir = tmp_path / "full"
    failed = _torchrun(TESTS / "cli_driver.py",
                       *_command(parallel, data_dir, config, run_dir, "--max-steps", STEPS),
                       env={"K3_TEST_FSIZE": str(400_000)}, ok=False)
    assert failed.returncode != 0
    # Each rank reports its own line unless torchrun, seeing the other rank exit first, has
    # already terminated it (which rank exits first is a race); either way no rank dies of
    # an unhandled exception.
    said = rank_errors(failed.stderr)
    assert said and all(line.startswith("cannot write checkpoint") for line in said.values()), \
        failed.stderr[-3000:]
    assert len(said) == 2 or "Signal 15 (SIGTERM) received" in failed.stderr, \
        failed.stderr[-3000:]
    assert "Traceback" not in "\n".join(line for line in failed.stderr.splitlines()
                                        if line.startswith("[rank"))
    assert find_checkpoint(run_dir) is None
    assert _history(run_dir) == []  # the failed write's staging folder is removed


def test_a_two_node_torchrun_launch_trains_the_same_run(continuous, config, tmp_path, data_dir):
    """The multi-node launch the README shows, with both "nodes" on this machine: two
    torchrun agents (``--nnodes 2 --node-rank 0|1 --rdzv-endpoint``), one process each,
    train the expert-parallel run that 2 processes on one node train, bitwise."""
    import socket
    import subprocess

    from harness import kill_tree, subprocess_env

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run_dir = tmp_path / "two-nodes"
    cli = [str(a) for a in _command("fsdp+ep", data_dir, config, run_dir, "--max-steps", STEPS)]
    # Each agent writes to its own files, never to a pipe nobody reads while the test
    # waits on the other agent (a full pipe would stall that node and, through the
    # collectives, both).
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    nodes = []
    for node, log in enumerate(logs):
        with log.open("w") as out:
            nodes.append(subprocess.Popen(
                [str(TORCHRUN), "--nnodes", "2", "--node-rank", str(node),
                 "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "-m", "k3_trainer.cli", *cli],
                stdout=out, stderr=subprocess.STDOUT, env=subprocess_env(),
                start_new_session=True))
    try:
        for node in nodes:
            node.wait(timeout=180)
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_tree(node.pid)
    for node, log in zip(nodes, logs):
        assert node.returncode == 0, log.read_text()[-3000:]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["sessions"][-1]["data_parallel"] == {"mode": "fsdp", "world_size": 2,
                                                        "expert_parallel": 2}
    assert_bitwise_equal(_final_state(continuous["fsdp+ep"], tmp_path),
                         _final_state(run_dir, tmp_path))
