from __future__ import annotations

import pytest
import torch
from optim_reference import ns_reference

from k3_optim import newton_schulz, resolve_ns_dtype

SHAPES = [(24, 40), (40, 24), (3, 16, 48), (2, 3, 20, 12), (32, 32)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max())


def _reference(G: torch.Tensor, coefficients, steps=5) -> torch.Tensor:
    mats = G.double().reshape(-1, *G.shape[-2:])
    return torch.stack([ns_reference(m, coefficients, steps) for m in mats]).reshape(G.shape)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("coefficients", ["jordan", "polar_express"])
def test_fp64_matches_float64_reference(shape, coefficients):
    G = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = newton_schulz(G, coefficients=coefficients, dtype="fp64")
    assert out.shape == G.shape and out.dtype == torch.float64
    assert _rel(out, _reference(G, coefficients)) < 1e-10


def test_explicit_triples_repeat_the_last_one():
    triples = [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)]
    G = torch.randn(20, 30, dtype=torch.float64)
    out = newton_schulz(G, steps=4, coefficients=triples, dtype=torch.float64)
    assert _rel(out, ns_reference(G, triples, steps=4)) < 1e-10
    # A different last triple gives a different result: the steps really use them.
    other = newton_schulz(G, steps=4, coefficients=[triples[0], (2.0, -1.4, 0.4)], dtype="fp64")
    assert not torch.allclose(out, other)


@pytest.mark.parametrize("shape", [(48, 80), (80, 48), (4, 32, 64)])
def test_fp32_within_single_precision(shape):
    G = torch.randn(*shape)
    out = newton_schulz(G, dtype="fp32")
    assert out.dtype == torch.float32
    assert _rel(out.double(), _reference(G, "jordan")) < 1e-4


def test_bf16_within_bf16_precision():
    G = torch.randn(2, 16, 24)  # kept tiny: bf16 matmuls are very slow on CPU
    out = newton_schulz(G, dtype=torch.bfloat16)
    assert out.dtype == torch.float32  # returned in G's dtype
    assert _rel(out.double(), _reference(G, "jordan")) < 5e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_input_is_never_modified(dtype):
    # The iteration dtype equals the input dtype here, so `.to(dtype)` aliases G.
    G = torch.randn(2, 12, 20).to(dtype)
    before = G.clone()
    newton_schulz(G, dtype=dtype)
    newton_schulz(G.mT, dtype=dtype)  # tall, transposed view
    assert torch.equal(G, before)


def test_converged_sets_orthogonalize():
    G = torch.randn(64, 128, dtype=torch.float64)
    for coefficients, band in [("jordan", (0.6, 1.25)), ("polar_express", (0.8, 1.2))]:
        s = torch.linalg.svdvals(newton_schulz(G, coefficients=coefficients, dtype="fp64"))
        assert band[0] < s.min() and s.max() < band[1], (coefficients, s.min(), s.max())


def test_each_matrix_in_a_batch_uses_its_own_norm():
    a = torch.randn(16, 24, dtype=torch.float64)
    batch = torch.stack([a, 1000.0 * a])
    out = newton_schulz(batch, dtype="fp64", eps=0.0)  # eps=0: exactly scale invariant
    torch.testing.assert_close(out[0], out[1], rtol=1e-9, atol=1e-12)
    alone = newton_schulz(a, dtype="fp64", eps=0.0)
    torch.testing.assert_close(out[0], alone, rtol=1e-12, atol=1e-14)


def test_zero_matrix_stays_finite():
    assert torch.equal(newton_schulz(torch.zeros(8, 12)), torch.zeros(8, 12))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "fp16"}, "dtype"),
        ({"dtype": torch.float16}, "dtype"),
        ({"coefficients": "nope"}, "coefficient set"),
        ({"coefficients": [(1.0, 2.0)]}, "triples"),
        ({"coefficients": [(1.0, float("nan"), 0.0)]}, "finite"),
        ({"steps": 0}, "steps"),
        ({"steps": 2.5}, "steps"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        newton_schulz(torch.randn(4, 6), **kwargs)


def test_bad_tensors_raise():
    with pytest.raises(ValueError, match="shape"):
        newton_schulz(torch.randn(5))
    with pytest.raises(ValueError, match="complex"):
        newton_schulz(torch.randn(4, 4, dtype=torch.complex64))


def test_dtype_names_and_auto():
    assert resolve_ns_dtype("bf16") is torch.bfloat16
    assert resolve_ns_dtype("FP64") is torch.float64
    assert resolve_ns_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_ns_dtype("auto", torch.device("cuda")) is torch.bfloat16


# --- the Gram form -------------------------------------------------------------------------

GRAM_SHAPES = [(16, 64), (64, 16), (24, 60), (32, 32), (3, 12, 96), (2, 2, 40, 10)]


def _ill_conditioned(m: int, n: int, seed: int = 0) -> torch.Tensor:
    """Singular values log-spaced over 1 … 1e-6: a momentum-like matrix whose small
    directions NS only partly lifts (the case where iterating on X Xᵀ drifts)."""
    gen = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U = torch.linalg.qr(torch.randn(m, k, dtype=torch.float64, generator=gen))[0]
    V = torch.linalg.qr(torch.randn(n, k, dtype=torch.float64, generator=gen))[0]
    return (U * torch.logspace(0, -6, k, dtype=torch.float64)) @ V.T


@pytest.mark.parametrize("shape", GRAM_SHAPES)
@pytest.mark.parametrize("coefficients", ["jordan", "polar_express"])
def test_gram_equals_the_standard_iteration_in_fp64(shape, coefficients):
    G = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    standard = newton_schulz(G, coefficients=coefficients, dtype="fp64")
    gram = newton_schulz(G, coefficients=coefficients, dtype="fp64", method="gram")
    assert gram.shape == G.shape and gram.dtype == G.dtype
    assert _rel(gram, standard) < 1e-12


@pytest.mark.parametrize("coefficients", ["jordan", "polar_express"])
@pytest.mark.parametrize("steps", [3, 5, 8])  # no restart, one, two
def test_gram_equals_standard_on_ill_conditioned_matrices_in_fp64(coefficients, steps):
    G = _ill_conditioned(32, 128)
    standard = newton_schulz(G, steps=steps, coefficients=coefficients, dtype="fp64")
    gram = newton_schulz(G, steps=steps, coefficients=coefficients, dtype="fp64", method="gram")
    assert _rel(gram, standard) < 1e-10


@pytest.mark.parametrize("shape", [(48, 192), (192, 48), (4, 32, 128), (40, 100)])
@pytest.mark.parametrize("coefficients", ["jordan", "polar_express"])
def test_gram_within_1e5_of_standard_in_fp32(shape, coefficients):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    standard = newton_schulz(G, coefficients=coefficients, dtype="fp32")
    gram = newton_schulz(G, coefficients=coefficients, dtype="fp32", method="gram")
    assert _rel(gram, standard) < 1e-5


@pytest.mark.parametrize("coefficients", ["jordan", "polar_express"])
def test_gram_in_fp32_drifts_no_more_than_standard_on_ill_conditioned_input(coefficients):
    """Rounding in the carried X Xᵀ is what the restart bounds: against the fp64 iteration
    the Gram form's fp32 error stays within 3× the standard form's (both ≈ 1e-5)."""
    G = _ill_conditioned(64, 256, seed=1)
    exact = newton_schulz(G, coefficients=coefficients, dtype="fp64")
    standard = newton_schulz(G.float(), coefficients=coefficients, dtype="fp32")
    gram = newton_schulz(G.float(), coefficients=coefficients, dtype="fp32", method="gram")
    assert _rel(gram, exact) < max(3 * _rel(standard, exact), 1e-5)
    assert _rel(gram, exact) < 2e-4


def _frobenius(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("coefficients", ["jordan", "polar_express"])
def test_gram_in_bf16_within_its_documented_tolerance(coefficients):
    """bf16 (README): within 0.12 of the fp64 iteration in Frobenius norm on a Gaussian
    matrix (the standard form in bf16: within 0.03), with the same orthogonality: the
    singular values' largest distance from 1 within 0.02 of the fp64 iteration's."""
    G = torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(4))  # small: bf16 CPU
    exact = newton_schulz(G.double(), coefficients=coefficients, dtype="fp64")
    standard = newton_schulz(G, coefficients=coefficients, dtype="bf16")
    gram = newton_schulz(G, coefficients=coefficients, dtype="bf16", method="gram")
    assert _frobenius(standard, exact) < 0.03
    assert _frobenius(gram, exact) < 0.12
    spread = [float((torch.linalg.svdvals(x.double()) - 1).abs().max()) for x in (gram, exact)]
    assert abs(spread[0] - spread[1]) < 0.02


def test_the_gram_restart_is_what_keeps_bf16_on_ill_conditioned_input():
    """Without the restart after step 2 a rounding-negative eigenvalue of the carried
    X Xᵀ grows by h(λ)² per step (polar_express: ×67 at the first); with it, the bf16
    Gram form stays as close to the fp64 iteration as the standard bf16 form."""
    import sys

    ns = sys.modules["k3_optim.newton_schulz"]  # the module (the package exports the function)
    G = _ill_conditioned(64, 256, seed=2).float()
    exact = newton_schulz(G.double(), coefficients="polar_express", dtype="fp64")
    standard = _rel(newton_schulz(G, coefficients="polar_express", dtype="bf16"), exact)
    gram = _rel(newton_schulz(G, coefficients="polar_express", dtype="bf16", method="gram"), exact)
    assert ns.gram_restarts(5) == frozenset({2})
    assert gram < 2 * standard
    original = ns.gram_restarts
    try:  # the same iteration with its first segment four steps long (restart after step 4)
        ns.gram_restarts = lambda steps: frozenset({4})  # type: ignore[assignment]
        late = _rel(newton_schulz(G, coefficients="polar_express", dtype="bf16",
                                  method="gram"), exact)
    finally:
        ns.gram_restarts = original
    assert late > 4 * gram


def test_auto_takes_gram_from_the_aspect_ratio_threshold():
    from k3_optim import GRAM_MIN_ASPECT, resolve_ns_method

    wide = int(16 * GRAM_MIN_ASPECT)
    assert resolve_ns_method("auto", 16, wide) == "gram"
    assert resolve_ns_method("auto", wide, 16) == "gram"  # tall: the same matrix transposed
    assert resolve_ns_method("auto", 16, wide - 1) == "standard"
    assert resolve_ns_method("auto", 32, 32) == "standard"
    assert resolve_ns_method("standard", 16, 1024) == "standard"
    assert resolve_ns_method("gram", 32, 32) == "gram"
    G = torch.randn(16, wide)
    assert torch.equal(newton_schulz(G, method="auto"), newton_schulz(G, method="gram"))
    H = torch.randn(16, wide - 1)
    assert torch.equal(newton_schulz(H, method="auto"), newton_schulz(H, method="standard"))
    with pytest.raises(ValueError, match="Newton–Schulz method"):
        newton_schulz(G, method="fast")


def test_gram_restarts_after_step_two_then_every_third():
    from k3_optim.newton_schulz import gram_restarts

    assert gram_restarts(2) == frozenset()
    assert gram_restarts(5) == frozenset({2})
    assert gram_restarts(8) == frozenset({2, 5})
