"""What a session builds from its plan: the device, the loaders (this rank's rows), the
model through its spec, and the ``Trainer`` that holds them (nothing written yet)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..checkpoint import CheckpointStore
from ..compiling import prepare_model
from ..config import ConfigError, TrainConfig
from ..data import BatchLoader, MixtureLoader, Source, TokenDataLoader, check_vocab_fits
from ..distributed import Parallel
from ..models import HubFolderError, ModelSpec
from ..optim import build_optimizer
from ..pipeline import Pipeline
from ..trainer import Trainer
from .plan import Plan


def parse_device(name: str) -> torch.device:
    """``--device``: auto, cpu, cuda or cuda:N, checked against this machine."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device: unknown device {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name}: k3-train trains on cpu or cuda only")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def max_seq_len_of(model_config: Any, config: TrainConfig) -> int:
    """The longest sequence the model takes: its config's ``max_seq_len``, else the run's
    ``seq_len`` (a model that declares none was trained on that)."""
    length = getattr(model_config, "max_seq_len", None)
    return length if isinstance(length, int) else config.seq_len


def loaders(
    config: TrainConfig,
    model_config: Any,
    data_dir: Path,
    parallel: Parallel | None,
    sources: tuple[Source, ...] = (),
    *,
    adopt: bool = False,
) -> tuple[BatchLoader, BatchLoader]:
    """Both loaders (this rank's rows) of one dataset or of a mixture of ``sources``
    (``adopt``: a new phase, which may read another mixture than its checkpoint's),
    checked against the model's vocabulary and length."""
    rank, world = (parallel.data_rank, parallel.data_parallel) if parallel is not None \
        else (0, 1)
    train: BatchLoader
    val: BatchLoader
    if sources:
        if config.overfit_batch:
            raise ConfigError("overfit_batch reads one dataset, not a mixture")
        train, val = (
            MixtureLoader(
                sources,
                split,
                config.batch_size,
                config.seq_len,
                rank=rank,
                world_size=world,
                adopt=adopt,
            )
            for split in ("train", "val")
        )
    else:
        train = TokenDataLoader(
            data_dir, "train", config.batch_size, config.seq_len, rank=rank, world_size=world
        )
        val = TokenDataLoader(
            data_dir, "val", config.batch_size, config.seq_len, rank=rank, world_size=world
        )
    vocab = getattr(model_config, "vocab_size", None)
    if isinstance(vocab, int):
        check_vocab_fits(train, vocab)
    longest = getattr(model_config, "max_seq_len", None)
    if isinstance(longest, int) and config.seq_len > longest:
        raise ConfigError(f"seq_len {config.seq_len} exceeds the model's max_seq_len {longest}")
    return train, val


def build_model(spec: ModelSpec, model_config: Any, device: torch.device) -> nn.Module:
    return spec.build(model_config).to(device)


def build_trainer(
    plan: Plan,
    device: torch.device,
    parallel: Parallel | None,
    checkpoint: CheckpointStore | Path | None,
) -> Trainer:
    """Model, optimizer and loaders built from the plan, held by a ``Trainer`` (nothing
    written yet).

    Data parallel: the loaders read this rank's rows, every rank initializes the same
    model from the seed, which is then sharded or replicated before the optimizer is
    built (FSDP2 parameters become DTensors; DDP asks Muon for one owner per matrix).
    Expert parallelism slices the routed experts first (the spec's hooks), so FSDP2
    leaves them alone; context parallelism sets the model to its ``cp`` group (the
    spec's hooks), the loaders reading by data rank.
    """
    config, spec = plan.config, plan.spec
    data = loaders(
        config,
        plan.model_config,
        plan.data_dir,
        parallel,
        plan.sources,
        adopt=plan.phase is not None,
    )
    seed_everything(config.seed)
    model = build_model(spec, plan.model_config, device)
    if plan.init_from is not None:  # continued pretraining: the folder's weights
        assert spec.hub is not None  # resolving refused a spec without one
        try:
            spec.hub.load_weights(model, plan.init_from)
        except HubFolderError as exc:
            raise ConfigError(f"--init-from {exc}") from None
    distributed: bool | None = None
    if config.expert_parallel > 1 and parallel is None:
        raise ConfigError(
            f"--expert-parallel {config.expert_parallel} needs a torchrun launch "
            "with --parallel fsdp (e.g. k3-train train --nproc 2 --parallel fsdp)"
        )
    pipeline = None
    if parallel is not None and parallel.pipeline > 1:
        if spec.pipeline is None:
            raise ConfigError(f"--pipeline-parallel: the model {spec.name!r} declares no way "
                              "to cut it into stages")
        pipeline = Pipeline(model, spec.pipeline, parallel, config)  # cuts the model
    if parallel is not None and parallel.context_parallel > 1:
        hooks = spec.context_parallel
        if hooks is None:
            raise ConfigError(f"--context-parallel: the model {spec.name!r} declares no way "
                              "to split a sequence over ranks")
        hooks.set_group(model, parallel.context_group)  # the forward now takes slices
    if parallel is not None:
        parallel.shard_experts(model, config.expert_parallel, spec.expert_parallel)
        # Activation checkpointing and compile before sharding/wrapping (the order PyTorch
        # recommends); fit() finds them applied and leaves them be.
        prepare_model(model, config)
        if spec.set_token_gather is not None:
            spec.set_token_gather(model, parallel.gather_rows)
        parallel.wrap(model, None if pipeline is None else pipeline.modules)
        distributed = True if parallel.mode == "ddp" else None
    if pipeline is not None:
        pipeline.start()
        assert parallel is not None  # stages need the process group
        parallel.stages = pipeline
    optimizer = build_optimizer(model, config, distributed=distributed,
                                stage=pipeline is not None)
    return Trainer(model, optimizer, data, config, parallel=parallel, checkpoint_path=checkpoint)
