"""Rotary position embedding (RoPE), half-split pairs, tables cached per model.

Dimension ``i`` of the first half rotates with dimension ``i + d/2`` by angle
``position · theta^(-2i/d)``. The cos/sin tables are non-persistent buffers: they are
recomputed from the config, so they never enter a checkpoint.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables for ``dim`` rotary dims and positions ``0 .. max_seq_len - 1``."""

    cos: Tensor
    sin: Tensor

    def __init__(self, dim: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RotaryEmbedding: dim must be even, got {dim}")
        half = dim // 2
        # fp64 angles, then fp32 tables: exact enough at long positions.
        inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv_freq
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def extra_repr(self) -> str:
        return f"dim={2 * self.cos.shape[1]}, max_seq_len={self.cos.shape[0]}"

    def forward(self, seq_len: int) -> tuple[Tensor, Tensor]:
        """``(cos, sin)``, each ``(seq_len, dim / 2)``, for positions ``0 .. seq_len - 1``."""
        return self.cos[:seq_len], self.sin[:seq_len]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the last dim of ``x`` ``(..., T, dim)`` by the tables ``(T, dim / 2)``."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
