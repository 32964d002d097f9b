"""A hub folder on disk: safetensors shards, their index, JSON files; written atomically.

Writing builds the whole folder beside the target (``.<name>.tmp-…``), fsyncs every
file and the folder, then renames it into place: a reader sees a complete folder or none.
An existing folder is replaced only when it is a previous export (:func:`export_refusal`),
and only once the new one is complete. Reading goes through ``safetensors`` only (no
pickle) and checks what the index promises against what the shards hold before any
tensor is used.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .card import README, written_by_us
from .config import HubFormatError
from .remote import REMOTE_FILES

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
EXPORT_FILES = frozenset({CONFIG, SINGLE, INDEX, "generation_config.json", *REMOTE_FILES,
                          README, "tokenizer.json", "tokenizer_config.json"})
"""The names a previous export may hold, beside its shards (:data:`SHARD`): what
``save_pretrained`` writes (``config.json``, the weights, ``generation_config.json``, the
Kimi K3 form's modeling code, ``README.md``) and the tokenizer files ``k3-train export``
adds. A ``README.md`` counts only as the one an export writes (its first line says so):
one a person wrote or edited there is theirs, never replaced."""
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
"""A shard's name (``model-00001-of-00003.safetensors``), as :func:`write_tensors` and
transformers name them."""


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FolderInUse(FileExistsError):
    """An existing folder :func:`atomic_folder` will not replace, in one line naming what
    it holds. ``reason``: why it is not a previous export, phrased to follow "``path``
    already exists and" (None: it is one, and ``overwrite`` was not given); ``entries``:
    its names, sorted (a folder's with a trailing ``/``, a link's with ``@``)."""

    def __init__(self, message: str, path: Path, reason: str | None,
                 entries: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.path, self.reason, self.entries = path, reason, entries


def listed(names: list[str] | tuple[str, ...], limit: int = 4) -> str:
    """``a, b, c and 2 more``: the first ``limit`` of ``names``."""
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f" and {more} more" if more > 0 else "")


def _entries(folder: Path) -> tuple[list[str], list[str]]:
    """The folder's names (a folder's with ``/``, a link's with ``@``), sorted, and those no
    export writes: anything but a plain file named in :data:`EXPORT_FILES` or a shard."""
    names, unexpected = [], []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        link, sub = entry.is_symlink(), entry.is_dir()
        name = entry.name + ("@" if link else "/" if sub else "")
        names.append(name)
        if link or sub or not entry.is_file() or not (
                entry.name in EXPORT_FILES or SHARD.fullmatch(entry.name)) or (
                entry.name == README and not written_by_us(entry)):
            unexpected.append(name)
    return names, unexpected


def export_refusal(path: Path) -> tuple[tuple[str, ...], str | None]:
    """What the existing ``path`` holds and why it is not a previous export (None: it is
    one, or an empty folder), phrased to follow "``path`` already exists and".

    A previous export is a folder (not a link) holding ``config.json`` and the weights
    (``model.safetensors``, or ``model.safetensors.index.json`` with its shards) and
    nothing but plain files named in :data:`EXPORT_FILES` or shards: no other file, no
    subfolder, no link. Only such a folder may be replaced (``overwrite``): removing it
    removes nothing of anyone else's."""
    if path.is_symlink():
        return (), f"is a symbolic link (to {os.readlink(path)})"
    if not path.is_dir():
        return (), "is not a folder"
    names, unexpected = _entries(path)
    if not names:
        return (), None
    if unexpected:
        return tuple(names), f"holds {listed(unexpected)}, which no export writes"
    if CONFIG not in names:
        return tuple(names), f"holds no {CONFIG}, so it is not a previous export"
    if SINGLE not in names and INDEX not in names:
        return tuple(names), (f"holds neither {SINGLE} nor {INDEX}, so it is not a "
                              "previous export")
    return tuple(names), None


def _refusal(path: Path, overwrite: bool, shown: Path) -> FolderInUse | None:
    """Why ``atomic_folder`` must not replace ``path`` (named ``shown``), or None."""
    entries, reason = export_refusal(path)
    if reason is not None:
        return FolderInUse(f"{shown} already exists and {reason}; choose another folder or "
                           "move it aside yourself (overwrite replaces only a previous export: "
                           "a folder of the files save_pretrained and k3-train export write "
                           "and nothing else)", shown, reason, entries)
    if entries and not overwrite:
        return FolderInUse(f"{shown} already exists: a previous export ({len(entries)} "
                           f"files: {listed(entries)}); overwrite=True replaces it",
                           shown, None, entries)
    return None


@contextmanager
def atomic_folder(path: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """A fresh folder to fill; on success it replaces ``path`` in one rename.

    An existing ``path`` must be an empty folder or, with ``overwrite``, a previous export
    (:func:`export_refusal`); anything else is refused with :class:`FolderInUse` before
    anything is written, and checked again once the new folder is complete (after the old
    one is moved aside, so nothing written into it meanwhile is lost). The old folder is
    removed only once the new one is in its place. On failure (an exception while the
    folder is filled, or a refusal) the new folder is removed and ``path`` is as it was;
    only a crash between the two renames would leave the old folder beside ``path`` as
    ``.<name>.old-…``. Nothing outside ``path`` and these hidden siblings is touched."""
    path = Path(path)
    refused = _refusal(path, overwrite, path) if os.path.lexists(path) else None
    if refused is not None:
        raise refused
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes it 0700; a folder's usual mode
        yield staging
        for child in staging.iterdir():
            _fsync(child)
        _fsync(staging)
        _move_into_place(staging, path, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _move_into_place(staging: Path, path: Path, overwrite: bool) -> None:
    """``staging`` renamed to ``path``; an existing ``path`` is first moved aside, checked
    again (it may have changed while the new folder was written), and removed only once
    ``staging`` is in its place; on any failure it is moved back."""
    if not os.path.lexists(path):
        staging.rename(path)
        _fsync(path.parent)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
    try:
        path.rename(aside)  # onto the empty folder just made: a name nobody else uses
    except BaseException:
        aside.rmdir()
        raise
    try:
        refused = _refusal(aside, overwrite, path)
        if refused is not None:
            raise refused
        staging.rename(path)
    except BaseException:
        aside.rename(path)  # as it was
        raise
    _fsync(path.parent)
    shutil.rmtree(aside, ignore_errors=True)


def _shards(tensors: Mapping[str, Tensor], max_bytes: int) -> list[list[str]]:
    """Names grouped in order into shards of at most ``max_bytes`` (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_file(tensors: Mapping[str, Tensor], path: Path) -> None:
    """One safetensors file, readable as the umask allows (safetensors itself creates its
    files 0600)."""
    from safetensors.torch import save_file as write

    write(dict(tensors), str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())


def write_tensors(folder: Path, tensors: Mapping[str, Tensor], max_shard_bytes: int) -> list[str]:
    """``model.safetensors``, or shards and ``model.safetensors.index.json``; the names of
    the files written."""

    groups = _shards(tensors, max_shard_bytes)
    if len(groups) == 1:
        save_file(tensors, folder / SINGLE)
        return [SINGLE]
    files = [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
    weight_map: dict[str, str] = {}
    for file, names in zip(files, groups):
        save_file({n: tensors[n] for n in names}, folder / file)
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_json(folder / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return [*files, INDEX]


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HubFormatError(f"{path} not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HubFormatError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise HubFormatError(f"{path} must hold a JSON object")
    return data


def shard_files(folder: Path) -> dict[str, list[str]]:
    """``{file: [tensor names the index puts there]}`` (the single file: names unknown
    until opened, an empty list)."""
    if (folder / INDEX).is_file():
        index = read_json(folder / INDEX)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) and "/" not in v and v.endswith(".safetensors")
                for v in weight_map.values()):
            raise HubFormatError(f"{folder / INDEX}: weight_map must map tensor names to "
                                 ".safetensors files in the folder")
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        return files
    if (folder / SINGLE).is_file():
        return {SINGLE: []}
    raise HubFormatError(f"{folder} holds neither {SINGLE} nor {INDEX}")


def read_headers(folder: Path) -> dict[str, tuple[str, tuple[int, ...], torch.dtype]]:
    """``{tensor: (file, shape, dtype)}`` from the shards' headers (no tensor data read),
    checked against the index: a truncated or corrupt shard, or a tensor the index puts
    in another file, is refused naming the file."""
    from safetensors import SafetensorError, safe_open

    found: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}
    for file, promised in shard_files(folder).items():
        path = folder / file
        if not path.is_file():
            raise HubFormatError(f"{path} not found (named by {INDEX})")
        try:
            with safe_open(str(path), framework="pt") as shard:
                names = list(shard.keys())
                for name in names:
                    piece = shard.get_slice(name)
                    found[name] = (file, tuple(piece.get_shape()),
                                   _dtype(piece.get_dtype(), path, name))
        except (SafetensorError, OSError, ValueError) as exc:
            raise HubFormatError(f"{path} is not a complete safetensors file "
                                 f"(truncated or corrupt): {' '.join(str(exc).split())}"
                                 ) from None
        if promised and sorted(promised) != sorted(names):
            missing = sorted(set(promised) - set(names))
            extra = sorted(set(names) - set(promised))
            raise HubFormatError(f"{path} does not hold what {INDEX} says: "
                                 f"missing {missing[:3]}, unlisted {extra[:3]}")
    return found


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _dtype(code: str, path: Path, name: str) -> torch.dtype:
    if code not in _DTYPES:
        raise HubFormatError(f"{path}: tensor {name} has dtype {code}, which k3-model does "
                             "not read (quantized weights: dequantize first)")
    return _DTYPES[code]


def read_tensors(folder: Path, headers: Mapping[str, tuple[str, tuple[int, ...], torch.dtype]]
                 ) -> dict[str, Tensor]:
    """Every tensor named in ``headers`` (from :func:`read_headers`), on the CPU."""
    from safetensors import SafetensorError, safe_open

    by_file: dict[str, list[str]] = {}
    for name, (file, _, _) in headers.items():
        by_file.setdefault(file, []).append(name)
    tensors: dict[str, Tensor] = {}
    for file, names in by_file.items():
        try:
            with safe_open(str(folder / file), framework="pt", device="cpu") as shard:
                for name in names:
                    tensors[name] = shard.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise HubFormatError(f"{folder / file} cannot be read (truncated or corrupt): "
                                 f"{' '.join(str(exc).split())}") from None
    return tensors
