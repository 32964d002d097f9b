from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from k3_model import (
    PRESETS,
    K3Model,
    KimiDeltaAttention,
    MoE,
    ResidualRead,
    Router,
    count_parameters,
)
from k3_model.attention import MLAttention

KINDS = ("mha", "gqa", "mla", "mla_qlora", "hybrid", "k3")


def test_initial_loss_of_the_tiny_preset_is_about_ln_vocab():
    torch.manual_seed(0)
    model = K3Model(PRESETS["tiny"])
    x = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(2))
    logits, loss = model(x, y)
    assert logits.shape == (4, 64, 256)
    assert loss is not None and abs(loss.item() - math.log(256)) < 0.1 * math.log(256)


@pytest.mark.parametrize("kind", KINDS)
def test_loss_is_mean_token_cross_entropy_and_absent_without_targets(kind, make_model, make_tokens):
    model = make_model(kind).eval()
    x, y = make_tokens(seed=1), make_tokens(seed=2)
    logits, loss = model(x, y)
    assert loss is not None
    expected = F.cross_entropy(logits.reshape(-1, 64), y.reshape(-1))
    torch.testing.assert_close(loss, expected)
    logits2, none = model(x)
    assert none is None
    torch.testing.assert_close(logits2, logits)


@pytest.mark.parametrize("kind", KINDS)
def test_forward_is_causal_and_keeps_no_state_between_calls(kind, make_model, make_tokens):
    model = make_model(kind).eval()
    x = make_tokens(t=16)
    full, _ = model(x)
    changed = x.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 64  # only the future changes
    torch.testing.assert_close(model(changed)[0][:, :10], full[:, :10], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(x[:, :7])[0], full[:, :7], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(model(changed)[0][:, 10:], full[:, 10:])


def test_sequence_longer_than_max_seq_len_is_refused(make_model, make_tokens):
    with pytest.raises(ValueError, match="max_seq_len"):
        make_model()(make_tokens(t=33))


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_backward_reaches_every_parameter(kind, make_model, make_tokens):
    model = make_model(kind).train()
    with torch.no_grad():  # zero pseudo-queries leave their read norms without a gradient
        for module in model.modules():
            if isinstance(module, ResidualRead):
                module.query.normal_()
    _, loss = model(make_tokens(seed=1), make_tokens(seed=2))
    assert loss is not None
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name  # every weight influences the loss


def test_bf16_autocast_keeps_fp32_params_and_an_fp32_router(make_model, make_tokens):
    model = make_model("mla").train()
    seen: dict[str, torch.dtype] = {}
    for name, module in model.named_modules():
        if isinstance(module, Router | MoE):
            module.register_forward_hook(
                lambda m, inp, out, name=name: seen.__setitem__(name, out.dtype)
            )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(make_tokens(seed=1), make_tokens(seed=2))
    assert loss is not None
    assert logits.dtype == torch.bfloat16  # autocast is really on
    assert loss.dtype == torch.float32
    assert seen["layers.1.mlp.router"] == torch.float32
    assert seen["layers.1.mlp"] == torch.bfloat16  # while the experts ran in bf16
    loss.backward()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name
    assert model.layers[1].mlp.balancer.bias.dtype == torch.float32


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_a_few_adamw_steps_on_a_fixed_batch_drive_the_loss_down(kind, make_model, make_tokens):
    model = make_model(kind).train()
    x, y = make_tokens(b=4, t=24, seed=1), make_tokens(b=4, t=24, seed=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        _, loss = model(x, y)
        assert loss is not None
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < 0.75 * losses[0], losses


def test_tied_embeddings_share_one_tensor(make_model):
    model = make_model(tie_embeddings=True)
    assert model.lm_head.weight is model.embed.weight
    total = sum(p.numel() for p in model.parameters())
    assert total == count_parameters(model.config).total


def test_state_dict_holds_weights_and_balancer_buffers_but_not_rope_tables(make_model):
    model = make_model()
    keys = set(model.state_dict())
    for suffix in ("bias", "load", "updates"):
        assert f"layers.1.mlp.balancer.{suffix}" in keys
    assert not any("rotary" in k for k in keys)
    assert not any(k.startswith("layers.0.mlp.balancer") for k in keys)  # layer 0 is dense


def test_moe_layers_and_muon_heads_describe_the_model(make_model):
    model = make_model("gqa", n_layers=3)
    assert list(model.moe_layers()) == ["layers.1.mlp", "layers.2.mlp"]
    assert [layer.attn.muon_heads() for layer in model.layers] == [
        {"q_proj.weight": 4, "k_proj.weight": 2, "v_proj.weight": 2}] * 3
    mla = make_model("mla_qlora")
    assert [layer.attn.muon_heads() for layer in mla.layers] == [
        {"q_up.weight": 4, "kv_up.weight": 4}] * 2
    hybrid = make_model("hybrid", kda_heads=2)  # KDA and MLA head counts differ
    assert [layer.attn.muon_heads() for layer in hybrid.layers] == [
        {"q_proj.weight": 2, "k_proj.weight": 2, "v_proj.weight": 2},
        {"q_proj.weight": 4, "kv_up.weight": 4},
    ]
    for m in (mla, hybrid):
        for layer in m.layers:
            weights = dict(layer.attn.named_parameters())
            for name, heads in layer.attn.muon_heads().items():
                assert weights[name].shape[0] % heads == 0, name


def test_hybrid_layout_puts_gated_nope_mla_every_fourth_and_last_layer(make_model):
    model = make_model("hybrid", n_layers=6)
    kinds = ["kda", "kda", "kda", "mla", "kda", "mla"]
    assert model.config.layer_types() == kinds
    for layer, kind in zip(model.layers, kinds):
        cls = KimiDeltaAttention if kind == "kda" else MLAttention
        assert isinstance(layer.attn, cls)
    mla = model.layers[3].attn
    assert mla.gated and not mla.rope  # K3: gated, NoPE
    assert model.rotary is None  # nothing rotates: no tables at all
    assert isinstance(model.layers[0].mlp, MoE) is False  # layer 0 dense
    assert all(isinstance(layer.mlp, MoE) for layer in model.layers[1:])
    plain = make_model("mla", n_layers=2).layers[0].attn
    assert not plain.gated and plain.rope and plain.g_proj is None  # comparison mode


def test_gated_mla_output_is_o_proj_of_heads_times_sigmoid_gate(make_model):
    model = make_model("hybrid", n_layers=1, mlp="dense").eval()
    attn = model.layers[0].attn
    assert isinstance(attn, MLAttention) and attn.g_proj is not None
    seen: list[torch.Tensor] = []
    attn.o_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    x = torch.randn(2, 10, 48)
    gated = attn(x)
    gate, attn.g_proj = attn.g_proj, None  # the same module without its gate
    attn(x)
    torch.testing.assert_close(seen[0], seen[1] * torch.sigmoid(gate(x)))
    torch.testing.assert_close(gated, attn.o_proj(seen[0]))


def test_reset_parameters_keeps_the_designed_inits(make_model):
    model = make_model("k3", n_layers=3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.reset_parameters()
    reads = [m for m in model.modules() if isinstance(m, ResidualRead)]
    assert len(reads) == 2 * 3  # two per layer, none before layer 0's attention, one final
    assert all(torch.equal(r.query, torch.zeros(48)) for r in reads)
    kdas = [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]
    assert len(kdas) == 2
    for kda in kdas:
        assert torch.equal(kda.dt_bias, torch.zeros_like(kda.dt_bias))
        assert ((kda.A_log.exp() >= 1 - 1e-6) & (kda.A_log.exp() <= 16 + 1e-5)).all()
        assert kda.A_log.std() > 0  # drawn, not filled
        assert torch.equal(kda.o_norm.weight, torch.ones_like(kda.o_norm.weight))
        # depthwise conv: torch's fan-in init (fan-in 4), far wider than N(0, 0.02)
        assert kda.q_conv.weight.abs().max() > 0.1
    assert 0.015 < model.layers[1].mlp.router.weight.std() < 0.025


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_every_rmsnorm_of_a_preset_uses_k3s_eps(name):
    """K3's RMSNorms (blocks, MLA latents, KDA output, LatentMoE, residual reads, final)
    use eps 1e-5 (DESIGN §7); a stray default of 1e-6 anywhere fails here."""
    from k3_model import preset
    from k3_model.norm import RMSNorm

    config = preset(name, n_layers=4, vocab_size=256) if name == "small" else preset(name)
    norms = [m for m in K3Model(config).modules() if isinstance(m, RMSNorm)]
    assert len(norms) > 10
    assert {m.eps for m in norms} == {1e-5}


def test_attention_residuals_start_as_the_mean_of_their_sources(make_model, make_tokens):
    """Zero pseudo-queries: every read is the plain mean of its sources (DESIGN §7)."""
    model = make_model("k3", n_layers=3, mlp="dense", attn_res_block_size=2).eval()
    x = make_tokens()
    emb = model.embed(x)
    mix = [layer.mix for layer in model.layers]
    feed = [layer.feed for layer in model.layers]
    # Layer 0 commits the embedding; layer 2 commits block 1 (layers 0-1).
    p = mix[0](emb, None)
    p = p + feed[0]((emb + p) / 2)
    p = p + mix[1]((emb + p) / 2, None)
    p = p + feed[1]((emb + p) / 2)
    block1, p = p, mix[2]((emb + p) / 2, None)
    p = p + feed[2]((emb + block1 + p) / 3)
    expected = model.lm_head(model.norm((emb + block1 + p) / 3))
    torch.testing.assert_close(model(x)[0], expected, rtol=1e-5, atol=1e-5)


def test_a_residual_read_is_a_softmax_over_normalized_sources():
    torch.manual_seed(0)
    read = ResidualRead(8, eps=1e-6)
    with torch.no_grad():
        read.query.normal_()
        read.norm.weight.uniform_(0.5, 1.5)
    sources = [torch.randn(2, 3, 8) * s for s in (1.0, 3.0, 0.2)]
    scores = torch.stack([(read.norm(s) * read.query).sum(-1) for s in sources])
    weights = scores.softmax(0)
    expected = sum(w.unsqueeze(-1) * s for w, s in zip(weights, sources))
    torch.testing.assert_close(read(sources), expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = read([s.bfloat16() for s in sources])
    assert mixed.dtype == torch.bfloat16


def test_the_hybrid_model_trains(make_model):
    """Loss falls over a few dozen AdamW steps on a repeating sequence (k3-model alone;
    tests/test_model_param_groups.py trains it with MuonAdamW and its own groups)."""
    torch.manual_seed(0)
    model = make_model("k3", n_layers=3).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    x = torch.arange(33).remainder(7).repeat(4, 1)  # 0..6 repeating: predictable
    losses = []
    for _ in range(30):
        _, loss = model(x[:, :-1], x[:, 1:])
        assert loss is not None
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < 0.3 * losses[0], losses


def test_bf16_autocast_runs_the_k3_model_with_fp32_params_router_and_situ(make_model,
                                                                           make_tokens):
    model = make_model("k3").train()
    layer = model.layers[1].mlp
    assert isinstance(layer, MoE)
    seen: dict[str, torch.dtype] = {}
    layer.experts.register_forward_hook(lambda m, i, out: seen.__setitem__("experts", out.dtype))
    layer.router.register_forward_hook(lambda m, i, out: seen.__setitem__("router", out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer.experts.grouped_mm_applies(torch.zeros(1, 32))  # the bf16 grouped GEMM
        logits, loss = model(make_tokens(seed=1), make_tokens(seed=2))
    assert loss is not None and logits.dtype == torch.bfloat16
    assert seen == {"experts": torch.bfloat16, "router": torch.float32}
    loss.backward()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
