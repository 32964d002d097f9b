"""What the commands build from a plan or a run directory: the device, the loaders, the
model (through its spec), the ``Trainer``, and a run's model restored from its checkpoint
for the commands that continue no training (eval, sample, export)."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..checkpoint import (
    HISTORY,
    LATEST,
    READ_ONLY,
    Checkpointer,
    CheckpointHistory,
    CheckpointStore,
    find_checkpoint,
    run_metadata,
)
from ..compiling import prepare_model
from ..config import ConfigError, TrainConfig
from ..contract import check_model
from ..data import (
    BatchLoader,
    Codec,
    MixtureLoader,
    Source,
    TokenDataLoader,
    check_vocab_fits,
    load_codec,
    read_manifest,
)
from ..distributed import Parallel
from ..models import HubFolderError, ModelSpec, get_model_spec
from ..optim import build_optimizer
from ..record import RunRecord
from ..state import TrainState
from ..trainer import Trainer
from .hub import check_tokenizer, folder_codec, load_folder, trained_with_document_masking
from .resolve import (
    Plan,
    RunError,
    model_config_from,
    read_record,
    train_config_from,
)
from .sources import recorded_sources


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


def loaders(config: TrainConfig, model_config: Any, data_dir: Path,
            parallel: Parallel | None, sources: tuple[Source, ...] = (), *,
            adopt: bool = False) -> tuple[BatchLoader, BatchLoader]:
    """Both loaders (this rank's rows) of one dataset or of a mixture of ``sources``
    (``adopt``: a new phase, which may read another mixture than its checkpoint's),
    checked against the model's vocabulary and length."""
    rank, world = (parallel.rank, parallel.world_size) if parallel is not None else (0, 1)
    train: BatchLoader
    val: BatchLoader
    if sources:
        if config.overfit_batch:
            raise ConfigError("overfit_batch reads one dataset, not a mixture")
        train, val = (MixtureLoader(sources, split, config.batch_size, config.seq_len,
                                    rank=rank, world_size=world,
                                    adopt=adopt) for split in ("train", "val"))
    else:
        train = TokenDataLoader(data_dir, "train", config.batch_size, config.seq_len,
                                rank=rank, world_size=world)
        val = TokenDataLoader(data_dir, "val", config.batch_size, config.seq_len,
                              rank=rank, world_size=world)
    vocab = getattr(model_config, "vocab_size", None)
    if isinstance(vocab, int):
        check_vocab_fits(train, vocab)
    longest = getattr(model_config, "max_seq_len", None)
    if isinstance(longest, int) and config.seq_len > longest:
        raise ConfigError(f"seq_len {config.seq_len} exceeds the model's max_seq_len "
                          f"{longest}")
    return train, val


def build_model(spec: ModelSpec, model_config: Any, device: torch.device) -> nn.Module:
    return spec.build(model_config).to(device)


def build_trainer(plan: Plan, device: torch.device, parallel: Parallel | None,
                  checkpoint: CheckpointStore | Path | None) -> Trainer:
    """Model, optimizer and loaders built from the plan, held by a ``Trainer`` (nothing
    written yet).

    Data parallel: the loaders read this rank's rows, every rank initializes the same
    model from the seed, which is then sharded or replicated before the optimizer is
    built (FSDP2 parameters become DTensors; DDP asks Muon for one owner per matrix).
    Expert parallelism slices the routed experts first (the spec's hooks), so FSDP2
    leaves them alone.
    """
    config, spec = plan.config, plan.spec
    data = loaders(config, plan.model_config, plan.data_dir, parallel, plan.sources,
                   adopt=plan.phase is not None)
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
        raise ConfigError(f"--expert-parallel {config.expert_parallel} needs a torchrun launch "
                          "with --parallel fsdp (e.g. k3-train train --nproc 2 --parallel fsdp)")
    if parallel is not None:
        parallel.shard_experts(model, config.expert_parallel, spec.expert_parallel)
        # Activation checkpointing and compile before sharding/wrapping (the order PyTorch
        # recommends); fit() finds them applied and leaves them be.
        prepare_model(model, config)
        if spec.set_token_gather is not None:
            spec.set_token_gather(model, parallel.gather_rows)
        parallel.wrap(model)
        distributed = True if parallel.mode == "ddp" else None
    optimizer = build_optimizer(model, config, distributed=distributed)
    return Trainer(model, optimizer, data, config, parallel=parallel,
                   checkpoint_path=checkpoint)


@dataclass(frozen=True)
class Restored:
    """A model (and what it is measured on) for a command that trains nothing."""

    spec: ModelSpec
    model: nn.Module
    model_config: Any
    config: TrainConfig
    state: TrainState
    loaders: tuple[BatchLoader, BatchLoader]
    data_dir: Path

    @property
    def max_seq_len(self) -> int:
        return max_seq_len_of(self.model_config, self.config)

    def codec(self) -> Codec:
        """The tokenizer the data was prepared with (every source of a mixture shares it)."""
        return load_codec(self.data_dir, read_manifest(self.data_dir))


def restore(run_dir: Path, data: Path | None, device: torch.device,
            step: int | None = None) -> Restored:
    """The run's model rebuilt from its run.json with its weights and counters read from
    its latest checkpoint (``step``: the one of that step), for commands that continue no
    training (eval, sample, export): only those components are read (no optimizer is
    built, no loader cursor restored), a sharded checkpoint is read into this one
    process, another runtime (threads, torch version, device) is accepted, and the model
    is validated as strictly as for a resume, but not the recipe (:data:`READ_ONLY`): a
    step kept from before a phase is read with its own train config. The loaders read
    the run's data (its latest phase's) with the run's global batch (every rank's rows),
    so validation measures the same tokens as the run's logged one."""
    record = read_record(run_dir)
    found = checkpoint_at(run_dir, step)
    spec = get_model_spec(record.model)
    config = train_config_from(record.train_config, {}, {})
    world = _recorded_world_size(record)
    model_config = model_config_from(spec, None, {}, record.model_config)
    data_dir = data or Path(record.data.dir)
    data_loaders = loaders(config.replace(batch_size=config.batch_size * world), model_config,
                           data_dir, None, () if data is not None else recorded_sources(record))
    seed_everything(config.seed)
    model = build_model(spec, model_config, device)
    state = TrainState()
    from ..checkpoint.components import read_only_states  # the components, declared once

    states = read_only_states(model, state)
    loaded = Checkpointer(states, run_metadata(check_model(model), config), READ_ONLY,
                          subset=True).load(found)
    own = loaded.metadata.get("train_config")
    if isinstance(own, dict):  # the step's own recipe (a step before a phase has another)
        config = train_config_from(own, {}, {})
    return Restored(spec, model, model_config, config, state, data_loaders, data_dir)


@dataclass(frozen=True)
class Opened:
    """A model to read (sample, score) with its tokenizer: ``where`` names it in output;
    ``max_seq_len`` is None for a hub folder whose model declares none."""

    model: nn.Module
    codec: Codec
    where: str
    max_seq_len: int | None
    step: int | None = None
    """The checkpoint's step (a run's; None: a hub folder)."""


def open_model(run_dir: Path | None, folder: Path | None, step: int | None,
               device: torch.device, data: Path | None = None) -> Opened:
    """A run's latest checkpoint (``step``: the one its history kept; ``data``: its data
    elsewhere) or the hub folder ``folder`` with the tokenizer it ships, for the commands
    that only read a model."""
    if folder is not None:
        if step is not None:
            raise ConfigError("--step picks a checkpoint of --run-dir, not of a --model folder")
        spec, model = load_folder(folder, device)
        longest = getattr(getattr(model, "config", None), "max_seq_len", None)
        return Opened(model, folder_codec(folder, spec), str(folder),
                      longest if isinstance(longest, int) else None)
    assert run_dir is not None  # argparse requires one of the two
    checkpoint_at(run_dir, step)  # before run.json: the likelier miss
    restored = restore(run_dir, data, device, step)
    return Opened(restored.model, restored.codec(), f"step {restored.state.step}",
                  restored.max_seq_len, restored.state.step)


def checkpoint_at(run_dir: Path, step: int | None) -> Path:
    """The run's latest checkpoint, or (``step``) the one its history kept for that step;
    ``RunError`` naming the steps it has when there is none."""
    own = (run_dir / LATEST).is_symlink()  # a history folder itself
    history = CheckpointHistory(run_dir if own else run_dir / HISTORY)
    if step is None:
        found = history.latest() if own else find_checkpoint(run_dir)
        if found is None:
            raise RunError(f"{run_dir} has no checkpoint ({run_dir / HISTORY} is empty or "
                           "missing): train it first")
        return found
    at = history.at_step(step)
    if at is None:
        kept = history.steps()
        listed = (f"it keeps steps {', '.join(map(str, kept))}" if kept
                  else "it holds no checkpoint history")
        raise RunError(f"--step {step}: {run_dir} has no checkpoint of step {step}; {listed} "
                       "(train with --keep-last N or --keep-every K to keep more)")
    return at


def _recorded_world_size(record: RunRecord) -> int:
    """The data-parallel world size of the run's last session (1 when it recorded none)."""
    last = record.last_session
    layout = last.data_parallel if last is not None else None
    return layout.world_size if layout is not None and layout.world_size is not None else 1


def pretrained(folder: Path, data: Path | None, device: torch.device,
               flag: str = "--model", sources: tuple[Source, ...] = ()) -> Restored:
    """A hub folder's model with the validation data it is evaluated on (``--data``, or a
    mixture of ``sources``, prepared with the folder's tokenizer), read with the default
    recipe's batch shape and validation budget, and with documents kept apart when the
    folder says its model was trained so."""
    if sources:
        data = sources[0].path
    if data is None:
        raise ConfigError(f"{flag} needs --data: a dataset prepared with the model's "
                          "tokenizer (k3-train prepare ... --tokenizer MODEL/tokenizer.json), "
                          "or a mixture's sources, NAME=DIR[:WEIGHT] each")
    spec, model = load_folder(folder, device)
    model_config = getattr(model, "config", None)
    longest = getattr(model_config, "max_seq_len", None)
    seq_len = TrainConfig().seq_len
    config = TrainConfig(seq_len=min(seq_len, longest) if isinstance(longest, int) else seq_len,
                         document_masking=trained_with_document_masking(folder))
    data_loaders = loaders(config, model_config, data, None, sources)
    note = check_tokenizer(folder, load_codec(data, read_manifest(data)), data, flag)
    if note is not None:
        print(f"k3-train: note: {note}", file=sys.stderr)
    return Restored(spec, model, model_config, config, TrainState(), data_loaders, data)
