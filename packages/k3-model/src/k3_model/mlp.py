"""SwiGLU feed-forward: the dense MLP, and the always-on shared experts of a MoE layer."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class SwiGLU(nn.Module):
    """``w_down(silu(w_gate x) · w_up x)``, no biases (Shazeer 2020, "GLU variants")."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
        return out
