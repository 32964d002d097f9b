"""The load buffer: the payload's tensors view the verified bytes instead of copies, and after a
restore the pages nothing kept go back to the OS while every kept tensor stays intact."""

from __future__ import annotations

import io
import itertools
import mmap
import random
import re
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import assert_same_payload, write_enveloped
from torch import nn

from k3_checkpoint import CheckpointError, load_checkpoint, read_payload, save_checkpoint
from k3_checkpoint import buffer as buffer_module
from k3_checkpoint.buffer import PayloadBuffer
from k3_checkpoint.payload import read_verified

needs_zero_copy = pytest.mark.skipif(
    not buffer_module.zero_copy_supported(),
    reason="zero-copy loading needs little-endian Linux and torch's serialization internals",
)


class Keeper:
    """A component that keeps the very tensor it is given, as a component may."""

    def __init__(self, seed: int) -> None:
        self.table = torch.randn(128, 128, generator=torch.Generator().manual_seed(seed))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"table": self.table}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.table = state["table"]


def _state(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Keeper]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 128)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, Keeper(seed)


def _components(state: tuple[nn.Module, torch.optim.Optimizer, Keeper]) -> dict[str, object]:
    model, optimizer, keeper = state
    return {"model": model, "optimizer": optimizer, "keeper": keeper}


def _inside(tensor: torch.Tensor, buffer: PayloadBuffer) -> bool:
    base = buffer._storage.data_ptr()
    return base <= tensor.data_ptr() < base + buffer.length


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.manual_seed(99)
    model(torch.randn(4, 128)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@needs_zero_copy
def test_payload_tensors_view_the_verified_bytes(tmp_path):
    path = tmp_path / "ckpt.k3"
    save_checkpoint(path, _components(_state(0)))
    payload, _, buffer = read_verified(path)
    weight = payload["model"]["0.weight"]
    assert _inside(weight, buffer)
    assert torch.equal(weight, _state(0)[0][0].weight.detach())


@needs_zero_copy
def test_release_frees_what_was_copied_and_keeps_what_was_kept(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.k3"
    saved = _state(0)
    save_checkpoint(path, _components(saved))
    expected_opt = {
        name: value.clone() for name, value in saved[1].state[saved[0][0].weight].items()
    }
    buffers, released = [], []
    real_release = PayloadBuffer.release_unused

    def spy(self: PayloadBuffer) -> int:
        buffers.append(self)
        released.append(real_release(self))
        return released[-1]

    monkeypatch.setattr(PayloadBuffer, "release_unused", spy)
    live = _state(1)  # other weights, other moments, another table
    load_checkpoint(path, _components(live))
    (buffer,) = buffers
    model, optimizer, keeper = live

    # Kept as they are: the optimizer adopts its saved state, the keeper its table.
    moments = optimizer.state[model[0].weight]
    assert _inside(moments["exp_avg"], buffer) and _inside(keeper.table, buffer)
    for name, value in expected_opt.items():
        assert torch.equal(moments[name], value), name
    assert torch.equal(keeper.table, saved[2].table)
    for mine, theirs in zip(model.parameters(), saved[0].parameters()):
        assert torch.equal(mine, theirs) and not _inside(mine, buffer)

    # Released: the model's weights (copied into the model) and nothing that was kept.
    weights = sum(p.numel() * p.element_size() for p in saved[0].parameters())
    kept = keeper.table.nbytes + sum(
        value.nbytes for state in optimizer.state.values() for value in state.values()
    )
    slack = 2 * mmap.PAGESIZE * len(list(saved[0].parameters()))  # partial first/last pages
    assert weights - slack <= released[0] <= buffer.length - kept
    whole = buffer.length // mmap.PAGESIZE * mmap.PAGESIZE
    pages = torch.frombuffer(buffer.view, dtype=torch.uint8)[:whole].view(-1, mmap.PAGESIZE)
    zero_pages = (pages == 0).all(dim=1).sum().item()
    assert zero_pages * mmap.PAGESIZE >= released[0]  # handed back: they read as fresh zeros
    assert buffer.release_unused() == 0  # it forgot what it lent

    # The adopted state trains on exactly as the saved one does.
    _train_step(*saved[:2])
    _train_step(model, optimizer)
    for mine, theirs in zip(model.parameters(), saved[0].parameters()):
        assert torch.equal(mine, theirs)


@needs_zero_copy
def test_the_viewing_load_gives_what_torch_load_gives(tmp_path):
    """Six dtypes, an empty tensor, a transposed view and a row sharing its storage, and a
    sparse tensor load as torch.load loads them; each storage is one view of the buffer."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    payload = {
        "format_version": 7,
        "tensors": {
            str(dtype): torch.arange(6).to(dtype)
            for dtype in (torch.float64, torch.bfloat16, torch.int64, torch.bool, torch.complex64)
        },
        "empty": torch.empty(0, 3),
        "base": base,
        "transposed": base.t(),
        "row": base[2],
        "sparse": torch.sparse_coo_tensor(
            torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=True
        ),
    }
    path = tmp_path / "ckpt.k3"
    body = write_enveloped(payload, path)
    ours, _, buffer = read_verified(path)
    assert_same_payload(ours, torch.load(io.BytesIO(body), weights_only=True))
    for name in ("base", "transposed", "row"):
        assert _inside(ours[name], buffer), name
    shared = {ours[name].untyped_storage().data_ptr() for name in ("base", "transposed", "row")}
    assert len(shared) == 1
    assert len(buffer._lent) == len(payload["tensors"]) + 1 + 1 + 2  # sparse: indices, values


@needs_zero_copy
def test_a_big_endian_checkpoint_is_byte_swapped_as_torch_load_does(tmp_path, monkeypatch):
    """A checkpoint written on a big-endian machine records so; its tensors cannot view the
    little-endian reader's buffer and are swapped into copies, as torch.load does."""
    values = torch.tensor([1.0, -2.5, 3.25])
    with monkeypatch.context() as patch:
        patch.setattr(sys, "byteorder", "big")  # what torch.save records as the byte order
        body = write_enveloped({"format_version": 7, "values": values}, tmp_path / "ckpt.k3")
    ours, _, buffer = read_verified(tmp_path / "ckpt.k3")
    theirs = torch.load(io.BytesIO(body), weights_only=True)["values"]
    assert not torch.equal(theirs, values)  # control: the recorded order is honoured
    assert torch.equal(ours["values"], theirs) and not _inside(ours["values"], buffer)


@needs_zero_copy
def test_the_load_validates_sparse_tensors_and_restores_torchs_thread_state(tmp_path):
    """As torch.load: with sparse invariant checks on, an index outside its tensor is refused.
    The map location torch's rebuild functions read is set for the load only, error or not."""
    bad = torch.sparse_coo_tensor(
        torch.tensor([[7]]), torch.tensor([1.0]), (3,), check_invariants=False
    )
    path = tmp_path / "ckpt.k3"
    body = write_enveloped({"format_version": 7, "sparse": bad}, path)
    local = torch.serialization._serialization_tls
    assert local.map_location is None
    read_payload(path)  # checks off (torch's default): loaded as torch.load loads it
    assert local.map_location is None
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        with pytest.raises(RuntimeError, match="found index 7"):
            torch.load(io.BytesIO(body), weights_only=True)  # control
        with pytest.raises(CheckpointError, match="found index 7"):
            read_payload(path)
    assert local.map_location is None
    assert not torch._utils._sparse_tensors_to_validate  # nothing left for the next load


def test_without_zero_copy_the_payload_is_copied_out_and_equal(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.k3"
    saved = _state(0)
    save_checkpoint(path, _components(saved))
    monkeypatch.setattr(buffer_module, "zero_copy_supported", lambda: False)
    payload, _, buffer = read_verified(path)
    weight = payload["model"]["0.weight"]
    assert torch.equal(weight, saved[0][0].weight.detach()) and not _inside(weight, buffer)
    assert buffer.release_unused() == 0
    live = _state(1)
    load_checkpoint(path, _components(live))
    assert torch.equal(live[2].table, saved[2].table)
    assert torch.equal(live[0][2].bias, saved[0][2].bias)


@pytest.mark.parametrize("span", [slice(0, 101), slice(-1, 5), slice(60, 50), slice(0.0, 5)])
def test_tensor_bytes_outside_the_payload_are_refused(span):
    with pytest.raises(ValueError, match="outside the 100-byte payload"):
        PayloadBuffer(100)[span]


def test_subtract_matches_a_byte_by_byte_reference():
    generator = random.Random(7)
    for _ in range(300):
        spans = [
            [tuple(sorted(generator.sample(range(40), 2))) for _ in range(generator.randint(0, 5))]
            for _ in range(2)
        ]
        ranges, holes = spans
        expected = {
            byte
            for byte in range(40)
            if any(a <= byte < b for a, b in ranges) and not any(a <= byte < b for a, b in holes)
        }
        result = buffer_module._subtract(ranges, holes)
        assert {byte for a, b in result for byte in range(a, b)} == expected
        assert all(b > a for a, b in result) and all(  # sorted, merged
            left[1] < right[0] for left, right in itertools.pairwise(result)
        )


@needs_zero_copy
def test_release_never_touches_a_kept_tensors_pages_even_when_spans_overlap():
    """A crafted (but well-digested) file could point two tensors at overlapping bytes: the
    pages of the one that is kept must survive the release of the other."""
    page = mmap.PAGESIZE
    buffer = PayloadBuffer(6 * page)
    buffer.view[:] = b"\xab" * (6 * page)
    unused = buffer[0 : 6 * page]  # a tensor nothing keeps, covering everything
    kept = torch.empty(0, dtype=torch.uint8).set_(buffer[2 * page + 100 : 3 * page + 100])
    del unused
    assert buffer.release_unused() == 4 * page  # pages 0, 1, 4, 5
    assert bool((kept == 0xAB).all())
    whole = torch.frombuffer(buffer.view, dtype=torch.uint8).view(6, page)
    assert (whole == 0).all(dim=1).tolist() == [True, True, False, False, True, True]


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


@pytest.mark.skipif(_thp_mode() != "madvise", reason="needs THP in 'madvise' mode")
def test_the_buffer_asks_for_huge_pages():
    """One fault per 2 MiB instead of per 4 KiB: most of a fresh read's cost was faults. In
    'madvise' mode only memory that asks for huge pages is eligible."""
    buffer = PayloadBuffer(8 << 20)
    start = buffer._storage.data_ptr()
    with open("/proc/self/smaps") as smaps:
        areas = re.split(r"^(?=[0-9a-f]+-[0-9a-f]+ )", smaps.read(), flags=re.MULTILINE)
    for area in filter(None, areas):  # the text before the first area is empty
        low, high = (int(part, 16) for part in area.split(" ", 1)[0].split("-"))
        if low <= start < high:
            assert re.search(r"^THPeligible:\s+1$", area, flags=re.MULTILINE), area
            return
    pytest.fail("the buffer's mapping is not in /proc/self/smaps")
