"""Split a model's parameters into MuonAdamW groups: Muon for hidden matrices, AdamW else.

Muon's orthogonalized update suits the hidden linear maps of a network. Embeddings and
the output head are lookup/readout tables whose rows see very different gradient
scales, and norms, biases and scalars are not matrices at all, so they go to AdamW.

A model that knows its parameters should declare its groups itself (``k3_model.K3Model``
does, with ``parameter_groups(lr, weight_decay)``); :func:`check_parameter_groups`
verifies such a declaration. :func:`build_parameter_groups` is the fallback for models
that do not: it guesses from module types and names, and logs what it decided.
"""

from __future__ import annotations

import fnmatch
import logging
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

# Module names (last dotted component) treated as the output head when not tied.
DEFAULT_HEAD_NAMES = ("lm_head", "output", "head", "unembed", "output_head", "classifier")

MuonPredicate = Callable[[str, nn.Parameter], "bool | None"]

logger = logging.getLogger(__name__)


def build_parameter_groups(
    model: nn.Module,
    *,
    lr: float | None = None,
    weight_decay: float | None = None,
    adamw_patterns: Iterable[str] = (),
    muon_patterns: Iterable[str] = (),
    predicate: MuonPredicate | None = None,
    per_head: Mapping[str, int] | None = None,
    head_names: Iterable[str] = DEFAULT_HEAD_NAMES,
    muon_options: Mapping[str, Any] | None = None,
    adamw_options: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Return MuonAdamW param groups for ``model``'s trainable parameters.

    Default choice: a parameter goes to Muon when it has ≥ 2 dims and does not belong
    to an ``nn.Embedding`` or an output head: a module whose name is in ``head_names``,
    a weight tied to an embedding, or the model's *last* ``nn.Linear`` when its weight
    has an embedding table's shape (an untied readout). A hidden matrix that merely has
    the table's shape (``d_ff == vocab``…) stays with Muon. Everything else goes to
    AdamW; 1-D and scalar parameters get no weight decay. Being a guess, the result is
    logged (logger ``k3_optim.param_groups``, INFO): one line per group with its
    parameter names. The guesses most likely to be wrong are also a ``UserWarning``
    (visible by default), one for the call: matrices sent to Muon that are the model's
    first layer (a ``Linear`` that reads the input, in a model without an embedding), its
    last ``Linear`` (an output layer not recognised as a head), or a parameter of no
    ``Linear`` or convolution (no rule recognised it). A route the caller declared
    (``predicate``, ``muon_patterns``, ``adamw_patterns``) is never in it.

    Overrides, strongest first: ``predicate(name, param)`` returning True/False (None
    defers), then fnmatch ``muon_patterns`` / ``adamw_patterns`` on the full parameter
    name. ``per_head`` maps name patterns to a head count for per-head Muon (e.g.
    ``{"*.q_proj.weight": n_heads, "*.k_proj.weight": n_kv_heads}``). >2-D parameters of
    convolution modules are flattened to one matrix; other >2-D parameters (expert
    stacks) are a batch of matrices. ``lr``/``weight_decay`` (when given) and the
    ``muon_options``/``adamw_options`` mappings are set on the respective groups.

    Each group carries ``name``, ``use_muon`` and ``param_names`` (for checkpoint layout
    checks); groups with no parameters are omitted.
    """
    adamw_patterns = tuple(adamw_patterns)
    muon_patterns = tuple(muon_patterns)
    per_head = dict(per_head or {})
    head_names = set(head_names)

    embedding_params: set[int] = set()
    embedding_shapes: set[tuple[int, ...]] = set()
    head_params: set[int] = set()
    conv_params: set[int] = set()
    modules = list(model.named_modules())
    for _, module in modules:
        if isinstance(module, nn.Embedding | nn.EmbeddingBag):
            embedding_params.update(id(p) for p in module.parameters(recurse=False))
            embedding_shapes.add(tuple(module.weight.shape))
    linears = [m for _, m in modules if isinstance(m, nn.Linear)]
    # An untied readout is the last Linear, shaped like an embedding table (vocab × d);
    # an earlier Linear of that shape is a hidden matrix whose shape is a coincidence.
    readout = linears[-1] if linears and tuple(linears[-1].weight.shape) in embedding_shapes \
        else None
    for module_name, module in modules:
        direct = list(module.parameters(recurse=False))
        if module_name.rsplit(".", 1)[-1] in head_names or module is readout:
            head_params.update(id(p) for p in direct)
        if isinstance(module, nn.modules.conv._ConvNd):
            conv_params.update(id(p) for p in direct)

    # key → (group name, use_muon, extra options)
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}

    def add(key: tuple[Any, ...], group: dict[str, Any], name: str, p: nn.Parameter) -> None:
        entry = groups.setdefault(key, {**group, "params": [], "param_names": []})
        entry["params"].append(p)
        entry["param_names"].append(name)

    first = linears[0] if linears and not embedding_params else None
    last = linears[-1] if linears else None
    layered = {id(p) for _, m in modules if isinstance(m, nn.Linear)
               for p in m.parameters(recurse=False)} | conv_params
    doubtful: list[str] = []
    for name, p in model.named_parameters():  # tied parameters appear once
        if not p.requires_grad:
            continue
        declared = _declared_route(name, p, predicate, muon_patterns, adamw_patterns)
        use_muon = declared if declared is not None else (
            p.ndim >= 2 and id(p) not in embedding_params and id(p) not in head_params)
        if use_muon and declared is None:
            if first is not None and p is first.weight:
                doubtful.append(f"{name} (the model's first layer)")
            elif last is not None and p is last.weight:
                doubtful.append(f"{name} (the model's last layer)")
            elif id(p) not in layered:
                doubtful.append(f"{name} (no rule recognised it)")
        if use_muon:
            if p.ndim < 2:
                raise ValueError(
                    f"parameter {name} with shape {tuple(p.shape)} was assigned to Muon, which "
                    "needs at least 2 dims; route it to AdamW"
                )
            heads = next((h for pat, h in per_head.items() if fnmatch.fnmatchcase(name, pat)), None)
            flatten = p.ndim > 2 and id(p) in conv_params
            label = "muon" + (f"_heads{heads}" if heads else "") + ("_flat" if flatten else "")
            add(("muon", heads, flatten), {"name": label, "use_muon": True,
                                           "num_heads": heads, "flatten": flatten}, name, p)
        elif p.ndim >= 2:
            add(("adamw",), {"name": "adamw", "use_muon": False}, name, p)
        else:
            add(("adamw_no_decay",), {"name": "adamw_no_decay", "use_muon": False,
                                      "weight_decay": 0.0}, name, p)

    result = []
    for group in groups.values():
        options = muon_options if group["use_muon"] else adamw_options
        group.update(options or {})
        if lr is not None:
            group["lr"] = lr
        if weight_decay is not None and group["name"] != "adamw_no_decay":
            group["weight_decay"] = weight_decay
        result.append(group)
    if not result:
        raise ValueError("model has no trainable parameters")
    # Muon groups first, then AdamW: a stable, readable order for checkpoints and logs.
    result.sort(key=lambda g: (not g["use_muon"], g["name"]))
    for group in result:
        logger.info(
            "build_parameter_groups (guessed from names and shapes) %s: %s",
            group["name"], ", ".join(group["param_names"]),
        )
    if doubtful:
        warnings.warn(
            "build_parameter_groups guessed from names and shapes and sends to Muon: "
            f"{', '.join(doubtful)}. If any of them should be AdamW's, declare the routes: "
            "pass adamw_patterns=/muon_patterns= (or predicate=) to build_parameter_groups, "
            "or give MuonAdamW your own parameter groups with use_muon set on each",
            UserWarning, stacklevel=2)
    return result


def check_parameter_groups(model: nn.Module, groups: Iterable[Mapping[str, Any]]) -> None:
    """Raise ``ValueError`` unless ``groups`` hold every trainable parameter of ``model``
    exactly once, each with ``use_muon`` and, when given, ``param_names`` that are the
    model's ``named_parameters()`` names of the group's params, in order.

    What a trainer checks of a model's own declaration before building the optimizer:
    a parameter left out would silently never train.
    """
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    seen: dict[int, str] = {}
    for index, group in enumerate(groups):
        label = f"param group {index} ({group.get('name', '?')!r})"
        if "use_muon" not in group:
            raise ValueError(f"{label} has no 'use_muon' key")
        params = list(group["params"])
        declared = group.get("param_names")
        if declared is not None and len(declared) != len(params):
            raise ValueError(f"{label}: {len(params)} params but {len(declared)} param_names")
        for i, p in enumerate(params):
            name = names.get(id(p))
            if name is None:
                raise ValueError(f"{label}: parameter {i} is not a trainable parameter of "
                                 "the model")
            if declared is not None and declared[i] != name:
                raise ValueError(f"{label}: param_names[{i}] is {declared[i]!r}, but that "
                                 f"parameter is the model's {name!r}")
            if id(p) in seen:
                raise ValueError(f"{label}: parameter {name} is also in {seen[id(p)]}")
            seen[id(p)] = label
    missing = [n for i, n in names.items() if i not in seen]
    if missing:
        raise ValueError(
            f"the model's parameter groups leave out {', '.join(missing)}: every trainable "
            "parameter must be in exactly one group"
        )


def _declared_route(
    name: str,
    p: torch.Tensor,
    predicate: MuonPredicate | None,
    muon_patterns: tuple[str, ...],
    adamw_patterns: tuple[str, ...],
) -> bool | None:
    """Muon (True) or AdamW (False) as the caller declared it, or None (guess)."""
    if predicate is not None:
        decided = predicate(name, p)  # type: ignore[arg-type]
        if decided is not None:
            return bool(decided)
    if any(fnmatch.fnmatchcase(name, pat) for pat in muon_patterns):
        return True
    if any(fnmatch.fnmatchcase(name, pat) for pat in adamw_patterns):
        return False
    return None
