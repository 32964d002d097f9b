"""Per-head max-logit observation: the observer QKClip installs, and the attention helper.

An attention module that declares a :class:`~k3_qkclip.QKSpec` keeps an attribute
``qk_observer`` (``None`` by default). While a :class:`~k3_qkclip.QKClip` is active it
holds a :class:`QKObserver`; the module passes it to :func:`observed_attention`, which
runs ordinary ``scaled_dot_product_attention`` and, in training forwards only, reports
each query head's maximum pre-softmax logit ``max (q_i·k_j)·scale`` over the batch and
the causal pairs ``j ≤ i``. Nothing is observed in eval mode or outside the context.

Why a separate no-grad ``QKᵀ`` instead of reusing explicit scores for the softmax: the
fused attention kernels (flash on CUDA, the flash CPU kernel) are much faster than
explicit ``softmax(QKᵀ)V`` with autograd, so one extra forward-only matmul (about a
seventh of the attention's forward+backward FLOPs, and none of its memory for backward)
is the cheaper exact observation. See the package README for measurements.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Bounds the transient score tensor of head_max_logits (elements per query-row chunk).
_CHUNK_ELEMENTS = 1 << 26


class QKObserver:
    """Running fp32 max of one module's per-head pre-softmax logits, kept on device.

    ``record`` is sync-free (an elementwise ``maximum``); NaN and +inf propagate so that
    :meth:`QKClip.validate` sees them. Values are replaced, never mutated in place, so a
    tensor returned by :attr:`value` is a snapshot.
    """

    def __init__(self, module: nn.Module, name: str, n_heads: int, device: torch.device):
        self.module = module
        self.name = name
        self.n_heads = n_heads
        self._max = torch.full((n_heads,), -math.inf, dtype=torch.float32, device=device)
        self.observed = False  # recorded since the last reset()
        self.unvalidated = False  # recorded since the last QKClip.validate()

    @property
    def active(self) -> bool:
        """True in training mode: eval forwards are never observed."""
        return self.module.training

    @property
    def value(self) -> Tensor:
        """Current per-head maxima, shape ``(n_heads,)``, fp32; ``-inf`` = not observed."""
        return self._max

    def record(self, head_max: Tensor) -> None:
        """Fold one forward's per-head maxima (shape ``(n_heads,)``) into the running max.

        A no-op in eval mode. Use this directly when your attention kernel computes
        the maxima itself (e.g. from :func:`head_max_logits` or a fused kernel).
        """
        if not self.active:
            return
        if tuple(head_max.shape) != (self.n_heads,):
            raise ValueError(
                f"QK-Clip observer of {self.name!r}: expected per-head maxima of shape "
                f"({self.n_heads},), got {tuple(head_max.shape)}"
            )
        value = head_max.detach().to(torch.float32)
        if value.device != self._max.device:
            self._max = self._max.to(value.device)
        self._max = torch.maximum(self._max, value)
        self.observed = self.unvalidated = True

    def replace(self, value: Tensor) -> None:
        """Take ``value`` as the maxima (the data-parallel MAX over ranks of this one's)."""
        self._max = value.detach().to(self._max.device, torch.float32).clone()

    def reset(self) -> None:
        """Discard the observations (a fresh tensor, so earlier snapshots stay valid)."""
        self._max = torch.full_like(self._max, -math.inf)
        self.observed = self.unvalidated = False


@torch.no_grad()
def head_max_logits(
    q: Tensor, k: Tensor, *, causal: bool = True, scale: float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Exact per-query-head max of ``(q_i·k_j)·scale`` over batch and visible pairs.

    ``q``: ``(B, H, T, E)``; ``k``: ``(B, H_kv, S, E)`` with ``H % H_kv == 0`` (query head
    h reads key head ``h // (H // H_kv)``). ``causal`` masks ``j > i`` (top-left
    aligned, like ``scaled_dot_product_attention(is_causal=True)``); ``mask`` (bool,
    ``(B, 1, T, S)``, True where query i may see key j, e.g. documents kept apart) masks
    the pairs it forbids as well; ``scale`` defaults to ``1/√E``. Returns fp32 ``(H,)``,
    detached, with no host sync. Query rows are processed in chunks so the transient
    scores stay bounded for long sequences.
    """
    b, h, t, e = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if k.shape[0] != b or k.shape[3] != e or h % hkv:
        raise ValueError(
            f"head_max_logits: q {tuple(q.shape)} and k {tuple(k.shape)} do not match "
            "(B, H, T, E) / (B, H_kv, S, E) with H a multiple of H_kv"
        )
    scale = e**-0.5 if scale is None else scale
    if not scale > 0:
        raise ValueError(f"head_max_logits: scale must be > 0, got {scale}")
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4
                             or mask.shape[1] != 1 or mask.shape[2:] != (t, s)):
        raise ValueError(f"head_max_logits: mask must be bool (B, 1, T, S) = "
                         f"({b}, 1, {t}, {s}), got {mask.dtype} {tuple(mask.shape)}")
    g = h // hkv
    qg = q.reshape(b, hkv, g, t, e)
    kt = k.transpose(-1, -2)
    rows = max(1, min(t, _CHUNK_ELEMENTS // max(1, b * h * s)))
    if causal:  # a few row chunks skip the invisible upper triangle (~3/8 of the work)
        rows = min(rows, max(32, -(-t // 4)))
    # Inside a chunk's diagonal block, key j > query i is the same upper triangle each time.
    upper = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu(1) if causal else None
    best: Tensor | None = None
    for start in range(0, t, rows):
        stop = min(t, start + rows)
        cols = min(s, stop) if causal else s
        if cols == 0:  # no key at all
            continue
        n = stop - start
        chunk = qg[:, :, :, start:stop].reshape(b, hkv, g * n, e)
        scores = torch.matmul(chunk, kt[..., :cols]).view(b, hkv, g, n, cols)
        if upper is not None and cols > start + 1:  # mask only the diagonal block
            scores[..., start:].masked_fill_(upper[:n, : cols - start], -math.inf)
        if mask is not None:
            scores.masked_fill_(~mask[:, :, None, start:stop, :cols], -math.inf)
        chunk_max = scores.amax(dim=(0, 3, 4))
        best = chunk_max if best is None else torch.maximum(best, chunk_max)
    if best is None:
        return torch.full((h,), -math.inf, dtype=torch.float32, device=q.device)
    # max(x·c) == max(x)·c for c > 0 (rounding is monotonic), so scale once at the end.
    return best.reshape(h).to(torch.float32) * scale


def observed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    observer: QKObserver | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """``scaled_dot_product_attention`` that reports per-head max logits to ``observer``.

    Shapes as in :func:`head_max_logits`, plus ``v``: ``(B, H_kv, S, E_v)``; returns
    ``(B, H, T, E_v)``. ``mask`` (bool ``(B, 1, T, S)``, True = visible) restricts the
    pairs further than ``causal`` (documents kept apart); the observed maxima cover only
    the visible pairs. With ``observer`` None or inactive (eval mode) this is exactly
    ``F.scaled_dot_product_attention`` and costs nothing extra.
    """
    if observer is not None and observer.active:
        observer.record(head_max_logits(q, k, causal=causal, scale=scale, mask=mask))
    gqa = q.shape[1] != k.shape[1]
    if mask is not None:
        if causal:
            t, s = q.shape[2], k.shape[2]
            mask = mask & torch.ones(t, s, dtype=torch.bool, device=mask.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
