"""Attention Residuals (block variant, Kimi K3): a learned read over the residual history.

A plain pre-norm decoder adds every sub-layer's output to one running sum, so layer l
sees ``embed + Σ outputs`` with fixed unit weights. Block Attention Residuals keep the
sum of each block of ``S`` layers apart (a *committed block*; block 0 is the token
embedding) plus the *partial* sum of the current block, and every sub-layer reads a
softmax mix of those sources instead of their plain sum:

    h = Σ_i softmax_i(w · RMSNorm(V_i)) · V_i,   V = [committed blocks…, partial]

with ``w`` a pseudo-query of width d, zero at init (so a fresh model reads the mean of
its sources), one per read. Layer l: ``x = read_attn`` (just the partial while nothing
is committed); if ``l % S == 0`` commit the partial and start a new one; ``partial +=
attn(norm(x))``; ``h = read_mlp``; ``partial += mlp(norm(h))``. A final read mixes
everything before the output norm. Scores and softmax are fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .norm import RMSNorm


def inverse_rms(x: Tensor, eps: float) -> Tensor:
    """``1 / rms(x)`` over the last dim, fp32, shape ``x.shape[:-1]``."""
    return torch.rsqrt(x.float().pow(2).mean(-1) + eps)


class ResidualRead(nn.Module):
    """One Attention-Residuals read: ``query`` (d, zero-init) and ``norm`` (RMSNorm gain).

    ``w · RMSNorm(V)`` is computed as ``(V · (gain ⊙ w)) / rms(V)``: the same number,
    but a matrix-vector product per source instead of a normalized copy of it, and the
    ``1 / rms`` of a committed block can be computed once for every later read.
    """

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d_model))
        self.norm = RMSNorm(d_model, eps)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.query.zero_()
            self.norm.weight.fill_(1.0)

    def forward(self, sources: list[Tensor], inv_rms: list[Tensor] | None = None) -> Tensor:
        """Softmax mix of ``sources`` (each ``(..., d)``), weights per position, fp32;
        ``inv_rms`` are the sources' :func:`inverse_rms` when already known."""
        if inv_rms is None:
            inv_rms = [inverse_rms(s, self.norm.eps) for s in sources]
        dtype = sources[0].dtype
        for s in sources[1:]:
            dtype = torch.promote_types(dtype, s.dtype)
        with torch.autocast(device_type=sources[0].device.type, enabled=False):
            key = self.norm.weight.float() * self.query.float()
            scores = torch.stack([(s.float() @ key) * r for s, r in zip(sources, inv_rms)])
            weights = scores.softmax(dim=0).unsqueeze(-1)  # (N, ..., 1)
            mixed = weights[0] * sources[0].float()
            for w, s in zip(weights[1:], sources[1:]):
                mixed = mixed + w * s.float()
        return mixed.to(dtype)

