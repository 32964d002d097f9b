from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch
from torch import nn

from k3_optim import MuonAdamW, build_parameter_groups, check_parameter_groups


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        hd = d // heads
        self.norm = nn.RMSNorm(d)
        self.q_proj = nn.Linear(d, heads * hd, bias=True)
        self.k_proj = nn.Linear(d, kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(heads * hd, d, bias=False)
        self.experts = nn.Parameter(torch.randn(4, 2 * d, d))  # MoE expert stack
        self.gate_scale = nn.Parameter(torch.ones(()))


class TinyLM(nn.Module):
    def __init__(self, vocab=40, d=16, tied=True, head_name="lm_head") -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, 4, 2) for _ in range(2)])
        self.final_norm = nn.LayerNorm(d)
        setattr(self, head_name, nn.Linear(d, vocab, bias=False))
        if tied:
            getattr(self, head_name).weight = self.embed.weight


def _by_name(groups):
    out = {}
    for g in groups:
        for n in g["param_names"]:
            out[n] = g
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_default_split(tied):
    model = TinyLM(tied=tied)
    groups = build_parameter_groups(model, lr=0.02, weight_decay=0.1)
    where = _by_name(groups)
    assert set(where) == {n for n, _ in model.named_parameters()}
    for name in ["blocks.0.q_proj.weight", "blocks.1.o_proj.weight", "blocks.0.experts"]:
        assert where[name]["use_muon"], name
    assert not where["embed.weight"]["use_muon"]
    if not tied:
        assert not where["lm_head.weight"]["use_muon"]
        assert where["lm_head.weight"]["weight_decay"] == 0.1
    for name in ["blocks.0.q_proj.bias", "blocks.0.norm.weight", "final_norm.bias",
                 "blocks.1.gate_scale"]:
        assert not where[name]["use_muon"] and where[name]["weight_decay"] == 0.0, name
    assert all(g["lr"] == 0.02 for g in groups)
    assert [g["use_muon"] for g in groups] == sorted((g["use_muon"] for g in groups), reverse=True)
    MuonAdamW(groups)  # the groups are accepted as they are


def test_untied_head_found_by_shape_when_name_is_unknown():
    model = TinyLM(tied=False, head_name="readout")
    assert not _by_name(build_parameter_groups(model))["readout.weight"]["use_muon"]


def test_overrides_patterns_predicate_and_per_head():
    model = TinyLM(tied=False)
    groups = build_parameter_groups(
        model,
        adamw_patterns=["blocks.1.*"],
        muon_patterns=["lm_head.weight"],
        predicate=lambda name, p: False if name == "blocks.0.o_proj.weight" else None,
        per_head={"*.q_proj.weight": 4, "*.k_proj.weight": 2},
        muon_options={"ns_dtype": "fp64"},
        adamw_options={"betas": (0.8, 0.9)},
    )
    where = _by_name(groups)
    assert not where["blocks.1.q_proj.weight"]["use_muon"]
    assert where["lm_head.weight"]["use_muon"]
    assert not where["blocks.0.o_proj.weight"]["use_muon"]
    assert where["blocks.0.q_proj.weight"]["num_heads"] == 4
    assert where["blocks.0.k_proj.weight"]["num_heads"] == 2
    assert where["blocks.0.experts"]["num_heads"] is None
    assert all(g["ns_dtype"] == "fp64" for g in groups if g["use_muon"])
    assert all(g["betas"] == (0.8, 0.9) for g in groups if not g["use_muon"])
    MuonAdamW(groups)


def test_conv_kernels_flatten_and_frozen_params_are_left_out():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8, 4))
    model[2].weight.requires_grad_(False)
    where = _by_name(build_parameter_groups(model))
    assert where["0.weight"]["use_muon"] and where["0.weight"]["flatten"]
    assert "2.weight" not in where


def test_muon_override_on_a_vector_raises():
    with pytest.raises(ValueError, match=r"final_norm\.weight"):
        build_parameter_groups(TinyLM(), muon_patterns=["final_norm.weight"])


def test_group_param_names_survive_in_the_optimizer_state_dict():
    model = TinyLM()
    opt = MuonAdamW(build_parameter_groups(model))
    saved = opt.state_dict()["param_groups"]
    assert [n for g in saved for n in g["param_names"]] == [
        n for g in opt.param_groups for n in g["param_names"]
    ]


def test_a_hidden_linear_shaped_like_the_embedding_table_stays_with_muon():
    # d_ff == vocab: the up-projection is (vocab, d) like the table, but it is not last.
    model = TinyLM(vocab=32, d=16, tied=False)
    model.blocks[0].up = nn.Linear(16, 32, bias=False)
    where = _by_name(build_parameter_groups(model))
    assert where["blocks.0.up.weight"]["use_muon"]
    assert not where["lm_head.weight"]["use_muon"]


def test_the_guess_is_logged_group_by_group(caplog):
    with caplog.at_level(logging.INFO, logger="k3_optim.param_groups"):
        groups = build_parameter_groups(TinyLM(tied=False))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(groups)
    for group, line in zip(groups, lines):
        assert group["name"] in line
        assert all(name in line for name in group["param_names"])


def test_check_parameter_groups_finds_missing_duplicated_and_foreign_parameters():
    model = TinyLM(tied=False)
    groups = build_parameter_groups(model)
    check_parameter_groups(model, groups)  # complete: no error
    short = [dict(g) for g in groups]
    short[0] = {**short[0], "params": short[0]["params"][1:],
                "param_names": short[0]["param_names"][1:]}
    with pytest.raises(ValueError, match=groups[0]["param_names"][0].replace(".", r"\.")):
        check_parameter_groups(model, short)
    twice = [*groups, {**groups[0], "name": "again"}]
    with pytest.raises(ValueError, match="also in"):
        check_parameter_groups(model, twice)
    stranger = [*groups, {"use_muon": False, "params": [nn.Parameter(torch.ones(2))]}]
    with pytest.raises(ValueError, match="not a trainable parameter"):
        check_parameter_groups(model, stranger)
    with pytest.raises(ValueError, match="use_muon"):
        check_parameter_groups(model, [{"params": list(model.parameters())}])


def test_check_parameter_groups_refuses_param_names_that_name_other_parameters():
    model = TinyLM(tied=False)
    groups = build_parameter_groups(model)
    index = next(i for i, g in enumerate(groups) if len(g["params"]) >= 2)
    names = groups[index]["param_names"]
    swapped = [dict(g) for g in groups]  # same params, same count, two names swapped
    swapped[index] = {**swapped[index], "param_names": [names[1], names[0], *names[2:]]}
    with pytest.raises(ValueError, match=re.escape(
            f"param_names[0] is '{names[1]}', but that parameter is the model's '{names[0]}'")):
        check_parameter_groups(model, swapped)
    other = next(n for g in groups if g is not groups[index] for n in g["param_names"])
    renamed = [dict(g) for g in groups]  # a name of another group's parameter
    renamed[index] = {**renamed[index], "param_names": [*names[:-1], other]}
    with pytest.raises(ValueError, match=re.escape(
            f"is '{other}', but that parameter is the model's '{names[-1]}'")):
        check_parameter_groups(model, renamed)
    shorter = [dict(g) for g in groups]  # a count mismatch is still refused
    shorter[index] = {**shorter[index], "param_names": names[1:]}
    with pytest.raises(ValueError, match="param_names"):
        check_parameter_groups(model, shorter)


class _PlainMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.hidden = nn.Linear(32, 32)
        self.mix = nn.Parameter(torch.zeros(32, 32))
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.hidden(self.inp(x)) @ self.mix)


def test_doubtful_guesses_are_one_visible_warning_and_declared_routes_are_silent():
    """An MLP's input and output layers and a bare matrix go to Muon by shape alone: the
    guesses most likely wrong, so they are named (a hidden layer is not)."""
    with pytest.warns(UserWarning) as caught:
        build_parameter_groups(_PlainMLP())
    assert len(caught) == 1
    text = str(caught[0].message)
    assert ("mix (no rule recognised it), inp.weight (the model's first layer), out.weight "
            "(the model's last layer)") in text
    assert "hidden.weight" not in text
    assert "adamw_patterns=/muon_patterns= (or predicate=)" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_parameter_groups(_PlainMLP(), adamw_patterns=["inp.*", "out.*"],
                               muon_patterns=["mix"])
        build_parameter_groups(_PlainMLP(), predicate=lambda name, p: p.ndim >= 2
                               and name.startswith(("hidden", "mix")))
