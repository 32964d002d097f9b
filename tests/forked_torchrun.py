"""torchrun's own entry point, in an interpreter that has already imported torch and the
k3 packages: the tests' launcher for torchrun launches meant to succeed.

``python forked_torchrun.py [torchrun's flags] --run-path --start-method fork SCRIPT ARGS``
is ``torchrun`` itself (its parser, elastic agent, standalone rendezvous and the
environment it gives each rank), told by its own flags to run SCRIPT as a function in a
fork of this process rather than in a new interpreter per rank. Each rank then starts with
the imports below done, instead of spending a few CPU-seconds importing them again, most
of what a test's small launch otherwise costs on a 2-core machine.

Launches whose failure is under test use the ``torchrun`` command unchanged: with
functions as ranks, torchrun reports only the first failing rank, not every rank's exit
(``test_distributed_training.torchrun``). Nothing in the packages imports this file.
"""

from __future__ import annotations

import sys

import numpy  # noqa: F401
import torch.distributed.checkpoint
import torch.distributed.fsdp
import torch.distributed.run
import torch.distributed.tensor
import torch.nn.parallel

import k3_checkpoint  # noqa: F401
import k3_model  # noqa: F401
import k3_optim  # noqa: F401
import k3_trainer.cli
import k3_trainer.distributed
import k3_trainer.session  # noqa: F401

if __name__ == "__main__":
    sys.exit(torch.distributed.run.main())
