"""Quintic Newton–Schulz orthogonalization, batched, in a caller-chosen dtype.

Muon replaces a momentum matrix ``G = U S Vᵀ`` by (approximately) its orthogonal
factor ``U Vᵀ``. The quintic iteration ``X ← a·X + (b·A + c·A²)·X`` with ``A = X Xᵀ``
pushes every singular value of a Frobenius-normalized ``X`` toward 1 using only
matrix products, which is why it is cheap on accelerators.

For a wide ``m × n`` matrix (``m ≤ n``) every step is ``X ← h(A)·X`` with
``h(A) = a·I + b·A + c·A²``, so after k steps ``X_k = Q_k·X_0`` where ``Q_k`` is a
polynomial in ``A_0``. The Gram form iterates on the ``m × m`` matrices instead
(``Q ← h(R)·Q``, ``R ← h(R)·R·h(R)``, all polynomials of one matrix, so they commute)
and touches the ``m × n`` matrix only to form ``R = X Xᵀ`` and to return ``Q·X``: fewer
products when ``n`` is a few times ``m``. ``R`` is carried from step to step rather than
recomputed, so rounding accumulates (in bf16 a rounding-negative eigenvalue of ``R``
grows by ``h(λ)²`` per step); the iteration restarts (``X ← Q·X``, ``R ← X Xᵀ``) after
step 2 and then every third step, as Gram Newton–Schulz's authors recommend for five
steps.
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

NS_METHODS = ("standard", "gram", "auto")

# ``method="auto"`` takes the Gram form for matrices at least this many times wider than
# tall (either orientation). Its products cost ≈ (8r + 28)·m³ against (20r + 10)·m³ for
# the standard form (r = n/m, five steps, one restart), equal at r = 1.5; measured on
# CPU (``bench_optim.py --only gram``) the Gram form first wins clearly from r ≈ 2.5.
GRAM_MIN_ASPECT = 2.5

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


def resolve_ns_method(method: str, rows: int, cols: int) -> str:
    """``"standard"`` or ``"gram"`` for a ``rows × cols`` matrix: ``"auto"`` picks Gram
    where the matrix is at least :data:`GRAM_MIN_ASPECT` times wider than tall (or
    taller than wide)."""
    if method not in NS_METHODS:
        raise ValueError(
            f"unknown Newton–Schulz method {method!r}; use one of {', '.join(NS_METHODS)}"
        )
    if method != "auto":
        return method
    short, long = sorted((rows, cols))
    return "gram" if short and long >= GRAM_MIN_ASPECT * short else "standard"


def gram_restarts(steps: int) -> frozenset[int]:
    """The 0-based steps before which the Gram form restarts from ``X``: after step 2,
    then every third step (5 steps: one restart; 8 steps: two)."""
    return frozenset(range(2, steps, 3))


def newton_schulz(
    G: torch.Tensor,
    *,
    steps: int = 5,
    coefficients: CoefficientSpec = "jordan",
    dtype: DTypeSpec = torch.float32,
    eps: float = 1e-7,
    method: str = "standard",
) -> torch.Tensor:
    """Approximately orthogonalize ``G`` (shape ``(..., m, n)``) with the quintic iteration.

    Each matrix in the batch is normalized by its own Frobenius norm and iterated in
    ``dtype`` on its smaller Gram matrix (``X Xᵀ`` for a wide matrix, ``Xᵀ X`` for a tall
    one, which is iterated as ``X ← X·h(Xᵀ X)``: no transposed copy). ``method`` is
    ``"standard"`` (iterate on ``X``), ``"gram"`` (iterate on the Gram matrix: the same
    polynomial, cheaper for rectangular matrices) or ``"auto"`` (Gram from an aspect
    ratio of :data:`GRAM_MIN_ASPECT`). Returns a new tensor of ``G``'s shape and dtype;
    ``G`` is never modified, even when it already has the iteration dtype.
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a (..., m, n) tensor, got shape {tuple(G.shape)}")
    if G.is_complex():
        raise ValueError("newton_schulz does not support complex tensors")
    per_step, norm_factor = resolve_coefficients(coefficients, steps)
    work_dtype = resolve_ns_dtype(dtype, G.device)
    m, n = G.shape[-2], G.shape[-1]
    mats = G.reshape(-1, m, n)
    X = torch.empty(mats.shape, dtype=work_dtype, device=G.device)
    normalize_into(X, mats, norm_factor=norm_factor, eps=eps)  # never writes into G
    X = iterate(X, per_step, method=resolve_ns_method(method, m, n))
    return X.to(G.dtype).reshape(G.shape)


def normalize_into(out: torch.Tensor, mats: torch.Tensor, *, norm_factor: float,
                   eps: float) -> None:
    """``out ← mats / (‖mats‖_F·norm_factor + eps)`` per matrix, in ``out``'s dtype.

    The norm and the division run in at least fp32 (fp64 when either side is fp64), on
    the input as given (not on its rounding to a bf16 ``out``), and the division writes
    ``out`` directly: one pass over the input besides the norm.
    """
    norm_dtype = torch.promote_types(torch.promote_types(mats.dtype, out.dtype), torch.float32)
    norm = torch.linalg.vector_norm(mats, dim=(-2, -1), keepdim=True, dtype=norm_dtype)
    torch.div(mats, norm * norm_factor + eps, out=out)


class _Side:
    """Products on the side of ``X`` that keeps the Gram matrix small: a wide ``X``
    (``m ≤ n``) is iterated as ``X ← h(X Xᵀ)·X``, a tall one as ``X ← X·h(Xᵀ X)`` (the same
    iteration on ``Xᵀ``, without transposing anything)."""

    def __init__(self, X: torch.Tensor) -> None:
        self.tall = X.shape[-2] > X.shape[-1]

    def gram(self, X: torch.Tensor) -> torch.Tensor:
        return torch.bmm(X.mT, X) if self.tall else torch.bmm(X, X.mT)

    def apply(self, M: torch.Tensor, X: torch.Tensor, *, beta: float | None = None) -> torch.Tensor:
        """``M·X`` (tall: ``X·M``), or ``beta·X + M·X`` with ``a·X`` accumulated with the
        product before one rounding."""
        if beta is None:
            return torch.bmm(X, M) if self.tall else torch.bmm(M, X)
        return torch.baddbmm(X, X, M, beta=beta) if self.tall else torch.baddbmm(X, M, X, beta=beta)


def iterate(X: torch.Tensor, per_step: Sequence[Coefficients], *, method: str) -> torch.Tensor:
    """Run the iteration on a normalized ``(batch, m, n)`` stack (wide or tall), in its
    dtype; ``method`` is ``"standard"`` or ``"gram"``. ``X`` is only read."""
    side = _Side(X)
    return (_gram_iteration if method == "gram" else _standard_iteration)(X, per_step, side)


def _standard_iteration(X: torch.Tensor, per_step: Sequence[Coefficients],
                        side: _Side) -> torch.Tensor:
    """``X ← a·X + (b·A + c·A²)·X`` with ``A = X Xᵀ``. ``a·X`` is added inside the last
    product (accumulated in fp32 with it before one rounding), not folded into the small
    factor, whose diagonal would be rounded in bf16 (twice the error)."""
    for a, b, c in per_step:
        A = side.gram(X)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b·A + c·A·A
        X = side.apply(B, X, beta=a)  # a·X + B·X
    return X


def _gram_iteration(X: torch.Tensor, per_step: Sequence[Coefficients],
                    side: _Side) -> torch.Tensor:
    """The same polynomial as :func:`_standard_iteration`, iterated on ``R = X Xᵀ``.

    Per step ``H = a·I + b·R + c·R²``, ``Q ← H·Q`` and (unless a restart or the end
    follows) ``R ← H·R·H``; ``X`` is touched only at the start, at each restart
    (``X ← Q·X``, ``R ← X Xᵀ``) and at the end (``Q·X``).
    """
    restarts = gram_restarts(len(per_step))
    R = side.gram(X)
    Q: torch.Tensor | None = None
    for i, (a, b, c) in enumerate(per_step):
        if i in restarts and Q is not None:
            X = side.apply(Q, X)
            R = side.gram(X)
            Q = None
        H = torch.baddbmm(R, R, R, beta=b, alpha=c)  # b·R + c·R·R
        H.diagonal(dim1=-2, dim2=-1).add_(a)
        Q = H if Q is None else torch.bmm(H, Q)
        if i + 1 < len(per_step) and i + 1 not in restarts:
            R = torch.bmm(H, torch.bmm(R, H))
    assert Q is not None  # at least one step (resolve_coefficients)
    return side.apply(Q, X)
