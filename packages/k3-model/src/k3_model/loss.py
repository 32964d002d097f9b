"""Chunked cross-entropy: the output head and the loss without a ``(tokens, vocab)`` tensor.

The plain path, ``F.cross_entropy(lm_head(h).float(), y)``, keeps the logits (in the
autocast dtype) and their fp32 copy alive for the backward: at a 160K vocabulary and
4096 tokens that is 2.6 GB per sequence in fp32. :func:`chunked_cross_entropy` walks
the tokens in chunks of ``chunk_size`` and saves only its inputs plus one fp32
log-sum-exp per token; the backward recomputes each chunk's logits and turns them
into the gradient at once (``softmax − onehot``), so at most one chunk of logits is
alive at a time, forward or backward. The price is the head's matmul done twice.

Numerics follow the plain path: a chunk's logits are computed in the autocast dtype
(when autocast is on) and upcast to fp32 for the softmax; the gradient is cast back
to that dtype for the two backward matmuls; the head weight's gradient is summed
over chunks in fp32. Targets equal to ``ignore_index`` (-100) are not scored and the
loss is the mean over scored targets (NaN when none is, like ``F.cross_entropy``).
No host sync: the count of scored targets stays on the device.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's when it is on, else ``x``'s."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Per token ``lse(h_t Wᵀ) − (h_t Wᵀ)[y_t]`` (0 where not scored), chunked over tokens
    ``t``; :func:`chunked_cross_entropy` takes their mean (or keeps them)."""

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int,
        dtype: torch.dtype,
    ) -> Tensor:
        scored = targets != IGNORE_INDEX
        safe = torch.where(scored, targets, 0)
        w = weight.to(dtype)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        picked = torch.empty_like(lse)
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            logits = F.linear(hidden[start:end].to(dtype), w).float()
            lse[start:end] = logits.logsumexp(dim=-1)
            picked[start:end] = logits.gather(1, safe[start:end, None]).squeeze(1)
        ctx.save_for_backward(hidden, weight, safe, scored, lse)
        ctx.chunk_size, ctx.dtype = chunk_size, dtype
        return torch.where(scored, lse - picked, 0.0)

    @staticmethod
    def backward(ctx: Any, grad_tokens: Tensor) -> tuple[Tensor | None, ...]:
        with torch.autocast(device_type=grad_tokens.device.type, enabled=False):
            return _ChunkedCrossEntropy._backward(ctx, grad_tokens)

    @staticmethod
    def _backward(ctx: Any, grad_tokens: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, safe, scored, lse = ctx.saved_tensors
        dtype, chunk_size = ctx.dtype, ctx.chunk_size
        w = weight.to(dtype)
        # d loss_t / d logits_t = (softmax_t − onehot(y_t)) · grad_t for scored t (the mean's
        # grad_t is grad / count, as autograd passes it down).
        scale = torch.where(scored, grad_tokens.float(), 0.0)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if ctx.needs_input_grad[1] else None
        )
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            h = hidden[start:end].to(dtype)
            probs = (F.linear(h, w).float() - lse[start:end, None]).exp_()
            rows = torch.arange(probs.shape[0], device=probs.device)
            probs[rows, safe[start:end]] -= 1.0
            grad_logits = probs.mul_(scale[start:end, None]).to(dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ w
            if grad_weight is not None:
                grad_weight.add_(grad_logits.t() @ h)  # summed in fp32
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_cross_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk_size: int,
    reduction: str = "mean",
) -> Tensor:
    """Mean token cross-entropy of ``hidden @ weightᵀ`` against ``targets``, chunked.

    ``hidden``: ``(..., d)`` (the output of the final norm); ``weight``: ``(vocab, d)``
    (the output head, no bias); ``targets``: ``hidden.shape[:-1]`` token ids, -100 =
    not scored. ``chunk_size`` tokens of the flattened batch form one chunk. Returns
    a 0-d fp32 tensor equal to ``F.cross_entropy(F.linear(hidden, weight).float(),
    targets)`` with its gradients, without ever holding more than one chunk of logits;
    ``reduction="none"``: each target's loss, ``targets``' shape (0 where not scored),
    as ``F.cross_entropy(..., reduction="none")``.
    """
    if reduction not in ("mean", "none"):
        raise ValueError(f"chunked_cross_entropy: reduction must be 'mean' or 'none', got "
                         f"{reduction!r}")
    if chunk_size < 1:
        raise ValueError(f"chunked_cross_entropy: chunk_size must be ≥ 1, got {chunk_size}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"chunked_cross_entropy: targets {tuple(targets.shape)} must match hidden "
            f"{tuple(hidden.shape)} without its last dim"
        )
    dtype = _compute_dtype(hidden)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        tokens: Tensor = _ChunkedCrossEntropy.apply(  # type: ignore[no-untyped-call]
            hidden.flatten(0, -2), weight, targets.flatten(), chunk_size, dtype
        )
        if reduction == "none":  # a copy, not a view (FSDP2 warns of views it returns)
            return tokens.view(targets.shape).clone()
        loss: Tensor = tokens.sum() / (targets != IGNORE_INDEX).sum()
    return loss
