"""Small tensors are saved side by side (fewer zip records), and nothing else changes."""

from __future__ import annotations

import zipfile
from collections import OrderedDict

import pytest
import torch
from ckpt_helpers import make_run, run_fingerprint
from torch import nn

from k3_checkpoint import load_checkpoint, packing, read_payload, save_checkpoint
from k3_checkpoint.packing import PACK_AT_MOST, PACK_BUFFER, pack
from k3_checkpoint.plain import tensors_in


def storage_records(path) -> list[str]:
    """The zip records holding tensor storages (``<archive>/data/<key>``)."""
    with zipfile.ZipFile(path) as archive:
        return [name for name in archive.namelist() if name.split("/")[-2:-1] == ["data"]]


def storage_of(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class Norms(nn.Module):
    """Ten small parameters (five LayerNorms of width 8) and one above ``PACK_AT_MOST``."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(8) for _ in range(5))
        self.big = nn.Linear(256, 256, bias=False)
        assert self.big.weight.nbytes > PACK_AT_MOST


def test_small_tensors_of_a_component_share_one_record(tmp_path):
    model = Norms()
    path = tmp_path / "ckpt.k3"
    save_checkpoint(path, {"model": model})

    payload = read_payload(path)
    assert len(storage_records(path)) == len({storage_of(t) for t in tensors_in(payload)})
    loaded = payload["model"]
    assert len({storage_of(t) for t in tensors_in(loaded)}) == 2  # ten small, one large
    assert loaded.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor) and loaded[name].stride() == tensor.stride()
    assert storage_of(loaded["big.weight"]) != storage_of(loaded["norms.0.weight"])
    assert len({storage_of(loaded[f"norms.{i}.{kind}"]) for i in range(5)
                for kind in ("weight", "bias")}) == 1  # fmt: skip


def test_each_component_packs_into_its_own_buffers(tmp_path):
    """An optimizer keeps the views it is restored from: they must not hold the model's
    bytes (or another component's) alive."""
    model = Norms()
    optimizer = torch.optim.AdamW(model.parameters())
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    path = tmp_path / "ckpt.k3"
    save_checkpoint(path, {"model": model, "optimizer": optimizer})
    payload = read_payload(path)

    optimizer_storages = {storage_of(t) for t in tensors_in(payload["optimizer"]["state"])}
    assert len(optimizer_storages) == 3  # the steps and small moments, two large
    assert {storage_of(t) for t in tensors_in(payload["model"])}.isdisjoint(optimizer_storages)


def test_a_packed_checkpoint_resumes_training_bitwise(tmp_path):
    run = make_run(seed=0)
    for _ in range(2):
        run.step()
    path = tmp_path / "ckpt.k3"
    save_checkpoint(path, **run.save_kwargs())
    assert len(storage_records(path)) < len(list(tensors_in(read_payload(path))))  # packed
    for _ in range(2):
        run.step()
    expected = run_fingerprint(run)

    resumed = make_run(seed=1)
    load_checkpoint(path, **resumed.load_kwargs())
    for _ in range(2):
        resumed.step()
    assert run_fingerprint(resumed) == expected


def test_a_checkpoint_written_without_packing_loads_the_same(tmp_path, monkeypatch):
    """Readers need nothing to read packed files, and files from before packing read as
    they did."""
    run = make_run(seed=0)
    run.step()
    packed, unpacked = tmp_path / "packed.k3", tmp_path / "unpacked.k3"
    save_checkpoint(packed, **run.save_kwargs())
    monkeypatch.setattr(packing, "PACK_AT_MOST", 0)
    save_checkpoint(unpacked, **run.save_kwargs())
    assert len(storage_records(unpacked)) > len(storage_records(packed))
    saved = run_fingerprint(run)

    for path in (unpacked, packed):
        run.step()
        load_checkpoint(path, **run.load_kwargs())
        assert run_fingerprint(run) == saved


def test_packing_keeps_shared_storages_and_modifies_nothing_given():
    tied, base, loose = torch.randn(4), torch.randn(6), [torch.randn(3), torch.randn(2, 2)]
    part, outside = base[2:4], torch.randn(1000)
    window = outside[10:13]  # a view of a tensor the state does not hold
    model_state = OrderedDict(a=tied, b=tied, whole=base, part=part, x=loose[0], y=loose[1],
                              w=window)
    model_state._metadata = {"": {"version": 1}}  # what Module.state_dict() carries
    untouched = {"step": [torch.randn(5)]}  # a component with a single small tensor
    states = {"model": model_state, "other": untouched}

    packed = pack(states)

    given = [tied, tied, base, part, *loose, window]
    assert [id(value) for value in model_state.values()] == [id(value) for value in given]
    result = packed["model"]
    assert type(result) is OrderedDict and result._metadata == {"": {"version": 1}}
    assert result["a"] is tied and result["b"] is tied  # shared, so not packed
    assert result["whole"] is base and result["part"] is part  # a view and its base
    assert storage_of(result["x"]) == storage_of(result["y"]) != storage_of(loose[0])
    assert storage_of(result["w"]) == storage_of(result["x"]) and torch.equal(result["w"], window)
    assert torch.equal(result["x"], loose[0]) and torch.equal(result["y"], loose[1])
    assert result["y"].shape == (2, 2) and result["y"].stride() == (2, 1)
    assert packed["other"] is untouched  # nothing to pack it with: left as it was


@pytest.mark.parametrize(
    "odd",
    [
        pytest.param(lambda: torch.randn(3, requires_grad=True), id="requires-grad"),
        pytest.param(lambda: nn.Parameter(torch.randn(3)), id="a-parameter"),
        pytest.param(lambda: torch.randn(3, 2).t(), id="not-contiguous"),
        pytest.param(lambda: torch.randn(PACK_AT_MOST // 4 + 1), id="too-large"),
        pytest.param(lambda: torch.empty(0), id="empty"),
        pytest.param(lambda: torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8),
                     id="quantized",  # deprecated by torch; a buffer would requantize it
                     marks=pytest.mark.filterwarnings("ignore:.*quantized tensor creation")),
        pytest.param(lambda: torch.eye(3).to_sparse(), id="sparse"),
        pytest.param(lambda: torch.randn(3, device="meta"), id="not-on-cpu"),
    ],
)
def test_only_plain_small_dense_cpu_tensors_are_packed(odd):
    odd_ones = odd(), odd()  # two, so that they could share a buffer if they were packed
    state = {"odd": odd_ones[0], "odder": odd_ones[1], "x": torch.randn(3), "y": torch.randn(3)}

    packed = pack({"model": state})["model"]

    assert packed["odd"] is odd_ones[0] and packed["odder"] is odd_ones[1]
    assert storage_of(packed["x"]) == storage_of(packed["y"])


@pytest.mark.parametrize(
    "odd",
    [
        pytest.param(lambda: torch.randn(3, device="meta"), id="not-on-cpu"),
        pytest.param(lambda: torch.empty(0), id="empty"),
    ],
)
def test_a_single_storageless_tensor_is_left_alone(odd):
    """Meta and empty tensors all report storage address 0, so two of them (as above) look
    shared and are left alone for that reason: one alone shows they are left alone anyway."""
    alone = odd()
    state = {"alone": alone, "x": torch.randn(3), "y": torch.randn(3)}

    packed = pack({"model": state})["model"]

    assert packed["alone"] is alone
    assert storage_of(packed["x"]) == storage_of(packed["y"])


def test_a_tensor_with_no_room_beside_it_is_left_alone():
    """A batch of one would be a copy that saves no record."""
    first, second = PACK_BUFFER - PACK_AT_MOST + 4, PACK_AT_MOST  # bytes: more than a buffer
    sizes = [first, second, 4096, 4096]
    state = {str(i): torch.randn(size // 4) for i, size in enumerate(sizes)}
    assert all(tensor.nbytes <= PACK_AT_MOST for tensor in state.values())

    packed = pack({"model": state})["model"]

    assert packed["0"] is state["0"]
    assert len({storage_of(packed[key]) for key in ("1", "2", "3")}) == 1


def test_buffers_stay_within_their_size_limit():
    """Each buffer is allocated like the small tensors it replaces (below the allocator's
    mapping threshold), so a load adds no memory they would not."""
    state = {str(i): torch.randn(1024) for i in range(64)}  # 256 KiB of 4 KiB tensors

    packed = pack({"model": state})["model"]

    sizes = {storage_of(t): t.untyped_storage().nbytes() for t in packed.values()}
    assert 1 < len(sizes) < len(state)
    assert max(sizes.values()) <= PACK_BUFFER
    assert all(torch.equal(packed[key], state[key]) for key in state)
