"""Kimi K3 (``k3_model``) as the ``k3`` model spec: the only module of the trainer that
imports ``k3_model``.

Its config, presets and class load here (torch-free); building a model, expert
parallelism and the hub format import the rest of ``k3_model`` when first used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k3_model.config import K3Config
from k3_model.presets import PRESETS

from ..config import ConfigError
from .spec import (
    ContextParallelHooks,
    ExpertParallel,
    HubFolderError,
    HubFormat,
    ModelSpec,
    PipelineHooks,
)

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn


def _build(config: K3Config) -> nn.Module:
    from k3_model import K3Model

    return K3Model(config)


def _set_token_gather(model: nn.Module, gather: Callable[[Tensor], Tensor] | None) -> None:
    model.set_balancer_gather(gather)  # type: ignore[operator]


def _n_experts(model: nn.Module) -> int:
    from k3_model.moe import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    return layers[0].experts.n_experts if layers else 0


def _shard(model: nn.Module, world_size: int, degree: int, device_type: str,
           stages: int = 1) -> None:
    from k3_model.expert_parallel import expert_mesh, shard_experts

    shard_experts(model, expert_mesh(world_size, degree, device_type, stages))


def _expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    from k3_model.expert_parallel import expert_parameters

    return expert_parameters(model)


def _reduce_gradients(model: nn.Module) -> None:
    from k3_model.expert_parallel import reduce_gradients

    reduce_gradients(model)


def _moved_bytes(model: nn.Module) -> int:
    from k3_model.expert_parallel import pop_moved_bytes

    return pop_moved_bytes(model)


def _n_layers(model: nn.Module) -> int:
    return int(model.config.n_layers)  # type: ignore[union-attr, arg-type]


def _keep(model: nn.Module, layers: list[int], *, first: bool, last: bool) -> None:
    from k3_model.pipeline import keep_stages

    try:
        keep_stages(model, layers, first=first, last=last)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _stage(model: nn.Module, layers: range, *, first: bool, last: bool) -> nn.Module:
    from k3_model.pipeline import StageForward

    return StageForward(model, layers, first=first, last=last)  # type: ignore[arg-type]


def _stage_loss(stage: nn.Module, output: Tensor, targets: Tensor,
                reduction: str = "mean") -> Tensor:
    loss: Tensor = stage.loss(output, targets, reduction)  # type: ignore[operator]
    return loss


def _stage_logits(stage: nn.Module, output: Tensor) -> Tensor:
    logits: Tensor = stage.logits(output)  # type: ignore[operator]
    return logits


def _check_context(config: K3Config, seq_len: int, degree: int) -> None:
    from k3_model.context_parallel import check_context_parallel

    try:
        check_context_parallel(config, seq_len, degree)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _set_context_group(model: nn.Module, group: Any) -> None:
    model.set_context_parallel(group)  # type: ignore[operator]


@contextmanager
def _refusals() -> Iterator[None]:
    """k3_model.hub's refusals as the spec's :class:`HubFolderError`."""
    from k3_model.hub import HubFormatError

    try:
        yield
    except HubFormatError as exc:
        raise HubFolderError(str(exc)) from None


def _save(model: nn.Module, out: Path, **options: Any) -> Path:
    from k3_model.hub import save_pretrained

    with _refusals():
        return save_pretrained(model, out, **options)  # type: ignore[arg-type]


def _load(folder: Path, dtype: torch.dtype) -> nn.Module:
    from k3_model.hub import load_pretrained

    with _refusals():
        return load_pretrained(folder, dtype=dtype)


def _pretrained_config(folder: Path, **fields: Any) -> K3Config:
    from k3_model.hub import pretrained_config

    with _refusals():
        return pretrained_config(folder, **fields)


def _load_weights(model: nn.Module, folder: Path) -> None:
    from k3_model.hub import load_weights

    with _refusals():
        load_weights(model, folder)  # type: ignore[arg-type]


def _token_ids(folder: Path) -> Mapping[str, int | None]:
    from k3_model.hub import read_config, token_ids

    with _refusals():
        return token_ids(read_config(folder))


def _describe(config: K3Config) -> str:
    from k3_model.hub import hub_form

    if hub_form(config) == "kimi_linear":
        return "kimi_linear: transformers (AutoModelForCausalLM), vLLM and SGLang load it"
    return ("kimi_k3: Kimi K3's text-model names; SGLang's kimi_k3 loads them, and "
            "transformers with trust_remote_code where k3-model is installed")


SPEC = ModelSpec(
    name="k3",
    config_class=K3Config,
    build=_build,
    presets=PRESETS,
    default_preset="tiny",
    from_dict=K3Config.from_dict,
    set_token_gather=_set_token_gather,
    expert_parallel=ExpertParallel(
        n_experts=_n_experts, shard=_shard, parameters=_expert_parameters,
        reduce_gradients=_reduce_gradients, moved_bytes=_moved_bytes),
    pipeline=PipelineHooks(n_layers=_n_layers, keep=_keep, stage=_stage, loss=_stage_loss,
                           logits=_stage_logits),
    context_parallel=ContextParallelHooks(check=_check_context, set_group=_set_context_group),
    hub=HubFormat(
        model_types=("kimi_linear", "kimi_k3"), save=_save, load=_load,
        config=_pretrained_config, load_weights=_load_weights, token_ids=_token_ids,
        describe=_describe),
)
