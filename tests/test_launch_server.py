"""The tests' launch server (launch_server.py): a run through it is the client's own.

Every successful torchrun launch and most ``k3-train`` runs in these tests go through it,
so a server that lost a rank's failure or an exit status, ran in the wrong directory or
environment, or left a timed-out launch running would pass or hang tests for reasons of
its own. Deselect with ``-m 'not distributed'``.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from harness import k3_train, proc_stat
from test_distributed_training import _run, needs_torchrun, one_launch_at_a_time, torchrun

pytestmark = [pytest.mark.distributed, needs_torchrun, one_launch_at_a_time]

RANK_SCRIPT = """
import os, sys, time
from pathlib import Path
rank = os.environ["RANK"]
Path(f"rank{rank}.txt").write_text(f"{os.getpid()} {os.environ.get('K3_TEST_MARK')}")
os.write(1, f"out of rank {rank}\\n".encode())  # one write: the ranks share the pipe
if sys.argv[1] == "sleep":
    time.sleep(600)
if sys.argv[1] == "fail" and rank == "1":
    raise SystemExit("rank 1 gives up")
"""


def _alive(pid: int) -> bool:
    try:
        return proc_stat(pid)[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.fixture
def script(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "ranks.py"
    path.write_text(RANK_SCRIPT)
    monkeypatch.chdir(tmp_path)  # the ranks write beside it: the client's directory
    return path


def test_ranks_run_in_the_clients_directory_environment_and_streams(script, tmp_path):
    done = _run(torchrun(2, script, "ok"), env={"K3_TEST_MARK": "seen"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(done.stdout.split("\n")) == ["", "out of rank 0", "out of rank 1"]
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text().endswith(" seen")


def test_a_failing_rank_fails_the_launch(script):
    done = _run(torchrun(2, script, "fail"))
    assert done.returncode == 1
    assert "rank 1 gives up" in done.stderr


def test_a_timed_out_launch_takes_its_ranks_with_it(script, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        _run(torchrun(2, script, "sleep"), timeout=20)
    pids = [int((tmp_path / f"rank{rank}.txt").read_text().split()[0]) for rank in (0, 1)]
    deadline = time.monotonic() + 20
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, pids))


def test_another_thread_count_is_refused_not_ignored(script, tmp_path):
    """torch read the thread count when the server imported it: a launch asking for
    another would silently get the server's."""
    done = _run(torchrun(2, script, "ok"), env={"OMP_NUM_THREADS": "3"})
    assert done.returncode == 2
    assert "OMP_NUM_THREADS=3" in done.stderr
    assert not (tmp_path / "rank0.txt").exists()


def test_a_k3_train_run_is_the_clients_process(data_dir, tmp_path, monkeypatch):
    """``harness.k3_train`` runs ``k3-train`` in a fork of the server: the client's
    directory (a relative run directory lands there), separate streams and exit status
    (the environment travels as a torchrun launch's does, tested above)."""
    monkeypatch.chdir(tmp_path)
    done = k3_train("train", "--run-dir", "run", "--data", data_dir, "--device", "cpu",
                    "--max-steps", 1)
    assert Path(done.args[2]).name == "launch_client.py", done.args  # not a new interpreter
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    assert "step" in done.stdout and "Traceback" not in done.stderr
    refused = k3_train("train", "--run-dir", "refused", "--no-such-flag")  # argparse exits
    assert refused.returncode == 2 and refused.stdout == ""
    assert "unrecognized arguments: --no-such-flag" in refused.stderr
    refused = k3_train("train", "--run-dir", "refused", "--data", tmp_path / "none")  # main
    assert refused.returncode == 2 and refused.stdout == ""  # returns 2
    assert "manifest.json not found" in refused.stderr


def test_a_k3_train_run_at_another_thread_count_gets_a_new_interpreter(tmp_path):
    """torch read ``OMP_NUM_THREADS`` when the server imported it, so such a run cannot be
    a fork: it runs as ``python -m k3_trainer.cli``, and still runs."""
    done = k3_train("train", "--run-dir", tmp_path, "--no-such-flag",
                    env={"OMP_NUM_THREADS": "3"})
    assert done.args[1:3] == ["-m", "k3_trainer.cli"], done.args
    assert done.returncode == 2 and "unrecognized arguments" in done.stderr
