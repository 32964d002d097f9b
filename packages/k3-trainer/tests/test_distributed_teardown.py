"""Leaving the process group: DDP's reducer goes while the group is still registered.

A gloo group destroyed from the reducer's destructor joins gloo's worker threads with the
GIL held; a worker waiting for the GIL then hangs the rank at exit. One process and a
``HashStore`` make a real (world size 1) gloo group, no torchrun needed.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from k3_trainer.distributed import Parallel, shutdown

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed absent")


@pytest.fixture
def ddp() -> Parallel:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel = Parallel("ddp", torch.device("cpu"))
        module = parallel.wrap(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
        module(torch.randn(3, 4)).square().sum().backward()  # the reducer has run
        yield parallel
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _reducer_alive_at_destroy(monkeypatch, parallel: Parallel) -> list[bool]:
    reducer = weakref.ref(parallel.module.reducer)
    seen: list[bool] = []
    destroy = dist.destroy_process_group

    def recording_destroy(*args, **kwargs):
        seen.append(reducer() is not None)
        return destroy(*args, **kwargs)

    monkeypatch.setattr(dist, "destroy_process_group", recording_destroy)
    return seen


@pytest.mark.parametrize("clean", [True, False])
def test_the_reducer_is_gone_before_the_group_is_destroyed(ddp, monkeypatch, clean):
    seen = _reducer_alive_at_destroy(monkeypatch, ddp)
    shutdown(ddp, clean=clean)
    assert seen == [False]
    assert ddp.module is None and not dist.is_initialized()


def test_a_wrapper_still_held_elsewhere_loses_its_reducer(ddp, monkeypatch):
    """An error's traceback can keep the wrapper alive past the shutdown."""
    held = ddp.module
    seen = _reducer_alive_at_destroy(monkeypatch, ddp)
    shutdown(ddp, clean=False)
    assert seen == [False]
    assert isinstance(held, nn.Module) and not hasattr(held, "reducer")
