"""``validate_precision``'s BF16 check asks the run's own CUDA device for *native* BF16.

No GPU is needed: a fake CUDA runtime with two devices stands in (``is_available``,
``device_count``, ``current_device``, ``get_device_properties`` and the ``device`` context
manager), and BF16 emulation succeeds on every device, as it does on real pre-Ampere GPUs,
so ``torch.cuda.is_bf16_supported()``'s default (``including_emulation=True``) would accept
all of them.
"""

from __future__ import annotations

import types

import pytest
import torch

from k3_trainer import validate_precision
from k3_trainer.config import ConfigError


class FakeCuda:
    """Two devices with the given compute capabilities; ``current`` is the selected one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, capabilities: list[tuple[int, int]],
                 current: int = 0, hip: str | None = None) -> None:
        self.capabilities, self.current = capabilities, current
        self.asked: list[int] = []  # the device index of every properties query
        fake = self

        class device:  # torch.cuda.device: select a device for the block, then restore it
            def __init__(self, index: torch.device | int | None) -> None:
                self.index = fake._index(index)

            def __enter__(self) -> None:
                self.previous, fake.current = fake.current, self.index

            def __exit__(self, *exc: object) -> None:
                fake.current = self.previous

        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_device_properties", self.properties)
        monkeypatch.setattr(torch.cuda, "device", device)
        # Emulated bf16 works everywhere (a bf16 tensor can be made on any of them).
        monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda d: True)

    def _index(self, device: torch.device | str | int | None) -> int:
        if device is None:
            return self.current
        if isinstance(device, int):
            return device
        device = torch.device(device)
        return self.current if device.index is None else device.index

    def properties(self, device: torch.device | str | int | None = None) -> types.SimpleNamespace:
        index = self._index(device)
        self.asked.append(index)
        major, minor = self.capabilities[index]
        return types.SimpleNamespace(major=major, minor=minor, name=f"fake sm_{major}{minor}",
                                     gcnArchName="gfx942")


def test_emulated_bf16_is_refused(monkeypatch):
    fake = FakeCuda(monkeypatch, [(7, 5), (7, 0)])
    assert torch.cuda.is_bf16_supported()  # torch's default counts the emulation
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        with pytest.raises(ConfigError, match="native bf16") as refused:
            validate_precision("bf16", device)
        assert str(torch.device(device)) in str(refused.value)
    assert fake.current == 0


def test_the_requested_device_is_asked_not_the_current_one(monkeypatch):
    fake = FakeCuda(monkeypatch, [(9, 0), (7, 5)], current=0)  # cuda:0 native, cuda:1 not
    with pytest.raises(ConfigError, match=r"cuda:1\b"):
        validate_precision("bf16", "cuda:1")
    assert 1 in fake.asked and fake.current == 0  # asked cuda:1; the selection is restored
    validate_precision("bf16", "cuda:0")
    validate_precision("bf16", "cuda")  # the current device, cuda:0

    fake = FakeCuda(monkeypatch, [(7, 5), (8, 0)], current=0)  # now only cuda:1 is native
    validate_precision("bf16", torch.device("cuda:1"))
    assert fake.asked and set(fake.asked) == {1} and fake.current == 0
    with pytest.raises(ConfigError, match=r"cuda:0\b"):
        validate_precision("bf16", "cuda:0")
    with pytest.raises(ConfigError, match="native bf16"):
        validate_precision("bf16", "cuda")


def test_native_bf16_is_accepted_and_other_precisions_are_not_asked(monkeypatch):
    fake = FakeCuda(monkeypatch, [(8, 0), (9, 0)], current=1)
    for device in ("cuda", "cuda:0", "cuda:1"):
        validate_precision("bf16", device)
    assert fake.current == 1
    fake.asked.clear()
    validate_precision("fp16", "cuda:0")
    validate_precision("fp32", "cuda:0")
    assert fake.asked == []


def test_a_device_that_does_not_exist_is_named(monkeypatch):
    FakeCuda(monkeypatch, [(9, 0), (9, 0)])
    with pytest.raises(ConfigError, match=r"cuda:2: there is no such CUDA device \(2 visible\)"):
        validate_precision("bf16", "cuda:2")


def test_rocm_keeps_torch_s_answer(monkeypatch):
    FakeCuda(monkeypatch, [(9, 4), (9, 4)], hip="6.4")
    validate_precision("bf16", "cuda:1")
