"""Data-parallel training on 2 CPU processes (torchrun, gloo) against one process.

A 2-rank run with per-rank batch B/2 reads exactly the token stream of a 1-process run
with batch B, so its losses and weights match that run's (fp32; only reduction order
differs); every rank ends with the same weights, balancer biases and QK-Clip maxima; DDP
an FP16 overflow found by one rank skips the update on every rank. Checkpoints and resume
are in test_distributed_checkpoints.py. Deselect with ``-m 'not distributed'``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import k3_train, kill_tree, launch_server, proc_stat, rank_errors, subprocess_env

import k3_trainer.cli
from k3_trainer import TokenDataLoader

TESTS = Path(__file__).resolve().parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
# ``python -m k3_trainer.cli`` as a script path, for torchrun's ``--run-path``.
CLI_SCRIPT = Path(k3_trainer.cli.__file__).with_name("__main__.py")
STEPS, BATCH = 10, 4
TAU = 0.02  # below the small model's max logits: QK-Clip rescales heads every step

distributed = pytest.mark.distributed
needs_torchrun = pytest.mark.skipif(
    not (TORCHRUN.exists() and torch.distributed.is_available()),
    reason="torchrun / torch.distributed unavailable")
# Every module that launches torchrun runs on one pytest-xdist worker, one test at a time:
# each launch already keeps two processes busy, and more launches at once only fight over
# the cores. Each module's expensive module-scoped set-up (continuous runs, one-process
# references) is then computed once too.
one_launch_at_a_time = pytest.mark.xdist_group("torchrun")
# ...except a second lane of launches, small enough to end with the other worker's
# ungrouped tests: the torchrun group alone outlasts all of those (it was the suite's
# critical path, its worker still launching while the other had nothing left), so one
# module's launches go to that worker instead, one at a time there too.
second_launch_lane = pytest.mark.xdist_group("torchrun-lane-2")


def _run(command: list[object], timeout: float = 120,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``command``; on timeout every process it started goes too. torchrun starts each
    rank in a session of its own, so killing torchrun's group would leave a stuck rank
    alive, holding the output pipes open and the test waiting forever."""
    with subprocess.Popen(list(map(str, command)), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=subprocess_env(env),
                          start_new_session=True) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)
            process.communicate(timeout=30)
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def torchrun(nproc: int, *args: object, forked: bool = True) -> list[object]:
    """The command line of a standalone torchrun launch of ``nproc`` ranks running ``args``
    (a script and its arguments, or ``-m k3_trainer.cli`` and its).

    ``forked``, for a launch meant to succeed: torchrun's own entry point with its own
    ``--run-path --start-method fork``, run in a fork of a warm server that has imported
    torch and the k3 packages already (launch_server.py, started on first use), so the
    agent and each rank start with those imports done. Same agent, rendezvous and
    environment; a rank runs the script as a function (``k3-train``'s ``python -m`` entry
    by its path). Otherwise the ``torchrun`` command as a user runs it, one new interpreter
    per rank: a launch whose failure is under test, since torchrun reports only the first
    failing rank of function ranks."""
    if not forked:
        return [TORCHRUN, "--standalone", "--nproc_per_node", nproc, *args]
    if args[:1] == ("-m",):
        assert args[1] == "k3_trainer.cli", args[:2]
        args = (CLI_SCRIPT, *args[2:])
    return [sys.executable, "-S", TESTS / "launch_client.py", launch_server(), "torchrun",
            "--standalone", "--nproc_per_node", nproc, "--run-path", "--start-method", "fork",
            *args]


def _torchrun(*args: object) -> subprocess.CompletedProcess[str]:
    result = _run(torchrun(2, *args))
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _worker(out: Path, data_dir: Path, parallel: str, *extra: object) -> list[dict]:
    """Run tests/dist_worker.py (1 process for ``none``, else 2 ranks); per-rank results.
    ``fsdp+ep`` is FSDP2 with the experts split over both ranks (``--expert-parallel 2``),
    ``fsdp+pp`` two pipeline stages (``--pp 2``, rank R holding stage R). ``extra`` comes
    last, so it may override the batch size."""
    per_rank = BATCH // 2  # two data ranks
    if parallel == "fsdp+ep":
        parallel, extra = "fsdp", ("--expert-parallel", 2, *extra)
    elif parallel == "fsdp+pp":  # two stages of one data rank: each sees the whole batch
        parallel, extra, per_rank = "fsdp", ("--pp", 2, *extra), BATCH
    args = [TESTS / "dist_worker.py", "--parallel", parallel, "--data", data_dir,
            "--out", out, "--steps", STEPS, "--qk-clip-tau", TAU]
    if parallel == "none":
        done = subprocess.run(
            [sys.executable, *map(str, [*args, "--batch-size", BATCH, *extra])],
            capture_output=True, text=True, env=subprocess_env(), timeout=120)
        assert done.returncode == 0, done.stderr[-4000:]
        return [torch.load(out / "rank0.pt", weights_only=False)]
    _torchrun(*args, "--batch-size", per_rank, *extra)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _train_events(result: dict) -> list[dict]:
    return [e for e in result["events"] if e["event"] == "train"]


pytestmark = one_launch_at_a_time


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, data_dir):
    return _worker(tmp_path_factory.mktemp("one"), data_dir, "none")[0]


def test_each_rank_reads_its_rows_of_the_one_process_batch(data_dir):
    one = TokenDataLoader(data_dir, "train", BATCH, 16)
    ranks = [TokenDataLoader(data_dir, "train", BATCH // 2, 16, rank=r, world_size=2)
             for r in range(2)]
    for _ in range(3):
        x, y = one.next_batch()
        parts = [loader.next_batch() for loader in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
        assert {loader.offset for loader in ranks} == {one.offset}  # global cursors
    assert ranks[1].state_dict() == one.state_dict()


@distributed
@needs_torchrun
@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "fsdp+ep"])
def test_two_ranks_match_one_process_and_agree(parallel, one_process, tmp_path, data_dir):
    ranks = _worker(tmp_path, data_dir, parallel)
    ours, reference = _train_events(ranks[0]), _train_events(one_process)
    assert [e["step"] for e in ours] == list(range(1, STEPS + 1))
    for a, b in zip(ours, reference):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["tokens_seen"] == b["tokens_seen"]  # every rank's tokens are counted
        assert a["qk_heads_clipped"] == b["qk_heads_clipped"]
    assert sum(e["qk_heads_clipped"] for e in ours) > 0  # QK-Clip rescaled sharded weights
    evals = [e["val_loss"] for e in ranks[0]["events"] if e["event"] == "eval"]
    assert evals == pytest.approx([e["val_loss"] for e in one_process["events"]
                                   if e["event"] == "eval"], rel=1e-4)
    for name, weight in one_process["weights"].items():
        torch.testing.assert_close(ranks[0]["weights"][name], weight, rtol=1e-4, atol=1e-5)
        # The ranks agree bitwise: weights, balancer biases (buffers), logged QK maxima.
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
    assert ranks[0]["biases"] and all(torch.equal(b, ranks[1]["biases"][n])
                                      for n, b in ranks[0]["biases"].items())
    qk = [{k: v for k, v in e.items() if k.startswith("qk_")} for e in _train_events(ranks[1])]
    assert qk == [{k: v for k, v in e.items() if k.startswith("qk_")} for e in ours]
    # Expert parallelism moves tokens (and only then is the traffic reported).
    moved = [e.get("moe_all_to_all_bytes_per_step") for e in ours]
    if parallel == "fsdp+ep":
        assert all(m > 0 for m in moved) and all(e["moe_dropped_tokens"] == 0 for e in ours)
    else:
        assert moved == [None] * len(ours)


@distributed
@needs_torchrun
def test_a_mixture_with_documents_kept_apart_matches_one_process_under_fsdp_and_ep(
        tmp_path, data_dir, code_dir):
    """Row-level mixing gives every global batch 0.7/0.3 of its rows (within one row at
    every step) whatever the world size, and document masking (KDA restarts, MLA within
    the document) trains the same under FSDP2 with expert parallelism as in one process."""
    extra = ("--mix", code_dir, "--document-masking")
    one = _worker(tmp_path / "one", data_dir, "none", *extra)[0]
    ranks = _worker(tmp_path / "two", data_dir, "fsdp+ep", *extra)
    ours, reference = _train_events(ranks[0]), _train_events(one)
    assert [e["step"] for e in ours] == list(range(1, STEPS + 1))
    for a, b in zip(ours, reference):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert a["tokens_by_source"] == b["tokens_by_source"]
        # each source's loss: every rank's rows, summed over the ranks at the log boundary
        assert a["loss_by_source"] == pytest.approx(b["loss_by_source"], rel=1e-4)
        rows = {name: tokens // 16 for name, tokens in a["tokens_by_source"].items()}
        assert abs(rows["docs"] - 0.7 * BATCH * a["step"]) < 1
        assert abs(rows["code"] - 0.3 * BATCH * a["step"]) < 1
    evals = [e["val_loss"] for e in ranks[0]["events"] if e["event"] == "eval"]
    assert evals == pytest.approx([e["val_loss"] for e in one["events"]
                                   if e["event"] == "eval"], rel=1e-4)
    for name, weight in one["weights"].items():
        torch.testing.assert_close(ranks[0]["weights"][name], weight, rtol=1e-4, atol=1e-5)
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name


@distributed
@needs_torchrun
@pytest.mark.parametrize("accumulation", [1, 2])
def test_expert_parallel_adds_one_host_read_per_moe_layer_and_microbatch(
        accumulation, tmp_path, data_dir):
    """The data-parallel update reads the host ``accumulation + 2`` times at most (the
    finite-loss check per microbatch, the norm, the scaler); expert parallelism adds the
    split sizes, one read per MoE layer per forward: ``accumulation·(1 + layers) + 2``."""
    ranks = _worker(tmp_path, data_dir, "fsdp+ep", "--count-host-reads",
                    "--accumulation", accumulation)
    layers = ranks[0]["moe_layers"]
    assert layers >= 1
    for rank in ranks:
        reads = rank["host_reads_per_update"]
        assert len(reads) == STEPS - 1
        assert max(reads) <= accumulation * (1 + layers) + 2, reads
        # ...and they are really there: at least one per layer and microbatch.
        assert min(reads) >= accumulation * (1 + layers), reads


@distributed
@needs_torchrun
@pytest.mark.parametrize("parallel", ["fsdp", "fsdp+ep"])
def test_an_overflow_found_by_one_rank_skips_the_update_on_every_rank(parallel, tmp_path,
                                                                      data_dir):
    ranks = _worker(tmp_path, data_dir, parallel, "--overflow-on-rank", 1)
    for result in ranks:  # attempt 2 skipped everywhere; steps 1..STEPS still all done
        overflows = [e for e in result["events"] if e["event"] == "overflow"]
        assert [e["step"] for e in overflows] == [2]
        assert _train_events(result)[-1]["skipped_updates"] == 1
    for name, weight in ranks[0]["weights"].items():
        assert torch.equal(weight, ranks[1]["weights"][name]), name


@distributed
@needs_torchrun
def test_an_overflow_found_by_one_stage_skips_the_update_on_every_stage(tmp_path, data_dir):
    """Pipeline stages through the Trainer: the last stage's scaler finds an inf at attempt
    2 in its own gradients only. Found-inf is a MAX over every rank, so the first stage
    skips that update too, and each stage's weights equal one process's that skipped the
    same attempt (had the first stage stepped, its matrices would be a whole update off).
    The reference accumulates the same two microbatches the schedule runs (a batch in one
    forward may route a token to another expert on a near-tie)."""
    steps = ("--steps", 4)
    alone = _worker(tmp_path / "one", data_dir, "none", "--overflow-on-rank", 0, *steps,
                    "--batch-size", BATCH // 2, "--accumulation", 2)[0]
    stages = _worker(tmp_path / "pp", data_dir, "fsdp+pp", "--overflow-on-rank", 1, *steps)
    for result in [alone, *stages]:
        assert [e["step"] for e in result["events"] if e["event"] == "overflow"] == [2]
        assert _train_events(result)[-1]["skipped_updates"] == 1
    held = [set(stage["weights"]) for stage in stages]
    assert held[0] and held[1] and not held[0] & held[1]  # each stage its own layers
    for stage in stages:
        for name, weight in stage["weights"].items():
            torch.testing.assert_close(weight, alone["weights"][name], rtol=1e-4, atol=1e-5,
                                       msg=name)


def test_parallel_none_refuses_a_torchrun_launch_and_ddp_needs_one(tmp_path, data_dir):
    base = ["train", "--data", data_dir, "--device", "cpu", "--max-steps", 1]
    launched = k3_train(*base, "--run-dir", tmp_path / "a",
                        env={"WORLD_SIZE": "2", "RANK": "1"})
    assert launched.returncode == 2
    assert launched.stderr.startswith("k3-train[rank 1]: error: launched with 2 processes")
    alone = k3_train(*base, "--run-dir", tmp_path / "b", "--parallel", "ddp")
    assert alone.returncode == 2 and "torchrun" in alone.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@distributed
@needs_torchrun
def test_an_impossible_expert_parallel_layout_is_refused_before_anything_is_written(
        tmp_path, data_dir):
    base = ["train", "--data", data_dir, "--device", "cpu", "--max-steps", 1]
    alone = k3_train(*base, "--run-dir", tmp_path / "alone", "--expert-parallel", 2)
    assert alone.returncode == 2
    assert "--expert-parallel 2 needs a torchrun launch with --parallel fsdp" in alone.stderr
    for mode, degree, message in (
            ("ddp", 2, "--expert-parallel 2 needs --parallel fsdp"),
            ("fsdp", 3, "ep (3) must divide dp·cp (2)")):
        run_dir = tmp_path / f"{mode}{degree}"
        launched = _run(torchrun(2, "-m", "k3_trainer.cli", *base, "--run-dir", run_dir,
                                 "--parallel", mode, "--expert-parallel", degree,
                                 forked=False))
        assert launched.returncode != 0
        # Every rank refuses; which of them prints before torchrun terminates the rest
        # is a race, so any rank's line will do, and every line printed must be this one.
        said = rank_errors(launched.stderr)
        assert said and all(line.startswith(message) for line in said.values()), \
            launched.stderr[-2000:]
        # One line per rank, no rank's traceback (torchrun prints its own summary).
        assert "Traceback" not in "\n".join(line for line in launched.stderr.splitlines()
                                            if line.startswith("[rank"))
        assert not run_dir.exists()
    assert not (tmp_path / "alone").exists()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the tree from /proc")
def test_a_timed_out_launch_takes_the_ranks_in_their_own_sessions_with_it(tmp_path):
    """What torchrun does: each "rank" in a session of its own. The timeout must reach it
    (a stuck rank once outlived its killed torchrun and hung the suite)."""
    pid_file = tmp_path / "rank.pid"
    launcher = ("import subprocess, sys, time\n"
                "rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],"
                " start_new_session=True, stdout=subprocess.DEVNULL,"
                " stderr=subprocess.DEVNULL)\n"
                f"open({str(pid_file)!r}, 'w').write(str(rank.pid))\n"
                "time.sleep(300)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        _run([sys.executable, "-c", launcher], timeout=5)
    rank = int(pid_file.read_text())
    for _ in range(100):  # SIGKILL is asynchronous; a reaped or zombie rank is gone
        try:
            if proc_stat(rank)[0] == "Z":
                break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"rank {rank} outlived the timeout")
