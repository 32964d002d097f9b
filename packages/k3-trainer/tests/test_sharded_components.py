"""Sharded checkpoints in one process, beyond the weights: every component goes through the
shards (a stateful callback's tensors included), a resume restores all of them or none, a
read-only load takes the components it asks for and ignores the rest, values are read as
plain data only, folders of the previous layout still load, and a background write holds
the update boundary it was started at and reports its failures. (Several ranks:
tests/test_sharded_dcp.py.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import k3_checkpoint
from k3_checkpoint import CheckpointError, CompatibilityPolicy
from k3_trainer.checkpoint import sharded

# A background write in one process runs DCP without a process group, which DCP warns about
# on its own thread (the synchronous functions silence it around their own calls).
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

METADATA = {"width": 8}


class Counter:
    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class Ema:
    """A stateful callback: tensors, an empty mapping, a list of mixed values."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self.shadow = {} if model is None else {
            name: p.detach().clone() for name, p in model.named_parameters()}
        self.notes: dict = {}
        self.history: list = []

    def update(self, model: nn.Module) -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                self.shadow[name].mul_(0.9).add_(p, alpha=0.1)
        self.history.append(len(self.history))

    def state_dict(self) -> dict:
        return {"shadow": self.shadow, "notes": self.notes, "history": self.history,
                "mixed": [torch.ones(2) * len(self.history), "tag", None]}

    def load_state_dict(self, state: dict) -> None:
        assert state["notes"] == {} and state["mixed"][1:] == ["tag", None], state
        self.shadow, self.notes, self.history = dict(state["shadow"]), {}, list(state["history"])


class Picky:
    """Takes any state but a negative one."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        if state["value"] < 0:
            raise ValueError("not a negative one")
        self.value = state["value"]


def _parts(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _trained(seed: int = 0) -> dict:
    model, optimizer = _parts(seed)
    ema = Ema(model)
    counters = Counter()
    for _ in range(2):
        _step(model, optimizer)
        ema.update(model)
        counters.value += 1
    return {"model": model, "optimizer": optimizer, "counters": counters,
            "callbacks": {"ema": ema}}


def _fresh(seed: int = 1, ema: bool = True) -> dict:
    model, optimizer = _parts(seed)
    states = {"model": model, "optimizer": optimizer, "counters": Counter()}
    if ema:
        states["callbacks"] = {"ema": Ema()}  # not stepped yet: an empty shadow
    return states


def _write(folder: Path, states: dict, metadata: dict | None = None) -> str:
    folder.mkdir()
    return sharded.write_sharded(folder, states, metadata or METADATA, None)


def _read(folder: Path, states: dict, *, subset: bool = False, policy=None):
    return sharded.read_sharded(folder, states, METADATA, policy or CompatibilityPolicy(),
                                None, subset=subset)


def _tensors_in(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors_in(item)]
    if isinstance(value, list):
        return [t for item in value for t in _tensors_in(item)]
    return []


def _picture(states: dict) -> dict:
    """Everything a restore changes, copied."""
    out = {"model": {k: v.clone() for k, v in states["model"].state_dict().items()},
           "optimizer": repr(states["optimizer"].state_dict()) if "optimizer" in states
           else None, "counters": states["counters"].value,
           "rng": k3_checkpoint.capture_rng()["torch_cpu"].clone()}
    if "callbacks" in states:
        ema = states["callbacks"]["ema"]
        out["ema"] = ({k: v.clone() for k, v in ema.shadow.items()}, list(ema.history))
    return out


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(map(_equal, a, b)))
    return a == b


# --- every component through the shards -------------------------------------------------

def test_a_stateful_callback_added_to_states_alone_is_saved_and_restored(tmp_path):
    states = _trained()
    folder = tmp_path / "step"
    _write(folder, states)
    payload = k3_checkpoint.read_payload(folder / "k3.ckpt")
    assert not _tensors_in(payload["shards"]) and "callbacks" not in payload
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    keys = FileSystemReader(folder).read_metadata().state_dict_metadata
    assert "callbacks.ema.shadow.0.weight" in keys and "counters.value" in keys
    assert payload["shards"]["structure"]["callbacks.ema"]["notes"] == {}

    fresh = _fresh()  # its callback has not stepped: the saved shadow is all it gets
    _read(folder, fresh)
    saved, got = states["callbacks"]["ema"], fresh["callbacks"]["ema"]
    assert got.shadow.keys() == saved.shadow.keys()
    assert all(torch.equal(got.shadow[k], saved.shadow[k]) for k in saved.shadow)
    assert got.history == [0, 1] and fresh["counters"].value == 2
    assert _equal(_picture(fresh)["model"], _picture(states)["model"])


def test_a_resume_restores_every_saved_component_or_is_refused(tmp_path):
    folder = tmp_path / "step"
    _write(folder, _trained())
    without = _fresh(ema=False)
    before = _picture(without)
    with pytest.raises(CheckpointError, match="holds components this load has none for: "
                                              r"callbacks\.ema"):
        _read(folder, without)
    assert _equal(before, _picture(without)) and not without["optimizer"].state
    extra = {**_fresh(), "other": Counter(5)}
    with pytest.raises(CheckpointError, match="has no state for other"):
        _read(folder, extra)
    assert extra["other"].value == 5 and extra["counters"].value == 0


def test_a_component_that_refuses_puts_every_one_back(tmp_path):
    folder = tmp_path / "step"
    _write(folder, {**_trained(), "picky": Picky(-1)})
    fresh = {**_fresh(), "picky": Picky(3)}
    torch.manual_seed(42)
    before = _picture(fresh)
    with pytest.raises(CheckpointError, match="picky refused its saved state "
                                              r"\(ValueError: not a negative one\); nothing"):
        _read(folder, fresh)
    assert _equal(before, _picture(fresh))  # counters and the callback were restored first
    assert fresh["picky"].value == 3
    assert fresh["callbacks"]["ema"].shadow == {} and not fresh["optimizer"].state


def test_values_are_read_as_plain_data_never_unpickled(tmp_path):
    """A value in the shards that names a class (here one whose unpickling would create a
    file) is refused with nothing changed: DCP's own planner would run it."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return (Path.touch, (marker,))

    states = _trained()
    folder = tmp_path / "step"
    _write(folder, states)
    for name in (".metadata", "__0_0.distcp"):
        (folder / name).unlink()
    model_state, optimizer_state = get_state_dict(states["model"], states["optimizer"])
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        save({"model": model_state, "optimizer": optimizer_state,
              "counters": {"value": Hostile()}, "callbacks": {"ema": states["callbacks"]["ema"]
                                                            .state_dict()}},
             storage_writer=FileSystemWriter(folder), no_dist=True)
    _reindex(folder, states["model"])
    fresh = _fresh()
    before = _picture(fresh)
    with pytest.raises(CheckpointError, match="cannot read the components' saved states"):
        _read(folder, fresh)
    assert not marker.exists()
    assert _equal(before, _picture(fresh))


def test_a_state_that_is_not_plain_data_is_refused_by_its_place(tmp_path):
    """A component state holding an object (here a set) is named, with its place, before
    any shard is written: what the shards hold must read back as plain data."""
    states = _trained()
    states["counters"] = _Record({"value": 2, "seen": [1, {"ids": {3, 4}}]})
    folder = tmp_path / "step"
    with pytest.raises(OSError, match=r"counters\.seen\[1\]\.ids is a builtins\.set"):
        _write(folder, states)
    assert list(folder.iterdir()) == []


def _reindex(folder: Path, model: nn.Module) -> None:
    """Record the folder's current files in its k3.ckpt (as if it had been written so)."""
    payload = k3_checkpoint.read_payload(folder / "k3.ckpt")
    index = dict(payload["shards"])
    index["files"] = {p.name: {"bytes": p.stat().st_size,
                               "xxh3_128": k3_checkpoint.file_checksum(p)}
                      for p in sorted(folder.iterdir()) if p.name != "k3.ckpt"}
    metadata = {k: v for k, v in payload.items()
                if k not in ("format_version", "components", "shards", "runtime", "rng")}
    k3_checkpoint.save_checkpoint(folder / "k3.ckpt", {"shards": _Record(index)}, metadata,
                                  modules=[model])


class _Record:
    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


# --- read-only loads ----------------------------------------------------------------------

def test_a_subset_read_takes_what_it_asks_for_and_ignores_the_rest(tmp_path):
    states = _trained()
    folder = tmp_path / "step"
    _write(folder, states)
    model, _ = _parts(seed=1)
    wanted = {"model": model, "counters": Counter()}
    _read(folder, wanted, subset=True)  # no optimizer, no callback asked for
    assert wanted["counters"].value == 2
    assert _equal(_picture(wanted)["model"], _picture(states)["model"])
    model, _ = _parts(seed=1)
    with pytest.raises(CheckpointError, match="holds components this load has none for"):
        _read(folder, {"model": model, "counters": Counter()})  # a resume needs them all
    with pytest.raises(CheckpointError, match="has no state for loaders"):
        _read(folder, {"model": model, "loaders": Counter()}, subset=True)


# --- the previous layout --------------------------------------------------------------------

class _FilesOnly:
    """The previous layout's index: the shard files alone."""

    def __init__(self, files: dict) -> None:
        self.files = files

    def state_dict(self) -> dict:
        return {"files": self.files}

    def load_state_dict(self, state: dict) -> None:
        self.files = state["files"]


def _write_legacy(folder: Path, states: dict, *, named_components: bool = True) -> None:
    """A folder as the previous version wrote it: the model and optimizer in the shards,
    every other component and the optimizer's class and layout in k3.ckpt (whose payload
    lists its components unless ``named_components`` is False, as before k3-checkpoint
    named them)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    model, optimizer = states["model"], states["optimizer"]
    model_state, optimizer_state = get_state_dict(model, optimizer)
    folder.mkdir()
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        save({"model": model_state, "optimizer": optimizer_state},
             storage_writer=FileSystemWriter(folder, sync_files=True), no_dist=True)
    files = {p.name: {"bytes": p.stat().st_size, "xxh3_128": k3_checkpoint.file_checksum(p)}
             for p in sorted(folder.iterdir())}
    small = {"shards": _FilesOnly(files), "counters": states["counters"],
             "callbacks": states["callbacks"]}
    metadata = {**METADATA, "optimizer_type": k3_checkpoint.optimizer_identity(optimizer),
                "optimizer_layout": k3_checkpoint.optimizer_layout(optimizer, model)}
    if named_components:
        k3_checkpoint.save_checkpoint(folder / "k3.ckpt", small, metadata, modules=[model])
        return
    from k3_checkpoint.payload import write_payload
    from k3_checkpoint.save import build_payload

    payload = build_payload(small, metadata, [model])
    del payload["components"]
    write_payload(folder / "k3.ckpt", payload)


@pytest.mark.parametrize("named_components", [True, False])
def test_a_folder_of_the_previous_layout_still_loads(tmp_path, named_components):
    states = _trained()
    folder = tmp_path / "legacy"
    _write_legacy(folder, states, named_components=named_components)
    assert "components" not in k3_checkpoint.read_payload(folder / "k3.ckpt")["shards"]
    fresh = _fresh()
    _read(folder, fresh)
    assert _equal(_picture(fresh), {**_picture(states), "rng": _picture(fresh)["rng"]})
    model, _ = _parts(seed=2)
    wanted = {"model": model, "counters": Counter()}
    _read(folder, wanted, subset=True)
    assert wanted["counters"].value == 2
    assert _equal(_picture(wanted)["model"], _picture(states)["model"])
    lines = sharded.describe_sharded(folder)
    assert any(line.startswith("counters ") and "value=2" in line for line in lines)
    assert any(line.startswith("optimizer ") and "(sharded)" in line for line in lines)


def test_a_folder_of_the_previous_layout_is_refused_like_any_other(tmp_path):
    states = _trained()
    folder = tmp_path / "legacy"
    _write_legacy(folder, states)
    fresh = _fresh(ema=False)  # the callback it saved is missing
    before = _picture(fresh)
    with pytest.raises(CheckpointError, match="callbacks"):
        _read(folder, fresh)
    assert _equal(before, _picture(fresh)) and not fresh["optimizer"].state


# --- background writes --------------------------------------------------------------------

def _gathered(folder: Path, scratch: Path) -> dict:
    """The shards' content as one mapping (DCP's own converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    return torch.load(out, weights_only=True)


def _without_files(payload: dict) -> dict:
    return {**payload, "shards": {k: v for k, v in payload["shards"].items() if k != "files"}}


def test_a_background_write_equals_a_synchronous_one(tmp_path):
    states = _trained()
    sync, background = tmp_path / "sync", tmp_path / "background"
    torch.manual_seed(3)
    _write(sync, states)
    torch.manual_seed(3)
    background.mkdir()
    write = sharded.start_sharded_write(background, states, METADATA, None)
    digest = write.result()
    assert write.done() and len(digest) == 32
    assert {p.name for p in background.iterdir()} == {p.name for p in sync.iterdir()}
    a, b = (k3_checkpoint.read_payload(f / "k3.ckpt") for f in (sync, background))
    assert _equal(_without_files(a), _without_files(b))  # metadata, RNG, index alike
    assert _equal(_gathered(sync, tmp_path), _gathered(background, tmp_path))
    assert _read(background, _fresh()).digest == digest


def test_a_background_write_holds_the_boundary_it_started_at(tmp_path, monkeypatch):
    """DCP's writer is held back until training has moved on: parameters, optimizer
    moments, counters, the callback's tensors and the RNG all changed in place. The folder
    still holds the boundary, because start_sharded_write copied it before returning."""
    from torch.distributed.checkpoint import state_dict_saver

    release, real_save = threading.Event(), state_dict_saver.save

    def held_save(*args, **kwargs):
        assert release.wait(60)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(state_dict_saver, "save", held_save)
    states = _trained()
    boundary = _picture(states)
    torch.manual_seed(7)
    expected_draw = (torch.manual_seed(7), torch.rand(3))[1]
    torch.manual_seed(7)
    folder = tmp_path / "step"
    folder.mkdir()
    write = sharded.start_sharded_write(folder, states, METADATA, None)
    assert not write.done()  # the write waits in the background
    _step(states["model"], states["optimizer"])  # training goes on, in place
    with torch.no_grad():
        for shadow in states["callbacks"]["ema"].shadow.values():
            shadow.add_(1.0)
    states["callbacks"]["ema"].history.append(99)
    states["counters"].value = 99
    torch.rand(5)
    release.set()
    write.result()
    fresh = _fresh()
    _read(folder, fresh)
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG of the boundary
    assert _equal(_picture(fresh), {**boundary, "rng": _picture(fresh)["rng"]})


def _wait(write: sharded.ShardedWrite) -> None:
    """Fail instead of hanging if a failed write never ends."""
    deadline = time.monotonic() + 60
    while not write.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert write.done(), "the failed background write never ended"


def _folder_is_a_file(folder: Path, monkeypatch) -> None:
    folder.rmdir()
    folder.write_bytes(b"not a folder")


def _disk_full_while_hashing(folder: Path, monkeypatch) -> None:
    def full(path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(k3_checkpoint, "file_checksum", full)


def _disk_full_writing_the_index(folder: Path, monkeypatch) -> None:
    def full(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(k3_checkpoint.CheckpointSnapshot, "write", full)


@pytest.mark.parametrize("fault, errno", [
    (_folder_is_a_file, None), (_disk_full_while_hashing, 28),
    (_disk_full_writing_the_index, 28)])
def test_a_failed_background_write_is_reported_by_result(tmp_path, monkeypatch, fault, errno):
    folder = tmp_path / "step"
    folder.mkdir()
    fault(folder, monkeypatch)
    write = sharded.start_sharded_write(folder, _trained(), METADATA, None)
    _wait(write)
    with pytest.raises(OSError) as raised:
        write.result()
    if errno is not None:
        assert raised.value.errno == errno and "No space" in str(raised.value)
    with pytest.raises(OSError):  # asked again, still there
        write.result()
    assert not (folder / "k3.ckpt").exists()


def test_a_state_a_checkpoint_cannot_hold_is_refused_before_anything_starts(tmp_path):
    class Odd:
        def state_dict(self):
            return {"seen": {1, 2}}

        def load_state_dict(self, state):
            pass

    folder = tmp_path / "step"
    folder.mkdir()
    with pytest.raises(OSError, match=r"odd\.seen is a builtins\.set"):
        sharded.start_sharded_write(folder, {**_trained(), "odd": Odd()}, METADATA, None)
    assert not any(folder.iterdir())


def test_background_writes_in_a_row_each_complete(tmp_path):
    states = _trained()
    writes = []
    for step in range(3):
        folder = tmp_path / f"step-{step}"
        folder.mkdir()
        states["counters"].value = step
        writes.append((folder, sharded.start_sharded_write(folder, states, METADATA, None)))
    for step, (folder, write) in enumerate(writes):
        write.result()
        fresh = _fresh()
        _read(folder, fresh)
        assert fresh["counters"].value == step
