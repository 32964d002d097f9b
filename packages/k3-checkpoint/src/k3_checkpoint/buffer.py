"""The memory a checkpoint is read into, and the payload's tensors viewing it.

A load reads the payload once into one page-aligned anonymous mapping (asking for
transparent huge pages, so the read is not mostly page faults), hashes it while it is read
(``digest.py``), and only then unpickles it (``payload.py``). ``torch.load`` from that
memory would copy every tensor out of it: the load would need twice the payload's memory, and
in a fresh process (a resume) each page of the copy is one more page fault. Instead, torch's
own zip reader and weights-only unpickler run with a ``persistent_load`` whose storages view
the buffer: the mechanism behind ``torch.load(mmap=True)``, fed from verified memory rather
than a file mapping that could change after it was hashed.

Views keep the mapping alive, so after a restore ``release_unused()`` returns to the OS the
pages of every tensor that nothing kept (the model's weights, copied into the model), and
leaves those something still holds (a CPU optimizer adopts its saved state as it is). Whether
a tensor was kept is read from its storage's reference count, so a page is released only when
no tensor can reach it.

This needs torch internals (the zip reader, the weights-only unpickler and the thread-local
map location it places rebuilt tensors by) and Linux's ``MADV_DONTNEED``. Where either is
missing, ``zero_copy_supported()`` is False and ``torch.load`` copies the tensors out of the
same verified buffer.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import mmap
import sys
from typing import Any

import torch

__all__ = ["MemoryFile", "PayloadBuffer", "zero_copy_supported"]

Span = tuple[int, int]
"""Half-open byte offsets ``[start, stop)`` into the buffer."""


class PayloadBuffer:
    """``length`` bytes of page-aligned memory (``view``) that a payload is read into, then
    unpickled from (``unpickle``) with its tensors viewing it where supported."""

    def __init__(self, length: int) -> None:
        self.length = length
        self._map = _anonymous_map(max(length, 1))
        self.view = memoryview(self._map)[:length]
        self._storage = torch.frombuffer(self._map, dtype=torch.uint8).untyped_storage()
        self._lent: list[tuple[int, int, torch.UntypedStorage]] = []

    def unpickle(self) -> Any:
        """The object ``torch.save`` wrote into the buffer, loaded with torch's weights-only
        unpickler onto the CPU. Raises what ``torch.load`` raises."""
        source = MemoryFile(self.view)
        if not zero_copy_supported():
            return torch.load(source, weights_only=True, map_location="cpu")  # type: ignore[arg-type]
        with torch.serialization._open_zipfile_reader(source) as archive:  # type: ignore[arg-type]
            if archive.has_record("byteorder") and archive.get_record("byteorder") != b"little":
                # Written on a big-endian machine: torch.load copies and byte-swaps it.
                return torch.load(MemoryFile(self.view), weights_only=True, map_location="cpu")  # type: ignore[arg-type]
            return self._unpickle_viewing(archive)

    def _unpickle_viewing(self, archive: Any) -> Any:
        """``torch.load(map_location="cpu", weights_only=True)`` of the open ``archive``, each
        storage a view of the buffer: torch's weights-only unpickler over the archive's
        ``data.pkl``, with a ``persistent_load`` that finds a storage's record in the buffer.

        ``torch.serialization._load(overall_storage=...)`` does the same, and was called here
        before. Its per-storage bookkeeping (fake-tensor detection twice, a device restore)
        cost a 99-tensor payload 1.4 ms of its 7.2 ms unpickle (``BENCHMARKS.md``)."""
        storages: dict[Any, torch.TypedStorage] = {}

        def persistent_load(saved_id: tuple[Any, ...]) -> torch.TypedStorage:
            # The unpickler has checked that saved_id is a ("storage", ...) tuple.
            _, storage_type, key, _location, numel = saved_id  # every location maps to the CPU
            storage = storages.get(key)
            if storage is None:
                dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
                start = archive.get_record_offset(f"data/{key}")
                storage = storages[key] = torch.TypedStorage(  # type: ignore[no-untyped-call]
                    wrap_storage=self[start : start + numel * dtype.itemsize],
                    dtype=dtype,
                    _internal=True,
                )
            return storage

        unpickler = torch.serialization._weights_only_unpickler.Unpickler(  # type: ignore[attr-defined]
            io.BytesIO(archive.get_record("data.pkl")), encoding="utf-8"
        )
        unpickler.persistent_load = persistent_load
        local = torch.serialization._serialization_tls
        previous, local.map_location = local.map_location, "cpu"  # for rebuilds that place tensors
        try:
            return unpickler.load()
        finally:
            local.map_location = previous
            torch._utils._validate_loaded_sparse_tensors()  # type: ignore[no-untyped-call]

    def __getitem__(self, span: slice) -> torch.UntypedStorage:
        """A tensor's bytes, as ``persistent_load`` slices them: a storage viewing the buffer."""
        start, stop = span.start, span.stop
        if not (type(start) is int and type(stop) is int and 0 <= start <= stop <= self.length):
            raise ValueError(
                f"tensor bytes {start}:{stop} lie outside the {self.length}-byte payload"
            )
        storage: torch.UntypedStorage = self._storage[start:stop]
        self._lent.append((start, stop, storage))
        return storage

    def release_unused(self) -> int:
        """Return to the OS the whole pages of every tensor no one holds any more; the bytes
        released. Call it once the payload is no longer needed (the buffer forgets which
        tensors it lent, so a second call releases nothing). A page that also holds bytes of
        a kept tensor is never released, even where a crafted file's records overlap."""
        page = mmap.PAGESIZE
        kept: list[Span] = []  # pages touched by a tensor someone still holds
        unused: list[Span] = []  # pages wholly inside a tensor no one holds
        for start, stop, storage in self._lent:
            if torch._C._storage_Use_Count(storage._cdata) > 1:  # a tensor still views it
                kept.append((start // page * page, -(-stop // page) * page))
            else:
                unused.append((-(-start // page) * page, stop // page * page))
        self._lent.clear()
        released = 0
        for first, last in _subtract(unused, kept):
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)
            released += last - first
        return released


def _subtract(ranges: list[Span], holes: list[Span]) -> list[Span]:
    """The bytes inside some range of ``ranges`` and inside none of ``holes`` (all half-open),
    as sorted, merged ranges."""
    depth: dict[int, list[int]] = {}  # point -> change in (ranges, holes) open there
    for kind, spans in ((0, ranges), (1, holes)):
        for start, stop in spans:
            if stop > start:
                depth.setdefault(start, [0, 0])[kind] += 1
                depth.setdefault(stop, [0, 0])[kind] -= 1
    points = sorted(depth)
    inside, result = [0, 0], list[Span]()
    for point, following in itertools.pairwise(points):
        inside = [inside[0] + depth[point][0], inside[1] + depth[point][1]]
        if inside[0] > 0 and inside[1] == 0:
            if result and result[-1][1] == point:
                result[-1] = (result[-1][0], following)
            else:
                result.append((point, following))
    return result


def _anonymous_map(size: int) -> mmap.mmap:
    """Private anonymous memory (pages cost nothing until touched). Private, not Python's
    default shared mapping: MADV_DONTNEED frees private pages but only unmaps shared ones.

    Asked for transparent huge pages: the read then takes one fault per 2 MiB instead of
    one per 4 KiB, which made reading 96 MiB into fresh memory 5x faster here (68 -> 14 ms;
    page faults were most of a resume's read). Where the kernel has THP off, the advice
    does nothing. A release that covers part of a huge page splits it; the kernel frees
    the released part when it needs the memory."""
    if not (hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")):
        return mmap.mmap(-1, size)  # Windows: no flags (and no release: see zero_copy_supported)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # EINVAL: a kernel built without THP
            mapping.madvise(mmap.MADV_HUGEPAGE)
    return mapping


@functools.cache
def zero_copy_supported() -> bool:
    """Whether this torch and OS have what ``PayloadBuffer`` views and releases memory with."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_DONTNEED"):
        return False  # elsewhere MADV_DONTNEED may keep the pages: released would be kept
    if sys.byteorder != "little":
        return False  # there torch.load byte-swaps a little-endian file's tensors into copies
    serialization = torch.serialization
    needed = [
        (serialization, "_open_zipfile_reader"),
        (serialization, "_serialization_tls"),
        (getattr(serialization, "_weights_only_unpickler", None), "Unpickler"),
        (torch._utils, "_validate_loaded_sparse_tensors"),
        (torch._C, "_storage_Use_Count"),
    ]
    return all(hasattr(owner, name) for owner, name in needed)


class MemoryFile(io.RawIOBase):
    """A read-only, seekable file over bytes in memory, for torch's zip reader."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data = data
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset += self._position
        elif whence == io.SEEK_END:
            offset += len(self._data)
        elif whence != io.SEEK_SET:
            raise ValueError(f"invalid whence ({whence})")
        self._position = max(0, offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        chunk = self._data[self._position : self._position + len(target)]
        target[: len(chunk)] = chunk
        self._position += len(chunk)
        return len(chunk)
