"""The hub format without transformers: round trips, the names and shapes of both forms,
sharding, atomic writes, and one clear refusal for each kind of bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3_model import K3Config, K3Model, preset
from k3_model.hub import (
    HubFormatError,
    from_hub_config,
    hub_form,
    load_pretrained,
    load_weights,
    pretrained_config,
    save_pretrained,
    to_hub_config,
)
from k3_model.hub.config import meaning
from k3_model.hub.names import hub_shapes


def _model(name: str = "tiny", seed: int = 0, **overrides) -> K3Model:
    torch.manual_seed(seed)
    model = K3Model(preset(name, kda_backend="torch", **overrides))
    with torch.no_grad():  # a trained balancer has a non-zero bias; A_log is random already
        for layer in model.moe_layers().values():
            layer.balancer.bias.normal_(0.0, 0.05)
            layer.balancer.updates.fill_(7)
        for module in model.modules():
            if hasattr(module, "query") and isinstance(module.query, torch.nn.Parameter):
                module.query.normal_(0.0, 0.1)  # AttnRes pseudo-queries, zero at init
    return model


def _tokens(t: int = 40, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (2, t), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name", ["tiny", "kimi-linear-tiny"])
def test_export_then_import_is_bitwise_and_computes_the_same(tmp_path, name):
    model = _model(name).eval()
    save_pretrained(model, tmp_path / "out", eos_token_id=255)
    loaded = load_pretrained(tmp_path / "out", kda_chunk_size=model.config.kda_chunk_size,
                             kda_backend="torch")
    assert loaded.config == model.config
    ours, theirs = model.state_dict(), loaded.state_dict()
    for key, value in ours.items():
        if key.endswith(("balancer.load", "balancer.updates")):
            assert not theirs[key].any(), key  # training telemetry is not a weight
        else:
            assert torch.equal(value, theirs[key]), key
    x = _tokens()
    with torch.no_grad():
        assert torch.equal(model(x)[0], loaded(x)[0])
    assert not loaded.training


def test_kimi_linear_shaped_model_is_written_with_kimi_linear_names_and_config(tmp_path):
    model = _model("kimi-linear-tiny")
    save_pretrained(model, tmp_path / "out", bos_token_id=255, eos_token_id=255)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "kimi_linear"
    assert config["architectures"] == ["KimiLinearForCausalLM"]
    assert config["linear_attn_config"] == {"num_heads": 4, "head_dim": 32,
                                            "short_conv_kernel_size": 4,
                                            "kda_layers": [1, 2, 3], "full_attn_layers": [4]}
    assert (config["first_k_dense_replace"], config["num_experts"],
            config["num_experts_per_token"], config["eos_token_id"]) == (1, 8, 2, 255)
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    shapes = {name: list(t.shape) for name, t in tensors.items()}
    assert shapes["model.layers.0.self_attn.A_log"] == [1, 1, 4, 1]
    assert shapes["model.layers.0.self_attn.q_conv1d.weight"] == [128, 1, 4]
    assert shapes["model.layers.0.self_attn.g_a_proj.weight"] == [32, 128]
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == [384, 128]
    assert shapes["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"] == [64 + 16, 128]
    assert shapes["model.layers.1.block_sparse_moe.experts.7.w2.weight"] == [128, 128]
    assert "model.layers.1.block_sparse_moe.gate.e_score_correction_bias" in tensors
    # expert e's w1/w2/w3 are rows of our gate/down/up stacks
    experts = model.layers[1].mlp.experts
    assert torch.equal(tensors["model.layers.1.block_sparse_moe.experts.5.w1.weight"],
                       experts.w_gate[5])
    assert torch.equal(tensors["model.layers.1.block_sparse_moe.experts.5.w2.weight"],
                       experts.w_down[5])
    assert not any("balancer" in name or "load" in name for name in tensors)
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 255


def test_k3_featured_model_is_written_with_kimi_k3_names_and_fields(tmp_path):
    model = _model("tiny")
    assert hub_form(model.config) == "kimi_k3"
    save_pretrained(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "kimi_k3"
    text = config["text_config"]
    assert text["model_type"] == "kimi_linear"
    assert (text["attn_res_block_size"], text["hidden_act"], text["mla_use_output_gate"],
            text["routed_expert_hidden_size"]) == (2, "situ", True, 64)
    assert text["linear_attn_config"]["gate_lower_bound"] == -5.0
    assert text["linear_attn_config"]["use_full_rank_gate"] is True
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    top = "language_model.model."
    for name in ("layers.1.self_attention_res_proj.weight", "layers.0.mlp_res_norm.weight",
                 "output_attn_res_proj.weight", "layers.1.block_sparse_moe."
                 "routed_expert_down_proj.weight", "layers.1.block_sparse_moe.routed_expert_norm"
                 ".weight", "layers.0.self_attn.g_proj.weight", "layers.3.self_attn.g_proj"
                 ".weight"):
        assert top + name in tensors, name
    assert "language_model.lm_head.weight" in tensors
    assert list(tensors[top + "output_attn_res_proj.weight"].shape) == [1, 128]
    # A_log zero-padded to head_dim, as the published K3 checkpoint stores it
    a_log = tensors[top + "layers.0.self_attn.A_log"]
    assert list(a_log.shape) == [32] and not a_log[4:].any()
    assert torch.equal(a_log[:4], model.layers[0].attn.A_log.detach())
    # layer 0's never-used attention read ships as the identity, as published
    assert not tensors[top + "layers.0.self_attention_res_proj.weight"].any()


def test_published_kimi_linear_48b_shape_on_the_meta_device():
    config = preset("kimi-linear-48b-a3b")
    with torch.device("meta"):
        model = K3Model(config)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(49.12, abs=0.01)
    hub = to_hub_config(config, bos_token_id=163584, eos_token_id=163586)
    assert hub["linear_attn_config"]["full_attn_layers"] == [4, 8, 12, 16, 20, 24, 27]
    assert (hub["hidden_size"], hub["num_experts"], hub["moe_intermediate_size"],
            hub["routed_scaling_factor"], hub["vocab_size"]) == (2304, 256, 1024, 2.446,
                                                                  163840)
    shapes = hub_shapes(config)
    assert shapes["model.layers.0.self_attn.A_log"] == (1, 1, 32, 1)
    assert shapes["model.layers.0.self_attn.q_conv1d.weight"] == (4096, 1, 4)
    assert shapes["model.layers.3.self_attn.q_proj.weight"] == (32 * 192, 2304)
    assert shapes["model.layers.26.block_sparse_moe.experts.255.w2.weight"] == (2304, 1024)
    assert from_hub_config(hub) == config.replace(loss_chunk_size=0)


def test_large_models_are_sharded_with_an_index(tmp_path):
    model = _model("tiny")
    save_pretrained(model, tmp_path / "out", max_shard_bytes=400_000, dtype=torch.bfloat16)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 3 and "model.safetensors.index.json" in files
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    for shard in shards:
        assert (tmp_path / "out" / shard).stat().st_size <= 400_000 + 20_000
    loaded = load_pretrained(tmp_path / "out")
    assert loaded.embed.weight.dtype == torch.bfloat16
    assert loaded.layers[0].attn.A_log.dtype == torch.bfloat16  # the model's dtype
    stored = load_file(tmp_path / "out" / index["weight_map"][
        "language_model.model.layers.0.self_attn.A_log"])
    assert stored["language_model.model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert torch.equal(loaded.embed.weight, model.embed.weight.to(torch.bfloat16))


def test_a_failed_write_leaves_no_folder_and_an_existing_one_is_not_replaced(tmp_path):
    model = _model("tiny")
    with pytest.raises(ValueError, match="extra_files"):
        save_pretrained(model, tmp_path / "out", extra_files={"config.json": "{}"})
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its staging copy
    save_pretrained(model, tmp_path / "out")
    before = (tmp_path / "out" / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="out"):
        save_pretrained(_model("tiny", seed=1), tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == before
    save_pretrained(_model("tiny", seed=1), tmp_path / "out", overwrite=True)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.fixture
def exported(tmp_path) -> Path:
    save_pretrained(_model("kimi-linear-tiny"), tmp_path / "out")
    return tmp_path / "out"


def _edit_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_a_missing_tensor_is_named(exported):
    _edit_tensors(exported, lambda t: t.pop("model.layers.2.self_attn.b_proj.weight"))
    with pytest.raises(HubFormatError, match=r"1 missing \(model\.layers\.2\.self_attn\."
                                              r"b_proj\.weight\)"):
        load_pretrained(exported)


def test_an_unexpected_tensor_is_named(exported):
    _edit_tensors(exported, lambda t: t.update({"model.layers.1.extra.weight": torch.ones(2)}))
    with pytest.raises(HubFormatError, match=r"unexpected \(model\.layers\.1\.extra\.weight\)"):
        load_pretrained(exported)


def test_a_mis_shaped_tensor_is_named_with_both_shapes(exported):
    name = "model.layers.3.self_attn.kv_b_proj.weight"
    _edit_tensors(exported, lambda t: t.update({name: t[name][:-1].clone()}))
    with pytest.raises(HubFormatError, match=rf"{name} has shape \[255, 64\], its "
                                             r"config\.json needs \[256, 64\]"):
        load_pretrained(exported)


def test_a_truncated_shard_is_refused_naming_the_file(exported):
    path = exported / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(HubFormatError, match=r"model\.safetensors is not a complete "
                                             r"safetensors file"):
        load_pretrained(exported)


def test_a_corrupt_header_is_refused_naming_the_file(exported):
    path = exported / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"#" * 12
    path.write_bytes(bytes(data))
    with pytest.raises(HubFormatError, match=r"model\.safetensors is not a complete"):
        load_pretrained(exported)


def test_non_zero_a_log_padding_is_refused(tmp_path):
    save_pretrained(_model("tiny"), tmp_path / "out")
    name = "language_model.model.layers.1.self_attn.A_log"

    def pad(tensors):
        tensors[name][-1] = 1.0

    _edit_tensors(tmp_path / "out", pad)
    with pytest.raises(HubFormatError, match="must be zero padding"):
        load_pretrained(tmp_path / "out")


@pytest.mark.parametrize(("change", "field"), [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"moe_renormalize": False}, "moe_renormalize"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"num_expert_group": 4, "topk_group": 2}, "topk_group"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"linear_attn_config": {"num_heads": 4, "head_dim": 32, "short_conv_kernel_size": 4,
                             "kda_layers": [1, 3, 4], "full_attn_layers": [2]}},
     "full_attn_layers"),
    ({"model_type": "llama"}, "model_type"),
])
def test_a_config_value_k3config_cannot_represent_is_named(exported, change, field):
    path = exported / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(HubFormatError, match=field):
        load_pretrained(exported)


@pytest.mark.parametrize(("overrides", "field"), [
    ({"attention": "gqa", "n_kv_heads": 2}, "attention='gqa'"),
    ({"mla_rope": True}, "mla_rope"),
    ({"mla_norm_eps": 1e-6}, "mla_norm_eps"),
    ({"mlp": "dense"}, "mlp='dense'"),
])
def test_a_model_the_hub_format_cannot_carry_is_refused_by_field(tmp_path, overrides, field):
    with pytest.raises(HubFormatError, match=field):
        save_pretrained(K3Model(preset("tiny", **overrides)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_overrides_may_set_compute_fields_but_not_contradict_the_shape(exported):
    config = pretrained_config(exported, kda_chunk_size=16, moe_balance=False)
    assert (config.kda_chunk_size, config.moe_balance, config.n_layers) == (16, False, 4)
    assert pretrained_config(exported, n_layers=4).n_layers == 4  # agreeing is fine
    with pytest.raises(HubFormatError, match=r"n_layers=8 \(it has 4\) contradicts"):
        pretrained_config(exported, n_layers=8)


def test_load_weights_refuses_a_model_of_another_shape_before_changing_it(exported):
    model = K3Model(preset("kimi-linear-tiny", d_ff=256))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HubFormatError, match="d_ff 384"):
        load_weights(model, exported)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_loading_leaves_the_global_rng_alone(exported):
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    load_pretrained(exported)
    assert torch.equal(torch.rand(3), expected)


def test_not_a_folder_is_refused(tmp_path):
    with pytest.raises(HubFormatError, match="not a folder"):
        load_pretrained(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(HubFormatError, match=r"config\.json not found"):
        load_pretrained(tmp_path / "empty")


def test_kimi_linear_decay_and_low_rank_gate_follow_the_published_formulas():
    torch.manual_seed(0)
    model = K3Model(preset("kimi-linear-tiny"))
    kda = model.layers[0].attn
    x = torch.randn(2, 5, 128)
    f = kda.f_b(kda.f_a(x)) + kda.dt_bias
    expected = -kda.A_log.exp().view(4, 1) * torch.nn.functional.softplus(f.view(2, 5, 4, 32))
    assert torch.allclose(kda.decay(x), expected)
    assert kda.decay_bound is None and not hasattr(kda, "g_proj")
    assert torch.equal(kda.output_gate(x), kda.g_b(kda.g_a(x)))
    # fla's dt init: softplus(dt_bias) in [1e-3, 0.1]
    dt = torch.nn.functional.softplus(kda.dt_bias)
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001
    k3 = K3Model(preset("tiny")).layers[0].attn
    assert k3.decay_bound == -5.0 and not k3.dt_bias.any()


def test_later_fields_are_left_out_of_the_plain_data_at_their_defaults():
    """A checkpoint saved before the hub fields existed still compares equal."""
    old = K3Config(attention="hybrid").to_dict()
    assert not {"kda_decay", "kda_gate_lower_bound", "kda_output_gate_rank",
                "mla_norm_eps"} & set(old)
    changed = K3Config(attention="hybrid", kda_decay="softplus", mla_norm_eps=1e-6).to_dict()
    assert (changed["kda_decay"], changed["mla_norm_eps"]) == ("softplus", 1e-6)
    assert K3Config.from_dict(changed).kda_decay == "softplus"
    assert math.isclose(K3Config.from_dict(old).kda_gate_lower_bound, -5.0)


@pytest.mark.parametrize("addition", [
    {"attn_res_block_size": 2}, {"mla_gate": True}, {"moe_latent_dim": 64},
    {"activation": "situ"}, {"kda_decay": "bounded"}, {"kda_output_gate_rank": 0},
])
def test_each_k3_addition_alone_makes_a_kimi_k3_model_that_round_trips(tmp_path, addition):
    """Kimi Linear plus exactly one of K3's additions is written as kimi_k3 (Kimi Linear's
    form cannot carry it) and reads back bitwise, computing the same. (The K3 form's MLA
    latent norms use norm_eps, so mla_norm_eps goes back to that default.)"""
    model = _model("kimi-linear-tiny", mla_norm_eps=None, **addition).eval()
    assert hub_form(model.config) == "kimi_k3"
    save_pretrained(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "kimi_k3"
    loaded = load_pretrained(tmp_path / "out", kda_chunk_size=model.config.kda_chunk_size,
                             kda_backend="torch")
    assert meaning(loaded.config) == meaning(model.config)  # the same model, field by field
    theirs = loaded.state_dict()
    for key, value in model.state_dict().items():
        if not key.endswith(("balancer.load", "balancer.updates")):
            assert torch.equal(value, theirs[key]), key
    x = _tokens()
    with torch.no_grad():
        assert torch.equal(model(x)[0], loaded(x)[0])


def test_an_mla_only_model_with_k3s_kda_defaults_is_kimi_linear_and_round_trips(tmp_path):
    """Without KDA layers the KDA fields build nothing: they neither block the write nor
    the reload into the same model."""
    model = _model("kimi-linear-tiny", attention="mla", mla_rope=False, kda_decay="bounded",
                   kda_output_gate_rank=0).eval()
    assert hub_form(model.config) == "kimi_linear"
    save_pretrained(model, tmp_path / "out")
    load_weights(model, tmp_path / "out")
    same = _model("kimi-linear-tiny", attention="mla", mla_rope=False, seed=1).eval()
    load_weights(same, tmp_path / "out")
    loaded = load_pretrained(tmp_path / "out", kda_backend="torch")
    x = _tokens()
    with torch.no_grad():
        assert torch.equal(model(x)[0], loaded(x)[0])
        assert torch.equal(model(x)[0], same(x)[0])
