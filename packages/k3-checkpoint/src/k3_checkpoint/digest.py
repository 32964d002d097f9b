"""The payload digest: sha256 over the sha256 of each 4 MiB block, hashed on several cores.

``digest = sha256(sha256(block_0) || sha256(block_1) || ...)``, blocks of ``BLOCK`` bytes
(the last one shorter). A plain sha256 is one serial stream, and on this project's CPUs it
runs at about 1-2 GB/s, no faster than ``torch.load`` copies tensors; blocks hash in parallel
(``hashlib`` releases the GIL), so the digest costs a fraction of a pass on idle cores. Any
change to any block changes that block's hash and so the digest, with sha256's strength.

Saving hashes each block from the page cache as soon as ``torch.save`` has written past it
(``TrailingHasher``: torch never waits for a hash, and the last blocks hash while the file is
flushed to disk). Loading reads the file into memory once, hashing each block while the next
is read (``read_and_digest``), and only then unpickles those same bytes (``buffer.py``).

Reproduce it without this package::

    blocks = [data[i : i + BLOCK] for i in range(0, len(data), BLOCK)]
    sha256(b"".join(sha256(block).digest() for block in blocks)).digest()
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO

Buffer = bytes | bytearray | memoryview

__all__ = [
    "BLOCK", "TrailingHasher", "digest_of_bytes", "digest_of_view", "read_and_digest",
]  # fmt: skip

BLOCK = 4 << 20
_MAX_THREADS = 8  # sha256 at ~1-2 GB/s per core: 8 cores outrun a page-cache read
_LAG = 2  # blocks still hashing when torch.save returns that are worth an early data sync


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


class TrailingHasher:
    """A write-through file for ``torch.save`` that hashes what it has written, from the file.

    ``file`` (opened for reading and writing) receives every byte at once; each time the data
    written since ``start`` completes a block, that block is hashed on a worker thread from a
    read-only mapping of the file, i.e. the bytes the page cache now holds and the disk will
    hold. Nothing waits for a hash while torch writes, and no caller buffer is kept past its
    ``write`` call. ``finish()`` hashes the last block and returns the digest. Use as a
    context manager so the workers stop even when torch fails half-way.
    """

    def __init__(self, file: BinaryIO, start: int) -> None:
        self.file = file
        self.name = getattr(file, "name", None)  # what a file object would report
        self.length = 0
        self._start = start
        self._pool = ThreadPoolExecutor(_threads(), thread_name_prefix="k3-digest")
        self._hashes: list[Future[bytes]] = []

    def __enter__(self) -> TrailingHasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def write(self, data: Buffer) -> int:
        written = self.file.write(data)
        self.length += written
        if self.length >= (len(self._hashes) + 1) * BLOCK:
            self.file.flush()  # the mapping reads the file, not Python's buffer
            while self.length >= (len(self._hashes) + 1) * BLOCK:
                self._submit(BLOCK)
        return written

    def flush(self) -> None:
        self.file.flush()

    def fileno(self) -> int:
        return self.file.fileno()

    def finish(self, meanwhile: Callable[[], object] | None = None) -> bytes:
        """The digest of everything written. ``meanwhile`` (e.g. an fdatasync, which releases
        the GIL) runs on this thread while the workers hash the remaining blocks, if the
        hashing has fallen behind by at least ``_LAG`` blocks (busy cores); with the hashing
        caught up it would only add work."""
        self.file.flush()
        tail = self.length - len(self._hashes) * BLOCK
        if tail:
            self._submit(tail)
        pending = sum(not future.done() for future in self._hashes)
        if meanwhile is not None and pending >= _LAG:
            meanwhile()
        return hashlib.sha256(b"".join(future.result() for future in self._hashes)).digest()

    def _submit(self, size: int) -> None:
        offset = self._start + len(self._hashes) * BLOCK
        self._hashes.append(self._pool.submit(_hash_mapped, self.file.fileno(), offset, size))


def read_and_digest(file: BinaryIO, into: memoryview) -> bytes:
    """Fill ``into`` from ``file``, hashing each block on a worker thread while the next one
    is read; the digest of those bytes, or ``b""`` if the file ended first."""
    into = into.cast("B")
    with ThreadPoolExecutor(_threads(), thread_name_prefix="k3-digest") as pool:
        digests = []
        for start in range(0, len(into), BLOCK):
            block = into[start : start + BLOCK]
            if _read_fully(file, block) < len(block):
                return b""
            digests.append(pool.submit(_sha256, block))
        return hashlib.sha256(b"".join(future.result() for future in digests)).digest()


def _read_fully(file: BinaryIO, into: memoryview) -> int:
    """Fill ``into`` from ``file`` (one read may return less than asked); the bytes read."""
    done = 0
    while done < len(into):
        count = file.readinto(into[done:])  # type: ignore[attr-defined]
        if not count:
            break
        done += count
    return done


def _hash_mapped(descriptor: int, offset: int, size: int) -> bytes:
    """sha256 of ``size`` bytes at ``offset`` of a file, read through a read-only mapping
    (no copy into Python memory; the mapping is gone when this returns)."""
    aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(
        descriptor, offset + size - aligned, access=mmap.ACCESS_READ, offset=aligned
    )
    try:
        with memoryview(mapping) as whole, whole[offset - aligned :] as piece:
            return hashlib.sha256(piece).digest()
    finally:
        mapping.close()


def _sha256(data: Buffer) -> bytes:
    return hashlib.sha256(data).digest()


def _threads() -> int:
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        available = os.cpu_count() or 1
    return max(1, min(_MAX_THREADS, available))
