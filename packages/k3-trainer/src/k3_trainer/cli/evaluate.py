"""``k3-train eval``: the validation loss of a run's checkpoint or of a hub folder, or
(``--tasks``) its downstream task scores."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..data import document_boundary, document_start
from ..data.mixture import Source
from ..evaluation import evaluate_split
from ..session import open_model, parse_device, pretrained, restore
from ..tasks import DownstreamTasks, parse_tasks, summary
from .options import EvalCommand
from .sources import command_line_data


def run(command: EvalCommand, notes: tuple[str, ...] = ()) -> int:
    """The loss over ``--batches`` full batches from the start of the validation split
    (default: as many as the run's own evaluations read, :meth:`~k3_trainer.config.
    TrainConfig.validation_batches`; a hub folder's: the default budget's; ``all``: the
    whole split), with the number of tokens it measured; a mixture's (the run's, or
    ``--model`` with ``--data NAME=DIR[:WEIGHT]`` sources) source by source and combined
    by weight; with ``--tasks``, the tasks' metrics instead."""
    device = parse_device(command.device)
    data, sources = eval_data(command.data)
    if command.tasks is not None:
        if sources:
            raise ConfigError("--tasks scores the tasks' own documents; --data NAME=DIR "
                              "(a mixture) goes with the validation loss")
        return _tasks(command, device, data)
    if command.limit is not None or command.output is not None:
        raise ConfigError("--limit and --output go with --tasks")
    if command.model is not None:
        if command.step is not None:
            raise ConfigError("--step picks a checkpoint of --run-dir, not of a --model folder")
        run_ = pretrained(command.model, data, device, sources=sources)
    else:
        assert command.run_dir is not None  # argparse requires one of the two
        if sources:
            raise ConfigError("--data NAME=DIR[:WEIGHT] (a mixture) goes with --model; "
                              "--run-dir evaluates on the run's own data, its mixture "
                              "included (or on one --data DIR)")
        run_ = restore(command.run_dir, data, device, command.step)
    val = run_.loaders[1]
    parts = getattr(val, "sources", None) or {"": val}  # a mixture: each source to its end
    available = max((part.num_tokens - 1) // part.tokens_per_batch for part in parts.values())
    batches = command.batches
    wanted = available if batches == "all" else int(
        batches or run_.config.validation_batches(val.tokens_per_batch))
    if wanted > available and batches is not None:
        print(f"k3-train: note: --batches {wanted} is more than the validation split holds "
              f"({available} full batches); evaluating all {available}", file=sys.stderr)
    wanted = min(wanted, available)
    result = evaluate_split(run_.model, val, device, wanted, run_.config.precision,
                            document_boundary=document_boundary(val)
                            if run_.config.document_masking else None)
    bpb = "" if result.bpb is None else f", val_bpb {result.bpb:.4f}"
    where = f"step {run_.state.step}" if command.model is None else str(command.model)
    mixture = "" if result.by_source is None else ", mixture by weight"
    print(f"{where}: val_loss {result.loss:.4f}{bpb} "
          f"({result.tokens:,} tokens in {wanted} of {available} batches{mixture})")
    for name, part in (result.by_source or {}).items():
        part_bpb = "" if part.bpb is None else f", val_bpb {part.bpb:.4f}"
        print(f"  {name}: val_loss {part.loss:.4f}{part_bpb} ({part.tokens:,} tokens)")
    return 0


def eval_data(values: list[str] | None) -> tuple[Path | None, tuple[Source, ...]]:
    """``--data``: one dataset folder, or a mixture's ``NAME=DIR[:WEIGHT]`` sources (weight
    default 1); ``(None, ())`` when none is given."""
    return command_line_data(values, default_weight=1.0) if values else (None, ())


def _tasks(command: EvalCommand, device: Any, data: Path | None) -> int:
    """Score ``--tasks`` on the run's checkpoint or the hub folder: a line per task, the
    aggregate, and ``--output``'s JSON (written once everything is scored)."""
    names = parse_tasks(command.tasks or "")
    if command.batches is not None:
        raise ConfigError("--batches counts validation batches; with --tasks use --limit")
    opened = open_model(command.run_dir, command.model, command.step, device, data=data)
    model, codec, where = opened.model, opened.codec, opened.where
    config = getattr(model, "config", None)
    vocab, max_len = (getattr(config, "vocab_size", None), getattr(config, "max_seq_len", None))
    if not isinstance(vocab, int) or not isinstance(max_len, int):
        raise ConfigError("--tasks: the model declares no vocab_size or max_seq_len")
    tasks = DownstreamTasks(names, codec, limit=command.limit, bos=document_start(codec))
    tasks.check(vocab)
    results = tasks.evaluate(model, vocab_size=vocab, max_len=max_len)
    totals = summary(results)
    for name, result in results.items():
        print(f"{where}: {format_task(name, result.metrics)}")
    print(f"{where}: core {totals['core']:+.4f} (mean centered_acc of "
          f"{', '.join(totals['core_tasks'])})")
    for name, result in results.items():
        dropped = sum(1 for d in result.docs if d.dropped)
        if dropped:
            print(f"k3-train: note: {name}: {dropped} document(s) longer than the model's "
                  f"window ({max_len} tokens) kept their contexts' last tokens",
                  file=sys.stderr)
        if result.metrics.get("skipped"):
            print(f"k3-train: note: {name}: {result.metrics['skipped']} document(s) skipped: "
                  f"a continuation alone is longer than the model's window ({max_len} tokens)",
                  file=sys.stderr)
    if command.output is not None:
        measured = ({"model": str(command.model)} if command.model is not None else
                    {"run_dir": str(command.run_dir), "step": opened.step})
        write_json(command.output, {**measured, "limit": command.limit,
                                     "tasks": {n: r.to_json() for n, r in results.items()},
                                     "core": totals["core"],
                                     "core_tasks": totals["core_tasks"]})
    return 0


def format_task(name: str, metrics: dict[str, float]) -> str:
    """One task's metrics on one line."""
    return (f"{name}: acc {metrics['acc']:.4f}, acc_norm {metrics['acc_norm']:.4f}, "
            f"bpb {metrics['bpb']:.4f}, centered_acc {metrics['centered_acc']:+.4f} "
            f"({int(metrics['docs'])} docs"
            + (f", {int(metrics['skipped'])} skipped" if metrics.get("skipped") else "") + ")")


def write_json(path: Path, data: dict[str, Any]) -> None:
    """``data`` as JSON at ``path``, atomically (a partial file is never left)."""
    temporary = path.with_name(path.name + ".tmp")
    try:
        temporary.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise ConfigError(f"--output {path}: cannot write it ({error.strerror})") from None


__all__ = ["eval_data", "format_task", "run", "write_json"]
