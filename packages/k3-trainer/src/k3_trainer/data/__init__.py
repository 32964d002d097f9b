"""Data: corpora prepared into immutable token shards, and the loader that reads them."""

from .loader import (
    DataError,
    DataExhausted,
    TokenDataLoader,
    check_vocab_fits,
    read_manifest,
)
from .prepare import (
    PrepareOptions,
    builtin_corpus,
    default_workers,
    describe_prepared,
    prepare_dataset,
)
from .tokenizer import BytesCodec, Codec, HFCodec, load_codec

__all__ = [
    "BytesCodec",
    "Codec",
    "DataError",
    "DataExhausted",
    "HFCodec",
    "PrepareOptions",
    "TokenDataLoader",
    "builtin_corpus",
    "check_vocab_fits",
    "default_workers",
    "describe_prepared",
    "load_codec",
    "prepare_dataset",
    "read_manifest",
]
