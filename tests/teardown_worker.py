"""One torchrun rank: join the group, wrap a model in DDP, train one step, shut down, and
print the gloo threads still alive (``gloo threads: []`` when the group was freed).

Run by test_distributed_teardown.py; nothing in the packages imports it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from k3_trainer.distributed import init_parallel, shutdown

parallel, device = init_parallel("ddp", torch.device("cpu"))
assert parallel is not None
module = parallel.wrap(torch.nn.Linear(4, 4))
module(torch.ones(2, 4)).sum().backward()
del module
shutdown(parallel)
names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
print(f"rank {os.environ['RANK']} gloo threads: {sorted(n for n in names if 'gloo' in n)}")
