"""Type stub of ``k3_trainer.data``'s lazily loaded public names: the one list of them
(``lazy_loader.attach_stub`` reads it at import; type checkers read it instead of
``__init__.py``)."""

from .documents import document_boundary, document_ids
from .loader import (
    DataError,
    DataExhausted,
    DataMismatch,
    TokenDataLoader,
    check_vocab_fits,
    read_manifest,
)
from .mixture import MixtureLoader, Source
from .options import PrepareOptions, default_workers
from .prepare import builtin_corpus, describe_prepared, prepare_dataset
from .protocol import BatchLoader
from .tokenizer import BytesCodec, Codec, HFCodec, document_start, load_codec

__all__ = [
    "BatchLoader",
    "BytesCodec",
    "Codec",
    "DataError",
    "DataExhausted",
    "DataMismatch",
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
