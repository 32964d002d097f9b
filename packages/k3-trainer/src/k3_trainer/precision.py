"""Precision contracts: which precisions a device supports, autocast, and the scaler."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from .config import PRECISIONS, ConfigError

_AUTOCAST_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def validate_precision(precision: str, device: torch.device | str) -> None:
    """Reject unsupported precisions: unknown names, FP16 on CPU, BF16 on CUDA without it."""
    device = torch.device(device)
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp16" and device.type == "cpu":
        raise ConfigError(
            "precision fp16 needs a CUDA device (CPU autocast does not use fp16 with a "
            "GradScaler); use bf16 or fp32 on CPU"
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("precision bf16 needs native bf16 support on this CUDA device; use fp16")


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
