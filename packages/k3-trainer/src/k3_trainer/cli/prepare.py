"""``k3-train prepare``: tokenize a corpus into a dataset folder, or each input into its own
dataset with one shared tokenizer (``--out-each``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..data.options import PrepareOptions, default_workers
from ..data.prepare import describe_prepared, prepare_dataset, prepare_each
from .options import PrepareCommand


def run(command: PrepareCommand, notes: tuple[str, ...] = ()) -> int:
    options = PrepareOptions(
        val_fraction=command.val_fraction, tokenizer=command.tokenizer,
        train_tokenizer=command.train_tokenizer,
        tokenizer_sample_mb=command.tokenizer_sample, text_field=command.text_field,
        eod_token=command.eod_token, workers=command.workers or default_workers(),
        shard_tokens=command.shard_tokens,
        shuffle_seed=None if command.no_shuffle else command.shuffle_seed,
        include=tuple(command.include or ()), exclude=tuple(command.exclude or ()),
        allow_eod_in_text=command.allow_eod_in_text)
    progress = sys.stderr.isatty()
    if command.out_each is None:
        assert command.out is not None  # argparse requires one of --out and --out-each
        manifest = prepare_dataset(command.inputs, command.out, options,
                                   overwrite=command.overwrite, progress=progress)
        print(describe_prepared(command.out, manifest))
        return 0
    manifests = prepare_each(command.inputs, command.out_each, options,
                             overwrite=command.overwrite, progress=progress)
    for out, manifest in manifests.items():
        print(describe_prepared(out, manifest))
    print(_mixture_hint(manifests))
    return 0


def _mixture_hint(manifests: dict[Path, dict[str, Any]]) -> str:
    """How the datasets train together (they share one tokenizer)."""
    first = next(iter(manifests.values()))["tokenizer"]
    which = (f"tokenizer.json sha256 {first['sha256'][:12]}" if first["kind"] != "bytes"
             else "the byte tokenizer")
    sources = " ".join(f"--data {_source_name(out.name)}={out}:WEIGHT" for out in manifests)
    return (f"{len(manifests)} datasets share one tokenizer ({which}); train them as a "
            f"mixture with {sources}")


def _source_name(name: str) -> str:
    """A mixture source name (letters, digits, - and _) for a dataset folder's name."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name) or "source"
