"""Gated feed-forward (GLU) MLPs: the dense MLP, and the shared experts of a MoE layer.

Two gates: SwiGLU ``silu(g)·u`` (Shazeer 2020, "GLU variants") and Kimi K3's SiTU-GLU
``[4·tanh(g/4)·σ(g)]·[25·tanh(u/25)]``, a SiLU whose gate and value are both softly
bounded (|gate| < 4, |value| < 25), so no activation can blow up. SiTU runs in fp32
whatever the input dtype: tanh saturates, and bf16 would flatten the curve near the caps.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Activation = Literal["swiglu", "situ"]
ACTIVATIONS: tuple[str, ...] = ("swiglu", "situ")
SITU_GATE_CAP = 4.0
SITU_VALUE_CAP = 25.0


def situ_glu(gate: Tensor, up: Tensor) -> Tensor:
    """``[4·tanh(g/4)·σ(g)]·[25·tanh(u/25)]`` in fp32, returned in ``gate``'s dtype."""
    g, u = gate.float(), up.float()
    a = SITU_GATE_CAP * torch.tanh(g / SITU_GATE_CAP) * torch.sigmoid(g)
    return (a * (SITU_VALUE_CAP * torch.tanh(u / SITU_VALUE_CAP))).to(gate.dtype)


def glu(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    """The gated hidden activation named ``activation`` (``"swiglu"`` or ``"situ"``)."""
    if activation == "situ":
        return situ_glu(gate, up)
    if activation == "swiglu":
        return F.silu(gate) * up
    raise ValueError(f"unknown activation {activation!r}; use one of {', '.join(ACTIVATIONS)}")


class GatedMLP(nn.Module):
    """``w_down(glu(w_gate x, w_up x))``, no biases; ``activation`` ``"swiglu"`` or ``"situ"``."""

    def __init__(self, d_model: int, hidden: int, activation: str = "swiglu"):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"GatedMLP: unknown activation {activation!r}; use one of {', '.join(ACTIVATIONS)}"
            )
        self.activation = activation
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.w_down(glu(self.w_gate(x), self.w_up(x), self.activation))
        return out

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


SwiGLU = GatedMLP  # the name before SiTU-GLU existed (default activation: SwiGLU)
