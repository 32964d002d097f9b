"""The model takes part in QK-Clip through k3-qkclip's public API."""

from __future__ import annotations

import pytest
import torch

from k3_model import K3Model, apply_rotary
from k3_qkclip import QKClip, QKClipPolicy

KINDS = ("mha", "gqa", "mla", "mla_qlora")


def _observe(model: K3Model, x: torch.Tensor) -> torch.Tensor:
    with QKClip(model, QKClipPolicy(enabled=False)) as clip, torch.no_grad():
        model(x)
        return clip.max_logits()["layers.0.attn"].clone()


@pytest.mark.parametrize("kind", KINDS)
def test_after_apply_the_reobserved_max_is_min_of_s_and_tau(kind, make_model, make_tokens):
    model = make_model(kind, n_layers=1, mlp="dense").train()
    with torch.no_grad():  # larger logits, spread over heads
        for p in model.layers[0].attn.parameters():
            p.mul_(6.0)
    x = make_tokens(b=2, t=24)
    before = _observe(model, x)
    tau = before.median().item()
    assert (before > tau).any() and (before <= tau).any()
    untouched = {
        n: p.clone() for n, p in model.named_parameters()
        if not any(s in n for s in ("q_proj", "k_proj", "q_up", "kv_up"))
    }
    with QKClip(model, QKClipPolicy(tau=tau)) as clip:
        clip.reset()
        model(x)
        report = clip.apply()
    assert report.modules["layers.0.attn"].heads_clipped == (before > tau).sum().item()
    after = _observe(model, x)
    torch.testing.assert_close(after, before.clamp(max=tau), rtol=2e-5, atol=1e-6)
    for name, p in model.named_parameters():
        if name in untouched:
            assert torch.equal(p, untouched[name]), name


@pytest.mark.parametrize("kind", KINDS)
def test_observation_changes_nothing_and_eval_is_not_observed(kind, make_model, make_tokens):
    model = make_model(kind, moe_balance=False).train()  # same routing on every forward
    x = make_tokens()
    with torch.no_grad():
        plain, _ = model(x)
        with QKClip(model, QKClipPolicy()) as clip:
            observed, _ = model(x)
            maxima = clip.max_logits()
            assert list(maxima) == ["layers.0.attn", "layers.1.attn"]
            assert all(torch.isfinite(v).all() for v in maxima.values())
            clip.reset()
            model.eval()
            model(x)
            assert all(torch.isinf(v).all() for v in clip.max_logits().values())
    assert torch.equal(observed, plain)  # observing is a side computation


def test_observed_max_is_the_exact_logit_max(make_model, make_tokens):
    model = make_model("gqa", n_layers=1, mlp="dense").train()
    x = make_tokens(b=1, t=8)
    attn = model.layers[0].attn
    captured = {}

    def grab(module, args):
        captured["x"] = args[0]

    attn.register_forward_pre_hook(grab)
    observed = _observe(model, x)
    h = captured["x"]
    cos, sin = model.rotary(8)
    q = apply_rotary(attn.q_proj(h).view(1, 8, 4, 12).transpose(1, 2), cos, sin)
    k = apply_rotary(attn.k_proj(h).view(1, 8, 2, 12).transpose(1, 2), cos, sin)
    k = k.repeat_interleave(2, dim=1)
    logits = (q @ k.transpose(-1, -2)) / 12**0.5
    logits = logits.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), -torch.inf)
    torch.testing.assert_close(observed, logits.amax(dim=(0, 2, 3)), rtol=1e-5, atol=1e-6)


def test_geometry_is_declared_per_layer(make_model):
    model = make_model("mla_qlora", n_layers=3)
    with QKClip(model) as clip:
        geometry = clip.geometry()["modules"]
    assert list(geometry) == ["layers.0.attn", "layers.1.attn", "layers.2.attn"]
    layouts = geometry["layers.0.attn"]["layouts"]
    assert [x["target"] for x in layouts] == ["q_up", "kv_up", "kv_down"]
    # the shared rotary key sits after the 16-row latent in kv_down and is never scaled
    assert layouts[2]["blocks"] == [{"repeat": 1, "parts": [["other", 16], ["k_rope", 8]]}]
    gqa = make_model("gqa")
    with QKClip(gqa) as clip:
        spec = clip.geometry()["modules"]["layers.1.attn"]
    assert (spec["kind"], spec["n_heads"], spec["n_kv_heads"]) == ("gqa", 4, 2)


def test_on_the_hybrid_model_only_mla_layers_are_clipped_and_the_invariant_holds(
    make_model, make_tokens
):
    """KDA layers normalize q and k and take no part; the MLA layer's re-observed max
    logits are min(S, τ) behind two KDA layers (its input does not change); its shared
    NoPE key slice and every other weight are untouched."""
    model = make_model("k3", n_layers=3).train()
    assert model.config.layer_types() == ["kda", "kda", "mla"]
    for layer in model.moe_layers().values():  # fixed routing: the check is about attention
        layer.balancer.enabled = False
    attn = model.layers[2].attn
    with torch.no_grad():
        for p in attn.parameters():
            p.mul_(6.0)
    x = make_tokens(b=2, t=24)

    def observe() -> torch.Tensor:
        with QKClip(model, QKClipPolicy(enabled=False)) as clip, torch.no_grad():
            model(x)
            assert clip.module_names == ["layers.2.attn"]
            return clip.max_logits()["layers.2.attn"].clone()

    before = observe()
    tau = before.median().item()
    assert (before > tau).any() and (before <= tau).any()
    untouched = {
        n: p.clone() for n, p in model.named_parameters()
        if n not in ("layers.2.attn.q_proj.weight", "layers.2.attn.kv_up.weight")
    }
    with QKClip(model, QKClipPolicy(tau=tau)) as clip:
        clip.reset()
        model(x)
        report = clip.apply()
    assert report.modules["layers.2.attn"].heads_clipped == (before > tau).sum().item()
    torch.testing.assert_close(observe(), before.clamp(max=tau), rtol=2e-5, atol=1e-6)
    for name, p in model.named_parameters():
        if name in untouched:  # kv_down (latent and the shared key slice) among them
            assert torch.equal(p, untouched[name]), name
