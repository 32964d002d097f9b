from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys

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
        ({"attention": "hybrid", "full_attention_every": 0}, "full_attention_every"),
        ({"attention": "hybrid", "kda_heads": 0}, "kda_heads"),
        ({"attention": "hybrid", "kda_heads": 3}, "kda_head_dim"),  # 128 % 3
        ({"attention": "hybrid", "kda_head_dim": 0}, "kda_head_dim"),
        ({"attention": "hybrid", "kda_conv_size": 0}, "kda_conv_size"),
        ({"attention": "hybrid", "kda_chunk_size": 48}, "kda_chunk_size"),
        ({"attention": "hybrid", "kda_backend": "triton"}, "kda_backend"),
        ({"attention": "hybrid", "qk_rope_head_dim": 0}, "qk_rope_head_dim"),
        ({"attention": "hybrid", "mla_rope": True, "qk_rope_head_dim": 5}, "qk_rope_head_dim"),
        ({"mla_rope": "yes"}, "mla_rope"),
        ({"mla_gate": 1}, "mla_gate"),
        ({"attn_res_block_size": -1}, "attn_res_block_size"),
        ({"mlp": "moe", "moe_latent_dim": -1}, "moe_latent_dim"),
        ({"activation": "gelu"}, "activation"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"K3Config\.{field}\b"):
        K3Config(**changes)


def test_irrelevant_fields_are_not_checked():
    # MoE settings do not matter for a dense model, nor MLA dims for GQA, nor KDA for MLA.
    K3Config(mlp="dense", moe_top_k=99, n_experts=1)
    K3Config(attention="gqa", qk_rope_head_dim=3)
    K3Config(attention="mla", kda_chunk_size=48, full_attention_every=0)


@pytest.mark.parametrize(
    ("n_layers", "every", "kinds"),
    [
        (4, 4, "kkkm"),
        (6, 4, "kkkmkm"),  # the last layer is always MLA
        (8, 4, "kkkmkkkm"),
        (5, 2, "kmkmm"),
        (3, 1, "mmm"),
        (1, 4, "m"),
    ],
)
def test_layer_types_put_mla_every_nth_and_last(n_layers, every, kinds):
    config = K3Config(attention="hybrid", n_layers=n_layers, full_attention_every=every,
                      mlp="dense")
    assert "".join(t[0] for t in config.layer_types()) == kinds
    assert K3Config(attention="gqa", n_layers=3).layer_types() == ["gqa"] * 3
    assert K3Config(attention="mla", n_layers=2).layer_types() == ["mla"] * 2


def test_mla_rope_and_gate_default_to_k3_in_hybrid_and_to_plain_mla_otherwise():
    hybrid = K3Config(attention="hybrid")
    assert (hybrid.mla_uses_rope, hybrid.mla_gated, hybrid.uses_rope) == (False, True, False)
    mla = K3Config(attention="mla")
    assert (mla.mla_uses_rope, mla.mla_gated, mla.uses_rope) == (True, False, True)
    assert K3Config(attention="gqa").uses_rope
    # a K3 preset switched to all-MLA for comparison gets RoPE back, ungated
    compare = preset("tiny", attention="mla")
    assert compare.mla_uses_rope and not compare.mla_gated
    explicit = K3Config(attention="hybrid", mla_rope=True, mla_gate=False)
    assert explicit.mla_uses_rope and not explicit.mla_gated
    nope = K3Config(attention="hybrid", qk_rope_head_dim=3)  # NoPE: any width of shared slice
    assert nope.qk_dim == 32 + 3


def test_derived_kda_and_moe_widths():
    c = K3Config(attention="hybrid", d_model=96, n_heads=4, kda_heads=2, moe_latent_dim=48)
    assert (c.kda_n_heads, c.kda_dim, c.moe_width) == (2, 48, 48)
    assert K3Config(attention="hybrid", kda_head_dim=20).kda_dim == 20
    assert K3Config().moe_width == 128  # no latent: full width


def test_configs_saved_before_the_k3_fields_load_with_their_old_meaning():
    old = K3Config(attention="mla").to_dict()
    for name in ("full_attention_every", "mla_rope", "mla_gate", "kda_heads", "kda_head_dim",
                 "kda_conv_size", "kda_chunk_size", "kda_backend", "attn_res_block_size",
                 "activation", "moe_latent_dim"):
        del old[name]
    loaded = K3Config.from_dict(old)
    assert loaded.mla_uses_rope and not loaded.mla_gated
    assert (loaded.activation, loaded.moe_latent_dim, loaded.attn_res_block_size) == (
        "swiglu", 0, 0)


def test_preset_overrides_are_validated_and_unknown_names_rejected():
    assert preset("tiny", attention="gqa", n_kv_heads=2).kv_heads == 2
    assert preset("tiny") is PRESETS["tiny"]
    with pytest.raises(ValueError, match="huge"):
        preset("huge")
    with pytest.raises(ValueError, match=r"n_layer\b"):
        preset("tiny", n_layer=3)
    with pytest.raises(ValueError, match="n_kv_heads"):
        preset("tiny", n_kv_heads=2)  # tiny's softmax layers are MLA


def test_tiny_preset_exercises_every_mechanism_at_the_promised_size():
    tiny = PRESETS["tiny"]
    assert tiny.vocab_size == 256
    assert 1_000_000 <= count_parameters(tiny).total <= 3_000_000
    assert tiny.n_moe_layers >= 1 and tiny.moe_balance
    assert tiny.n_moe_layers < tiny.n_layers  # a dense layer too


@pytest.mark.parametrize("name", ["tiny", "small", "base"])
def test_presets_are_k3_shaped(name):
    c = PRESETS[name]
    kinds = c.layer_types()
    assert "kda" in kinds and kinds[-1] == "mla" and kinds.count("mla") < kinds.count("kda")
    assert c.mla_gated and not c.mla_uses_rope  # Gated MLA, NoPE
    assert c.attn_res_block_size > 0 and c.activation == "situ"
    assert c.moe_latent_dim > 0 and c.n_shared_experts >= 1 and c.n_dense_layers == 1
    sizes = [count_parameters(PRESETS[n]).total for n in ("tiny", "small", "base")]
    assert sizes == sorted(sizes) and sizes[-1] > 1e9


def test_config_and_presets_import_without_torch():
    """A command line lists the presets and the config's fields before it needs torch."""
    code = ("import sys\nfrom k3_model.config import K3Config\nfrom k3_model.presets import "
            "PRESETS\nimport k3_model\nassert k3_model.preset('tiny') is PRESETS['tiny']\n"
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.split() == ["False"], done.stderr


def test_every_field_is_documented_for_the_command_line():
    """Each field's docstring is its ``k3-train train --help`` line."""
    source = inspect.getsource(K3Config)
    for field in dataclasses.fields(K3Config):
        after = source.split(f"\n    {field.name}: ", 1)[1].split("\n", 2)[1].strip()
        assert after.startswith('"""') and len(after) > 6, field.name
