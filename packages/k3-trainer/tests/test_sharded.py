"""Sharded checkpoint folders in one process: atomic publication, strict validate-before-
mutate loading, and the shard checksums. (Several ranks: tests/test_distributed_checkpoints.py.)"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import k3_checkpoint
from k3_checkpoint import CheckpointError, CompatibilityPolicy
from k3_trainer.checkpoint import sharded


class Counter:
    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def _run(seed: int = 0, width: int = 8) -> tuple[nn.Module, torch.optim.Optimizer, Counter]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), Counter()


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, counter: Counter) -> None:
    model(torch.randn(3, model[0].in_features)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    counter.value += 1


def _save(path, model, optimizer, counter, metadata=None) -> str:
    return sharded.write_sharded(path, model, optimizer, {"counter": counter},
                                 metadata or {"width": 8}, counter.value, None)


def _load(path, model, optimizer, counter, metadata=None):
    return sharded.read_sharded(path, model, optimizer, {"counter": counter},
                                metadata or {"width": 8}, CompatibilityPolicy(), None)


def _snapshot(model, optimizer, counter):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            repr(optimizer.state_dict()), counter.value, k3_checkpoint.capture_rng())


def _same(a, b) -> bool:
    return (a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
            and a[1:3] == b[1:3] and torch.equal(a[3]["torch_cpu"], b[3]["torch_cpu"]))


@pytest.fixture
def saved(tmp_path):
    """A model after 2 steps, saved at step 1 and step 2."""
    model, optimizer, counter = _run()
    path = tmp_path / "checkpoint.dcp"
    _step(model, optimizer, counter)
    _save(path, model, optimizer, counter)
    _step(model, optimizer, counter)
    digest = _save(path, model, optimizer, counter)
    return path, (model, optimizer, counter), digest


def test_each_save_is_published_by_one_rename_and_the_previous_one_dropped(saved):
    path, _, digest = saved
    assert path.is_symlink() and os.readlink(path) == "checkpoint.dcp.step-00000002"
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "checkpoint.dcp", "checkpoint.dcp.step-00000002"]
    assert {p.name for p in path.iterdir()} == {".metadata", "__0_0.distcp", "k3.ckpt"}
    assert k3_checkpoint.read_payload(path / "k3.ckpt")["shards"]["files"].keys() == {
        ".metadata", "__0_0.distcp"}
    assert len(digest) == 32  # XXH3-128 of k3.ckpt, hex


def test_a_load_restores_weights_optimizer_components_and_rng_bitwise(saved):
    path, (model, optimizer, counter), digest = saved
    expected_draw = (torch.manual_seed(123), torch.rand(3))[1]
    torch.manual_seed(123)
    _save(path, model, optimizer, counter)  # RNG state of this moment is in the checkpoint
    fresh = _run(seed=1)
    torch.manual_seed(999)
    loaded = _load(path, *fresh)
    assert torch.equal(torch.rand(3), expected_draw)  # RNG restored last
    assert loaded.digest != digest and fresh[2].value == 2
    for (name, a), b in zip(model.state_dict().items(), fresh[0].state_dict().values()):
        assert torch.equal(a, b), name
    for key, entry in optimizer.state_dict()["state"].items():
        for field, value in entry.items():
            assert torch.equal(value, fresh[1].state_dict()["state"][key][field]), (key, field)
    # The resumed pair takes the same next step as the original.
    torch.manual_seed(5)
    _step(model, optimizer, counter)
    torch.manual_seed(5)
    _step(*fresh)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh[0].parameters()))


def test_a_publication_that_fails_leaves_the_previous_checkpoint(saved, monkeypatch):
    path, (model, optimizer, counter), _ = saved
    before = k3_checkpoint.read_payload(path / "k3.ckpt")["counter"]
    _step(model, optimizer, counter)
    real_replace = os.replace

    def failing(source, destination):
        if str(destination).endswith("checkpoint.dcp"):
            raise OSError(28, "No space left on device")
        return real_replace(source, destination)

    monkeypatch.setattr(sharded.os, "replace", failing)
    with pytest.raises(OSError, match="No space"):
        _save(path, model, optimizer, counter)
    monkeypatch.undo()
    assert k3_checkpoint.read_payload(path / "k3.ckpt")["counter"] == before
    _load(path, *_run(seed=1))  # still a complete, loadable checkpoint
    _save(path, model, optimizer, counter)  # the next save clears the leftovers
    assert sorted(p.name for p in path.parent.iterdir()) == [
        "checkpoint.dcp", "checkpoint.dcp.step-00000003"]


def _flip_a_byte(path) -> None:
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (_flip_a_byte, "__0_0.distcp does not match its recorded size and checksum"),
    (lambda path: (path / "__9_0.distcp").write_bytes(b"x"), "unexpected __9_0.distcp"),
    (lambda path: (path / "__0_0.distcp").unlink(), "missing __0_0.distcp"),
])
def test_a_damaged_folder_is_refused_with_nothing_changed(saved, damage, message):
    path = saved[0]
    damage(path)
    fresh = _run(seed=1)
    before = _snapshot(*fresh)
    with pytest.raises(CheckpointError, match=message):
        _load(path, *fresh)
    assert _same(before, _snapshot(*fresh))
    assert not fresh[1].state  # not even the optimizer's lazily created state


def test_another_model_or_metadata_is_refused_with_nothing_changed(saved):
    path = saved[0]
    other = _run(seed=1, width=6)
    before = _snapshot(*other)
    with pytest.raises(CheckpointError, match=r"0\.weight \[16, 8\] torch.float32 vs \[16, 6\]"):
        _load(path, *other)
    assert _same(before, _snapshot(*other)) and not other[1].state
    fresh = _run(seed=1)
    with pytest.raises(CheckpointError, match="width"):
        _load(path, *fresh, metadata={"width": 9})
    assert not fresh[1].state


def test_inspect_describes_the_folder(saved):
    lines = sharded.describe_sharded(saved[0])
    assert lines[0].startswith("checkpoint ") and "every checksum verified" in lines[1]
    assert any(line.startswith("counter ") and "value=2" in line for line in lines)


def test_a_run_directory_names_its_newest_checkpoint_in_either_form(saved, tmp_path):
    """Both forms exist only after a crash between publishing one and deleting the other:
    the newer one is the run's checkpoint; a leftover staging folder never is."""
    from k3_trainer.checkpoint import find_checkpoint

    path = saved[0]
    run_dir = path.parent
    assert find_checkpoint(run_dir) == path
    (run_dir / ".checkpoint.dcp.tmp").mkdir()
    single = run_dir / "checkpoint.pt"
    single.write_bytes(b"newer")
    assert find_checkpoint(run_dir) == single
    os.utime(single, (1, 1))  # now older than the folder's k3.ckpt
    assert find_checkpoint(run_dir) == path
    path.unlink()  # the symlink gone: only the file is left
    assert find_checkpoint(run_dir) == single
    assert find_checkpoint(tmp_path / "nothing") is None


def test_saving_the_published_step_again_never_removes_the_live_checkpoint(saved):
    path, (model, optimizer, counter), _ = saved
    live = path.resolve()
    _save(path, model, optimizer, counter)  # step 2 again
    assert path.resolve().name == "checkpoint.dcp.step-00000002.again"
    assert not live.exists()  # the old folder goes only once the new one is published
    _load(path, *_run(seed=1))


def test_a_symlink_to_a_folder_this_module_did_not_write_is_never_deleted(saved, tmp_path):
    """A user who points checkpoint.dcp at a checkpoint kept elsewhere (an absolute link)
    resumes from it; the next save replaces the link and leaves that folder alone."""
    path, (model, optimizer, counter), _ = saved
    elsewhere = tmp_path / "kept" / "my-checkpoint"
    elsewhere.parent.mkdir()
    os.rename(path.resolve(), elsewhere)
    path.unlink()
    os.symlink(elsewhere, path)
    _load(path, *_run(seed=1))
    _step(model, optimizer, counter)
    _save(path, model, optimizer, counter)
    assert os.readlink(path) == "checkpoint.dcp.step-00000003"
    assert (elsewhere / "k3.ckpt").is_file()  # untouched
