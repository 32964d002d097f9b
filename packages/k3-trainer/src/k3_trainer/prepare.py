"""Dataset preparation: tokenize text, split train/val, write immutable shards and a manifest.

The built-in corpus is CPython's own reference documentation: the ``pydoc_data.topics``
module that ships with every standard Python install (the text ``help("while")`` shows,
about 460 KB of English prose and grammar). It needs no download, so the demo runs on a
machine with no network.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .data import MANIFEST, MANIFEST_FORMAT, DataError, file_sha256, token_dtype

BYTE_TOKENIZER = {"name": "bytes-utf8", "vocab_size": 256}
DEFAULT_SHARD_TOKENS = 1 << 24


def builtin_corpus() -> tuple[str, dict[str, Any]]:
    """The built-in corpus text and a description of where it came from."""
    from pydoc_data import topics

    names = sorted(topics.topics)
    text = "\n\n".join(topics.topics[name].strip() for name in names) + "\n"
    return text, {"builtin": "pydoc_data.topics", "python": sys.version.split()[0],
                  "documents": len(names)}


def encode_bytes(text: str) -> np.ndarray:
    """Byte-level tokenizer: the UTF-8 bytes are the token ids (vocabulary 256)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)


def decode_bytes(ids: Sequence[int]) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def prepare_dataset(inputs: Sequence[str | Path], out_dir: str | Path, *,
                    val_fraction: float = 0.05, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                    overwrite: bool = False) -> dict[str, Any]:
    """Tokenize ``inputs`` (text files; none = the built-in corpus) into ``out_dir``.

    The stream of documents is split by tokens: the last ``val_fraction`` is validation.
    Shards are written to a temporary folder that replaces ``out_dir`` only when complete,
    so an interrupted prepare never leaves something that looks like a dataset. Returns
    the manifest.
    """
    out_dir = Path(out_dir)
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be positive, got {shard_tokens!r}")
    if out_dir.exists() and not overwrite:
        raise DataError(f"{out_dir} already exists; choose another --out or remove it")

    if inputs:
        texts, sources = [], []
        for item in inputs:
            path = Path(item)
            try:
                texts.append(path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                raise DataError(f"input {path} not found") from None
            except (OSError, UnicodeDecodeError) as exc:
                raise DataError(f"input {path} is not readable UTF-8 text: {exc}") from None
            sources.append({"file": str(path), "sha256": file_sha256(path)})
        text, source = "\n\n".join(texts), {"files": sources}
    else:
        text, source = builtin_corpus()
    tokens = encode_bytes(text)
    if len(tokens) < 2:
        raise DataError("the corpus is empty: nothing to train on")

    n_val = max(1, round(len(tokens) * val_fraction))
    splits = {"train": tokens[:-n_val], "val": tokens[-n_val:]}
    vocab_size = 256  # the byte tokenizer's vocabulary
    dtype = token_dtype(vocab_size)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        manifest: dict[str, Any] = {
            "format": MANIFEST_FORMAT,
            "tokenizer": dict(BYTE_TOKENIZER),
            "vocab_size": vocab_size,
            "dtype": dtype,
            "source": source,
            "splits": {},
        }
        for split, data in splits.items():
            entries = []
            for index, start in enumerate(range(0, len(data), shard_tokens)):
                name = f"{split}_{index:05d}.npy"
                np.save(staging / name, np.ascontiguousarray(data[start:start + shard_tokens],
                                                              dtype=dtype))
                entries.append({"file": name, "tokens": min(shard_tokens, len(data) - start),
                                "sha256": file_sha256(staging / name)})
            manifest["splits"][split] = entries
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        for file in staging.iterdir():
            os.chmod(file, 0o444)  # shards are immutable once written
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest
