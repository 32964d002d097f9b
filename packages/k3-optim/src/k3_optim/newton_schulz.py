"""Quintic Newton–Schulz orthogonalization, batched, in a caller-chosen dtype.

Muon replaces a momentum matrix ``G = U S Vᵀ`` by (approximately) its orthogonal
factor ``U Vᵀ``. The quintic iteration ``X ← a·X + (b·A + c·A²)·X`` with ``A = X Xᵀ``
pushes every singular value of a Frobenius-normalized ``X`` toward 1 using only
matrix products, which is why it is cheap on accelerators.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Coefficients = tuple[float, float, float]
CoefficientSpec = str | Sequence[Coefficients]
DTypeSpec = str | torch.dtype

# Keller Jordan's tuned quintic: one triple repeated every step. It does not converge
# to exactly 1 (singular values settle in roughly [0.7, 1.2]); Muon does not need more.
JORDAN: tuple[Coefficients, ...] = ((3.4445, -4.7750, 2.0315),)

# Polar Express (Amsel et al., 2025): a per-step optimal sequence for 5 steps, built
# with a 2e-2 safety margin, so the input is normalized by ‖X‖·(1 + 2e-2).
POLAR_EXPRESS: tuple[Coefficients, ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_SAFETY = 1.02

COEFFICIENT_SETS: dict[str, tuple[Coefficients, ...]] = {
    "jordan": JORDAN,
    "polar_express": POLAR_EXPRESS,
}
_NORM_FACTOR = {"jordan": 1.0, "polar_express": POLAR_EXPRESS_SAFETY}

_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
}
_ALLOWED = (torch.bfloat16, torch.float32, torch.float64)


def resolve_ns_dtype(dtype: DTypeSpec, device: torch.device | None = None) -> torch.dtype:
    """Turn ``"bf16"/"fp32"/"fp64"``, a torch dtype, or ``"auto"`` into a torch dtype.

    ``"auto"`` is bf16 on CUDA (tensor cores) and fp32 elsewhere: on CPUs bf16 matrix
    products are typically tens of times slower than fp32.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _ALLOWED:
            raise ValueError(f"Newton–Schulz dtype must be bf16, fp32 or fp64, got {dtype}")
        return dtype
    if isinstance(dtype, str):
        key = dtype.lower()
        if key == "auto":
            is_cuda = device is not None and torch.device(device).type == "cuda"
            return torch.bfloat16 if is_cuda else torch.float32
        if key in _DTYPES:
            return _DTYPES[key]
    raise ValueError(
        f"unknown Newton–Schulz dtype {dtype!r}; use 'auto', 'bf16', 'fp32', 'fp64' "
        "or torch.bfloat16/float32/float64"
    )


def resolve_coefficients(
    coefficients: CoefficientSpec, steps: int
) -> tuple[tuple[Coefficients, ...], float]:
    """Return one (a, b, c) triple per step and the normalization factor for the set.

    A named set shorter than ``steps`` (or an explicit sequence) repeats its last triple.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"Newton–Schulz steps must be a positive integer, got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENT_SETS:
            names = ", ".join(sorted(COEFFICIENT_SETS))
            raise ValueError(
                f"unknown Newton–Schulz coefficient set {coefficients!r}; use one of {names} "
                "or a sequence of (a, b, c) triples"
            )
        triples = COEFFICIENT_SETS[coefficients]
        factor = _NORM_FACTOR[coefficients]
    else:
        try:
            triples = tuple(tuple(float(v) for v in t) for t in coefficients)  # type: ignore[misc]
        except TypeError as exc:
            raise ValueError(
                "Newton–Schulz coefficients must be a set name or a sequence of (a, b, c) triples"
            ) from exc
        if not triples or any(len(t) != 3 for t in triples):
            raise ValueError(
                "Newton–Schulz coefficients must be non-empty (a, b, c) triples, "
                f"got {coefficients!r}"
            )
        if not all(math.isfinite(v) for t in triples for v in t):
            raise ValueError(f"Newton–Schulz coefficients must be finite, got {coefficients!r}")
        factor = 1.0
    per_step = tuple(triples[min(i, len(triples) - 1)] for i in range(steps))
    return per_step, factor


def newton_schulz(
    G: torch.Tensor,
    *,
    steps: int = 5,
    coefficients: CoefficientSpec = "jordan",
    dtype: DTypeSpec = torch.float32,
    eps: float = 1e-7,
) -> torch.Tensor:
    """Approximately orthogonalize ``G`` (shape ``(..., m, n)``) with the quintic iteration.

    Each matrix in the batch is normalized by its own Frobenius norm and iterated in
    ``dtype`` on the wide orientation (transposed when ``m > n``, so ``X Xᵀ`` is the
    smaller Gram matrix). Returns a new tensor of ``G``'s shape and dtype; ``G`` is never
    modified, even when it already has the iteration dtype.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a (..., m, n) tensor, got shape {tuple(G.shape)}")
    if G.is_complex():
        raise ValueError("newton_schulz does not support complex tensors")
    per_step, norm_factor = resolve_coefficients(coefficients, steps)
    work_dtype = resolve_ns_dtype(dtype, G.device)

    m, n = G.shape[-2], G.shape[-1]
    X = G.reshape(-1, m, n).to(work_dtype)  # may alias G: nothing below writes into X
    transposed = m > n
    if transposed:
        X = X.mT
    # Norm in at least fp32 so a bf16 iteration still starts from an accurate scale.
    norm_dtype = torch.float64 if work_dtype == torch.float64 else torch.float32
    norm = torch.linalg.vector_norm(X.to(norm_dtype), dim=(-2, -1), keepdim=True)
    X = (X.to(norm_dtype) / (norm * norm_factor + eps)).to(work_dtype)
    for a, b, c in per_step:
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b·A + c·A·A
        X = torch.baddbmm(X, B, X, beta=a, alpha=1.0)  # a·X + B·X
    if transposed:
        X = X.mT
    return X.to(G.dtype).contiguous().reshape(G.shape)
