"""The model's own optimizer routing: every parameter sent to Muon or AdamW by its role.

Guessing from names and shapes (``k3_optim.build_parameter_groups``) can misroute a
hidden matrix that happens to have the embedding table's shape. K3Model knows what
each parameter is, so it declares the groups itself (DESIGN §3 and §7, K3 report §2.5):

- **Muon, per-head row blocks**: KDA ``q_proj``/``k_proj``/``v_proj``, MLA query
  (``q_proj`` or ``q_up``) and ``kv_up``, GQA ``q_proj``/``k_proj``/``v_proj``
  (each attention module's ``muon_heads()``).
- **Muon, whole matrices**: every other ``nn.Linear`` (output projections, gates, the
  KDA forget-gate factors and β projection, MLA down-projections, LatentMoE down/up
  projections, MLPs), the router; **3-D expert stacks** as a batch of matrices.
- **AdamW**: the embedding, the output head, the KDA short convolutions.
- **AdamW without weight decay**: 1-D parameters — norm gains, ``A_log``,
  ``dt_bias``, Attention-Residuals pseudo-queries.

A parameter no rule covers raises ``TypeError`` by name, so a new kind of weight
cannot slip into a default. The groups are plain dicts in ``k3_optim.MuonAdamW``'s
format (``name``, ``use_muon``, ``num_heads``, ``flatten``, ``params``,
``param_names``), with the group names ``build_parameter_groups`` uses; k3-model does
not import k3-optim.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .moe import Experts, Router

# (use_muon, num_heads, weight decay)
Route = tuple[bool, "int | None", bool]


def parameter_routes(model: nn.Module) -> dict[str, Route]:
    """``{parameter name: (use_muon, num_heads, decay)}`` for every trainable parameter."""
    heads: dict[str, int] = {}
    for name, module in model.named_modules():
        declare = getattr(module, "muon_heads", None)
        if callable(declare):
            for rel, n in declare().items():
                heads[f"{name}.{rel}"] = n
    head = getattr(model, "lm_head", None)
    routes: dict[str, Route] = {}
    owner = {id(p): m for _, m in model.named_modules() for p in m.parameters(recurse=False)}
    for name, p in model.named_parameters():  # a tied head appears once, as the embedding
        if not p.requires_grad:
            continue
        module = owner[id(p)]
        if p.ndim == 1:
            routes[name] = (False, None, False)
        elif isinstance(module, nn.Embedding | nn.Conv1d) or module is head:
            routes[name] = (False, None, True)
        elif isinstance(module, nn.Linear | Router) or (
            isinstance(module, Experts) and p.ndim == 3
        ):
            routes[name] = (True, heads.get(name), True)
        else:
            raise TypeError(
                f"K3Model.parameter_groups: no routing rule for parameter {name} "
                f"({type(module).__name__}, shape {tuple(p.shape)}); add one in "
                "k3_model/routing.py"
            )
    return routes


def parameter_groups(
    model: nn.Module, *, lr: float | None = None, weight_decay: float | None = None
) -> list[dict[str, Any]]:
    """MuonAdamW param groups from :func:`parameter_routes`: Muon groups first (one per
    head count), then ``adamw`` and ``adamw_no_decay``; ``lr``/``weight_decay`` set on
    each group when given (never on ``adamw_no_decay``, whose decay is 0)."""
    params = dict(model.named_parameters())
    groups: dict[str, dict[str, Any]] = {}
    for name, (use_muon, heads, decay) in parameter_routes(model).items():
        if use_muon:
            label = "muon" + (f"_heads{heads}" if heads else "")
            fresh: dict[str, Any] = {"use_muon": True, "num_heads": heads, "flatten": False}
        else:
            label = "adamw" if decay else "adamw_no_decay"
            fresh = {"use_muon": False} if decay else {"use_muon": False, "weight_decay": 0.0}
        group = groups.setdefault(label, {"name": label, **fresh, "params": [],
                                          "param_names": []})
        group["params"].append(params[name])
        group["param_names"].append(name)
    for group in groups.values():
        if lr is not None:
            group["lr"] = lr
        if weight_decay is not None and group["name"] != "adamw_no_decay":
            group["weight_decay"] = weight_decay
    return sorted(groups.values(), key=lambda g: (not g["use_muon"], g["name"]))
