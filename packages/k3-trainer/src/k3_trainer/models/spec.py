"""``ModelSpec``: everything the trainer and the ``k3-train`` command need to know about a
model family, in one object registered by name (:mod:`k3_trainer.models.registry`).

The trainer itself asks a model only what the model contract (:mod:`k3_trainer.contract`)
names. What a *command* needs beyond that lives here: the config class whose fields
become the model flags, the presets those flags start from, how to build the model from
a config, and the hooks that are the model's own business when it is parallelized or
exported (which parameters are experts, how its balancer sees the global batch, how its
weights are named on the Hugging Face hub). Every hook is optional: a model without one
simply lacks that feature, and the command says so by name.

Torch-free at import, like the argument parsing that reads it.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    TokenGather = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class ExpertParallel:
    """How a model splits its routed experts over ranks (``--expert-parallel N``, FSDP2)."""

    n_experts: Callable[[nn.Module], int]
    """The routed experts of each MoE layer (0: the model has no MoE layer)."""
    shard: Callable[..., None]
    """``shard(model, world_size, degree, device_type, stages=1)``: keep this rank's
    ``1/degree`` of every MoE layer's experts, in place, before the model is wrapped; with
    ``stages`` pipeline stages (each stage's ``world_size / stages`` ranks consecutive),
    the expert groups are carved from this rank's stage. A hook without ``stages`` runs
    every layout but pipeline stages."""
    parameters: Callable[[nn.Module], list[nn.Parameter]]
    """The sharded expert parameters (kept out of FSDP2, on their own mesh)."""
    reduce_gradients: Callable[[nn.Module], None]
    """After an update's last backward: expert gradients become the data-parallel mean."""
    moved_bytes: Callable[[nn.Module], int]
    """Bytes this rank's expert exchanges sent to other ranks since the last call."""


@dataclass(frozen=True)
class PipelineHooks:
    """How a model is cut into pipeline stages (``--pipeline-parallel P``,
    :mod:`k3_trainer.pipeline`)."""

    n_layers: Callable[[nn.Module], int]
    """The decoder blocks, cut between."""
    keep: Callable[..., None]
    """``keep(model, layers, first=, last=)``: delete, in place, every layer outside
    ``layers`` (the embedding unless ``first``, the head unless ``last``), keeping names."""
    stage: Callable[..., nn.Module]
    """``stage(model, layers, first=, last=)``: one stage's forward module (a range)."""
    loss: Callable[..., Tensor]
    """``loss(stage_module, last_output, targets, reduction="mean")``: the mean token
    loss; ``reduction="none"``, each target's (a mixture's loss by source under stages;
    a hook without ``reduction`` runs every run but a mixture's)."""
    logits: Callable[[nn.Module, Tensor], Tensor] | None = None
    """``logits(stage_module, last_output)``: every position's logits, for in-loop
    downstream tasks scored through the stages (None: ``--downstream`` is refused)."""


@dataclass(frozen=True)
class ContextParallelHooks:
    """How a model splits each sequence over ranks (``--context-parallel N``,
    :mod:`k3_trainer.context`)."""

    check: Callable[[Any, int, int], None]
    """``check(model_config, seq_len, degree)``: raise ``ValueError`` (one line naming the
    fix) for a degree the model cannot run at that length."""
    set_group: Callable[[nn.Module, Any], None]
    """``set_group(model, group)``: from now on the forward takes this rank's contiguous
    slice of every row (its ``document_ids`` too) and returns that slice's logits and
    loss, exchanging what it needs over ``group`` (None: off)."""


class HubFolderError(ValueError):
    """What :class:`HubFormat`'s hooks raise for a folder or a model they refuse, in one
    line naming the field or tensor."""


@dataclass(frozen=True)
class HubFormat:
    """How a model reads and writes a Hugging Face hub folder (``config.json`` +
    safetensors), for ``export``, ``train --init-from`` and ``eval``/``sample --model``."""

    model_types: tuple[str, ...]
    """The ``config.json`` ``model_type`` values this format reads."""
    save: Callable[..., Path]
    """``save(model, out, *, dtype, bos_token_id, eos_token_id, extra_files, overwrite)``
    writes the folder atomically and returns it; an export of a run trained with documents
    apart also passes ``config_fields={"document_masking": True}`` (added to
    ``config.json``)."""
    load: Callable[[Path, torch.dtype], nn.Module]
    """The folder's model with its weights, in ``dtype``."""
    config: Callable[..., Any]
    """``config(folder, **fields)``: the folder's model config, with ``fields`` (those that
    only change how it computes) applied; a contradicting field raises ``error``."""
    load_weights: Callable[[nn.Module, Path], None]
    """Copy the folder's weights into a model built from :attr:`config`."""
    token_ids: Callable[[Path], Mapping[str, int | None]]
    """The folder's ``bos_token_id``/``eos_token_id``/``pad_token_id`` from its config."""
    describe: Callable[[Any], str]
    """One line on the written form and what loads it, for the export's message."""


@dataclass(frozen=True)
class ModelSpec:
    """A model family the trainer can build and the command can train by name."""

    name: str
    """What ``k3-train train --model NAME`` selects and ``run.json`` records."""
    config_class: type
    """A dataclass; each field (with its docstring) becomes a ``train`` model flag."""
    build: Callable[[Any], nn.Module]
    """A model (fp32, on the CPU) from a config instance, initialized from torch's RNG."""
    presets: Mapping[str, Any] = field(default_factory=dict)
    """Named configs the model flags start from (``--preset``)."""
    default_preset: str | None = None
    """The preset of a fresh run that names none (None: the config class's defaults)."""
    from_dict: Callable[[Mapping[str, Any]], Any] | None = None
    """A config from its recorded dict (default: the dataclass called with it)."""
    set_token_gather: Callable[[nn.Module, TokenGather | None], None] | None = None
    """Data parallel: give the model a function that gathers every rank's rows, for state
    that must see the global batch (K3's MoE balancer)."""
    expert_parallel: ExpertParallel | None = None
    pipeline: PipelineHooks | None = None
    """How to cut the model into pipeline stages (None: it cannot be)."""
    context_parallel: ContextParallelHooks | None = None
    """How to split each sequence over ranks (None: it cannot be)."""
    hub: HubFormat | None = None

    def __post_init__(self) -> None:
        if not dataclasses.is_dataclass(self.config_class):
            raise TypeError(f"ModelSpec {self.name!r}: config_class must be a dataclass "
                            "(its fields become the model flags)")
        for preset, config in self.presets.items():
            if not isinstance(config, self.config_class):
                raise TypeError(f"ModelSpec {self.name!r}: preset {preset!r} is not a "
                                f"{self.config_class.__name__}")
        if self.default_preset is not None and self.default_preset not in self.presets:
            raise ValueError(f"ModelSpec {self.name!r}: default_preset "
                             f"{self.default_preset!r} is not one of its presets")

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.config_class))

    def config(self, preset: str | None, fields: Mapping[str, Any],
               recorded: Mapping[str, Any] | None = None) -> Any:
        """The model config: the recorded one (a resumed run) or the preset (default:
        :attr:`default_preset`, else the class defaults), with ``fields`` applied.
        Raises ``ValueError``/``TypeError`` naming what is wrong."""
        unknown = sorted(set(fields) - set(self.field_names))
        if unknown:
            raise ValueError(f"{self.config_class.__name__} has no field(s) "
                             f"{', '.join(unknown)}")
        if recorded is not None and preset is None:
            data = {**recorded, **fields}
            return self.from_dict(data) if self.from_dict else self.config_class(**data)
        name = preset or self.default_preset
        if name is None:
            return self.config_class(**fields)
        if name not in self.presets:
            listed = ", ".join(self.presets) or "none"
            close = difflib.get_close_matches(name, list(self.presets), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"unknown model preset {name!r}; {hint}the {self.name} model's "
                             f"presets: {listed}")
        return dataclasses.replace(self.presets[name], **fields)

    def config_dict(self, config: Any) -> dict[str, Any]:
        """What ``run.json`` records of a config (its ``to_dict()``, else its fields)."""
        to_dict = getattr(config, "to_dict", None)
        return dict(to_dict()) if callable(to_dict) else dataclasses.asdict(config)
