"""Sharded checkpoint folders in one process: what a folder holds, strict validate-before-
mutate loading, and the shard checksums. (Components, read-only loads, the previous layout
and background writes: test_sharded_components.py; several ranks: tests/test_sharded_dcp.py
and tests/test_distributed_checkpoints.py.)"""

from __future__ import annotations

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


def _states(model, optimizer, counter) -> dict:
    return {"model": model, "optimizer": optimizer, "counter": counter}


def _save(folder, model, optimizer, counter, metadata=None) -> str:
    folder.mkdir()
    return sharded.write_sharded(folder, _states(model, optimizer, counter),
                                 metadata or {"width": 8}, None)


def _load(folder, model, optimizer, counter, metadata=None):
    return sharded.read_sharded(folder, _states(model, optimizer, counter),
                                metadata or {"width": 8}, CompatibilityPolicy(), None)


def _snapshot(model, optimizer, counter):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            repr(optimizer.state_dict()), counter.value, k3_checkpoint.capture_rng())


def _same(a, b) -> bool:
    return (a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0])
            and a[1:3] == b[1:3] and torch.equal(a[3]["torch_cpu"], b[3]["torch_cpu"]))


@pytest.fixture
def saved(tmp_path):
    """A model after 2 steps, saved at step 1 and step 2 (each into its own folder)."""
    model, optimizer, counter = _run()
    _step(model, optimizer, counter)
    _save(tmp_path / "step-1", model, optimizer, counter)
    _step(model, optimizer, counter)
    path = tmp_path / "step-2"
    digest = _save(path, model, optimizer, counter)
    return path, (model, optimizer, counter), digest


def test_a_folder_holds_every_component_in_the_shards_and_its_index_in_k3_ckpt(saved):
    path, _, digest = saved
    assert {p.name for p in path.iterdir()} == {".metadata", "__0_0.distcp", "k3.ckpt"}
    payload = k3_checkpoint.read_payload(path / "k3.ckpt")
    index = payload["shards"]
    assert index["files"].keys() == {".metadata", "__0_0.distcp"}
    assert index["components"] == ["counter", "model", "optimizer"]
    assert index["optimizers"]["optimizer"]["type"] == "torch.optim.adamw.AdamW"
    assert index["structure"] == {"counter": {"value": None}}
    assert "counter" not in payload and payload["width"] == 8  # the counter is in the shards
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    keys = FileSystemReader(path).read_metadata().state_dict_metadata
    assert "counter.value" in keys and "model.0.weight" in keys
    assert len(digest) == 32  # XXH3-128 of k3.ckpt, hex
    assert sharded.is_sharded(path)


def test_a_folder_without_dcp_metadata_is_not_sharded(tmp_path):
    """A history step folder holding k3.ckpt alone is a single-file checkpoint."""
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / "k3.ckpt").write_bytes(b"")
    assert not sharded.is_sharded(tmp_path / "step")
    assert not sharded.is_sharded(tmp_path / "absent")


def test_a_load_restores_weights_optimizer_components_and_rng_bitwise(saved, tmp_path):
    path, (model, optimizer, counter), digest = saved
    expected_draw = (torch.manual_seed(123), torch.rand(3))[1]
    torch.manual_seed(123)
    again = tmp_path / "again"
    _save(again, model, optimizer, counter)  # RNG state of this moment is in the checkpoint
    fresh = _run(seed=1)
    torch.manual_seed(999)
    loaded = _load(again, *fresh)
    assert torch.equal(torch.rand(3), expected_draw)  # RNG restored last
    assert loaded.digest != digest and fresh[2].value == 2
    for (name, a), b in zip(model.state_dict().items(), fresh[0].state_dict().values()):
        assert torch.equal(a, b), name
    for key, entry in optimizer.state_dict()["state"].items():
        for field, value in entry.items():
            assert torch.equal(value, fresh[1].state_dict()["state"][key][field]), (key, field)
    assert fresh[1].param_groups[0]["lr"] == 1e-2
    # The resumed pair takes the same next step as the original.
    torch.manual_seed(5)
    _step(model, optimizer, counter)
    torch.manual_seed(5)
    _step(*fresh)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh[0].parameters()))


def test_a_write_that_fails_raises_the_os_error(tmp_path, monkeypatch):
    model, optimizer, counter = _run()
    _step(model, optimizer, counter)

    def full(path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(k3_checkpoint, "file_checksum", full)
    with pytest.raises(OSError, match="No space") as raised:
        _save(tmp_path / "step", model, optimizer, counter)
    assert raised.value.errno == 28
    assert not (tmp_path / "step" / "k3.ckpt").exists()  # the index is written last


def _flip_a_byte(path) -> None:
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


def _flip_a_metadata_byte(path) -> None:
    """A flipped byte in DCP's own table: its checksum is checked like every shard's."""
    table = path / ".metadata"
    data = bytearray(table.read_bytes())
    data[-1] ^= 0x01
    table.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (_flip_a_byte, "__0_0.distcp does not match its recorded size and checksum"),
    (_flip_a_metadata_byte, r"\.metadata does not match its recorded size and checksum"),
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


def test_a_model_of_another_dtype_is_refused_with_nothing_changed(saved):
    path = saved[0]
    model, optimizer, counter = _run(seed=1)
    model.double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = _snapshot(model, optimizer, counter)
    # past the runtime's own check of the parameters' dtype (allowed to differ here), the
    # tensors read are checked against the live ones, dtype included
    allowed = CompatibilityPolicy(runtime_may_differ={"param_dtype"})
    with pytest.raises(CheckpointError,
                       match=r"0\.weight \[16, 8\] torch.float32 vs \[16, 8\] torch.float64"):
        sharded.read_sharded(path, _states(model, optimizer, counter), {"width": 8}, allowed,
                             None)
    assert _same(before, _snapshot(model, optimizer, counter)) and not optimizer.state


def test_another_optimizer_is_refused_with_nothing_changed(saved):
    path = saved[0]
    model, _, counter = _run(seed=1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _snapshot(model, sgd, counter)
    with pytest.raises(CheckpointError, match=r"optimizer class: checkpoint torch\.optim\.adamw"):
        _load(path, model, sgd, counter)
    assert _same(before, _snapshot(model, sgd, counter))


def test_a_step_limit_reads_the_saved_step_from_the_shards(saved):
    """The saved step lives in a component's state, inside the shards: a budget below it is
    refused with nothing changed, one at or above it resumes."""
    path = saved[0]  # the counter is at 2
    policy = CompatibilityPolicy(may_differ=frozenset({"max_steps"}),
                                 step_limit=("max_steps", "counter.value"))
    fresh = _run(seed=1)
    before = _snapshot(*fresh)
    with pytest.raises(CheckpointError, match=r"max_steps 1 is smaller than the checkpoint's "
                                              r"counter\.value 2"):
        sharded.read_sharded(path, _states(*fresh), {"width": 8, "max_steps": 1}, policy, None)
    assert _same(before, _snapshot(*fresh)) and not fresh[1].state
    sharded.read_sharded(path, _states(*fresh), {"width": 8, "max_steps": 2}, policy, None)
    assert fresh[2].value == 2


def test_inspect_describes_the_folder(saved):
    lines = sharded.describe_sharded(saved[0])
    assert lines[0].startswith("checkpoint ") and "every checksum verified" in lines[1]
    assert any(line.startswith("counter ") and "value=2" in line for line in lines)
    assert any(line.startswith("model ") and "of tensors (sharded)" in line for line in lines)
    assert any(line.startswith("width ") for line in lines)
    assert not any(line.startswith(("shards ", "components ")) for line in lines)
