"""Precision contracts: which precisions a device supports, autocast, and the scaler."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .config import PRECISIONS, ConfigError

_AUTOCAST_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def validate_precision(precision: str, device: torch.device | str) -> None:
    """Reject unsupported precisions: unknown names, FP16 on CPU, BF16 on a CUDA device
    without native BF16.

    BF16 is checked on the device the run uses (``cuda:1`` is asked about itself, not the
    current device; plain ``cuda`` means the current one), and emulated BF16 (what
    ``torch.cuda.is_bf16_supported()`` accepts by default on pre-Ampere GPUs) is refused.
    On ROCm torch's own answer stands: it counts every AMD architecture it supports as
    BF16-capable.
    """
    device = torch.device(device)
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp16" and device.type == "cpu":
        raise ConfigError(
            "precision fp16 needs a CUDA device (CPU autocast does not use fp16 with a "
            "GradScaler); use bf16 or fp32 on CPU"
        )
    if precision == "bf16" and device.type == "cuda":
        if device.index is None:  # the current device, which is the one the run uses
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        else:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if device.index >= count:
                raise ConfigError(f"precision bf16 on {device}: there is no such CUDA device "
                                  f"({count} visible)")
            with torch.cuda.device(device.index):  # the question is about the current device
                native = torch.cuda.is_bf16_supported(including_emulation=False)
        if not native:
            raise ConfigError(f"precision bf16 needs native bf16 support on the run's device, "
                              f"{device}, which has none (emulated bf16 does not count); "
                              "use fp16")


def validate_master_weights(model: nn.Module, precision: str) -> None:
    """Mixed precision keeps FP32 stored parameters; autocast lowers the compute only."""
    if precision == "fp32":
        return
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:
            raise ConfigError(
                f"precision {precision} needs fp32 master parameters, but {name} is {p.dtype}; "
                "keep the model in fp32 and let autocast lower the compute"
            )


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """A null context for fp32, otherwise torch autocast on the device's type."""
    if precision == "fp32":
        yield
        return
    with torch.autocast(device_type=device.type, dtype=_AUTOCAST_DTYPE[precision]):
        yield


def make_grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """A GradScaler that is enabled only for fp16 (bf16 has fp32's exponent range)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def overflow_flag(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer
                  ) -> torch.Tensor | None:
    """After ``scaler.unscale_(optimizer)``: a device scalar, non-zero when an inf/NaN was
    found (so ``scaler.step`` will skip and ``update()`` will lower the scale); None when
    the scaler is disabled. No host sync: the trainer reads it with the gradient norm.

    GradScaler keeps these per-device flags in its per-optimizer state (a private
    accessor, stable since torch 1.6); should a release move them, this fails loudly
    rather than guess whether the update was skipped.
    """
    if not scaler.is_enabled():
        return None
    try:
        found = scaler._found_inf_per_device(optimizer)  # private: see the docstring
        flags = [f.reshape(()).float() for f in found.values()]
    except (AttributeError, KeyError, TypeError):
        flags = []
    if not flags:
        raise RuntimeError("GradScaler exposes no found-inf flags after unscale_(); this "
                           "torch release is not supported by k3-trainer's skip detection")
    return torch.stack([f.to(flags[0].device) for f in flags]).sum()


class FP16SkipHarness(torch.amp.GradScaler):
    """An enabled loss scaler for fp32 training: the FP16 overflow-skip path, on any device.

    FP16 itself is refused on CPU, yet its skip path (scale, unscale, a dropped scale, a
    skipped update that still consumed data, the GradScaler state in checkpoints) must be
    testable there. ``Trainer`` accepts this scaler, and only this one, with
    ``precision="fp32"``: the arithmetic stays fp32 while the scaler behaves as under FP16
    (inject an infinite gradient to make it skip). It is a harness for tests and fault
    drills, named so that no other scaler slips past the precision checks.
    """

    def __init__(self, device: str = "cpu", init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=True)


def validate_grad_scaler(scaler: torch.amp.GradScaler, precision: str) -> None:
    """A scaler passed to ``Trainer`` must fit the precision: enabled exactly for fp16, or
    the named :class:`FP16SkipHarness` with fp32. Anything else would train a different
    recipe than the config (and the checkpoint) says."""
    if precision == "fp16" and not scaler.is_enabled():
        raise ConfigError("precision fp16 needs an enabled GradScaler (without loss scaling "
                          "small fp16 gradients underflow to zero)")
    if precision != "fp16" and scaler.is_enabled():
        if isinstance(scaler, FP16SkipHarness) and precision == "fp32":
            return
        raise ConfigError(
            f"an enabled GradScaler was passed with precision {precision}: loss scaling is for "
            "fp16 only; to exercise the FP16 skip path in fp32 use "
            "k3_trainer.FP16SkipHarness with precision='fp32'")
