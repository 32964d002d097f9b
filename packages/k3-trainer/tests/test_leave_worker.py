"""How a torchrun worker leaves (``k3_trainer.torchrun.leave_worker``): a process of its own
skips the interpreter's teardown; a rank torchrun runs as a function (``--run-path``)
hands its status back to torchrun, which waits for that function to return."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

TORCHRUN = Path(sys.executable).with_name("torchrun")


def test_a_process_of_its_own_leaves_with_its_status_and_no_teardown():
    program = ("import atexit; from k3_trainer.torchrun import leave_worker; "
               "atexit.register(print, 'teardown ran'); print('session over'); "
               "leave_worker(5)")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 5, done.stderr
    assert done.stdout == "session over\n"  # flushed; the atexit handler never ran


@pytest.mark.skipif(not (TORCHRUN.exists() and torch.distributed.is_available()),
                    reason="torchrun / torch.distributed unavailable")
def test_a_rank_run_as_a_function_hands_its_status_to_torchrun(tmp_path):
    """A rank that ``os._exit``ed with 0 would return nothing: torchrun, waiting for the
    function's return value, would never end."""
    script = tmp_path / "rank.py"
    script.write_text("from k3_trainer.torchrun import leave_worker\n"
                      "print('session over')\nleave_worker(0)\n")
    done = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "1", "--run-path",
                           "--start-method", "fork", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "session over\n"
