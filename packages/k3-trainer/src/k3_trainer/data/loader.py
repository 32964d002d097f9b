"""Token shards, their manifest, and ``TokenDataLoader`` (a cursor over a memory-mapped split).

A prepared dataset is a folder with ``manifest.json``, immutable ``.npy`` shards, the
bytes-per-token table (``token_bytes.npy``, for bits per byte) and, for a ``tokenizers``
tokenizer, its ``tokenizer.json``. The manifest lists, per split, each shard's file, token
count and sha256, plus the tokenizer (kind, end-of-document id, file sha256), vocabulary
size and dtype. Its digest is the loader's identity and covers every file by its sha256,
so a checkpoint refuses to resume on different data or a different tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..json_file import read_json_object

if TYPE_CHECKING:
    from .protocol import BatchLoader

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "k3-tokens/2"
OLD_FORMATS = ("k3-tokens/1",)
TOKEN_BYTES = "token_bytes.npy"


class DataError(ValueError):
    """A dataset folder, manifest or shard is missing, malformed or modified."""


class DataMismatch(DataError):
    """A loader's saved state belongs to other data (another dataset or mixture): resuming
    on it needs the run's own data, or a new phase that may change it."""


class DataExhausted(Exception):
    """The split has no complete batch left at the cursor (loaders never wrap by themselves)."""


def token_dtype(vocab_size: int) -> str:
    """uint16 when every id fits, else uint32."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def manifest_digest(manifest: dict[str, Any]) -> str:
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    """Load and structurally validate ``data_dir/manifest.json``."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(f"{path} not found: prepare a dataset with `k3-train prepare --out DIR`")
    manifest = read_json_object(path, DataError)
    if manifest.get("format") in OLD_FORMATS:
        raise DataError(f"{path} is a {manifest['format']} manifest from an older k3-trainer; "
                        f"prepare the dataset again (`k3-train prepare`) to get {MANIFEST_FORMAT}")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise DataError(f"{path} is not a {MANIFEST_FORMAT} manifest")
    vocab = manifest.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 2:
        raise DataError(f"{path}: vocab_size must be an integer >= 2, got {vocab!r}")
    if manifest.get("dtype") != token_dtype(vocab):
        raise DataError(
            f"{path}: dtype {manifest.get('dtype')!r} does not match vocab_size {vocab} "
            f"(expected {token_dtype(vocab)})"
        )
    splits = manifest.get("splits")
    if not isinstance(splits, dict) or not splits:
        raise DataError(f"{path}: no splits")
    for split, shards in splits.items():
        if not isinstance(shards, list) or not all(
            isinstance(s, dict) and {"file", "tokens", "sha256"} <= set(s) for s in shards
        ):
            raise DataError(f"{path}: split {split!r} must list shards with file, tokens, sha256")
        for shard in shards:
            _check_shard_entry(path, split, shard)
    _check_tokenizer_entry(path, manifest.get("tokenizer"), vocab)
    table = manifest.get("token_bytes")
    if not isinstance(table, dict) or not {"file", "sha256"} <= set(table):
        raise DataError(f"{path}: token_bytes must name the bytes-per-token file and its sha256")
    _check_file_entry(path, "token_bytes", table["file"], table["sha256"])
    return manifest


def _check_tokenizer_entry(path: Path, tokenizer: Any, vocab: int) -> None:
    """Kind, end-of-document id, and (``tokenizers`` files) the file name and sha256."""
    if not isinstance(tokenizer, dict) or tokenizer.get("kind") not in ("bytes", "huggingface"):
        raise DataError(f"{path}: tokenizer must be an object with kind 'bytes' or "
                        f"'huggingface', got {tokenizer!r}")
    eod = tokenizer.get("eod_id")
    if isinstance(eod, bool) or not isinstance(eod, int) or not 0 <= eod < vocab:
        raise DataError(f"{path}: tokenizer eod_id must be an id below vocab_size {vocab}, "
                        f"got {eod!r}")
    if tokenizer["kind"] == "huggingface":
        _check_file_entry(path, "tokenizer", tokenizer.get("file"), tokenizer.get("sha256"))


def _check_file_entry(path: Path, what: str, name: Any, digest: Any) -> None:
    if not (isinstance(name, str) and name and name not in (".", "..")
            and "/" not in name and "\\" not in name):
        raise DataError(f"{path}: {what} file {name!r} must be a file name inside the dataset "
                        "folder")
    if not _is_sha256(digest):
        raise DataError(f"{path}: {what} file {name} has sha256 {digest!r}; expected 64 hex "
                        "digits")


def _is_sha256(digest: Any) -> bool:
    return (isinstance(digest, str) and len(digest) == 64
            and all(c in "0123456789abcdef" for c in digest))


def verified_file(data_dir: Path, name: str, digest: str, what: str) -> Path:
    """``data_dir/name``, refused when missing or when its sha256 is not ``digest``."""
    file = data_dir / name
    if not file.is_file():
        raise DataError(f"{what} {file} listed in the manifest is missing")
    if file_sha256(file) != digest:
        raise DataError(f"{what} {file} does not match its manifest sha256: it was modified "
                        "after the dataset was prepared; prepare the dataset again")
    return file


def _check_shard_entry(path: Path, split: str, shard: dict[str, Any]) -> None:
    """A shard is a plain file name inside the dataset folder, a token count and a digest."""
    name, tokens, digest = shard["file"], shard["tokens"], shard["sha256"]
    if not (isinstance(name, str) and name and name not in (".", "..")
            and "/" not in name and "\\" not in name):
        raise DataError(f"{path}: split {split!r} names shard file {name!r}; a shard must be a "
                        "file name inside the dataset folder")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise DataError(f"{path}: shard {name} has token count {tokens!r}; expected an "
                        "integer >= 0")
    if not _is_sha256(digest):
        raise DataError(f"{path}: shard {name} has sha256 {digest!r}; expected 64 hex digits")


def check_vocab_fits(loader: BatchLoader, vocab_size: int) -> None:
    """Refuse data whose token ids can exceed the model's vocabulary."""
    if loader.vocab_size > vocab_size:
        raise DataError(f"the data's vocabulary ({loader.vocab_size}) exceeds the model's "
                        f"vocab_size ({vocab_size}); choose a preset or a [model] vocab_size "
                        "that covers the tokenizer")


class TokenDataLoader:
    """Causal ``(x, y)`` batches read sequentially from one split's memory-mapped shards.

    Row ``i`` of a batch at cursor ``o`` is the token window ``[o + i·T, o + (i+1)·T + 1)``;
    ``x`` is its first ``T`` tokens and ``y`` the same shifted by one. Each batch advances
    the cursor by ``B·T``. At the end of the split :meth:`next_batch` raises
    :class:`DataExhausted` instead of wrapping; :meth:`reset` starts over.

    Data parallel: with ``world_size=W`` the global batch is ``W·B`` rows and this loader
    (``rank`` r) reads rows ``[r·B, (r+1)·B)`` of it, the rows a one-process loader with
    batch ``W·B`` gives there. The cursor is global (identical on every rank) and
    advances by ``W·B·T``, so W ranks together read exactly the one-process stream.
    """

    def __init__(self, path: str | Path, split: str, batch_size: int, seq_len: int, *,
                 verify: bool = True, rank: int = 0, world_size: int = 1) -> None:
        self.path = Path(path)
        self.split = split
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        if self.batch_size < 1 or self.seq_len < 1:
            raise DataError("batch_size and seq_len must be positive")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world_size {world_size}")
        self.rank, self.world_size = int(rank), int(world_size)
        self.manifest = read_manifest(self.path)
        self.manifest_digest = manifest_digest(self.manifest)
        self.vocab_size: int = self.manifest["vocab_size"]
        if split not in self.manifest["splits"]:
            raise DataError(f"{self.path / MANIFEST} has no split {split!r}")
        self.tokenizer: dict[str, Any] = self.manifest["tokenizer"]
        if verify and self.tokenizer["kind"] == "huggingface":
            verified_file(self.path, self.tokenizer["file"], self.tokenizer["sha256"],
                          "tokenizer file")
        self._shards = [self._open(entry, verify) for entry in self.manifest["splits"][split]]
        self.token_bytes = self._token_bytes(verify)
        self._starts = np.cumsum([0] + [len(s) for s in self._shards])
        self.num_tokens = int(self._starts[-1])
        if self.num_tokens < self.tokens_per_batch + 1:
            raise DataError(
                f"split {split!r} of {self.path} has {self.num_tokens} tokens, fewer than one "
                f"batch needs ({self.batch_size}×{self.seq_len}+1); use a smaller batch_size or "
                "seq_len, or more data"
            )
        self.offset = 0

    def _open(self, entry: dict[str, Any], verify: bool) -> np.ndarray:
        file = self.path / entry["file"]
        if not file.is_file():
            raise DataError(f"shard {file} listed in the manifest is missing")
        if verify and file_sha256(file) != entry["sha256"]:
            raise DataError(
                f"shard {file} does not match its manifest sha256: it was modified after the "
                "dataset was prepared; prepare the dataset again"
            )
        try:
            array = np.load(file, mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise DataError(f"shard {file} is not a readable .npy array: {exc}") from None
        if array.ndim != 1 or array.dtype != np.dtype(self.manifest["dtype"]):
            raise DataError(f"shard {file} is {array.dtype}{list(array.shape)}, expected 1-D "
                            f"{self.manifest['dtype']}")
        if len(array) != entry["tokens"]:
            raise DataError(f"shard {file} holds {len(array)} tokens, the manifest says "
                            f"{entry['tokens']}")
        return np.asarray(array)

    def _token_bytes(self, verify: bool) -> np.ndarray:
        """UTF-8 bytes per token id, for bits per byte (one entry per vocabulary id)."""
        entry = self.manifest["token_bytes"]
        file = self.path / entry["file"]
        if verify:
            verified_file(self.path, entry["file"], entry["sha256"], "token_bytes file")
        try:
            table = np.load(file)
        except (OSError, ValueError) as exc:
            raise DataError(f"{file} is not a readable .npy array: {exc}") from None
        if table.ndim != 1 or len(table) != self.vocab_size or table.dtype.kind != "u":
            raise DataError(f"{file} is {table.dtype}{list(table.shape)}, expected one unsigned "
                            f"integer per vocabulary id ({self.vocab_size})")
        return np.asarray(table, dtype=np.int64)

    @property
    def tokens_per_batch(self) -> int:
        """Tokens the cursor advances per batch: the global batch (all ranks)."""
        return self.batch_size * self.seq_len * self.world_size

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the split (across shards), read-only."""
        pieces, end = [], start + length
        for shard, lo in zip(self._shards, self._starts[:-1]):
            hi = lo + len(shard)
            if hi > start and lo < end:
                pieces.append(shard[max(start, lo) - lo: min(end, hi) - lo])
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def batch_at(self, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch whose window starts at ``offset``, without moving the cursor."""
        if offset < 0 or offset + self.tokens_per_batch + 1 > self.num_tokens:
            raise DataExhausted(f"no complete batch at offset {offset} of split {self.split!r}")
        rows = self.batch_size * self.seq_len  # this rank's share of the global batch
        window = torch.from_numpy(
            self.window(offset + self.rank * rows, rows + 1).astype(np.int64))
        x = window[:-1].view(self.batch_size, self.seq_len)
        y = window[1:].view(self.batch_size, self.seq_len)
        return x, y

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch at the cursor; advances the cursor by :attr:`tokens_per_batch`."""
        batch = self.batch_at(self.offset)
        self.offset += self.tokens_per_batch
        return batch

    def reset(self) -> None:
        self.offset = 0

    def state_dict(self) -> dict[str, Any]:
        """The cursor and the loader's identity: the data (manifest digest) and its split."""
        return {"offset": self.offset, "manifest_digest": self.manifest_digest,
                "split": self.split}

    def load_state_dict(self, state: Mapping[str, Any], /) -> None:
        """Restore a cursor saved by :meth:`state_dict` on the same data and split."""
        offset = state.get("offset")
        if state.get("split") != self.split:
            raise DataError(f"loader state belongs to split {state.get('split')!r}, this "
                            f"loader reads split {self.split!r}")
        if state.get("manifest_digest") != self.manifest_digest:
            raise DataMismatch(f"loader state belongs to different data (manifest digest "
                            f"{state.get('manifest_digest')!r}; this loader reads "
                            f"{self.path}, manifest digest {self.manifest_digest!r})")
        if isinstance(offset, bool) or not isinstance(offset, int) or not (
                0 <= offset <= self.num_tokens):
            raise DataError(f"loader offset {offset!r} is outside split {self.split!r} "
                            f"(0..{self.num_tokens})")
        self.offset = offset
