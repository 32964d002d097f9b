"""Data: corpora prepared into immutable token shards, and the loader that reads them.

The names load on first use (PEP 562): :mod:`k3_trainer.data.options` stays torch-free
for the command line.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .documents import document_boundary, document_ids
    from .loader import (
        DataError,
        DataExhausted,
        TokenDataLoader,
        check_vocab_fits,
        read_manifest,
    )
    from .mixture import MixtureLoader, Source
    from .options import PrepareOptions, default_workers
    from .prepare import builtin_corpus, describe_prepared, prepare_dataset
    from .protocol import BatchLoader
    from .tokenizer import BytesCodec, Codec, HFCodec, document_start, load_codec

_EXPORTS = {
    "document_boundary": ".documents", "document_ids": ".documents",
    "DataError": ".loader", "DataExhausted": ".loader", "TokenDataLoader": ".loader",
    "check_vocab_fits": ".loader", "read_manifest": ".loader",
    "MixtureLoader": ".mixture", "Source": ".mixture",
    "PrepareOptions": ".options", "default_workers": ".options",
    "BatchLoader": ".protocol",
    "builtin_corpus": ".prepare", "describe_prepared": ".prepare",
    "prepare_dataset": ".prepare",
    "BytesCodec": ".tokenizer", "Codec": ".tokenizer", "HFCodec": ".tokenizer",
    "load_codec": ".tokenizer", "document_start": ".tokenizer",
}

__all__ = [
    "BatchLoader",
    "BytesCodec",
    "Codec",
    "DataError",
    "DataExhausted",
    "HFCodec",
    "MixtureLoader",
    "PrepareOptions",
    "Source",
    "TokenDataLoader",
    "builtin_corpus",
    "check_vocab_fits",
    "default_workers",
    "describe_prepared",
    "document_boundary",
    "document_ids",
    "document_start",
    "load_codec",
    "prepare_dataset",
    "read_manifest",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'k3_trainer.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
