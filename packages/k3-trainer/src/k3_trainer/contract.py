"""The model contract: everything the trainer asks of a model, declared and checked once.

A model is an ``nn.Module`` whose ``forward(x, targets=y)`` returns ``(logits,
mean_token_loss)``; that is all a model must do to train. Everything else is optional,
and each optional piece has a fallback, so a foreign ``nn.Module`` trains too:

================================  ==========================================================
piece (:class:`K3TrainerModel`)   fallback when absent
================================  ==========================================================
``config.to_dict()``,             the checkpoint records the model's class instead of its
``config.vocab_size``             config; the token ids are not checked against a vocabulary
``parameter_groups(lr=, weight_   ``k3_optim.build_parameter_groups``' name/shape routing
decay=)``
``flops_per_token(seq_len)``      MFU and ``model_flops_per_token`` are reported as None
``layers`` (``nn.ModuleList``)    compile, FSDP2 and activation checkpointing treat the whole
                                  model as one block
``set_activation_checkpointing``  ``activation_checkpointing`` must stay ``"none"``
``set_moe_stats``,                no MoE routing metrics
``pop_moe_stats``
``forward(..., reduction=         a mixture's ``train`` events carry no per-source loss
"none")`` (each target's loss)
================================  ==========================================================

:func:`check_model` reads the model once, when a trainer is built, and raises one
:class:`~k3_trainer.ConfigError` naming the first piece that is missing or malformed
(:func:`read_contract`, the optional pieces alone, serves ``build_optimizer``, compile
and sharding). The rest of the trainer asks the returned :class:`ModelContract`, never the
model by attribute name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

from .config import ConfigError


@runtime_checkable
class TrainableModel(Protocol):
    """What every model must offer: ``model(x, targets=y) -> (logits, mean_token_loss)``."""

    def __call__(self, x: Tensor, *, targets: Tensor) -> tuple[Tensor | None, Tensor]: ...


class ModelConfig(Protocol):
    """A model's configuration as the checkpoint records and compares it."""

    vocab_size: int

    def to_dict(self) -> dict[str, Any]: ...


@runtime_checkable
class K3TrainerModel(TrainableModel, Protocol):
    """The whole contract, as k3-model's ``K3Model`` fulfils it (see the module table for
    what each piece does and its fallback)."""

    config: ModelConfig
    layers: nn.ModuleList

    def parameter_groups(self, lr: float | None = None,
                         weight_decay: float | None = None) -> list[dict[str, Any]]: ...

    def flops_per_token(self, seq_len: int) -> float: ...

    def set_activation_checkpointing(self, mode: str) -> None: ...

    def set_moe_stats(self, enabled: bool) -> None: ...

    def pop_moe_stats(self) -> Mapping[str, Any]: ...


_METHODS = ("parameter_groups", "flops_per_token", "set_activation_checkpointing",
            "set_moe_stats", "pop_moe_stats")


@dataclass(frozen=True)
class ModelContract:
    """What one model offers, read once by :func:`check_model`."""

    model: nn.Module
    config: ModelConfig | None
    methods: Mapping[str, Callable[..., Any]]

    @property
    def vocab_size(self) -> int | None:
        return None if self.config is None else int(self.config.vocab_size)

    def model_config(self) -> dict[str, Any]:
        """What a checkpoint records of the model (and a resume compares)."""
        if self.config is None:
            kind = type(self.model)
            return {"class": f"{kind.__module__}.{kind.__qualname__}"}
        return dict(self.config.to_dict())

    def blocks(self) -> list[nn.Module]:
        """The units compiled, sharded and recomputed one at a time: ``model.layers``, or
        the whole model when it has no such list."""
        layers = getattr(self.model, "layers", None)
        return list(layers) if isinstance(layers, nn.ModuleList) and len(layers) else [
            self.model]

    def parameter_groups(self, lr: float, weight_decay: float) -> list[dict[str, Any]] | None:
        """The model's own optimizer groups, or None (route by name and shape)."""
        declared = self.methods.get("parameter_groups")
        return None if declared is None else declared(lr=lr, weight_decay=weight_decay)

    def flops_per_token(self, seq_len: int) -> float | None:
        own = self.methods.get("flops_per_token")
        return None if own is None else float(own(seq_len))

    def set_activation_checkpointing(self, mode: str) -> None:
        setter = self.methods.get("set_activation_checkpointing")
        if setter is not None:
            setter(mode)
        elif mode != "none":
            raise ConfigError(
                f"activation_checkpointing={mode!r}: {type(self.model).__name__} has no "
                "set_activation_checkpointing(mode); use 'none'")

    @property
    def has_moe_stats(self) -> bool:
        return "set_moe_stats" in self.methods and "pop_moe_stats" in self.methods

    def set_moe_stats(self, enabled: bool) -> None:
        if self.has_moe_stats:
            self.methods["set_moe_stats"](enabled)

    def pop_moe_stats(self) -> Mapping[str, Any]:
        return dict(self.methods["pop_moe_stats"]()) if self.has_moe_stats else {}


def check_model(model: object) -> ModelContract:
    """Check ``model`` for the trainer: the required ``forward(x, targets=y)`` and the
    optional pieces' form (:func:`read_contract`); raise ``ConfigError`` naming the first
    piece that is missing or malformed."""
    contract = read_contract(model)
    try:
        inspect.signature(contract.model.forward).bind(None, targets=None)
    except TypeError:
        raise ConfigError(f"{type(model).__name__}.forward must accept (x, targets=y) and "
                          "return (logits, mean_token_loss)") from None
    except ValueError:  # no signature to read (a C extension): take it at its word
        pass
    return contract


def check_takes_documents(model: nn.Module) -> None:
    """``document_masking`` needs ``forward(x, targets=y, document_ids=ids)``: refuse a
    model whose forward cannot take the ids, naming the setting."""
    try:
        inspect.signature(model.forward).bind(None, targets=None, document_ids=None)
    except TypeError:
        raise ConfigError(f"document_masking: {type(model).__name__}.forward takes no "
                          "document_ids; turn document_masking off for this model") from None
    except ValueError:
        pass


def takes_reduction(model: nn.Module) -> bool:
    """Whether ``forward(x, targets=y, reduction="none")`` is accepted: the model can give
    each target's loss, which a mixture's per-source training loss needs (without it the
    ``train`` events carry none)."""
    try:
        inspect.signature(model.forward).bind(None, targets=None, reduction="none")
    except TypeError:
        return False
    except ValueError:
        return False
    return True


def read_contract(model: object) -> ModelContract:
    """What ``model`` offers of :class:`K3TrainerModel`'s optional pieces (for the parts
    that need only those: compile, sharding, optimizer groups); raise ``ConfigError``
    when one is present in the wrong form."""
    name = type(model).__name__
    if not isinstance(model, nn.Module):
        raise ConfigError(f"the model must be a torch.nn.Module, got {name}")
    methods: dict[str, Callable[..., Any]] = {}
    for method in _METHODS:
        found = getattr(model, method, None)
        if found is None:
            continue
        if not callable(found):
            raise ConfigError(f"{name}.{method} must be a method (see "
                              f"k3_trainer.K3TrainerModel), got {type(found).__name__}")
        methods[method] = found
    if ("set_moe_stats" in methods) != ("pop_moe_stats" in methods):
        raise ConfigError(f"{name} offers only one of set_moe_stats/pop_moe_stats; MoE "
                          "metrics need both")
    layers = getattr(model, "layers", None)
    if layers is not None and not isinstance(layers, nn.ModuleList):
        raise ConfigError(f"{name}.layers must be an nn.ModuleList of blocks, got "
                          f"{type(layers).__name__}")
    config = getattr(model, "config", None)
    if config is not None:
        to_dict = getattr(config, "to_dict", None)
        vocab = getattr(config, "vocab_size", None)
        if not callable(to_dict) or isinstance(vocab, bool) or not isinstance(vocab, int):
            raise ConfigError(f"{name}.config must have to_dict() and an integer vocab_size "
                              "(a checkpoint records and compares it)")
    return ModelContract(model, config, methods)
