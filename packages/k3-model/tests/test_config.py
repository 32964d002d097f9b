from __future__ import annotations

import json

import pytest

from k3_model import PRESETS, K3Config, count_parameters, preset


def test_defaults_and_presets_are_valid_and_round_trip_through_plain_data():
    for config in (K3Config(), *PRESETS.values()):
        data = config.to_dict()
        assert json.loads(json.dumps(data)) == data  # plain data only
        assert K3Config.from_dict(json.loads(json.dumps(data))) == config


def test_from_dict_rejects_unknown_keys_by_name_and_defaults_missing_ones():
    data = K3Config().to_dict()
    data["n_expertz"] = 4
    with pytest.raises(ValueError, match="n_expertz"):
        K3Config.from_dict(data)
    assert K3Config.from_dict({"d_model": 64}) == K3Config(d_model=64)


def test_float_fields_accept_ints_and_store_floats():
    config = K3Config(rope_theta=500000)
    assert isinstance(config.rope_theta, float)
    assert K3Config.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"d_model": -1}, "d_model"),
        ({"n_layers": True}, "n_layers"),  # a bool is not an int here
        ({"n_heads": 4.0}, "n_heads"),
        ({"attention": "linear"}, "attention"),
        ({"mlp": "sparse"}, "mlp"),
        ({"n_heads": 4, "n_kv_heads": 3}, "n_kv_heads"),
        ({"d_model": 100, "n_heads": 3}, "head_dim"),
        ({"head_dim": 7}, "head_dim"),
        ({"attention": "mla", "n_kv_heads": 2}, "n_kv_heads"),
        ({"attention": "mla", "qk_rope_head_dim": 5}, "qk_rope_head_dim"),
        ({"attention": "mla", "kv_lora_rank": 0}, "kv_lora_rank"),
        ({"attention": "mla", "q_lora_rank": -1}, "q_lora_rank"),
        ({"mlp": "moe", "moe_top_k": 8, "n_experts": 8}, "moe_top_k"),
        ({"mlp": "moe", "n_experts": 0}, "n_experts"),
        ({"mlp": "moe", "n_dense_layers": 4, "n_layers": 4}, "n_dense_layers"),
        ({"mlp": "moe", "n_shared_experts": -1}, "n_shared_experts"),
        ({"mlp": "moe", "moe_balance_rate": 0.0}, "moe_balance_rate"),
        ({"mlp": "moe", "moe_balance_rate": 1.5}, "moe_balance_rate"),
        ({"mlp": "moe", "moe_balance": "yes"}, "moe_balance"),
        ({"mlp": "moe", "routed_scaling": 0.0}, "routed_scaling"),
        ({"mlp": "dense", "d_ff": 0}, "d_ff"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"init_std": -0.1}, "init_std"),
        ({"tie_embeddings": 1}, "tie_embeddings"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"K3Config\.{field}\b"):
        K3Config(**changes)


def test_irrelevant_fields_are_not_checked():
    # MoE settings do not matter for a dense model, nor MLA dims for GQA.
    K3Config(mlp="dense", moe_top_k=99, n_experts=1)
    K3Config(attention="gqa", qk_rope_head_dim=3)


def test_preset_overrides_are_validated_and_unknown_names_rejected():
    assert preset("tiny", attention="gqa", n_kv_heads=2).kv_heads == 2
    assert preset("tiny") is PRESETS["tiny"]
    with pytest.raises(ValueError, match="huge"):
        preset("huge")
    with pytest.raises(ValueError, match=r"n_layer\b"):
        preset("tiny", n_layer=3)
    with pytest.raises(ValueError, match="n_kv_heads"):
        preset("tiny", n_kv_heads=2)  # tiny is MLA


def test_tiny_preset_exercises_every_mechanism_at_the_promised_size():
    tiny = PRESETS["tiny"]
    assert tiny.vocab_size == 256
    assert 1_000_000 <= count_parameters(tiny).total <= 3_000_000
    assert tiny.n_moe_layers >= 1 and tiny.moe_balance
    assert tiny.n_moe_layers < tiny.n_layers  # a dense layer too
    sizes = [count_parameters(PRESETS[n]).total for n in ("tiny", "small", "base")]
    assert sizes == sorted(sizes) and sizes[-1] > 1e9
