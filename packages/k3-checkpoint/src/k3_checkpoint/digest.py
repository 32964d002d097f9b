"""The payload digest: sha256 over the sha256 of each 4 MiB block, hashed on several cores.

``digest = sha256(sha256(block_0) || sha256(block_1) || ...)``, blocks of ``BLOCK`` bytes
(the last one shorter). A plain sha256 is one serial stream, and on this project's CPUs it
runs at about 1 GB/s, no faster than ``torch.load`` copies tensors, so checking it would
double the load time; blocks hash in parallel (``hashlib`` releases the GIL), which keeps the
check before unpickling (see ``payload``) and still lets it scale with idle cores. Any change
to any block changes that block's hash and so the digest, with sha256's strength.

Reproduce it without this package::

    blocks = [data[i : i + BLOCK] for i in range(0, len(data), BLOCK)]
    sha256(b"".join(sha256(block).digest() for block in blocks)).digest()
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

from .errors import CheckpointError

__all__ = ["BLOCK", "digest_of_bytes", "digest_of_file"]

BLOCK = 4 << 20
_MAX_THREADS = 8  # sha256 at ~1 GB/s per core: 8 cores outrun a page-cache read


def digest_of_bytes(data: bytes | memoryview) -> bytes:
    """The digest of ``data``, computed serially (the reference; used by tests and tools)."""
    view = memoryview(data).cast("B")
    blocks = (view[start : start + BLOCK] for start in range(0, len(view), BLOCK))
    return hashlib.sha256(b"".join(hashlib.sha256(block).digest() for block in blocks)).digest()


def digest_of_file(file: BinaryIO, offset: int, length: int) -> bytes:
    """The digest of ``length`` bytes of ``file`` from ``offset``; blocks are hashed in parallel.

    Raises ``CheckpointError`` if the file is shorter than that (it changed while being read).
    """
    count = -(-length // BLOCK)
    read = _block_reader(file)

    def block_digest(index: int) -> bytes:
        start = index * BLOCK
        size = min(BLOCK, length - start)
        data = read(offset + start, size)
        if len(data) != size:
            raise CheckpointError("is shorter than when it was opened (changed while read)")
        return hashlib.sha256(data).digest()

    threads = min(_threads(), count)
    if threads <= 1:
        digests = [block_digest(index) for index in range(count)]
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="k3-digest") as pool:
            digests = list(pool.map(block_digest, range(count)))
    return hashlib.sha256(b"".join(digests)).digest()


def _threads() -> int:
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        available = os.cpu_count() or 1
    return max(1, min(_MAX_THREADS, available))


def _block_reader(file: BinaryIO) -> Callable[[int, int], bytes]:
    """``read(offset, size)`` safe to call from several threads at once."""
    if hasattr(os, "pread"):
        descriptor = file.fileno()
        return lambda offset, size: os.pread(descriptor, size, offset)
    lock = threading.Lock()  # Windows has no pread: serialize seek + read

    def read(offset: int, size: int) -> bytes:
        with lock:
            file.seek(offset)
            return file.read(size)

    return read
