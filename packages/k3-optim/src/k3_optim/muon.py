"""The Muon half of MuonAdamW as a functional core on lists of tensors.

Per group: momentum, Nesterov look-ahead and decoupled weight decay as ``torch._foreach_*``
calls over all of the group's tensors, then every same-shape matrix goes through one
batched Newton–Schulz call (standard or Gram form), then optionally NorMuon's row
normalization and cautious decay, then the scaled update added with one foreach call
per update scale. The optimizer class only gathers tensors (and, when distributed,
supplies an orthogonalizer that runs each matrix's Newton–Schulz on one rank).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from .decay import cautious_decay_
from .newton_schulz import (
    CoefficientSpec,
    DTypeSpec,
    iterate,
    normalize_into,
    resolve_coefficients,
    resolve_ns_dtype,
    resolve_ns_method,
)

UPDATE_SCALES = ("match_rms_adamw", "spectral", "none")


def update_scale_factor(rule: str, rows: int, cols: int) -> float:
    """Multiplier applied to the orthogonalized update of a ``rows × cols`` matrix.

    ``match_rms_adamw`` (Moonlight): 0.2·√max(rows, cols) gives the update the RMS of a
    typical AdamW update, so one peak LR and weight decay serve both halves.
    ``spectral``: √max(1, rows/cols), the spectral-norm scaling of the original Muon.
    ``none``: 1.
    """
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "spectral":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "none":
        return 1.0
    raise ValueError(f"unknown update_scale {rule!r}; use one of {', '.join(UPDATE_SCALES)}")


def matrix_view_shape(
    shape: Sequence[int], *, num_heads: int | None = None, flatten: bool = False
) -> tuple[int, int, int]:
    """The ``(batch, rows, cols)`` stack of matrices Muon orthogonalizes for a parameter.

    2-D: one matrix, or ``num_heads`` row blocks (per-head Muon for Q/K/V projections).
    3-D and more: the leading dims are a batch (MoE expert stacks ``(E, out, in)``),
    unless ``flatten`` asks for one ``(out, in·k…)`` matrix (convolution kernels).
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"Muon needs a parameter with at least 2 dims, got shape {shape}")
    if num_heads is not None:
        if len(shape) != 2:
            raise ValueError(f"per-head Muon needs a 2-D parameter, got shape {shape}")
        if shape[0] % num_heads:
            raise ValueError(f"{shape[0]} rows do not split into num_heads={num_heads} blocks")
        return num_heads, shape[0] // num_heads, shape[1]
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if flatten:
        return 1, shape[0], math.prod(shape[1:])
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def ns_cost(view: tuple[int, int, int]) -> int:
    """Relative Newton–Schulz cost of a ``(batch, rows, cols)`` stack (multiply-adds per step)."""
    batch, rows, cols = view
    m, n = min(rows, cols), max(rows, cols)
    return batch * m * m * (2 * n + m)


def orthogonalize(
    updates: Sequence[torch.Tensor],
    views: Sequence[tuple[int, int, int]],
    *,
    ns_steps: int,
    ns_dtype: DTypeSpec,
    ns_coefficients: CoefficientSpec,
    ns_eps: float,
    ns_method: str = "standard",
) -> list[torch.Tensor]:
    """Newton–Schulz on full updates: one batched call per shape bucket.

    Matrices with the same shape (orientation included: a tall stack is iterated as
    ``X ← X·h(Xᵀ X)``, never transposed), device and dtype share a call, so
    ``ns_method="auto"`` decides once per bucket. Each update is normalized straight
    into the bucket's stack in the iteration dtype (no separate concatenation). Returns
    tensors shaped and typed like ``updates``, contiguous, owned by the caller (a view
    into the bucket's result when no conversion is needed).
    """
    per_step, norm_factor = resolve_coefficients(ns_coefficients, ns_steps)
    buckets: dict[tuple[int, int, bool, torch.device, torch.dtype],
                  list[int]] = defaultdict(list)
    for i, (_, rows, cols) in enumerate(views):
        key = (min(rows, cols), max(rows, cols), rows > cols, updates[i].device,
               updates[i].dtype)
        buckets[key].append(i)

    result: list[torch.Tensor | None] = [None] * len(updates)
    for (short, long, tall, device, _), indices in buckets.items():
        work_dtype = resolve_ns_dtype(ns_dtype, device)
        shape = (long, short) if tall else (short, long)
        stack = torch.empty(sum(views[i][0] for i in indices), *shape, dtype=work_dtype,
                            device=device)
        start = 0
        for i in indices:
            batch = views[i][0]
            normalize_into(stack[start:start + batch], updates[i].reshape(batch, *shape),
                           norm_factor=norm_factor, eps=ns_eps)
            start += batch
        ortho = iterate(stack, per_step, method=resolve_ns_method(ns_method, short, long))
        for i, piece in zip(indices, torch.split(ortho, [views[i][0] for i in indices])):
            result[i] = piece.to(updates[i].dtype).reshape(updates[i].shape)
    return result  # type: ignore[return-value]


Orthogonalizer = Callable[[list[torch.Tensor]], list[torch.Tensor]]
Normalizer = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def muon_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor],
    views: list[tuple[int, int, int]],
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    update_scale: str,
    orthogonalize: Orthogonalizer,
    normalize: Normalizer | None = None,
    cautious_weight_decay: bool = False,
    foreach: bool = True,
) -> None:
    """Apply one Muon step in place to ``params`` (and ``momentum_buffers``).

    The tensors may be local shards (FSDP2): everything here is elementwise except
    ``orthogonalize``, which maps the list of momentum updates to orthogonalized updates
    of the same (local) shapes, and ``normalize`` (NorMuon, when given), which maps
    those to row-normalized updates. ``views[i]`` is the full parameter's ``(batch,
    rows, cols)`` stack from :func:`matrix_view_shape`, which sets the update scale.
    Momentum is an EMA (``buf ← m·buf + (1−m)·g``); the sum convention differs only by
    a scalar, which Newton–Schulz normalizes away. Decay is decoupled
    (``p ← p·(1 − lr·wd)``), or with ``cautious_weight_decay`` applied only where the
    final update and the parameter agree in sign. ``foreach=False`` runs the same
    arithmetic one tensor at a time (the baseline the benchmark compares against).
    """
    if not params:
        return
    decay = 1.0 - lr * weight_decay
    plain_decay = weight_decay != 0.0 and not cautious_weight_decay
    if foreach:
        torch._foreach_lerp_(momentum_buffers, grads, 1.0 - momentum)
        updates = (
            torch._foreach_lerp(grads, momentum_buffers, momentum)
            if nesterov else list(momentum_buffers)
        )
        if plain_decay:
            torch._foreach_mul_(params, decay)
    else:
        updates = []
        for p, g, buf in zip(params, grads, momentum_buffers):
            buf.lerp_(g, 1.0 - momentum)
            updates.append(g.lerp(buf, momentum) if nesterov else buf)
            if plain_decay:
                p.mul_(decay)

    ortho = orthogonalize(list(updates))
    if normalize is not None:
        ortho = normalize(ortho)
    if cautious_weight_decay:  # the update's sign is O's: its scale is positive
        cautious_decay_(params, ortho, lr * weight_decay, foreach=foreach)
    # One foreach add per (scale, device, dtype): the scale depends on the shape.
    by_scale: dict[tuple[float, torch.device, torch.dtype],
                   tuple[list[torch.Tensor], list[torch.Tensor]]] = defaultdict(lambda: ([], []))
    for p, o, (_, rows, cols) in zip(params, ortho, views):
        scale = update_scale_factor(update_scale, rows, cols)
        if not foreach:
            p.add_(o, alpha=-lr * scale)
            continue
        targets, deltas = by_scale[(scale, p.device, p.dtype)]
        targets.append(p)
        deltas.append(o)
    for (scale, _, _), (targets, deltas) in by_scale.items():
        torch._foreach_add_(targets, deltas, alpha=-lr * scale)
