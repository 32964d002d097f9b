"""One torchrun rank: join the group, wrap a model in DDP, train one step, shut down, and
print the gloo threads still alive (``gloo threads: []`` when the group was freed). With
arguments, a whole ``k3-train`` session instead (``main(ARGS)`` in this process, so the
rank is not ended early by ``leave_worker``) and one garbage-collection pass, then the
same listing: the session's objects (trainer, model, DDP wrapper, callbacks) form
reference cycles, so the wrapper, and through its reducer the group, live until such a
pass, not past it.

Run by test_distributed_teardown.py; nothing in the packages imports it.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import torch

from k3_trainer.cli import main
from k3_trainer.distributed import init_parallel, shutdown

if sys.argv[1:]:
    status = main(sys.argv[1:])
    assert status == 0, status
    gc.collect()
else:
    parallel, device = init_parallel("ddp", torch.device("cpu"))
    assert parallel is not None
    module = parallel.wrap(torch.nn.Linear(4, 4))
    module(torch.ones(2, 4)).sum().backward()
    del module
    shutdown(parallel)
names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
print(f"rank {os.environ['RANK']} gloo threads: {sorted(n for n in names if 'gloo' in n)}")
