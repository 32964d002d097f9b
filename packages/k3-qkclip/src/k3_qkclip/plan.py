"""Bind a module's QKSpec to its parameters and do the per-head rescaling.

Binding resolves every declared target to its weight (and bias), checks that the
declared rows tile it exactly, and precomputes one gather index per target so that a
rescale is three small device ops per weight and needs no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .policy import QKClipPolicy
from .spec import QKSpec

# Power of the (effective) γ applied to a role's rows, per kind and GQA mode. Head h's
# logit is Σ over its q·k parts, so each q/k pair of exponents must sum to 1 (or the
# key is shared and untouched, exponent 0, and its query takes the whole γ).
_EXPONENTS: dict[str, dict[str, float]] = {
    "mha": {"q": 0.5, "k": 0.5},
    "query_only": {"q": 1.0},
    "group_min": {"q": 0.5, "k": 0.5},
    "mla": {"q_nope": 0.5, "k_nope": 0.5, "q_rope": 1.0},
}


@dataclass
class BoundTarget:
    """One declared weight: its tensors and, per row, an index into the factor table."""

    target: str
    tensors: list[tuple[str, Tensor]]  # (name relative to the module, tensor)
    rows: int
    factor_index: Tensor | None  # (rows,) int64; None when no row of it is ever scaled


class ModulePlan:
    """A declaring module with its spec bound to its parameters."""

    def __init__(self, name: str, module: nn.Module, spec: QKSpec, policy: QKClipPolicy):
        self.name = name
        self.module = module
        self.spec = spec
        self.mode = spec.kind if spec.kind != "gqa" else policy.gqa
        self.targets = [self._bind(layout.target, layout.rows) for layout in spec.layouts]
        self._index_rows()

    @property
    def device(self) -> torch.device:
        return self.targets[0].tensors[0][1].device

    def _error(self, message: str) -> ValueError:
        return ValueError(f"QK-Clip declaration of module {self.name!r}: {message}")

    def _bind(self, target: str, declared: int) -> BoundTarget:
        tensors: list[tuple[str, Tensor]] = []
        try:
            sub = self.module.get_submodule(target)
        except AttributeError:
            try:
                tensors.append((target, self.module.get_parameter(target)))
            except AttributeError:
                raise self._error(f"{target!r} is neither a submodule nor a parameter") from None
        else:
            weight, bias = getattr(sub, "weight", None), getattr(sub, "bias", None)
            if not isinstance(weight, Tensor):
                raise self._error(f"submodule {target!r} has no weight tensor")
            tensors.append((f"{target}.weight", weight))
            if isinstance(bias, Tensor):
                tensors.append((f"{target}.bias", bias))
        weight = tensors[0][1]
        rows = weight.shape[0] if weight.dim() else 0
        if rows != declared:
            raise self._error(
                f"the declared rows of {target!r} ({declared}) do not tile its weight "
                f"({rows} rows, shape {tuple(weight.shape)}); declare every row exactly once"
            )
        for tname, tensor in tensors[1:]:
            if tuple(tensor.shape) != (rows,):
                raise self._error(f"bias {tname!r} has shape {tuple(tensor.shape)}, not ({rows},)")
        if not all(t.is_floating_point() for _, t in tensors):
            raise self._error(f"{target!r} is not a floating-point tensor")
        return BoundTarget(target, tensors, rows, None)

    def _index_rows(self) -> None:
        """Factor table layout: [√γ_eff (H) | √γ_kv (H_kv) | γ_eff (H) | γ_kv (H_kv) | 1]."""
        h, kv = self.spec.n_heads, self.spec.n_kv_heads
        one = 2 * (h + kv)
        exponents = _EXPONENTS[self.mode]
        index = {t.target: torch.full((t.rows,), one, dtype=torch.long) for t in self.targets}
        for seg in self.spec.segments():
            power = exponents.get(seg.role, 0.0)
            if power == 0.0:
                continue
            slot = seg.index + (h if seg.role == "k" else 0) + (h + kv if power == 1.0 else 0)
            index[seg.target][seg.start : seg.stop] = slot
        for t in self.targets:
            if bool((index[t.target] != one).any()):
                t.factor_index = index[t.target].to(self.device)

    def gammas(self, max_logits: Tensor, tau: float) -> tuple[Tensor, Tensor]:
        """Per-head γ (what head h's logits get multiplied by) and per-kv-head γ."""
        finite_over = torch.isfinite(max_logits) & (max_logits > tau)
        gamma = torch.where(finite_over, tau / max_logits, torch.ones_like(max_logits))
        kv = self.spec.n_kv_heads
        if self.mode == "group_min":
            gamma_kv = gamma.view(kv, -1).amin(dim=1)
            return gamma_kv.repeat_interleave(self.spec.n_heads // kv), gamma_kv
        return gamma, gamma if kv == self.spec.n_heads else gamma.new_ones(kv)

    @torch.no_grad()
    def rescale(self, gamma: Tensor, gamma_kv: Tensor) -> None:
        """Multiply every scaled row in place; unscaled rows are multiplied by exactly 1."""
        both = torch.cat([gamma, gamma_kv])
        table = torch.cat([both.sqrt(), both, both.new_ones(1)])
        for t in self.targets:
            if t.factor_index is None:
                continue
            factor = table[t.factor_index.to(table.device)]
            for _, tensor in t.tensors:
                shape = (-1,) + (1,) * (tensor.dim() - 1)
                tensor.mul_(_like(factor.to(tensor.device, tensor.dtype).view(shape), tensor))

    def geometry(self) -> dict[str, object]:
        """The spec plus the resolved parameter names and shapes, as plain data."""
        spec = self.spec.to_dict()
        spec["params"] = {
            f"{self.name}.{n}" if self.name else n: list(t.shape)
            for target in self.targets
            for n, t in target.tensors
        }
        return spec


def _like(factor: Tensor, tensor: Tensor) -> Tensor:
    """``factor`` as an operand of ``tensor``: replicated over the mesh of a DTensor (FSDP2
    shards a weight by rows; each rank then scales the rows it holds)."""
    if not hasattr(tensor, "device_mesh"):
        return factor
    from torch.distributed.tensor import DTensor, Replicate

    mesh = tensor.device_mesh
    return DTensor.from_local(factor, mesh, [Replicate()] * mesh.ndim, run_check=False)
