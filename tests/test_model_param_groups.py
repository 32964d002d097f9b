"""k3-model's parameter names are classified correctly by k3_optim.build_parameter_groups."""

from __future__ import annotations

import pytest
import torch

from k3_model import K3Model, preset
from k3_optim import MuonAdamW, build_parameter_groups


def _groups_by_param(model: K3Model) -> dict[str, dict]:
    groups = build_parameter_groups(model, per_head=model.muon_per_head())
    return {name: g for g in groups for name in g["param_names"]}


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # tiny: MLA, full-rank query
        {"q_lora_rank": 32},  # MLA with a query LoRA
        {"attention": "gqa", "n_kv_heads": 2},
        {"attention": "gqa", "n_kv_heads": None, "tie_embeddings": True},
    ],
)
def test_every_parameter_lands_in_the_intended_group(overrides):
    torch.manual_seed(0)
    model = K3Model(preset("tiny", **overrides))
    config = model.config
    by_name = _groups_by_param(model)
    assert set(by_name) == {n for n, _ in model.named_parameters()}
    per_head = {}
    if config.attention == "gqa":
        per_head = {"q_proj": config.n_heads, "k_proj": config.kv_heads,
                    "v_proj": config.kv_heads}
    else:
        q = "q_up" if config.q_lora_rank else "q_proj"
        per_head = {q: config.n_heads, "kv_up": config.n_heads}
    for name, p in model.named_parameters():
        group = by_name[name]
        module = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
        if name in ("embed.weight", "lm_head.weight"):
            assert group["name"] == "adamw", name  # embedding and head: AdamW with decay
        elif p.ndim == 1:
            assert group["name"] == "adamw_no_decay", name  # RMSNorm weights
        elif module in per_head:
            assert group["use_muon"] and group["num_heads"] == per_head[module], name
        else:
            assert group["use_muon"] and group["num_heads"] is None, name
            assert not group["flatten"], name  # expert stacks are a batch, not flattened
    assert config.tie_embeddings == ("lm_head.weight" not in by_name)
    experts = [n for n in by_name if ".experts.w_" in n]
    assert experts and all(by_name[n]["use_muon"] for n in experts)
    assert all(dict(model.named_parameters())[n].ndim == 3 for n in experts)
    assert not any("balancer" in n for n in by_name)  # buffers, not parameters


def test_muon_adamw_takes_a_step_on_the_tiny_model():
    torch.manual_seed(0)
    model = K3Model(preset("tiny", n_layers=2))
    optimizer = MuonAdamW(build_parameter_groups(model, per_head=model.muon_per_head()), lr=1e-2)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, loss = model(x[:, :-1], x[:, 1:])
    assert loss is not None
    loss.backward()
    optimizer.step()
    for name, p in model.named_parameters():
        assert not torch.equal(p, before[name]), f"{name} was not updated"
