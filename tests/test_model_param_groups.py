"""K3Model declares its optimizer groups; the trainer uses them; guessing is for others."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from k3_checkpoint import optimizer_layout
from k3_model import K3Model, ResidualRead, preset
from k3_optim import MuonAdamW, build_parameter_groups, check_parameter_groups
from k3_trainer import TrainConfig, build_optimizer

# Small K3-shaped models whose shapes collide with the embedding table (vocab × d_model):
# the cases a name/shape guess gets wrong.
COLLISIONS = [
    {},  # tiny as it is
    {"vocab_size": 384},  # dense d_ff == vocab: w_gate/w_up are (vocab, d_model)
    {"vocab_size": 128},  # d_model == vocab: every square d × d matrix
    {"vocab_size": 128, "tie_embeddings": True},
    {"moe_latent_dim": 0, "vocab_size": 128},  # experts at full width, (E, F, d) with F == vocab
    {"attention": "mla", "vocab_size": 128},
    {"attention": "gqa", "n_kv_heads": 2, "vocab_size": 384},
    {"q_lora_rank": 32, "kda_heads": 2},
]


def _small(**overrides) -> K3Model:
    torch.manual_seed(0)
    return K3Model(preset("tiny", n_layers=4, **overrides))


def _where(groups) -> dict[str, dict]:
    return {name: g for g in groups for name in g["param_names"]}


def _expected_heads(model: K3Model) -> dict[str, int]:
    heads = {}
    for i, layer in enumerate(model.layers):
        for rel, n in layer.attn.muon_heads().items():
            heads[f"layers.{i}.attn.{rel}"] = n
    return heads


@pytest.mark.parametrize("overrides", COLLISIONS)
def test_every_parameter_is_routed_by_its_role(overrides):
    model = _small(**overrides)
    groups = model.parameter_groups(lr=0.02, weight_decay=0.1)
    check_parameter_groups(model, groups)
    where = _where(groups)
    params = dict(model.named_parameters())
    assert set(where) == set(params)
    heads = _expected_heads(model)
    for name, p in params.items():
        g = where[name]
        if name in ("embed.weight", "lm_head.weight") or name.endswith("_conv.weight"):
            assert g["name"] == "adamw" and g["weight_decay"] == 0.1, name
        elif p.ndim == 1:  # norms, A_log, dt_bias, pseudo-queries
            assert g["name"] == "adamw_no_decay" and g["weight_decay"] == 0.0, name
        else:  # every hidden matrix: Muon, per head where declared, stacks as a batch
            assert g["use_muon"] and not g["flatten"], name
            assert g["num_heads"] == heads.get(name), name
    assert all(g["lr"] == 0.02 for g in groups)
    assert [g["use_muon"] for g in groups] == sorted((g["use_muon"] for g in groups), reverse=True)
    if model.config.attention == "hybrid":
        for name in ("layers.0.attn.A_log", "layers.0.attn.dt_bias", "layers.1.mlp_res.query"):
            assert where[name]["name"] == "adamw_no_decay"
    assert where["layers.1.mlp.experts.w_gate"]["use_muon"]
    assert model.config.tie_embeddings == ("lm_head.weight" not in where)
    MuonAdamW(groups)


@pytest.mark.parametrize("overrides", COLLISIONS)
def test_the_name_and_shape_guess_no_longer_sends_look_alike_matrices_to_adamw(overrides):
    model = _small(**overrides)
    declared = {n: g["use_muon"] for n, g in _where(model.parameter_groups()).items()}
    guessed = {n: g["use_muon"]
               for n, g in _where(build_parameter_groups(model)).items()}
    # The guess sends the 3-D convolutions to Muon (it cannot know they are depthwise);
    # every other parameter, the look-alikes included, lands where the model says.
    differs = sorted(n for n in declared if declared[n] != guessed[n])
    assert all(n.endswith("_conv.weight") for n in differs), differs


def test_the_trainer_uses_the_model_declaration_and_checks_it(monkeypatch):
    model = _small()
    optimizer = build_optimizer(model, TrainConfig())
    declared = model.parameter_groups()
    assert [g["param_names"] for g in optimizer.param_groups] == [
        g["param_names"] for g in declared
    ]
    assert [g["num_heads"] for g in optimizer.param_groups if g["use_muon"]] == [
        g["num_heads"] for g in declared if g["use_muon"]
    ]

    def leaves_one_out(lr=None, weight_decay=None):
        groups = K3Model.parameter_groups(model, lr=lr, weight_decay=weight_decay)
        groups[-1]["params"].pop()
        groups[-1]["param_names"].pop()
        return groups

    monkeypatch.setattr(model, "parameter_groups", leaves_one_out)
    with pytest.raises(ValueError, match="leave out"):
        build_optimizer(model, TrainConfig())


def test_a_foreign_model_is_guessed_and_the_guess_is_logged(caplog):
    class Foreign(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            self.hidden = nn.Linear(16, 16)
            self.up = nn.Linear(16, 32, bias=False)  # shaped like the table, not last
            self.down = nn.Linear(32, 16, bias=False)
            self.readout = nn.Linear(16, 32, bias=False)  # the last one: the head

        def forward(self, x, targets=None):  # the model contract's one required piece
            h = self.hidden(self.embed(x))
            logits = self.readout(h + self.down(self.up(h)))
            loss = None if targets is None else nn.functional.cross_entropy(
                logits.flatten(0, -2), targets.flatten())
            return logits, loss

    with caplog.at_level(logging.INFO):
        optimizer = build_optimizer(Foreign(), TrainConfig())
    text = caplog.text
    assert "declares no parameter_groups" in text
    assert "guessed" in text and "readout.weight" in text and "hidden.bias" in text
    where = _where(optimizer.param_groups)
    assert where["up.weight"]["use_muon"] and where["hidden.weight"]["use_muon"]
    assert not where["readout.weight"]["use_muon"] and not where["embed.weight"]["use_muon"]


def test_checkpoint_layout_and_a_muon_step_cover_every_new_parameter():
    model = _small()
    with torch.no_grad():  # non-zero pseudo-queries, so the read norms get gradients too
        for module in model.modules():
            if isinstance(module, ResidualRead):
                module.query.normal_()
    optimizer = MuonAdamW(model.parameter_groups(lr=1e-2, weight_decay=0.0))
    layout = optimizer_layout(optimizer, model)
    assert sorted(e["name"] for e in layout) == sorted(n for n, _ in model.named_parameters())
    shapes = {e["name"]: e["shape"] for e in layout}
    assert shapes["layers.0.attn.q_conv.weight"] == [128, 1, 4]
    assert shapes["layers.0.attn.A_log"] == [4]
    assert shapes["layers.2.mlp.experts.w_down"] == [8, 64, 128]
    x = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, loss = model(x[:, :-1], x[:, 1:])
    assert loss is not None
    loss.backward()
    optimizer.step()
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name]), f"{name} was not updated"


def test_the_hybrid_model_trains_with_muon_adamw_and_its_own_groups():
    """Loss falls over a few dozen MuonAdamW steps on a repeating sequence, with the
    model's declared groups (per-head Muon, expert stacks, AdamW for the rest)."""
    torch.manual_seed(0)
    model = K3Model(preset("tiny", n_layers=3, d_model=64, n_heads=2, kv_lora_rank=16,
                           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                           d_ff=128, moe_d_ff=64, moe_latent_dim=32)).train()
    optimizer = MuonAdamW(model.parameter_groups(lr=2e-2, weight_decay=0.0))
    x = torch.arange(33).remainder(7).repeat(4, 1)  # 0..6 repeating: predictable
    losses = []
    for _ in range(30):
        _, loss = model(x[:, :-1], x[:, 1:])
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < 0.3 * losses[0], losses
