"""Checkpoints written by k3-checkpoint 0.1.x: a 64-byte header *before* the payload, with a
sha256 digest over 4 MiB blocks. Still read, so a run saved by 0.1.x resumes; never written.

Header (little-endian)::

    0   8  magic   b"\\x89K3CKPT\\n"
    8   4  format  7
    12  4  scheme  1 = sha256 over 4 MiB blocks
    16  8  length  payload bytes after the header
    24  32 digest  sha256(sha256(block_0) || sha256(block_1) || ...)
    56  4  zero
    60  4  crc32   of bytes 0-59

The payload is read into memory, its digest checked, and the same bytes are unpickled by
``torch.load(..., weights_only=True)`` from that buffer (a header in front of the zip
rules out ``torch.load`` of the path).
"""

from __future__ import annotations

import hashlib
import io
import struct
import zlib
from pathlib import Path
from typing import Any, BinaryIO

from .errors import CheckpointError

__all__ = ["HEADER_SIZE", "MAGIC", "load_bytes", "pack_header", "read_legacy", "sha256_blocks"]

MAGIC = b"\x89K3CKPT\n"  # non-ASCII first byte and a newline: text-mode mangling breaks it
_FIELDS = struct.Struct("<8sIIQ32s4x")
_CRC = struct.Struct("<I")
HEADER_SIZE = _FIELDS.size + _CRC.size
SHA256_BLOCKS = 1
_BLOCK = 4 << 20


def sha256_blocks(data: bytes | memoryview) -> bytes:
    """0.1.x's digest of ``data``: sha256 over the sha256 of each 4 MiB block."""
    view = memoryview(data).cast("B")
    blocks = (view[start : start + _BLOCK] for start in range(0, len(view), _BLOCK))
    return hashlib.sha256(b"".join(hashlib.sha256(block).digest() for block in blocks)).digest()


def pack_header(format_version: int, length: int, digest: bytes) -> bytes:
    """0.1.x's header for a payload of ``length`` bytes (tests write such files with it)."""
    fields = _FIELDS.pack(MAGIC, format_version, SHA256_BLOCKS, length, digest)
    return fields + _CRC.pack(zlib.crc32(fields))


def read_legacy(file: BinaryIO, size: int, path: Path) -> tuple[int, bytes, str]:
    """``(format version, payload bytes, hex digest)`` of a 0.1.x file whose digest
    matched; every problem is a ``CheckpointError`` naming the file."""
    file.seek(0)
    head = file.read(HEADER_SIZE)
    if len(head) < HEADER_SIZE:
        raise CheckpointError(
            f"is truncated: {len(head)} of the header's {HEADER_SIZE} bytes", path=path
        )
    fields, (crc,) = head[: _FIELDS.size], _CRC.unpack(head[_FIELDS.size :])
    if zlib.crc32(fields) != crc:
        raise CheckpointError("header is corrupt (its CRC does not match)", path=path)
    _, version, scheme, length, digest = _FIELDS.unpack(fields)
    if scheme != SHA256_BLOCKS:
        raise CheckpointError(f"unknown digest scheme id {scheme}", path=path)
    if size != HEADER_SIZE + length:
        raise CheckpointError(
            f"is {size} bytes, its header promises {HEADER_SIZE + length} (truncated or "
            "extended)",
            path=path,
        )
    data = file.read(length)
    if len(data) != length:
        raise CheckpointError("is shorter than when it was opened (changed while read)",
                              path=path)
    actual = sha256_blocks(data)
    if actual != digest:
        raise CheckpointError(
            f"digest mismatch: the payload hashes to {actual.hex()[:16]}…, the header "
            f"records {digest.hex()[:16]}…; the file is corrupt",
            path=path,
        )
    return version, data, actual.hex()


def load_bytes(data: bytes) -> Any:
    """Unpickle a verified 0.1.x payload with torch's public weights-only load."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
