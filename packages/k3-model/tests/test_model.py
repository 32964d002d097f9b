from __future__ import annotations

import fnmatch
import math

import pytest
import torch
import torch.nn.functional as F

from k3_model import PRESETS, K3Model, MoE, Router, count_parameters

KINDS = ("mha", "gqa", "mla", "mla_qlora")


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


def test_moe_layers_and_muon_per_head_describe_the_model(make_model):
    model = make_model("gqa", n_layers=3)
    assert list(model.moe_layers()) == ["layers.1.mlp", "layers.2.mlp"]
    assert model.muon_per_head() == {
        "*.attn.q_proj.weight": 4, "*.attn.k_proj.weight": 2, "*.attn.v_proj.weight": 2,
    }
    mla = make_model("mla_qlora")
    assert mla.muon_per_head() == {"*.attn.q_up.weight": 4, "*.attn.kv_up.weight": 4}
    names = dict(mla.named_parameters())
    for pattern, heads in mla.muon_per_head().items():
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        assert len(matched) == 2
        assert all(names[n].shape[0] % heads == 0 for n in matched)
