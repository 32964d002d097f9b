"""A hub folder on disk: safetensors shards, their index, JSON files; written atomically.

Writing builds the whole folder beside the target (``.<name>.tmp-<pid>``), fsyncs every
file and the folder, then renames it into place: a reader sees a complete folder or none.
Reading goes through ``safetensors`` only (no pickle) and checks what the index promises
against what the shards hold before any tensor is used.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .config import HubFormatError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIG = "config.json"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_folder(path: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """A fresh folder to fill; on success it replaces ``path`` in one rename (an existing
    ``path`` only with ``overwrite``), on failure it is removed and ``path`` is untouched."""
    path = Path(path)
    if path.exists() and not overwrite and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{path} already exists; choose another folder or remove it")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        yield staging
        for child in staging.iterdir():
            _fsync(child)
        _fsync(staging)
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            path.rename(old)
        staging.rename(path)
        _fsync(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


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
