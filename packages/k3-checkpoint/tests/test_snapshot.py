"""A snapshot: the checkpoint of one update boundary, taken now and written later."""

from __future__ import annotations

import threading

import pytest
import torch
from ckpt_helpers import make_run, run_fingerprint

from k3_checkpoint import (
    CheckpointError,
    load_checkpoint,
    read_payload,
    save_checkpoint,
    snapshot_checkpoint,
)


def test_a_snapshot_writes_the_boundary_it_was_taken_at_byte_for_byte(tmp_path):
    """Written after training moved on (weights, optimizer moments, counters and RNG all
    changed), the file is the one save_checkpoint wrote at the boundary, byte for byte."""
    run = make_run()
    run.step()
    at_boundary = run_fingerprint(run)
    rng = torch.get_rng_state()
    snapshot = snapshot_checkpoint(**run.save_kwargs())
    torch.set_rng_state(rng)
    save_checkpoint(tmp_path / "direct.k3", **run.save_kwargs())
    run.step()  # the live state moves on before the snapshot is written
    assert run_fingerprint(run) != at_boundary

    writer = threading.Thread(target=snapshot.write, args=(tmp_path / "later.k3",))
    writer.start()
    writer.join()
    assert (tmp_path / "later.k3").read_bytes() == (tmp_path / "direct.k3").read_bytes()

    fresh = make_run(seed=3)
    load_checkpoint(tmp_path / "later.k3", fresh.components(), run.metadata())
    assert run_fingerprint(fresh) == at_boundary


def test_a_snapshot_copies_every_tensor_once_and_keeps_shared_storage_shared(tmp_path):
    run = make_run()
    run.step()
    live = {p.untyped_storage().data_ptr() for p in run.model.parameters()}
    snapshot = snapshot_checkpoint(**run.save_kwargs())
    held = [t for t in snapshot.payload["model"].values() if isinstance(t, torch.Tensor)]
    assert held and not {t.untyped_storage().data_ptr() for t in held} & live
    model_bytes = sum(t.untyped_storage().nbytes() for t in run.model.state_dict().values())
    assert snapshot.nbytes >= model_bytes

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

    tied = Tied()
    path = tmp_path / "tied.k3"
    snapshot_checkpoint({"model": tied}).write(path)
    state = read_payload(path)["model"]
    assert state["embed.weight"].untyped_storage().data_ptr() == \
        state["head.weight"].untyped_storage().data_ptr()


def test_a_snapshot_is_refused_as_a_save_is(tmp_path):
    run = make_run()
    run.model(torch.randint(0, 64, (2, 4))).float().mean().backward()  # a live .grad
    with pytest.raises(CheckpointError, match=r"still hold a \.grad"):
        snapshot_checkpoint(**run.save_kwargs())
