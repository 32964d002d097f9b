"""``k3-train prepare``: tokenize a corpus into a dataset folder."""

from __future__ import annotations

import sys

from ..data.options import PrepareOptions, default_workers
from ..data.prepare import describe_prepared, prepare_dataset
from .options import PrepareCommand


def run(command: PrepareCommand, notes: tuple[str, ...] = ()) -> int:
    options = PrepareOptions(
        val_fraction=command.val_fraction, tokenizer=command.tokenizer,
        train_tokenizer=command.train_tokenizer,
        tokenizer_sample_mb=command.tokenizer_sample, text_field=command.text_field,
        eod_token=command.eod_token, workers=command.workers or default_workers(),
        shard_tokens=command.shard_tokens,
        shuffle_seed=None if command.no_shuffle else command.shuffle_seed)
    manifest = prepare_dataset(command.inputs, command.out, options,
                               progress=sys.stderr.isatty())
    print(describe_prepared(command.out, manifest))
    return 0
