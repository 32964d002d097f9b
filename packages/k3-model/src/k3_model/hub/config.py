"""``config.json`` of the hub formats, to and from :class:`~k3_model.K3Config`.

Two forms share one family (``text_config.model_type == "kimi_linear"``):

- **Kimi Linear** (``model_type: kimi_linear``, ``KimiLinearForCausalLM``), what
  transformers, vLLM and SGLang load: KDA with the softplus decay and a low-rank output
  gate, NoPE MLA without an output gate and with 1e-6 latent norms, SwiGLU, a plain
  pre-norm residual, routed experts at full width.
- **Kimi K3** (``model_type: kimi_k3`` wrapping a ``text_config``): the same plus K3's
  additions, each named by its own field (``attn_res_block_size``, ``hidden_act: situ``,
  ``mla_use_output_gate``, ``linear_attn_config.gate_lower_bound`` and
  ``use_full_rank_gate``, ``routed_expert_hidden_size``).

A model without any K3 addition is written in the Kimi Linear form, any other in the K3
form. Reading accepts both, and also the field names transformers writes when it saves a
``kimi_linear`` model itself (``layer_types``, ``num_local_experts``, ...). What K3Config
cannot represent is refused by name (:class:`HubFormatError`), never approximated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ..config import K3Config

KIMI_LINEAR = "kimi_linear"
KIMI_K3 = "kimi_k3"
LATENT_NORM_EPS = 1e-6
"""Epsilon of MLA's ``q_a_layernorm``/``kv_a_layernorm`` in the Kimi Linear form: what
transformers' ``kimi_linear`` and Moonshot's modeling code use (vLLM uses
``rms_norm_eps``). The Kimi K3 form's is ``rms_norm_eps``, as SGLang's MLA computes it.
config.json has no field for it."""
SITU_BETAS = (4.0, 25.0)


class HubFormatError(ValueError):
    """A hub folder, or a model, that the hub format and K3Config cannot map onto each
    other; the message names the field, tensor or file and says why."""


def hub_form(config: K3Config) -> str:
    """``"kimi_linear"`` when the model uses none of K3's additions, else ``"kimi_k3"``."""
    kda_plain = config.attention != "hybrid" or (
        config.kda_decay == "softplus" and config.kda_output_gate_rank == config.kda_dim)
    plain = (kda_plain and config.attn_res_block_size == 0 and config.activation == "swiglu"
             and not config.mla_gated and config.moe_latent_dim == 0)
    return KIMI_LINEAR if plain else KIMI_K3


def _representable(config: K3Config) -> None:
    """Refuse, by field, what neither hub form can carry."""
    if config.attention == "gqa":
        raise HubFormatError("K3Config.attention='gqa' has no hub form (Kimi Linear and Kimi K3 "
                             "are KDA + MLA); export a 'hybrid' or 'mla' model")
    if config.mla_uses_rope:
        raise HubFormatError("K3Config.mla_rope: the hub form's MLA is NoPE (mla_use_nope); "
                             "a model whose MLA rotates its shared key slice cannot be written")
    linear = hub_form(config) == KIMI_LINEAR
    wanted = LATENT_NORM_EPS if linear else config.norm_eps
    if config.latent_norm_eps != wanted:
        raise HubFormatError(
            f"K3Config.mla_norm_eps: the {'Kimi Linear' if linear else 'Kimi K3'} form's MLA "
            f"latent norms use {'1e-6' if linear else 'rms_norm_eps (norm_eps)'}, this "
            f"model's {config.latent_norm_eps}; it cannot be written without changing its "
            "outputs")
    if config.mlp == "dense":
        raise HubFormatError("K3Config.mlp='dense': the hub form has routed experts past the "
                             "first_k_dense_replace layers; export a 'moe' model")


def to_hub_config(config: K3Config, *, bos_token_id: int | None = None,
                  eos_token_id: int | None = None,
                  pad_token_id: int | None = None) -> dict[str, Any]:
    """``config.json`` for ``config`` in its :func:`hub_form`."""
    _representable(config)
    form = hub_form(config)
    kinds = config.layer_types()
    linear: dict[str, Any] = {
        "num_heads": config.kda_n_heads, "head_dim": config.kda_dim,
        "short_conv_kernel_size": config.kda_conv_size,
        "kda_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "kda"],
        "full_attn_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "mla"],
    }
    text: dict[str, Any] = {
        "model_type": KIMI_LINEAR,
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_heads,
        "q_lora_rank": config.q_lora_rank or None,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "mla_use_nope": True,
        "linear_attn_config": linear,
        "num_experts": config.n_experts,
        "num_experts_per_token": config.moe_top_k,
        "num_shared_experts": config.n_shared_experts,
        "moe_intermediate_size": config.moe_d_ff,
        "routed_scaling_factor": config.routed_scaling,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "moe_layer_freq": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": config.n_dense_layers,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "model_max_length": config.max_seq_len,
        "num_nextn_predict_layers": 0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }
    if form == KIMI_LINEAR:
        if config.attention == "hybrid" and config.kda_output_gate_rank != config.kda_dim:
            raise HubFormatError(
                f"K3Config.kda_output_gate_rank: Kimi Linear's output gate has rank head_dim "
                f"({config.kda_dim}), this model's {config.kda_output_gate_rank}")
        return {**text, "dtype": "float32"}
    text["max_position_embeddings"] = text.pop("model_max_length")
    if config.kda_decay == "bounded":
        linear["gate_lower_bound"] = config.kda_gate_lower_bound
    linear["use_full_rank_gate"] = config.kda_output_gate_rank == 0
    if config.kda_output_gate_rank not in (0, config.kda_dim):
        raise HubFormatError(
            f"K3Config.kda_output_gate_rank: the hub form's output gate is full rank or of "
            f"rank head_dim ({config.kda_dim}), this model's {config.kda_output_gate_rank}")
    if config.activation == "situ":
        text["hidden_act"] = "situ"
        text["activation_situ_beta"], text["activation_situ_linear_beta"] = SITU_BETAS
    text["mla_use_output_gate"] = config.mla_gated
    if config.attn_res_block_size:
        text["attn_res_block_size"] = config.attn_res_block_size
    if config.moe_latent_dim:
        text["routed_expert_hidden_size"] = config.moe_latent_dim
        text["latent_moe_use_norm"] = True
    return {
        "model_type": KIMI_K3,
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "dtype": "float32",
    }


def text_config(data: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """``(form, the kimi_linear text config)`` of a ``config.json``."""
    if not isinstance(data, Mapping):
        raise HubFormatError("config.json must hold a JSON object")
    model_type = data.get("model_type")
    if model_type == KIMI_K3:
        text = data.get("text_config")
        if not isinstance(text, Mapping) or text.get("model_type") != KIMI_LINEAR:
            raise HubFormatError("config.json: a kimi_k3 config needs a text_config whose "
                                 "model_type is kimi_linear")
        return KIMI_K3, text
    if model_type != KIMI_LINEAR:
        raise HubFormatError(f"config.json: model_type {model_type!r} is not a Kimi Linear or "
                             "Kimi K3 model (kimi_linear, kimi_k3)")
    return KIMI_LINEAR, data


def _get(text: Mapping[str, Any], *names: str, default: Any = ...) -> Any:
    """The first of ``names`` present (the hub's name, then transformers' own)."""
    for name in names:
        if name in text:
            return text[name]
    if default is ...:
        raise HubFormatError(f"config.json lacks {names[0]}")
    return default


def _require(ok: bool, field: str, value: Any, why: str) -> None:
    if not ok:
        raise HubFormatError(f"config.json: {field}={value!r} cannot be represented: {why}")


def _layout(text: Mapping[str, Any], n_layers: int) -> tuple[str, int]:
    """``(attention, full_attention_every)`` from the layer lists, refused unless K3Config's
    rule (MLA every N-th and the last layer) reproduces them."""
    linear = text.get("linear_attn_config") or {}
    if "full_attn_layers" in linear and "kda_layers" in linear:
        mla = sorted(int(i) - 1 for i in linear["full_attn_layers"])
        kda = sorted(int(i) - 1 for i in linear["kda_layers"])
        _require(sorted(mla + kda) == list(range(n_layers)), "linear_attn_config", linear,
                 f"kda_layers and full_attn_layers must cover layers 1..{n_layers} once")
    elif isinstance(text.get("layer_types"), list):
        types = text["layer_types"]
        mla = [i for i, kind in enumerate(types) if kind == "full_attention"]
        _require(len(types) == n_layers and all(
            kind in ("full_attention", "linear_attention") for kind in types),
            "layer_types", types, "expected full_attention/linear_attention per layer")
    else:
        raise HubFormatError("config.json lacks linear_attn_config (kda_layers, "
                             "full_attn_layers) or layer_types")
    if len(mla) == n_layers:
        return "mla", 4
    every = mla[0] + 1 if mla else 0
    expected = [i for i in range(n_layers) if every and ((i + 1) % every == 0
                                                          or i == n_layers - 1)]
    _require(bool(mla) and mla == expected, "full_attn_layers", [i + 1 for i in mla],
             "K3Config places MLA at every N-th layer and the last one")
    return "hybrid", every


def _dense_layers(text: Mapping[str, Any], n_layers: int) -> int:
    kinds = text.get("mlp_layer_types")
    if isinstance(kinds, list):
        dense = [kind == "dense" for kind in kinds]
        first = dense.index(False) if False in dense else n_layers
        _require(len(kinds) == n_layers and not any(dense[first:]), "mlp_layer_types", kinds,
                 "dense layers must come first, the rest sparse")
        return first
    _require(int(_get(text, "moe_layer_freq", default=1)) == 1, "moe_layer_freq",
             text.get("moe_layer_freq"), "every layer past the dense ones must be MoE")
    return int(_get(text, "first_k_dense_replace", default=1))


def from_hub_config(data: Mapping[str, Any]) -> K3Config:
    """The :class:`K3Config` of a hub ``config.json`` (either form, or transformers' own
    field names); fields the hub does not carry (training-only ones) take K3Config's
    defaults."""
    form, text = text_config(data)
    _require("quantization_config" not in text and "quantization_config" not in data,
             "quantization_config", "…", "quantized weights are not supported; "
             "dequantize to bf16 or fp32 first")
    act = _get(text, "hidden_act", default="silu")
    _require(act in ("silu", "situ"), "hidden_act", act, "k3-model has silu (SwiGLU) and "
             "situ (SiTU-GLU)")
    if act == "situ":
        betas = (float(text.get("activation_situ_beta", 4.0)),
                 float(text.get("activation_situ_linear_beta", 25.0)))
        _require(betas == SITU_BETAS, "activation_situ_beta", betas, f"SiTU's are {SITU_BETAS}")
    heads = int(_get(text, "num_attention_heads"))
    kv_heads = _get(text, "num_key_value_heads", default=heads)
    _require(kv_heads in (None, heads), "num_key_value_heads", kv_heads,
             "MLA has one key/value head per query head")
    _require(_get(text, "mla_use_nope", default=True) is True, "mla_use_nope",
             text.get("mla_use_nope"), "k3-model's hub MLA is NoPE")
    _require(not text.get("attention_bias", False), "attention_bias",
             text.get("attention_bias"), "k3-model's projections have no biases")
    renorm = _get(text, "moe_renormalize", "norm_topk_prob", default=True)
    _require(renorm is True, "moe_renormalize", renorm, "the router always renormalizes")
    router = text.get("moe_router_activation_func", "sigmoid")
    _require(router == "sigmoid", "moe_router_activation_func", router,
             "the router is sigmoid")
    groups = int(_get(text, "num_expert_group", "n_group", default=1) or 1)
    top_groups = int(_get(text, "topk_group", default=groups) or groups)
    _require(top_groups >= groups, "topk_group", top_groups,
             f"group-limited routing ({top_groups} of {groups} groups) is not implemented")
    mtp = int(text.get("num_nextn_predict_layers") or 0)
    _require(mtp == 0, "num_nextn_predict_layers", mtp, "multi-token prediction layers "
             "are not implemented")
    n_layers = int(_get(text, "num_hidden_layers"))
    attention, every = _layout(text, n_layers)
    linear = text.get("linear_attn_config") or {}
    kda_dim = int(_get(linear, "head_dim", default=_get(text, "linear_head_dim", default=128)))
    bound = linear.get("gate_lower_bound")
    full_rank = bool(linear.get("use_full_rank_gate", False))
    eps = float(_get(text, "rms_norm_eps", default=1e-5))
    _require(math.isfinite(eps) and eps > 0, "rms_norm_eps", eps, "must be > 0")
    q_rank = text.get("q_lora_rank")
    fields: dict[str, Any] = dict(
        vocab_size=int(_get(text, "vocab_size")),
        d_model=int(_get(text, "hidden_size")),
        n_layers=n_layers,
        n_heads=heads,
        max_seq_len=int(_get(text, "model_max_length", "max_position_embeddings",
                             default=4096)),
        attention=attention,
        full_attention_every=every,
        q_lora_rank=int(q_rank or 0),
        kv_lora_rank=int(_get(text, "kv_lora_rank")),
        qk_nope_head_dim=int(_get(text, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_get(text, "qk_rope_head_dim")),
        v_head_dim=int(_get(text, "v_head_dim")),
        mla_rope=False,
        mla_gate=bool(text.get("mla_use_output_gate", False)),
        mla_norm_eps=LATENT_NORM_EPS if form == KIMI_LINEAR else None,
        kda_heads=int(_get(linear, "num_heads",
                           default=_get(text, "linear_num_heads", default=heads))),
        kda_head_dim=kda_dim,
        kda_conv_size=int(_get(linear, "short_conv_kernel_size",
                               default=_get(text, "linear_conv_kernel_dim", default=4))),
        kda_decay="softplus" if bound is None else "bounded",
        kda_gate_lower_bound=-5.0 if bound is None else float(bound),
        kda_output_gate_rank=0 if full_rank else kda_dim,
        attn_res_block_size=int(text.get("attn_res_block_size") or 0),
        mlp="moe",
        activation="situ" if act == "situ" else "swiglu",
        d_ff=int(_get(text, "intermediate_size")),
        n_experts=int(_get(text, "num_experts", "num_local_experts")),
        moe_top_k=int(_get(text, "num_experts_per_token", "num_experts_per_tok")),
        n_shared_experts=int(_get(text, "num_shared_experts", "n_shared_experts", default=0)
                             or 0),
        moe_d_ff=int(_get(text, "moe_intermediate_size")),
        moe_latent_dim=int(text.get("routed_expert_hidden_size") or 0),
        n_dense_layers=_dense_layers(text, n_layers),
        routed_scaling=float(_get(text, "routed_scaling_factor", default=1.0)),
        norm_eps=eps,
        tie_embeddings=bool(_get(text, "tie_word_embeddings",
                                 default=data.get("tie_word_embeddings", False))),
        init_std=float(text.get("initializer_range", 0.02)),
    )
    if form == KIMI_LINEAR:
        fields.update(kda_decay="softplus", kda_output_gate_rank=kda_dim, mla_gate=False,
                      attn_res_block_size=0, moe_latent_dim=0)
    try:
        return _simplest(K3Config(**fields))
    except ValueError as exc:
        raise HubFormatError(f"config.json cannot be represented: {exc}") from None


_DERIVED = {"mla_rope": "mla_uses_rope", "mla_gate": "mla_gated", "kda_heads": "kda_n_heads",
            "kda_head_dim": "kda_dim"}
"""Fields whose None means "derive it", with the property that holds the value."""


def _simplest(config: K3Config) -> K3Config:
    """``config`` with each of :data:`_DERIVED` left unset where unset means the same, as
    the presets write them (so an exported preset imports as an equal config)."""
    for name, derived in _DERIVED.items():
        candidate = config.replace(**{name: None})
        if getattr(candidate, derived) == getattr(config, derived):
            config = candidate
    return config


def meaning(config: K3Config) -> dict[str, Any]:
    """``config.to_dict()`` with every :data:`_DERIVED` field resolved: two configs that
    build the same model have the same meaning."""
    data = dataclasses.asdict(config)
    data.update({name: getattr(config, derived) for name, derived in _DERIVED.items()})
    if config.attention != "hybrid":  # no KDA layer: the KDA fields build nothing
        data = {name: value for name, value in data.items() if not name.startswith("kda_")}
    return data


def token_ids(data: Mapping[str, Any]) -> dict[str, int | None]:
    """``{bos_token_id, eos_token_id, pad_token_id}`` of a ``config.json`` (the first id
    where the hub lists several)."""
    _, text = text_config(data)
    found: dict[str, int | None] = {}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = text.get(name, data.get(name))
        if isinstance(value, list):
            value = value[0] if value else None
        found[name] = value if isinstance(value, int) and not isinstance(value, bool) else None
    return found
