"""The Hugging Face hub format: ``save_pretrained`` and ``load_pretrained`` for K3Model.

A folder of ``config.json`` and ``model.safetensors`` (or shards and
``model.safetensors.index.json``) with Moonshot's tensor names: the Kimi Linear form
(``kimi_linear``, which transformers ≥ 5, vLLM and SGLang load) for a model without K3's
additions, the Kimi K3 form (``kimi_k3``, its published text-model names) otherwise; see
:mod:`k3_model.hub.config` and :mod:`k3_model.hub.names`. Only safetensors and JSON are
needed, never transformers. Reading checks the config, every tensor's name and shape and
the files' integrity before a model is built, so bad input gives one
:class:`HubFormatError` and no half-loaded model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..config import K3Config
from ..model import K3Model
from .card import README, model_card
from .config import (
    KIMI_K3,
    KIMI_LINEAR,
    HubFormatError,
    from_hub_config,
    hub_form,
    meaning,
    to_hub_config,
    token_ids,
)
from .files import (
    CONFIG,
    atomic_folder,
    read_headers,
    read_json,
    read_tensors,
    write_json,
    write_tensors,
)
from .names import NOT_WEIGHTS, from_hub, hub_shapes, to_hub
from .remote import AUTO_MAP, remote_files

GENERATION_CONFIG = "generation_config.json"
KEEP_FP32 = ("A_log", "dt_bias", "e_score_correction_bias")
"""Hub tensors written in fp32 whatever ``dtype`` is asked for (the decay parameters and
the router's selection bias, which the published checkpoints keep in fp32)."""
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                torch.float16: "float16"}


def save_pretrained(model: K3Model, path: str | Path, *, dtype: torch.dtype | None = None,
                    max_shard_bytes: int = 5 * 2**30, bos_token_id: int | None = None,
                    eos_token_id: int | None = None, pad_token_id: int | None = None,
                    extra_files: Mapping[str, str | bytes] | None = None,
                    config_fields: Mapping[str, Any] | None = None,
                    overwrite: bool = False) -> Path:
    """Write ``model`` as a hub folder at ``path`` (complete or absent, never half-written).

    ``dtype`` casts the floating weights (default: as they are; :data:`KEEP_FP32` stay
    fp32); a shard holds at most ``max_shard_bytes``. The token ids go into
    ``config.json``, and with ``eos_token_id`` a ``generation_config.json`` is written.
    ``extra_files`` (name → text or bytes, e.g. the tokenizer's) are written beside;
    ``config_fields`` are added to ``config.json``'s top level (facts about how the model
    was trained that its shape does not say, e.g. ``document_masking``; never a field of
    the hub config itself). A ``README.md`` says how transformers loads the folder (for
    the Kimi K3 form, the line that installs the packages its modeling code runs:
    :mod:`k3_model.hub.card`).
    An existing non-empty ``path`` is replaced only with ``overwrite`` and only when it is
    a previous export (:func:`~k3_model.hub.files.export_refusal`), once the new one is
    complete; any other is refused naming what it holds (:class:`~k3_model.hub.files.FolderInUse`).
    """
    if not isinstance(model, K3Model):
        raise TypeError(f"save_pretrained needs a K3Model, got {type(model).__name__}")
    if dtype is not None and dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(map(str, _DTYPE_NAMES))}, got {dtype}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be ≥ 1, got {max_shard_bytes}")
    config_json = to_hub_config(model.config, bos_token_id=bos_token_id,
                                eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    code: dict[str, str] = {}
    if config_json.get("model_type") == KIMI_K3:  # no transformers model: ship ours
        config_json["auto_map"] = dict(AUTO_MAP)
        code = remote_files()
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    tensors = to_hub(state, model.config)
    if dtype is not None:
        tensors = {name: t if not t.is_floating_point() or name.endswith(KEEP_FP32)
                   else t.to(dtype) for name, t in tensors.items()}
    stored = _DTYPE_NAMES.get(tensors[next(iter(tensors))].dtype, "float32")
    config_json.get("text_config", config_json)["dtype"] = config_json["dtype"] = stored
    taken = sorted(set(config_fields or {}) & set(config_json))
    if taken:
        raise ValueError(f"config_fields: {', '.join(taken)} belong to the hub config; add "
                         "only fields of your own")
    config_json.update(config_fields or {})
    card = model_card(str(config_json["model_type"]), remote=bool(code))
    with atomic_folder(Path(path), overwrite=overwrite) as folder:
        write_tensors(folder, tensors, max_shard_bytes)
        write_json(folder / CONFIG, config_json)
        if eos_token_id is not None:
            generation = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
            if pad_token_id is not None:
                generation["pad_token_id"] = pad_token_id
            write_json(folder / GENERATION_CONFIG, generation)
        for name, text in {**code, README: card}.items():
            (folder / name).write_text(text, encoding="utf-8")
        for name, content in (extra_files or {}).items():
            if "/" in name or name in (CONFIG, GENERATION_CONFIG, README, *code):
                raise ValueError(f"extra_files: {name!r} must be a plain file name other "
                                 "than the ones save_pretrained writes")
            target = folder / name
            if isinstance(content, bytes):
                target.write_bytes(content)
            else:
                target.write_text(content, encoding="utf-8")
    return Path(path)


def read_config(path: str | Path) -> dict[str, object]:
    """A hub folder's ``config.json`` (a dict; :func:`from_hub_config` makes the K3Config)."""
    return read_json(Path(path) / CONFIG)


HUB_FREE_FIELDS = ("kda_chunk_size", "kda_backend", "moe_balance", "moe_balance_rate",
                   "loss_chunk_size", "init_std", "rope_theta")
"""K3Config fields that change how a model computes or trains, not what its weights mean:
a hub config does not carry them, so they may be set on load (``**overrides``)."""


def _folder(path: str | Path) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise HubFormatError(f"{folder} is not a folder (a hub model is a folder with "
                             f"{CONFIG} and model.safetensors)")
    return folder


def pretrained_config(path: str | Path, **overrides: Any) -> K3Config:
    """The :class:`K3Config` of the hub folder ``path``, with ``overrides`` applied. An
    override of a field the folder's ``config.json`` fixes is refused by name unless it
    equals the folder's value; :data:`HUB_FREE_FIELDS` may be set freely."""
    config = from_hub_config(read_json(_folder(path) / CONFIG))
    known = meaning(config)
    fixed = {name: value for name, value in overrides.items()
             if name not in HUB_FREE_FIELDS and known.get(name, value) != value}
    if fixed:
        listed = ", ".join(f"{name}={value!r} (it has {getattr(config, name)!r})"
                           for name, value in fixed.items())
        raise HubFormatError(f"{listed} contradicts {Path(path) / CONFIG}; a pretrained "
                             f"model's shape is its own (free: {', '.join(HUB_FREE_FIELDS)})")
    try:
        return config.replace(**overrides) if overrides else config
    except ValueError as exc:
        raise HubFormatError(str(exc)) from None


def _checked_state(folder: Path, config: K3Config) -> dict[str, torch.Tensor]:
    """The folder's weights as our state dict (without :data:`NOT_WEIGHTS`), read once
    every name, shape and shard has been checked against ``config``."""
    stored = read_headers(folder)
    headers = {_canonical(name): value for name, value in stored.items()}
    expected = hub_shapes(config)
    _check_names(folder, config, expected, headers)
    original = {_canonical(name): name for name in stored}
    tensors = read_tensors(folder, {original[name]: headers[name]
                                    for name in expected if name in headers})
    return from_hub({_canonical(name): t for name, t in tensors.items()}, config)


def _load_state(model: K3Model, state: dict[str, torch.Tensor]) -> None:
    """``state`` into ``model``, the balancer's counters (not in the hub format) zeroed."""
    current = model.state_dict()
    for name in current:
        if name.endswith(NOT_WEIGHTS):
            state[name] = torch.zeros_like(current[name])
    model.load_state_dict(state, strict=True)


def load_weights(model: K3Model, path: str | Path) -> None:
    """Copy the hub folder's weights into ``model``, whose config must match the folder's
    (:func:`pretrained_config`); the balancer's counters are zeroed. Everything is checked
    before the first parameter changes."""
    folder = _folder(path)
    config = model.config
    hub, ours = (meaning(c) for c in (from_hub_config(read_json(folder / CONFIG)), config))
    differs = [name for name in hub if name not in HUB_FREE_FIELDS and hub[name] != ours[name]]
    if differs:
        raise HubFormatError(f"{folder / CONFIG} describes another model: "
                             + ", ".join(f"{n} {hub[n]!r} (model: {ours[n]!r})"
                                         for n in differs))
    _load_state(model, _checked_state(folder, config))


def load_pretrained(path: str | Path, *, dtype: torch.dtype | None = None,
                    **overrides: Any) -> K3Model:
    """The :class:`K3Model` of a hub folder, whether we wrote it, transformers'
    ``save_pretrained`` did, or it came from the hub; in eval mode (``.train()`` to train
    it further). ``dtype``: the parameters' dtype (default: the stored embedding's);
    ``overrides``: :data:`HUB_FREE_FIELDS` (e.g. ``kda_backend="torch"``).

    Everything is checked before the model is built: the config (a field K3Config cannot
    represent is named), every tensor name (missing and unexpected ones named) and shape
    (both shapes named), and every shard's integrity. The global RNG is left as it was.
    """
    folder = _folder(path)
    config = pretrained_config(folder, **overrides)
    state = _checked_state(folder, config)
    with torch.random.fork_rng(devices=[]):
        model = K3Model(config).to(dtype or state["embed.weight"].dtype)
    _load_state(model, state)
    return model.eval()


_DENSE_SAVED_AS_MOE = re.compile(r"\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")


def _canonical(name: str) -> str:
    """The hub's name for a tensor stored under an alias: transformers' ``save_pretrained``
    writes a dense layer's ``mlp.{gate,up,down}_proj`` as ``block_sparse_moe.…`` (its
    load-time rename of ``block_sparse_moe`` to ``mlp``, reversed for every layer)."""
    return _DENSE_SAVED_AS_MOE.sub(r".mlp.\1", name)


def _check_names(folder: Path, config: object, expected: Mapping[str, tuple[int, ...]],
                 headers: Mapping[str, tuple[str, tuple[int, ...], torch.dtype]]) -> None:
    optional = {name for name in expected if ".self_attention_res_" in name
                and ".layers.0." in name}
    missing = sorted(set(expected) - set(headers) - optional)
    extra = sorted(set(headers) - set(expected))
    if getattr(config, "tie_embeddings", False):
        extra = [n for n in extra if not n.endswith("lm_head.weight")]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing ({_some(missing)})")
        if extra:
            parts.append(f"{len(extra)} unexpected ({_some(extra)})")
        raise HubFormatError(f"{folder}: the tensors do not match its {CONFIG}: "
                             + "; ".join(parts))
    for name, shape in expected.items():
        if name not in headers:
            continue
        file, found, dtype = headers[name]
        if found != shape:
            raise HubFormatError(f"{folder / file}: tensor {name} has shape {list(found)}, "
                                 f"its {CONFIG} needs {list(shape)}")
        if not dtype.is_floating_point:
            raise HubFormatError(f"{folder / file}: tensor {name} is {dtype}, not a "
                                 "floating-point tensor")


def _some(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", … {len(names) - limit} more" if len(names) > limit else "")


__all__ = ["GENERATION_CONFIG", "HUB_FREE_FIELDS", "KIMI_K3", "KIMI_LINEAR", "HubFormatError",
           "from_hub_config", "hub_form", "load_pretrained", "load_weights",
           "pretrained_config", "read_config", "save_pretrained", "to_hub_config",
           "token_ids"]
