"""The payload digest: sha256 over the sha256 of each 4 MiB block, hashed on several cores.

``digest = sha256(sha256(block_0) || sha256(block_1) || ...)``, blocks of ``BLOCK`` bytes
(the last one shorter). A plain sha256 is one serial stream, and on this project's CPUs it
runs at about 1-2 GB/s, no faster than ``torch.load`` copies tensors; blocks hash in parallel
(``hashlib`` releases the GIL), so the digest costs a fraction of a pass on idle cores. Any
change to any block changes that block's hash and so the digest, with sha256's strength.

Both directions hash a stream while it is produced (``StreamDigest``): each block on a worker
thread, which hashes all of the block that exists as soon as a ``CHUNK`` more of it does, so
the hash trails the producer by at most a chunk, not a block. Saving hashes from the page
cache behind ``torch.save`` (``TrailingHasher``: torch never waits for a hash); loading reads
the file into memory, hashing behind the read (``read_and_digest``), and only then unpickles
those same bytes (``buffer.py``). A checkpoint of one block would otherwise pay for its read
(or write) and its hash one after the other.

Reproduce it without this package::

    blocks = [data[i : i + BLOCK] for i in range(0, len(data), BLOCK)]
    sha256(b"".join(sha256(block).digest() for block in blocks)).digest()
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

Buffer = bytes | bytearray | memoryview
Update = Callable[[Any, int, int], None]
"""``update(hasher, start, stop)``: feed bytes ``[start, stop)`` of the stream to ``hasher``."""

__all__ = [
    "BLOCK", "CHUNK", "StreamDigest", "TrailingHasher", "digest_of_bytes", "digest_of_view",
    "read_and_digest", "workers",
]  # fmt: skip

BLOCK = 4 << 20
CHUNK = 1 << 20  # how far a block's hash may trail the bytes it covers
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
    if min(_threads(), len(blocks)) <= 1:
        return digest_of_bytes(view)
    digests = list(workers().map(_sha256, blocks))
    return hashlib.sha256(b"".join(digests)).digest()


class StreamDigest:
    """The digest of a stream still being produced (read into memory, written to a file).

    The producer reports how many bytes exist (``advance``); each block is hashed on a worker
    as its bytes appear, through ``update``, a ``CHUNK`` or more at a time. ``digest()`` ends the
    stream and combines the block hashes. Use as a context manager: leaving it, normally or
    not, ends the stream, so no worker waits for bytes that will never come.
    """

    def __init__(self, update: Update) -> None:
        self._update = update
        self._condition = threading.Condition()
        self._ready = 0
        self._ended = False
        self._blocks: list[Future[bytes]] = []

    def __enter__(self) -> StreamDigest:
        return self

    def __exit__(self, *exc: object) -> None:
        self._end()
        for block in self._blocks:
            block.cancel()  # a block not yet started; the others return at the end

    def advance(self, ready: int) -> None:
        """The stream's first ``ready`` bytes now exist (and stay as they are)."""
        while len(self._blocks) * BLOCK < ready:
            self._blocks.append(workers().submit(self._hash_block, len(self._blocks) * BLOCK))
        with self._condition:
            self._ready = ready
            self._condition.notify_all()

    def pending(self) -> int:
        """Blocks whose hash is not finished yet."""
        return sum(not block.done() for block in self._blocks)

    def digest(self) -> bytes:
        """End the stream and return the digest of its bytes."""
        self._end()
        return hashlib.sha256(b"".join(block.result() for block in self._blocks)).digest()

    def _end(self) -> None:
        with self._condition:
            self._ended = True
            self._condition.notify_all()

    def _hash_block(self, start: int) -> bytes:
        """Each pass waits for a chunk more, then hashes all of the block that exists: a producer
        that runs ahead (a read outpaces sha256) is caught up in one ``update``, so this thread
        waits for the GIL once, not once per chunk, while the producer's thread runs Python."""
        hasher, position, end = hashlib.sha256(), start, start + BLOCK
        while position < end:
            with self._condition:
                while self._ready < min(position + CHUNK, end) and not self._ended:
                    self._condition.wait()
                stop = min(self._ready, end)
            if stop <= position:  # the stream ended inside this block
                break
            self._update(hasher, position, stop)
            position = stop
        return hasher.digest()


class TrailingHasher:
    """A write-through file for ``torch.save`` that hashes what it has written, from the file.

    ``file`` (opened for reading and writing) receives every byte at once; each time the data
    written since ``start`` completes a chunk, it is flushed and a worker hashes it from a
    read-only mapping of the file, i.e. the bytes the page cache now holds and the disk will
    hold. Nothing waits for a hash while torch writes, and no caller buffer is kept past its
    ``write`` call. ``finish()`` returns the digest. Use as a context manager so the workers
    stop even when torch fails half-way.
    """

    def __init__(self, file: BinaryIO, start: int) -> None:
        self.file = file
        self.name = getattr(file, "name", None)  # what a file object would report
        self.length = 0
        self._flushed = 0
        descriptor = file.fileno()

        def update(hasher: Any, first: int, stop: int) -> None:
            _update_mapped(hasher, descriptor, start + first, stop - first)

        self._stream = StreamDigest(update)

    def __enter__(self) -> TrailingHasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stream.__exit__(*exc)

    def write(self, data: Buffer) -> int:
        written = self.file.write(data)
        self.length += written
        if self.length - self._flushed >= min(CHUNK, BLOCK):
            self.flush()  # the mapping reads the file, not Python's buffer
        return written

    def flush(self) -> None:
        self.file.flush()
        self._flushed = self.length
        self._stream.advance(self.length)

    def fileno(self) -> int:
        return self.file.fileno()

    def finish(self, meanwhile: Callable[[], object] | None = None) -> bytes:
        """The digest of everything written. ``meanwhile`` (e.g. an fdatasync, which releases
        the GIL) runs on this thread while the workers hash what is left, if the hashing has
        fallen behind by at least ``_LAG`` blocks (busy cores); with the hashing caught up it
        would only add work."""
        self.flush()
        if meanwhile is not None and self._stream.pending() >= _LAG:
            meanwhile()
        return self._stream.digest()


def read_and_digest(
    file: BinaryIO, into: memoryview, meanwhile: Callable[[], object] | None = None
) -> bytes:
    """Fill ``into`` from ``file``, hashing behind the read on worker threads; the digest of
    those bytes, or ``b""`` if the file ended first. ``meanwhile`` runs on this thread once
    everything is read, while the workers hash what is left."""
    into = into.cast("B")
    step = min(CHUNK, BLOCK)
    with StreamDigest(lambda hasher, start, stop: hasher.update(into[start:stop])) as stream:
        for start in range(0, len(into), step):
            chunk = into[start : start + step]
            if _read_fully(file, chunk) < len(chunk):
                return b""
            stream.advance(start + len(chunk))
        if meanwhile is not None:
            meanwhile()
        return stream.digest()


def _read_fully(file: BinaryIO, into: memoryview) -> int:
    """Fill ``into`` from ``file`` (one read may return less than asked); the bytes read."""
    done = 0
    while done < len(into):
        count = file.readinto(into[done:])  # type: ignore[attr-defined]
        if not count:
            break
        done += count
    return done


def _update_mapped(hasher: Any, descriptor: int, offset: int, size: int) -> None:
    """Feed ``size`` bytes at ``offset`` of a file to ``hasher``, through a read-only mapping
    (no copy into Python memory; the mapping is gone when this returns)."""
    aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(
        descriptor, offset + size - aligned, access=mmap.ACCESS_READ, offset=aligned
    )
    try:
        with memoryview(mapping) as whole, whole[offset - aligned :] as piece:
            hasher.update(piece)
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


_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def workers() -> ThreadPoolExecutor:
    """The package's worker threads: they hash, and close the file a save replaced
    (``payload.py``). Started once per process, since starting a thread costs 0.2-0.5 ms on
    this project's machine, a tenth of a small checkpoint's hash. Keyed by the process id
    too: a forked child inherits the pool object but not its threads."""
    key = (os.getpid(), _threads())
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = ThreadPoolExecutor(key[1], thread_name_prefix="k3-digest")
        return pool


if hasattr(os, "register_at_fork"):  # the child's copy of the lock may be held by a dead thread
    os.register_at_fork(after_in_child=lambda: globals().update(_pools_lock=threading.Lock()))
