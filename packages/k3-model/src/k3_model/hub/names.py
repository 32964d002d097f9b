"""Tensor names and shapes of the hub formats against :class:`~k3_model.K3Model`'s.

One plan per config (:func:`tensor_plan`) lists every hub tensor with the state-dict entry
it comes from, so export and import are the same table read in two directions. What
differs beyond a rename:

- routed experts: our ``(E, out, in)`` stacks are the hub's ``experts.E.{w1,w2,w3}``
  (gate, down, up), one matrix per expert;
- ``A_log``: ours is ``[H]``; Kimi Linear stores ``[1, 1, H, 1]``; Kimi K3 stores it
  zero-padded to ``max(H, head_dim)`` (its published checkpoint: 96 heads in 128 entries),
  and the padding must be zero on import;
- Attention-Residuals pseudo-queries: ours ``[d]``, the hub's ``*_res_proj`` a
  ``Linear(d, 1)`` weight ``[1, d]``. Kimi K3 ships layer 0's never-used attention read
  (``self_attention_res_*``) too: written as the identity (norm ones, proj zeros),
  ignored on import;
- the balancer's ``load``/``updates`` counters are training telemetry, not weights: not
  written, zero on import. Its ``bias`` is the hub's ``e_score_correction_bias``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import K3Config
from .config import KIMI_LINEAR, HubFormatError, hub_form

_KDA = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj",
        "q_conv": "q_conv1d", "k_conv": "k_conv1d", "v_conv": "v_conv1d",
        "f_a": "f_a_proj", "f_b": "f_b_proj", "dt_bias": "dt_bias", "b_proj": "b_proj",
        "g_proj": "g_proj", "g_a": "g_a_proj", "g_b": "g_b_proj", "o_norm": "o_norm",
        "o_proj": "o_proj"}
_MLA = {"q_proj": "q_proj", "q_down": "q_a_proj", "q_norm": "q_a_layernorm",
        "q_up": "q_b_proj", "kv_down": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm",
        "kv_up": "kv_b_proj", "g_proj": "g_proj", "o_proj": "o_proj"}
_GLU = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
_EXPERT = {"w_gate": "w1", "w_down": "w2", "w_up": "w3"}
_LATENT = {"down_proj": "routed_expert_down_proj", "latent_norm": "routed_expert_norm",
           "up_proj": "routed_expert_up_proj"}
_READS = {"attn_res": "self_attention_res", "mlp_res": "mlp_res"}
NOT_WEIGHTS = ("balancer.load", "balancer.updates")
"""State-dict buffers that are training telemetry, not part of the hub format."""


@dataclass(frozen=True)
class Entry:
    """One hub tensor: its name, the state-dict entry it comes from, and how."""

    hub: str
    ours: str
    index: int | None = None
    """The expert whose matrix of the ``ours`` stack this is."""
    kind: str = "same"
    """``same``, ``a_log`` (reshaped or padded), ``query`` (``[d]`` ↔ ``[1, d]``) or
    ``placeholder`` (K3's unused layer-0 read: no state-dict entry)."""


def prefixes(config: K3Config) -> tuple[str, str]:
    """``(model prefix, lm_head name)`` of the form ``config`` is written in."""
    if hub_form(config) == KIMI_LINEAR:
        return "model.", "lm_head.weight"
    return "language_model.model.", "language_model.lm_head.weight"


@functools.lru_cache(maxsize=8)
def _state_shapes(config: K3Config) -> dict[str, tuple[int, ...]]:
    """The state dict's shapes, from a model built on the meta device (no memory); one
    build per config."""
    from ..model import K3Model

    with torch.device("meta"):
        model = K3Model(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


@functools.lru_cache(maxsize=8)
def tensor_plan(config: K3Config) -> tuple[Entry, ...]:
    """Every hub tensor of a model of ``config``, in state-dict order."""
    top, head = prefixes(config)
    k3 = hub_form(config) != KIMI_LINEAR
    shapes = _state_shapes(config)
    plan: list[Entry] = []
    for name in shapes:
        if name.endswith(NOT_WEIGHTS):
            continue
        parts = name.split(".")
        if name == "embed.weight":
            plan.append(Entry(top + "embed_tokens.weight", name))
        elif name == "lm_head.weight":
            if not config.tie_embeddings:
                plan.append(Entry(head, name))
        elif name == "norm.weight":
            plan.append(Entry(top + "norm.weight", name))
        elif parts[0] == "final_res":
            kind = "query" if parts[1] == "query" else "same"
            plan.append(Entry(top + ("output_attn_res_proj.weight" if kind == "query"
                                     else "output_attn_res_norm.weight"), name, kind=kind))
        elif parts[0] == "layers":
            plan.extend(_layer_entry(config, top, name, parts, shapes[name]))
        else:
            raise HubFormatError(f"no hub name for the state-dict entry {name}")
    if k3 and config.attn_res_block_size:  # layer 0's unused attention read, as published
        for suffix in ("norm.weight", "proj.weight"):
            plan.append(Entry(f"{top}layers.0.self_attention_res_{suffix}", "",
                              kind="placeholder"))
    return tuple(plan)


def _layer_entry(config: K3Config, top: str, name: str, parts: list[str],
                 shape: tuple[int, ...]) -> list[Entry]:
    index, module, rest = parts[1], parts[2], parts[3:]
    layer = f"{top}layers.{index}."
    if module == "attn_norm":
        return [Entry(layer + "input_layernorm.weight", name)]
    if module == "mlp_norm":
        return [Entry(layer + "post_attention_layernorm.weight", name)]
    if module in _READS:
        kind = "query" if rest[0] == "query" else "same"
        return [Entry(f"{layer}{_READS[module]}_{'proj' if kind == 'query' else 'norm'}"
                      ".weight", name, kind=kind)]
    if module == "attn":
        kda = config.layer_types()[int(index)] == "kda"
        if rest == ["A_log"]:
            return [Entry(layer + "self_attn.A_log", name, kind="a_log")]
        table = _KDA if kda else _MLA
        return [Entry(f"{layer}self_attn.{table[rest[0]]}.{'.'.join(rest[1:])}".rstrip("."),
                      name)]
    if module == "mlp":
        if rest[0] in _GLU:  # a dense layer
            return [Entry(f"{layer}mlp.{_GLU[rest[0]]}.weight", name)]
        moe = layer + "block_sparse_moe."
        if rest[0] == "router":
            return [Entry(moe + "gate.weight", name)]
        if rest == ["balancer", "bias"]:
            return [Entry(moe + "gate.e_score_correction_bias", name)]
        if rest[0] == "shared":
            return [Entry(f"{moe}shared_experts.{_GLU[rest[1]]}.weight", name)]
        if rest[0] in _LATENT:
            return [Entry(f"{moe}{_LATENT[rest[0]]}.weight", name)]
        if rest[0] == "experts":
            return [Entry(f"{moe}experts.{e}.{_EXPERT[rest[1]]}.weight", name, index=e)
                    for e in range(shape[0])]
    raise HubFormatError(f"no hub name for the state-dict entry {name}")


def _a_log_width(config: K3Config) -> int:
    return max(config.kda_n_heads, config.kda_dim)


def hub_shapes(config: K3Config) -> dict[str, tuple[int, ...]]:
    """The shape of every hub tensor of a model of ``config``."""
    shapes = _state_shapes(config)
    k3 = hub_form(config) != KIMI_LINEAR
    out: dict[str, tuple[int, ...]] = {}
    for entry in tensor_plan(config):
        if entry.kind == "placeholder":
            out[entry.hub] = (config.d_model,) if entry.hub.endswith("norm.weight") \
                else (1, config.d_model)
            continue
        shape = shapes[entry.ours]
        if entry.index is not None:
            shape = shape[1:]
        elif entry.kind == "query":
            shape = (1, *shape)
        elif entry.kind == "a_log":
            shape = (_a_log_width(config),) if k3 else (1, 1, shape[0], 1)
        out[entry.hub] = shape
    return out


def to_hub(state: Mapping[str, Tensor], config: K3Config) -> dict[str, Tensor]:
    """The hub tensors of a model's state dict (contiguous, no two sharing memory)."""
    k3 = hub_form(config) != KIMI_LINEAR
    out: dict[str, Tensor] = {}
    for entry in tensor_plan(config):
        if entry.kind == "placeholder":
            ones = entry.hub.endswith("norm.weight")
            out[entry.hub] = (torch.ones if ones else torch.zeros)(
                *((config.d_model,) if ones else (1, config.d_model)),
                dtype=state["norm.weight"].dtype)
            continue
        value = state[entry.ours].detach()
        if entry.index is not None:
            value = value[entry.index]
        elif entry.kind == "query":
            value = value.unsqueeze(0)
        elif entry.kind == "a_log":
            value = torch.nn.functional.pad(value, (0, _a_log_width(config) - value.numel())) \
                if k3 else value.view(1, 1, -1, 1)
        out[entry.hub] = value.contiguous().clone()
    return out


def from_hub(tensors: Mapping[str, Tensor], config: K3Config) -> dict[str, Tensor]:
    """Our state dict (without :data:`NOT_WEIGHTS`) from hub tensors already checked
    against :func:`hub_shapes`."""
    stacks: dict[str, dict[int, Tensor]] = {}
    state: dict[str, Tensor] = {}
    for entry in tensor_plan(config):
        if entry.kind == "placeholder":
            continue
        value = tensors[entry.hub]
        if entry.index is not None:
            stacks.setdefault(entry.ours, {})[entry.index] = value
            continue
        if entry.kind == "query":
            value = value[0]
        elif entry.kind == "a_log":
            value = _a_log_from_hub(value, config, entry.hub)
        state[entry.ours] = value
    for name, parts in stacks.items():
        state[name] = torch.stack([parts[e] for e in range(len(parts))])
    if config.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    return state


def _a_log_from_hub(value: Tensor, config: K3Config, name: str) -> Tensor:
    heads = config.kda_n_heads
    flat = value.reshape(-1)
    if flat[heads:].count_nonzero():
        raise HubFormatError(f"{name}: entries past the {heads} heads must be zero padding")
    return flat[:heads]
