"""``PrepareOptions``: how ``prepare`` reads, tokenizes, shuffles and splits a corpus.

Torch-free, so ``k3-train`` builds its parser (and answers ``--help``) without torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SHARD_TOKENS = 1 << 24
DEFAULT_SHUFFLE_SEED = 20_251_202
"""``prepare``'s document shuffle seed unless ``--shuffle-seed`` names another."""
BUCKET_BYTES = 256 << 20
"""Input per shuffle bucket: about what one bucket holds in memory while it is permuted."""


def default_workers() -> int:
    """All cores this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


@dataclass(frozen=True)
class PrepareOptions:
    """How ``prepare_dataset`` reads, tokenizes and splits a corpus (``k3-train prepare``'s
    options).

    ``tokenizer`` is ``"bytes"`` or the path of a ``tokenizers`` file; ``train_tokenizer``
    trains a byte-level BPE of that vocabulary size on the inputs (the first
    ``tokenizer_sample_mb`` MB of text, default all; for ``prepare_each``, that many MB
    drawn from the inputs in proportion to their sizes); ``eod_token`` names the
    end-of-document token of a given tokenizer (default: a known name); ``text_field`` is
    the text of JSONL records and Parquet rows; every ``round(1 / val_fraction)``-th
    document is validation, after a seeded shuffle of the documents (``shuffle_seed``).
    Inside input folders, files with a known suffix are read, plus those whose name
    matches an ``include`` glob pattern, less those whose name matches an ``exclude`` one.
    """

    val_fraction: float = 0.05
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    tokenizer: str | Path = "bytes"
    train_tokenizer: int | None = None
    tokenizer_sample_mb: float | None = None
    text_field: str = "text"
    eod_token: str | None = None
    workers: int = 1
    shuffle_seed: int | None = DEFAULT_SHUFFLE_SEED
    """Documents are shuffled with this seed before the validation split (None: kept in
    input order)."""
    include: tuple[str, ...] = ()
    """Glob patterns on file names: files inside input folders to read besides the known
    suffixes (``*.h``, ``README``, ``*``); each must match a file."""
    exclude: tuple[str, ...] = ()
    """Glob patterns on file names: files inside input folders not to read (applied after
    ``include``; files named as inputs are always read)."""
    allow_eod_in_text: bool = False
    """Keep going when the end-of-document token occurs inside the documents' own text (an
    ordinary token named by ``eod_token``, or a special token's text in the corpus): the
    shards then hold it where no document ends, and document masking cuts the documents
    there. Refused without it; the manifest records how often it occurred."""
