"""Tiny reference attention modules of each kind, built reproducibly (CPU, fp32/fp64)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from k3_qkclip import QKClip, QKClipPolicy
from k3_qkclip.reference import ReferenceAttention, ReferenceMLA

DIM, HEADS = 32, 4
KINDS = ("mha", "mha_fused", "gqa", "mla")


def build(kind: str, *, bias: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    module: nn.Module
    if kind == "mha":
        module = ReferenceAttention(DIM, HEADS, bias=bias)
    elif kind == "mha_fused":
        module = ReferenceAttention(DIM, HEADS, fused=True, bias=bias)
    elif kind == "gqa":
        module = ReferenceAttention(DIM, HEADS, 2, bias=bias)
    elif kind == "mla":
        module = ReferenceMLA(DIM, HEADS, nope_dim=8, rope_dim=4, v_dim=6, kv_rank=12, bias=bias)
    else:
        raise AssertionError(kind)
    return module.to(dtype)


def batch(seed: int = 1, *, b: int = 2, t: int = 12, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    return 3.0 * torch.randn(b, t, DIM, generator=g, dtype=dtype)


def observe(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-head max logits of one training forward, measured with QK-Clip disabled."""
    with QKClip(model, QKClipPolicy(enabled=False)) as clip, torch.no_grad():
        model(x)
        return {k: v.clone() for k, v in clip.max_logits().items()}


@pytest.fixture
def make() -> Callable[..., nn.Module]:
    return build


@pytest.fixture
def make_batch() -> Callable[..., torch.Tensor]:
    return batch


@pytest.fixture
def observe_logits() -> Callable[[nn.Module, torch.Tensor], dict[str, torch.Tensor]]:
    return observe
