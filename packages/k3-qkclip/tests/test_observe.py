"""Exact per-head max-logit observation: values, masking, cost outside the context."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import k3_qkclip.observe as observe_module
from k3_qkclip import QKClip, QKClipPolicy, head_max_logits, observed_attention

KINDS = ("mha", "mha_fused", "gqa", "mla")


def reference_head_max(q, k, *, causal=True, scale=None):
    """Brute force in fp64, one head at a time."""
    _, h, t, e = q.shape
    s = k.shape[2]
    group = h // k.shape[1]
    scale = e**-0.5 if scale is None else scale
    out = []
    for head in range(h):
        scores = q[:, head].double() @ k[:, head // group].double().transpose(-1, -2) * scale
        if causal:
            scores = scores.masked_fill(torch.ones(t, s, dtype=torch.bool).triu(1), -math.inf)
        out.append(scores.max())
    return torch.stack(out).float()


def qk(h, hkv, t, s, e=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, h, t, e, generator=g), torch.randn(2, hkv, s, e, generator=g)


@pytest.mark.parametrize("causal", [True, False])
# T ≥ 64 exercises the causal row chunks (32 rows each here), T ≠ S the top-left mask.
@pytest.mark.parametrize(
    ("h", "hkv", "t", "s"),
    [
        (4, 4, 7, 7),
        (4, 2, 7, 7),
        (6, 1, 5, 5),
        (4, 2, 5, 9),
        (4, 2, 9, 5),
        (2, 1, 70, 70),
        (2, 1, 70, 40),
        (2, 1, 40, 70),
    ],
)
def test_head_max_matches_brute_force(h, hkv, t, s, causal):
    q, k = qk(h, hkv, t, s)
    got = head_max_logits(q, k, causal=causal)
    assert got.dtype == torch.float32 and got.shape == (h,)
    torch.testing.assert_close(got, reference_head_max(q, k, causal=causal), rtol=1e-6, atol=0)


def test_causal_mask_is_respected():
    q, k = qk(2, 2, 6, 6)
    q[:, :, 0] = 10.0  # query 0 aligned with key 5: a huge logit, but in the future
    k[:, :, 5] = 10.0
    got = head_max_logits(q, k, causal=True)
    unmasked = head_max_logits(q, k, causal=False)
    torch.testing.assert_close(got, reference_head_max(q, k), rtol=1e-6, atol=0)
    assert bool((unmasked > 2 * got).all())


def test_max_is_signed_when_every_logit_is_negative():
    q, k = qk(3, 3, 5, 5)
    q, k = q.abs() + 0.1, -(k.abs() + 0.1)
    got = head_max_logits(q, k)
    assert bool((got < 0).all())
    torch.testing.assert_close(got, reference_head_max(q, k), rtol=1e-6, atol=0)


def test_custom_scale_and_chunked_rows(monkeypatch):
    q, k = qk(4, 2, 11, 11)
    want = reference_head_max(q, k, scale=0.3)
    monkeypatch.setattr(observe_module, "_CHUNK_ELEMENTS", 1)  # one query row per chunk
    torch.testing.assert_close(head_max_logits(q, k, scale=0.3), want, rtol=1e-6, atol=0)


def _documents_mask(t, cuts):
    """(1, 1, T, T): query i sees key j when both lie between the same cuts."""
    doc = torch.zeros(t, dtype=torch.long)
    for cut in cuts:
        doc[cut:] += 1
    return (doc[:, None] == doc[None, :])[None, None].expand(2, 1, t, t)


@pytest.mark.parametrize("causal", [True, False])
def test_a_mask_keeps_the_maxima_to_the_pairs_it_allows(causal, monkeypatch):
    q, k = qk(4, 2, 70, 70)
    mask = _documents_mask(70, [5, 33, 34])
    q[:, :, 40] = 10.0  # a huge logit between query 40 and key 10: different documents
    k[:, :, 10] = 10.0
    allowed = mask & torch.ones(70, 70, dtype=torch.bool).tril() if causal else mask
    scores = torch.einsum("bhte,bhse->bhts", q.double(), k.repeat_interleave(2, 1).double())
    want = (scores * 8**-0.5).masked_fill(~allowed, -math.inf).amax(dim=(0, 2, 3)).float()
    torch.testing.assert_close(head_max_logits(q, k, causal=causal, mask=mask), want,
                               rtol=1e-6, atol=0)
    assert bool((head_max_logits(q, k, causal=causal) > 2 * want).all())
    monkeypatch.setattr(observe_module, "_CHUNK_ELEMENTS", 1)  # one query row per chunk
    torch.testing.assert_close(head_max_logits(q, k, causal=causal, mask=mask), want,
                               rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match=r"mask must be bool \(B, 1, T, S\)"):
        head_max_logits(q, k, mask=mask.float())


def test_observed_attention_with_a_mask_is_sdpa_with_that_mask_and_causal():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 12, 8, generator=g) for _ in range(3))
    mask = _documents_mask(12, [4, 9])
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    torch.testing.assert_close(observed_attention(q, k, v, mask=mask),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask & causal))


def test_head_max_rejects_bad_shapes_and_scale():
    q, k = qk(4, 3, 5, 5)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        head_max_logits(q, k)
    q, k = qk(4, 2, 5, 5)
    with pytest.raises(ValueError, match="scale"):
        head_max_logits(q, k, scale=0.0)


@pytest.mark.parametrize("hkv", [4, 2])
def test_observed_attention_output_and_grads_equal_plain_sdpa(hkv, make):
    model = make("mha" if hkv == 4 else "gqa")
    g = torch.Generator().manual_seed(3)
    q0, k0 = torch.randn(2, 4, 9, 8, generator=g), torch.randn(2, hkv, 9, 8, generator=g)
    v0 = torch.randn(2, hkv, 9, 8, generator=g)

    def run(observer):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = observed_attention(q, k, v, observer)
        out.square().sum().backward()
        return out, q.grad, k.grad, v.grad

    with QKClip(model) as clip:
        observed = run(model.qk_observer)
        assert bool(torch.isfinite(clip.max_logits()[""]).all())
    plain = run(None)
    ref = F.scaled_dot_product_attention(
        q0, k0.repeat_interleave(4 // hkv, 1), v0.repeat_interleave(4 // hkv, 1), is_causal=True
    )
    for a, b in zip(observed, plain):
        assert torch.equal(a, b)
    torch.testing.assert_close(observed[0], ref)


@pytest.mark.parametrize("kind", KINDS)
def test_module_observation_is_exact_and_fp32(kind, make, make_batch, observe_logits, monkeypatch):
    """The module's reported maxima equal a brute force over its own q and k (fp64)."""
    model, x = make(kind, dtype=torch.float64), make_batch(dtype=torch.float64)
    captured = {}

    def spy(q, k, v, observer=None, **kw):
        captured["q"], captured["k"] = q.detach(), k.detach()
        return observed_attention(q, k, v, observer, **kw)

    monkeypatch.setattr("k3_qkclip.reference.observed_attention", spy)
    got = observe_logits(model, x)[""]
    assert got.dtype == torch.float32
    want = reference_head_max(captured["q"], captured["k"])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_outside_the_context_nothing_is_computed_or_left_behind(make, make_batch, monkeypatch):
    model, x = make("gqa"), make_batch()
    with QKClip(model):
        assert model.qk_observer is not None
    assert "qk_observer" not in model.__dict__ and model.qk_observer is None

    def boom(*args, **kwargs):
        raise AssertionError("observation computed outside a QKClip context")

    monkeypatch.setattr(observe_module, "head_max_logits", boom)
    model(x)  # plain SDPA path
    with QKClip(model):
        model.eval()
        model(x)  # eval: not observed either
        model.train()
        with pytest.raises(AssertionError, match="outside a QKClip"):
            model(x)


def test_preexisting_instance_attribute_is_restored(make):
    model = make("mha")
    model.qk_observer = None
    with QKClip(model):
        pass
    assert "qk_observer" in model.__dict__ and model.qk_observer is None


def test_record_checks_shape_and_ignores_eval(make):
    model = make("mla")
    with QKClip(model) as clip:
        with pytest.raises(ValueError, match=r"of '':.*shape \(4,\)"):
            model.qk_observer.record(torch.zeros(3))
        model.eval()
        model.qk_observer.record(torch.ones(4))
        assert bool(torch.isneginf(clip.max_logits()[""]).all())


def test_max_logits_are_snapshots(make, make_batch):
    model = make("mha")
    with QKClip(model) as clip:
        model(make_batch(1))
        first = clip.max_logits()[""]
        kept = first.clone()
        model(make_batch(2))
        clip.reset()
        assert torch.equal(first, kept)


def test_autocast_bf16_observation_is_fp32_and_close(make, make_batch, observe_logits):
    model, x = make("gqa"), make_batch()
    want = observe_logits(model, x)[""]
    with QKClip(model, QKClipPolicy(enabled=False)) as clip, torch.autocast("cpu", torch.bfloat16):
        model(x)
        got = clip.max_logits()[""]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=3e-2, atol=0)


def test_no_host_sync_while_observing_and_applying(make, make_batch, monkeypatch):
    """Forwards and apply() after validate() never read a tensor back to the host."""
    model, x = make("mla"), make_batch()

    def sync(*args, **kwargs):
        raise AssertionError("host sync")

    with QKClip(model, QKClipPolicy(tau=1.0)) as clip:
        model(x)
        clip.validate()  # the one sync of an update, by design
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
                m.setattr(torch.Tensor, name, sync)
            model(x).sum().backward()
            with pytest.raises(AssertionError, match="host sync"):
                bool(clip.max_logits()[""].sum())  # the patch is live
            model.qk_observer.unvalidated = False  # as if validate() ran after this forward
            report = clip.apply()
        assert report.modules[""].heads_clipped > 0
