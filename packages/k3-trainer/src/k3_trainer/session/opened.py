"""A run or a hub folder opened for reading: the model at a kept step (or a folder's
weights), its tokenizer and the data it is measured on, for everything that trains
nothing (``eval``, ``sample``, ``export``, the lm-eval backend, a notebook)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint import READ_ONLY, Checkpointer, run_metadata
from ..config import ConfigError, TrainConfig
from ..contract import check_model
from ..data import BatchLoader, Codec, Source, load_codec, read_manifest
from ..hub import check_tokenizer, folder_codec, load_folder, trained_with_document_masking
from ..models import ModelSpec, get_model_spec
from ..state import TrainState
from .build import build_model, loaders, max_seq_len_of, seed_everything
from .messages import Say, to_stderr
from .plan import model_config_from, train_config_from
from .run_dir import checkpoint_at, read_record, recorded_sources, recorded_world_size


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


def restore(
    run_dir: Path, data: Path | None, device: torch.device, step: int | None = None
) -> Restored:
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
    world = recorded_world_size(record)
    model_config = model_config_from(spec, None, {}, record.model_config)
    data_dir = data or Path(record.data.dir)
    data_loaders = loaders(
        config.replace(batch_size=config.batch_size * world),
        model_config,
        data_dir,
        None,
        () if data is not None else recorded_sources(record),
    )
    seed_everything(config.seed)
    model = build_model(spec, model_config, device)
    state = TrainState()
    from ..checkpoint.components import read_only_states  # the components, declared once

    states = read_only_states(model, state)
    loaded = Checkpointer(
        states, run_metadata(check_model(model), config), READ_ONLY, subset=True
    ).load(found)
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


def open_model(
    run_dir: Path | None,
    folder: Path | None,
    step: int | None,
    device: torch.device,
    data: Path | None = None,
) -> Opened:
    """A run's latest checkpoint (``step``: the one its history kept; ``data``: its data
    elsewhere) or the hub folder ``folder`` with the tokenizer it ships, for the commands
    that only read a model."""
    if folder is not None:
        if step is not None:
            raise ConfigError("--step picks a checkpoint of --run-dir, not of a --model folder")
        spec, model = load_folder(folder, device)
        longest = getattr(getattr(model, "config", None), "max_seq_len", None)
        return Opened(
            model,
            folder_codec(folder, spec),
            str(folder),
            longest if isinstance(longest, int) else None,
        )
    assert run_dir is not None  # argparse requires one of the two
    checkpoint_at(run_dir, step)  # before run.json: the likelier miss
    restored = restore(run_dir, data, device, step)
    return Opened(
        restored.model, restored.codec(), f"step {restored.state.step}", restored.max_seq_len,
        restored.state.step,
    )


def pretrained(
    folder: Path,
    data: Path | None,
    device: torch.device,
    flag: str = "--model",
    sources: tuple[Source, ...] = (),
    say: Say = to_stderr,
) -> Restored:
    """A hub folder's model with the validation data it is evaluated on (``--data``, or a
    mixture of ``sources``, prepared with the folder's tokenizer), read with the default
    recipe's batch shape and validation budget, and with documents kept apart when the
    folder says its model was trained so."""
    if sources:
        data = sources[0].path
    if data is None:
        raise ConfigError(
            f"{flag} needs --data: a dataset prepared with the model's "
            "tokenizer (k3-train prepare ... --tokenizer MODEL/tokenizer.json), "
            "or a mixture's sources, NAME=DIR[:WEIGHT] each"
        )
    spec, model = load_folder(folder, device)
    model_config = getattr(model, "config", None)
    longest = getattr(model_config, "max_seq_len", None)
    seq_len = TrainConfig().seq_len
    config = TrainConfig(
        seq_len=min(seq_len, longest) if isinstance(longest, int) else seq_len,
        document_masking=trained_with_document_masking(folder),
    )
    data_loaders = loaders(config, model_config, data, None, sources)
    note = check_tokenizer(folder, load_codec(data, read_manifest(data)), data, flag)
    if note is not None:
        say(f"note: {note}")
    return Restored(spec, model, model_config, config, TrainState(), data_loaders, data)
