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
