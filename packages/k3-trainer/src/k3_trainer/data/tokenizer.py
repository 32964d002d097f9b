"""Tokenizers for ``prepare`` and ``sample``: UTF-8 bytes, or a Hugging Face ``tokenizers`` file.

Both kinds expose the same small interface (:class:`Codec`): batch encoding without
special tokens, decoding, the end-of-document id that separates documents in the shards,
and the number of UTF-8 bytes each token stands for (the denominator of bits per byte).

The byte tokenizer keeps the vocabulary at 256 by using byte ``0xFF`` as its
end-of-document token: that byte never occurs in UTF-8 text.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from .loader import DataError

BYTES_EOD = 0xFF
TRAINED_EOD = "<|endoftext|>"
EOD_CANDIDATES = (TRAINED_EOD, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")
TOKENIZER_FILE = "tokenizer.json"


def require_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise DataError("this tokenizer needs the tokenizers library: pip install tokenizers"
                        ) from None
    return tokenizers


@cache
def byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2 convention): one printable character per byte.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to
    code points 256, 257, ... in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + shifted)] = byte
            shifted += 1
    return chars


class Codec:
    """The interface ``prepare`` and ``sample`` use; see :class:`BytesCodec`, :class:`HFCodec`."""

    kind: str
    vocab_size: int
    eod_id: int

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def token_byte_lengths(self) -> np.ndarray:
        """UTF-8 bytes per token id (the end-of-document token counts as one byte: the
        separator, so every tokenizer divides the same text by the same byte count)."""
        raise NotImplementedError

    def spec(self) -> dict[str, Any]:
        """What a worker process needs to rebuild this codec (picklable)."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """The manifest's ``tokenizer`` entry."""
        raise NotImplementedError


class BytesCodec(Codec):
    kind, vocab_size, eod_id = "bytes", 256, BYTES_EOD

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) for i in ids if int(i) != BYTES_EOD)
        return data.decode("utf-8", errors="replace")

    def token_byte_lengths(self) -> np.ndarray:
        return np.ones(256, dtype=np.uint16)

    def spec(self) -> dict[str, Any]:
        return {"kind": "bytes"}

    def describe(self) -> dict[str, Any]:
        return {"kind": "bytes", "name": "bytes-utf8", "eod_id": BYTES_EOD,
                "eod_token": "0xFF", "special_ids": {"eod": BYTES_EOD}}


class HFCodec(Codec):
    """A Hugging Face ``tokenizers`` tokenizer; texts are encoded without special tokens."""

    kind = "huggingface"

    def __init__(self, json_text: str, eod_token: str | None = None,
                 source: str = "tokenizer.json") -> None:
        tokenizers = require_tokenizers()
        try:
            self.tokenizer = tokenizers.Tokenizer.from_str(json_text)
        except Exception as exc:  # the library raises a bare Exception for bad files
            raise DataError(f"{source} is not a tokenizers file: {exc}") from None
        self.json_text = json_text
        self.vocab_size = int(self.tokenizer.get_vocab_size(with_added_tokens=True))
        candidates = (eod_token,) if eod_token else EOD_CANDIDATES
        found = [(t, self.tokenizer.token_to_id(t)) for t in candidates]
        found = [(t, i) for t, i in found if i is not None]
        if not found:
            raise DataError(f"{source} has no end-of-document token "
                            f"({', '.join(candidates)}); name one with --eod-token")
        self.eod_token, self.eod_id = found[0]

    @classmethod
    def from_file(cls, path: str | Path, eod_token: str | None = None) -> HFCodec:
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise DataError(f"tokenizer {path} not found") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"tokenizer {path} cannot be read: {exc}") from None
        return cls(text, eod_token, source=str(path))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # encode_batch, not encode_batch_fast: measured as fast or faster here (bench_data)
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.array(e.ids, dtype=np.uint32) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return str(self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True))

    def special_ids(self) -> dict[str, int]:
        added = self.tokenizer.get_added_tokens_decoder()
        return {token.content: int(i) for i, token in sorted(added.items()) if token.special}

    def token_byte_lengths(self) -> np.ndarray:
        """Exact for byte-level tokenizers (each character of a token is one byte);
        otherwise the UTF-8 length of each token decoded on its own."""
        decoder = (json.loads(self.json_text).get("decoder") or {}).get("type")
        alphabet = byte_decoder()
        added = self.tokenizer.get_added_tokens_decoder()
        lengths = np.zeros(self.vocab_size, dtype=np.uint16)
        for i in range(self.vocab_size):
            token = self.tokenizer.id_to_token(i)
            if i == self.eod_id:
                lengths[i] = 1
            elif token is None or (i in added and added[i].special):
                lengths[i] = 0
            elif i in added:
                lengths[i] = len(token.encode("utf-8"))
            elif decoder == "ByteLevel" and all(c in alphabet for c in token):
                lengths[i] = len(token)
            else:
                lengths[i] = len(self.decode([i]).encode("utf-8"))
        return lengths

    def spec(self) -> dict[str, Any]:
        return {"kind": "huggingface", "json": self.json_text, "eod_token": self.eod_token}

    def describe(self) -> dict[str, Any]:
        return {"kind": "huggingface", "name": TOKENIZER_FILE, "file": TOKENIZER_FILE,
                "sha256": hashlib.sha256(self.json_text.encode("utf-8")).hexdigest(),
                "eod_id": self.eod_id, "eod_token": self.eod_token,
                "special_ids": self.special_ids()}


def document_start(codec: Codec) -> int:
    """The token a text begins with, as training saw documents: prepared shards separate
    documents with the end-of-document token, so every document after the first begins
    right after it. ``k3-train sample``, ``eval --tasks``, ``--downstream`` and the exported
    tokenizer (its ``tokenizer(text)``) all put it in front of a text."""
    return codec.eod_id


def codec_from_spec(spec: dict[str, Any]) -> Codec:
    if spec["kind"] == "bytes":
        return BytesCodec()
    return HFCodec(spec["json"], spec["eod_token"])


def train_bpe(texts: Iterator[str], vocab_size: int) -> HFCodec:
    """Train a byte-level BPE (GPT-2 pre-tokenization) with ``<|endoftext|>`` as id 0.

    The library's trainer is deterministic for the same texts in the same order.
    """
    if vocab_size < 258:
        raise DataError(f"--train-tokenizer {vocab_size}: the vocabulary needs room for the "
                        "256 bytes and the end-of-document token (at least 258)")
    tk = require_tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[TRAINED_EOD], show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return HFCodec(tokenizer.to_str(), TRAINED_EOD)


def load_codec(data_dir: str | Path, manifest: dict[str, Any]) -> Codec:
    """The tokenizer a prepared dataset was made with (its file already verified)."""
    info = manifest["tokenizer"]
    if info["kind"] == "bytes":
        return BytesCodec()
    return HFCodec.from_file(Path(data_dir) / info["file"], info["eod_token"])
