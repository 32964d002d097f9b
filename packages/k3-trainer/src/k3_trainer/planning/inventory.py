"""What a model holds, parameter by parameter, read from the model built on the meta device.

Building on the meta device allocates nothing (Kimi K3's 2.78 T parameters take about a
second), and it is the model the trainer builds, so every later sum (per stage, per
rank, per optimizer state) is over the real parameters, not over a second description
of them that could drift. The arithmetic counts of :func:`k3_model.count_parameters`
are checked against these sums in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from k3_model import K3Config, K3Model, count_parameters
from k3_model.moe import Experts
from k3_model.routing import parameter_routes

FIRST, LAST = -1, -2
"""Pseudo block indices: the embedding (first pipeline stage), and what follows the
decoder blocks (final Attention-Residuals read, output norm, ``lm_head``: last stage)."""


@dataclass(frozen=True)
class Parameter:
    """One parameter: its shape, the decoder block it belongs to (or :data:`FIRST`,
    :data:`LAST`), whether it is a routed-expert stack (split by expert parallelism)
    and whether MuonAdamW updates it with Muon (else AdamW)."""

    name: str
    shape: tuple[int, ...]
    block: int
    expert: bool
    muon: bool

    @cached_property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


@dataclass(frozen=True)
class Inventory:
    """A model's parameters and its counts (total, active per token, matmul weights)."""

    config: K3Config
    parameters: tuple[Parameter, ...]
    total: int
    active: int
    matmul: int

    @property
    def n_blocks(self) -> int:
        return self.config.n_layers

    @cached_property
    def by_block(self) -> dict[int, tuple[Parameter, ...]]:
        """The parameters of each block index (a search plans thousands of layouts)."""
        out: dict[int, list[Parameter]] = {}
        for p in self.parameters:
            out.setdefault(p.block, []).append(p)
        return {block: tuple(params) for block, params in out.items()}

    def of(self, blocks: set[int]) -> list[Parameter]:
        """The parameters of ``blocks``, in model order within each block."""
        return [p for block in sorted(blocks) for p in self.by_block.get(block, ())]


def _block_of(name: str) -> int:
    parts = name.split(".")
    if parts[0] == "layers":
        return int(parts[1])
    return FIRST if parts[0] == "embed" else LAST


def inventory(config: K3Config) -> Inventory:
    """Every trainable parameter of ``K3Model(config)``, built on the meta device."""
    with torch.device("meta"):
        model = K3Model(config)
    routes = parameter_routes(model)
    experts = {id(p) for m in model.modules() if isinstance(m, Experts)
               for p in m.parameters()}
    params = tuple(
        Parameter(name, tuple(p.shape), _block_of(name), id(p) in experts, routes[name][0])
        for name, p in model.named_parameters() if p.requires_grad)
    counts = count_parameters(config)
    return Inventory(config, params, counts.total, counts.active, counts.matmul)
