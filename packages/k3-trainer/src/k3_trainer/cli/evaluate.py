"""``k3-train eval``: the validation loss of a run's checkpoint or of a hub folder."""

from __future__ import annotations

import sys

from ..config import ConfigError
from ..evaluation import evaluate_split
from .build import parse_device, pretrained, restore
from .options import EvalCommand


def run(command: EvalCommand, notes: tuple[str, ...] = ()) -> int:
    """The loss over ``--batches`` full batches from the start of the validation split
    (default: the run's ``eval_batches``, or its whole split up to ``eval_tokens``;
    ``all``: the whole split), with the number of tokens it measured."""
    device = parse_device(command.device)
    if command.model is not None:
        if command.step is not None:
            raise ConfigError("--step picks a checkpoint of --run-dir, not of a --model folder")
        run_ = pretrained(command.model, command.data, device)
    else:
        assert command.run_dir is not None  # argparse requires one of the two
        run_ = restore(command.run_dir, command.data, device, command.step)
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
    result = evaluate_split(run_.model, val, device, wanted, run_.config.precision)
    bpb = "" if result.bpb is None else f", val_bpb {result.bpb:.4f}"
    where = f"step {run_.state.step}" if command.model is None else str(command.model)
    mixture = "" if result.by_source is None else ", mixture by weight"
    print(f"{where}: val_loss {result.loss:.4f}{bpb} "
          f"({result.tokens:,} tokens in {wanted} of {available} batches{mixture})")
    for name, part in (result.by_source or {}).items():
        part_bpb = "" if part.bpb is None else f", val_bpb {part.bpb:.4f}"
        print(f"  {name}: val_loss {part.loss:.4f}{part_bpb} ({part.tokens:,} tokens)")
    return 0
