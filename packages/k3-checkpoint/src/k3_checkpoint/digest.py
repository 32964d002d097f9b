"""The payload digest: sha256 over the sha256 of each 4 MiB block, hashed on several cores.

``digest = sha256(sha256(block_0) || sha256(block_1) || ...)``, blocks of ``BLOCK`` bytes
(the last one shorter). A plain sha256 is one serial stream, and on this project's CPUs it
runs at about 1 GB/s, no faster than ``torch.load`` copies tensors; blocks hash in parallel
(``hashlib`` releases the GIL), so the digest costs a fraction of a pass on idle cores. Any
change to any block changes that block's hash and so the digest, with sha256's strength.

Saving hashes while ``torch.save`` writes (``HashingWriter``: no second pass over the file);
loading reads the file into memory once, hashing each block while the next is read
(``read_and_digest``), and only then unpickles those same bytes.

Reproduce it without this package::

    blocks = [data[i : i + BLOCK] for i in range(0, len(data), BLOCK)]
    sha256(b"".join(sha256(block).digest() for block in blocks)).digest()
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

Buffer = bytes | bytearray | memoryview

__all__ = [
    "BLOCK", "HashingWriter", "digest_of_bytes", "digest_of_view", "read_and_digest",
]  # fmt: skip

BLOCK = 4 << 20
_MAX_THREADS = 8  # sha256 at ~1 GB/s per core: 8 cores outrun a page-cache read
_INLINE = 64 << 10  # pieces smaller than this are hashed on the calling thread


def digest_of_bytes(data: Buffer) -> bytes:
    """The digest of ``data``, computed serially (the reference; used by tests and tools)."""
    view = memoryview(data).cast("B")
    blocks = (view[start : start + BLOCK] for start in range(0, len(view), BLOCK))
    return hashlib.sha256(b"".join(hashlib.sha256(block).digest() for block in blocks)).digest()


def digest_of_view(data: Buffer) -> bytes:
    """The digest of ``data`` (already in memory), its blocks hashed on several threads."""
    view = memoryview(data).cast("B")
    blocks = [view[start : start + BLOCK] for start in range(0, len(view), BLOCK)]
    threads = min(_threads(), len(blocks))
    if threads <= 1:
        return digest_of_bytes(view)
    with ThreadPoolExecutor(threads, thread_name_prefix="k3-digest") as pool:
        digests = list(pool.map(_sha256, blocks))
    return hashlib.sha256(b"".join(digests)).digest()


class HashingWriter:
    """A write-only file for ``torch.save`` that passes every byte to ``file`` and hashes it.

    torch writes each tensor's storage in one call. A call's bytes are split at block
    boundaries and each piece goes to its block's own sha256 on a worker thread, straight
    from the caller's buffer (no copy), while the main thread writes the same buffer to
    ``file``; the call returns once all of it is hashed and written. Use as a context
    manager, then read ``digest()`` and ``length``.
    """

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.name = getattr(file, "name", None)  # what a file object would report
        self.length = 0
        self._pool = ThreadPoolExecutor(_threads(), thread_name_prefix="k3-digest")
        self._done: list[Any] = []  # finished blocks' sha256 objects, in order
        self._block = hashlib.sha256()
        self._filled = 0

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def write(self, data: Buffer) -> int:
        view = memoryview(data).cast("B")
        size, position = len(view), 0
        pieces = []
        while position < size:
            take = min(BLOCK - self._filled, size - position)
            pieces.append((self._block, view[position : position + take]))
            self._filled += take
            position += take
            if self._filled == BLOCK:
                self._done.append(self._block)
                self._block, self._filled = hashlib.sha256(), 0
        hashing = []
        for block, piece in pieces:
            if len(piece) < _INLINE:  # torch's small records: cheaper here than on a thread
                block.update(piece)
            else:
                hashing.append(self._pool.submit(block.update, piece))
        try:
            self.file.write(view)
        finally:  # the caller may free its buffer once write() returns, even by an error
            for future in hashing:
                future.result()
        self.length += size
        return size

    def flush(self) -> None:
        self.file.flush()

    def fileno(self) -> int:
        return self.file.fileno()

    def digest(self) -> bytes:
        """The digest of everything written (call after the last write)."""
        blocks = self._done + ([self._block] if self._filled else [])
        return hashlib.sha256(b"".join(block.digest() for block in blocks)).digest()


def read_and_digest(file: BinaryIO, length: int) -> tuple[list[bytes], bytes]:
    """Read ``length`` bytes of ``file`` into memory as 4 MiB blocks, hashing each block on a
    worker thread while the next one is read; returns the blocks (fewer bytes if the file was
    shorter) and the digest. Blocks, not one buffer: one large buffer is fresh memory on
    every load, faulted in page by page, which costs as much as the read itself."""
    blocks: list[bytes] = []
    with ThreadPoolExecutor(_threads(), thread_name_prefix="k3-digest") as pool:
        digests = []
        for start in range(0, length, BLOCK):
            block = file.read(min(BLOCK, length - start))
            blocks.append(block)
            if len(block) < min(BLOCK, length - start):
                return blocks, b""
            digests.append(pool.submit(_sha256, block))
        digest = hashlib.sha256(b"".join(future.result() for future in digests)).digest()
    return blocks, digest


def _sha256(data: Buffer) -> bytes:
    return hashlib.sha256(data).digest()


def _threads() -> int:
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        available = os.cpu_count() or 1
    return max(1, min(_MAX_THREADS, available))
