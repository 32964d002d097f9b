"""Kimi Delta Attention: the chunked operator against the step-by-step reference, and the layer."""

from __future__ import annotations

import math

import pytest
import torch

import k3_model.delta_rule as delta_rule
import k3_model.kda as kda
from k3_model.kda import KimiDeltaAttention, chunk_kda, l2_normalize, recurrent_kda

F64 = torch.float64


def inputs(b: int = 2, t: int = 17, h: int = 2, dk: int = 8, dv: int = 6, *,
           dtype: torch.dtype = F64, seed: int = 0, state: bool = False,
           g: tuple[float, float] = (-5.0, 0.0)) -> dict[str, torch.Tensor]:
    """Operator inputs as the layer makes them: unit q/k, g in [lo, hi], β in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64)

    lo, hi = g
    out = dict(q=l2_normalize(rand(b, t, h, dk)), k=l2_normalize(rand(b, t, h, dk)),
               v=rand(b, t, h, dv),
               g=lo + (hi - lo) * torch.rand(b, t, h, dk, generator=gen, dtype=F64),
               beta=torch.rand(b, t, h, generator=gen, dtype=F64))
    if state:
        out["initial_state"] = rand(b, h, dk, dv)
    return {name: x.to(dtype) for name, x in out.items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("t", [1, 17, 50, 100])
@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("bound", [None, -5.0])  # safe diagonal / K3's fast one
def test_chunk_equals_recurrent_fp64(t, chunk, state, bound):
    x = inputs(t=t, state=state, seed=t)
    o_ref, s_ref = recurrent_kda(**x, output_final_state=True)
    o, s = chunk_kda(**x, output_final_state=True, chunk_size=chunk, gate_lower_bound=bound)
    assert o.dtype == s.dtype == F64 and o.shape == o_ref.shape
    assert rel(o, o_ref) <= 1e-10
    assert rel(s, s_ref) <= 1e-10


def test_final_state_only_when_asked_and_custom_scale():
    x = inputs(t=20)
    o, s = chunk_kda(**x, scale=0.3, chunk_size=16)
    assert s is None
    o_ref, _ = recurrent_kda(**x, scale=0.3)
    assert rel(o, o_ref) <= 1e-10
    assert rel(o, recurrent_kda(**x)[0]) > 1e-3  # the scale is honoured, not K**-0.5


def grads(fn, x: dict[str, torch.Tensor], **kw) -> dict[str, torch.Tensor]:
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    o, s = fn(**leaves, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(7)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=F64).to(o.dtype)).sum()
    loss = loss + (s * torch.randn(s.shape, generator=gen, dtype=F64).to(s.dtype)).sum()
    loss.backward()
    return {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("bound", [None, -5.0])
def test_chunk_gradients_equal_recurrent_fp64(bound):
    x = inputs(b=1, t=40, state=True)
    ref, got = grads(recurrent_kda, x), grads(chunk_kda, x, chunk_size=16, gate_lower_bound=bound)
    assert set(got) == {"q", "k", "v", "g", "beta", "initial_state"}
    for name in ref:
        assert rel(got[name], ref[name]) <= 1e-10, name


@pytest.mark.parametrize("bound", [None, -5.0])
def test_chunk_gradcheck(bound):
    x = inputs(b=1, t=18, h=1, dk=3, dv=2, state=True)  # two chunks of 16
    names = list(x)

    def fn(*args):
        o, s = chunk_kda(**dict(zip(names, args)), output_final_state=True, chunk_size=16,
                         gate_lower_bound=bound)
        return o, s

    assert torch.autograd.gradcheck(fn, [t.requires_grad_() for t in x.values()])


def test_solve_runs_in_fp32_under_bf16_autocast(monkeypatch):
    seen: list[torch.dtype] = []
    solve = torch.linalg.solve_triangular

    def spy(a, b, **kw):
        seen.extend([a.dtype, b.dtype])
        return solve(a, b, **kw)

    monkeypatch.setattr(torch.linalg, "solve_triangular", spy)
    x = inputs(b=1, t=20, h=1, dk=8, dv=8)
    x16 = {n: t.to(torch.bfloat16) for n, t in x.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, s = chunk_kda(**x16, output_final_state=True, chunk_size=16)
    assert seen and set(seen) == {torch.float32}
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    step, state = recurrent_kda(**x16, output_final_state=True)  # the decode step's kernel
    assert step.dtype == torch.bfloat16 and state.dtype == torch.float32
    o32, _ = chunk_kda(**{n: t.float() for n, t in x16.items()}, chunk_size=16)
    assert rel(o, o32) < 1e-2  # only the bf16 rounding of the output
    seen.clear()
    o64, _ = chunk_kda(**x, chunk_size=16)
    assert set(seen) == {F64} and o64.dtype == F64


@pytest.mark.parametrize("dtype,tol", [(F64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("bound", [None, -5.0])
def test_extreme_decay_stays_finite_and_exact(dtype, tol, bound):
    # g ≈ −5 at every step: e^{−G} over a 64-step chunk would be e^{320}, far past fp32.
    x = inputs(b=1, t=200, h=2, dk=16, dv=16, state=True, g=(-5.0, -4.999))
    o_ref, s_ref = recurrent_kda(**x, output_final_state=True)
    o, s = chunk_kda(**{n: t.to(dtype) for n, t in x.items()}, output_final_state=True,
                     gate_lower_bound=bound)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel(o, o_ref) <= tol and rel(s, s_ref) <= tol


@pytest.mark.parametrize("bound", [None, -5.0])
def test_fp32_gradients_finite_under_extreme_decay(bound):
    x = inputs(b=1, t=130, h=1, dk=16, dv=16, g=(-5.0, -4.999))
    ref = grads(recurrent_kda, {n: t.to(F64) for n, t in x.items()})
    got = grads(chunk_kda, {n: t.float() for n, t in x.items()}, gate_lower_bound=bound)
    for name in ref:
        assert torch.isfinite(got[name]).all(), name
        # g's gradient sums terms that cancel within a chunk: fp32 keeps ~4 digits of it.
        assert rel(got[name], ref[name]) <= (1e-3 if name == "g" else 1e-5), name


def hostile(case: str) -> dict[str, torch.Tensor]:
    """fp64 inputs (T = 75: not a whole number of chunks) with gates far below K3's −5."""
    x = inputs(b=2, t=75, h=2, dk=8, dv=6, state=True, seed=3)
    g = x["g"]
    if case == "zero":
        g = torch.zeros_like(g)
    elif case.startswith("const"):
        g = torch.full_like(g, float(case[5:]))
    elif case == "spike-80":  # one step that all but wipes the state, in ordinary gates
        g = g.clone()
        g[:, 37] = -80.0
    elif case == "unbounded":  # −exp(3·N(0, 1)): from ≈ −1e-4 to below −1e4
        gen = torch.Generator().manual_seed(5)
        g = -torch.exp(3 * torch.randn(g.shape, generator=gen, dtype=F64))
    return {**x, "g": g}


HOSTILE = ["const-5.95", "const-20", "spike-80", "unbounded", "zero"]


@pytest.mark.parametrize("case", HOSTILE)
@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_chunk_exact_for_any_gate(case, chunk, dtype):
    # const-5.95 is just past the old fp32 limit: e^{5.95·15} overflowed to inf, then NaN.
    x = hostile(case)
    o_ref, s_ref = recurrent_kda(**x, output_final_state=True)
    o, s = chunk_kda(**{n: t.to(dtype) for n, t in x.items()}, output_final_state=True,
                     chunk_size=chunk)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    # Unbounded gates make |G| ~ 1e4 within a chunk: fp32 keeps ~4 digits of G_t − G_j.
    tol = 1e-10 if dtype == F64 else (2e-3 if case == "unbounded" else 1e-5)
    assert rel(o, o_ref) <= tol and rel(s, s_ref) <= tol


@pytest.mark.parametrize("case", ["spike-80", "unbounded"])
def test_chunk_gradients_for_any_gate_equal_recurrent_fp64(case):
    x = hostile(case)
    ref, got = grads(recurrent_kda, x), grads(chunk_kda, x, chunk_size=32)
    for name in ref:
        assert torch.isfinite(got[name]).all(), name
        assert rel(got[name], ref[name]) <= 1e-10, name


@pytest.mark.parametrize("case", HOSTILE)
def test_fp32_gradients_finite_for_any_gate(case):
    x = hostile(case)
    ref = grads(recurrent_kda, x)
    got = grads(chunk_kda, {n: t.float() for n, t in x.items()}, chunk_size=32)
    for name in ref:
        assert torch.isfinite(got[name]).all(), name
        if name != "g":  # g's gradient is tiny under const-20 (≈ e⁻²⁰): fp32 noise dominates
            assert rel(got[name], ref[name]) <= (2e-3 if case == "unbounded" else 1e-5), name


@pytest.mark.parametrize("bound,dtype,fast", [
    (None, torch.float32, False), (None, F64, False),
    (-5.0, torch.float32, True), (0.0, torch.float32, True),
    (-40.0, torch.float32, False),  # e^{40·15} is past fp32 ...
    (-40.0, F64, True),  # ... but not fp64
    (-50.0, F64, False),  # e^{750} is past fp64 too
])
def test_gate_lower_bound_picks_the_diagonal(monkeypatch, bound, dtype, fast):
    calls = []
    pairwise = delta_rule._pairwise_diagonal
    monkeypatch.setattr(
        delta_rule, "_pairwise_diagonal", lambda *a: calls.append(1) or pairwise(*a)
    )
    lo = 0.0 if bound is None else bound
    x = inputs(b=1, t=40, h=2, state=True, g=(lo, 0.0), seed=4)
    o_ref, s_ref = recurrent_kda(**x, output_final_state=True)
    o, s = chunk_kda(**{n: t.to(dtype) for n, t in x.items()}, output_final_state=True,
                     chunk_size=32, gate_lower_bound=bound)
    assert bool(calls) is not fast
    tol = 1e-10 if dtype == F64 else 1e-5
    assert rel(o, o_ref) <= tol and rel(s, s_ref) <= tol


@pytest.mark.parametrize("bound", [1.0, 1e-9, -math.inf, math.nan, "-5", True,
                                   torch.tensor(-5.0)])
def test_bad_gate_lower_bound_raises(bound):
    with pytest.raises(ValueError, match="gate_lower_bound"):
        chunk_kda(**inputs(dtype=torch.float32), gate_lower_bound=bound)


@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
@pytest.mark.parametrize("change,match", [
    (dict(k=torch.zeros(2, 17, 2, 7)), "k and g"),
    (dict(g=torch.zeros(2, 17, 2)), "k and g"),
    (dict(q=torch.zeros(2, 17, 8)), "q must be"),
    (dict(v=torch.zeros(2, 16, 2, 6)), "v must be"),
    (dict(beta=torch.zeros(2, 17, 2, 1)), "beta must be"),
    (dict(initial_state=torch.zeros(2, 2, 6, 8)), "initial_state"),
])
def test_bad_operator_inputs_raise(fn, change, match):
    x = {**inputs(dtype=torch.float32), **change}
    with pytest.raises(ValueError, match=match):
        fn(**x)


@pytest.mark.parametrize("chunk", [0, 8, 48, 128])
def test_bad_chunk_size_raises(chunk):
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(**inputs(dtype=torch.float32), chunk_size=chunk)


# ---- the layer ----------------------------------------------------------------------


def layer(seed: int = 0, **kw) -> KimiDeltaAttention:
    torch.manual_seed(seed)
    args: dict = {"chunk_size": 16, "backend": "torch", **kw}
    return KimiDeltaAttention(16, 2, 8, **args)


def x_in(b: int = 2, t: int = 21, seed: int = 1) -> torch.Tensor:
    return torch.randn(b, t, 16, generator=torch.Generator().manual_seed(seed))


def test_layer_shape_parameters_and_init():
    m = layer()
    out = m(x_in())
    assert out.shape == (2, 21, 16) and torch.isfinite(out).all()
    names = {n for n, _ in m.named_parameters()}
    assert names == {f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "q_conv", "k_conv",
                                              "v_conv", "f_a", "f_b", "b_proj", "g_proj",
                                              "o_norm", "o_proj")} | {"A_log", "dt_bias"}
    assert m.q_conv.weight.shape == (16, 1, 4) and m.f_a.weight.shape == (8, 16)
    assert m.f_b.weight.shape == (16, 8) and m.b_proj.weight.shape == (2, 16)
    assert ((m.A_log.exp() >= 1) & (m.A_log.exp() <= 16)).all()
    assert (m.dt_bias == 0).all() and (m.o_norm.weight == 1).all()
    assert m.muon_heads() == {"q_proj.weight": 2, "k_proj.weight": 2, "v_proj.weight": 2}
    with torch.no_grad():
        m.A_log.zero_(), m.dt_bias.fill_(3.0), m.o_norm.weight.fill_(2.0)
    m.reset_parameters()
    assert (m.A_log.exp() >= 1).all() and (m.dt_bias == 0).all() and (m.o_norm.weight == 1).all()


def test_layer_decay_is_k3_lower_bounded():
    m = layer()
    with torch.no_grad():
        m.dt_bias.fill_(-50.0)  # pushes sigmoid(·) towards 0: g → 0⁻
        g_hi = m.decay(x_in())
        m.dt_bias.fill_(50.0)  # towards 1: g → −5⁺
        g_lo = m.decay(x_in())
    assert g_hi.dtype == torch.float32 and g_hi.shape == (2, 21, 2, 8)
    assert (g_hi <= 0).all() and g_hi.min() > -1e-3
    assert (g_lo >= -5).all() and g_lo.max() < -5 + 1e-3


def test_layer_batch_does_not_depend_on_previous_batch():
    m = layer().train()
    a, b = x_in(seed=1), x_in(seed=2)
    alone = layer()(b)
    m(a).sum().backward()  # a training step on batch A leaves no state behind
    assert torch.equal(m(b), alone)


def test_layer_is_causal():
    m = layer()
    x = x_in(t=40)
    y = x.clone()
    y[:, 25] += 1.0
    out_x, out_y = m(x), m(y)
    torch.testing.assert_close(out_x[:, :25], out_y[:, :25], rtol=0, atol=1e-6)
    assert not torch.allclose(out_x[:, 25:], out_y[:, 25:])


def test_layer_gradients_reach_every_parameter():
    m = layer()
    m(x_in()).square().mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_layer_under_bf16_autocast():
    m = layer()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x_in(b=1, t=9))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("kw,match", [
    (dict(n_heads=0), "n_heads"), (dict(head_dim=-1), "head_dim"),
    (dict(conv_size=0), "conv_size"), (dict(norm_eps=0.0), "norm_eps"),
    (dict(chunk_size=48), "chunk_size"), (dict(backend="cuda"), "backend"),
])
def test_layer_rejects_invalid_arguments(kw, match):
    args: dict = {"d_model": 16, "n_heads": 2, "head_dim": 8, **kw}
    with pytest.raises(ValueError, match=match):
        KimiDeltaAttention(**args)


def test_layer_tells_chunk_kda_its_gate_bound(monkeypatch):
    seen: list[dict] = []
    real = kda.chunk_kda

    def spy(*args, **kw):
        seen.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(kda, "chunk_kda", spy)
    layer()(x_in())
    assert seen and seen[0]["gate_lower_bound"] == kda.DECAY_LOWER_BOUND == -5.0


def test_layer_fla_call_says_gate_is_bounded(monkeypatch):
    # fla's safe_gate: its fast kernel for a precomputed g bounded below (it names −5).
    seen: list[dict] = []

    def fake_fla(q, k, v, g, beta, **kw):
        seen.append({"g": g, **kw})
        return torch.zeros_like(v), None

    monkeypatch.setattr(kda, "fla_chunk_kda_kernel", lambda: fake_fla)
    monkeypatch.setattr(KimiDeltaAttention, "_use_fla", lambda self, x: True)
    m = layer(backend="auto")
    out = m(x_in())
    assert out.shape == (2, 21, 16) and len(seen) == 1
    kw = seen[0]
    assert kw["safe_gate"] is True
    assert not kw.get("use_gate_in_kernel", False)  # g is precomputed: no in-kernel gate
    assert kw["use_qk_l2norm_in_kernel"] is False and kw["scale"] == 8**-0.5
    assert (kw["g"] >= kda.DECAY_LOWER_BOUND).all() and (kw["g"] <= 0).all()


def test_an_older_fla_without_safe_gate_is_not_given_it(monkeypatch):
    seen: list[dict] = []

    def old_fla(q, k, v, g, beta, scale=None, use_qk_l2norm_in_kernel=False):
        seen.append({"scale": scale})
        return torch.zeros_like(v), None

    monkeypatch.setattr(kda, "fla_chunk_kda_kernel", lambda: old_fla)
    monkeypatch.setattr(KimiDeltaAttention, "_use_fla", lambda self, x: True)
    assert layer(backend="auto")(x_in()).shape == (2, 21, 16) and len(seen) == 1


@pytest.mark.skipif(kda.fla_available(), reason="flash-linear-attention is installed")
def test_fla_backend_without_fla_says_how_to_get_it():
    with pytest.raises(ImportError, match="flash-linear-attention"):
        KimiDeltaAttention(16, 2, 8, backend="fla")
    assert not layer(backend="auto")._use_fla(x_in())


@pytest.mark.skipif(not (torch.cuda.is_available() and kda.fla_available()),
                    reason="needs CUDA and flash-linear-attention")
def test_fla_kernel_agrees_with_chunk_kda():
    x = {n: t.float().cuda() for n, t in inputs(b=2, t=300, h=4, dk=64, dv=64).items()}
    ours, _ = chunk_kda(**x)
    for safe_gate in (False, True):  # g ∈ [−5, 0]: fla's bounded-gate kernel applies
        fla_kda = kda.fla_chunk_kda_kernel()
        theirs, _ = fla_kda(**x, use_qk_l2norm_in_kernel=False, safe_gate=safe_gate)
        assert rel(theirs, ours) <= 2e-3, safe_gate
    torch.manual_seed(0)
    m = KimiDeltaAttention(128, 2, 64, backend="torch").cuda()
    xs = torch.randn(2, 130, 128, device="cuda")
    ref = m(xs)
    m.backend = "fla"
    assert rel(m(xs), ref) <= 2e-3
