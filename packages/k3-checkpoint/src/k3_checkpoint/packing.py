"""Small tensors saved side by side, so ``torch.load`` reads fewer zip records.

``torch.save`` writes one zip record per storage, and ``torch.load`` pays a fixed cost for
every record it reads (a lookup, a read, a storage and its Python wrappers) on top of the
bytes. A model and optimizer state is mostly small tensors by count (norm weights, biases,
each parameter's ``step``) and large ones by bytes, so that fixed cost is a large share of
a small state's load and a noticeable one of a large state's (BENCHMARKS.md). ``pack``
copies each component's small tensors into flat buffers (per dtype, each of at most
``PACK_BUFFER`` bytes) and saves views of them, which ``torch.save`` writes as one record
per buffer. Large tensors stay single records: their fixed cost is negligible beside their
bytes.

A loaded checkpoint's small tensors are therefore views of shared storages, as every
tensor of ``torch.load(mmap=True)`` is a view of one mapping: equal values, shapes and
strides, each its own tensor. A module's state is copied into its parameters and the buffer
freed; an optimizer's state keeps its views, and buffers never mix components, so nothing
it keeps holds another component's bytes. A tensor whose storage another tensor of the
state also uses (tied weights, a view and its base) is saved as it is, so the sharing
survives; a view of a tensor outside the state is saved as its own bytes only.

Nothing new is needed to read such a file: ``torch.load`` restores views by itself, so any
reader of format 7 reads it, and files written without packing read as before.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .plain import tensors_in

__all__ = ["PACK_AT_MOST", "PACK_BUFFER", "pack"]

PACK_AT_MOST = 64 << 10
"""Tensors of at most this many bytes are packed."""

PACK_BUFFER = 120 << 10
"""A flat buffer's size limit in bytes. Enough tensors share one record to make the records'
fixed cost vanish, and the buffer stays below the size from which the C allocator (glibc's
default mmap threshold, 128 KiB) maps fresh pages for every allocation: it is then served
from the heap as the small tensors it replaces are, so a load adds no memory they did not
(larger buffers raised a small state's resume peak; BENCHMARKS.md)."""


def pack(states: Mapping[str, Any]) -> dict[str, Any]:
    """``states`` (component name: state) with the small tensors (see the module docstring)
    replaced by views of flat buffers; containers holding one are copied, so nothing given is
    modified."""
    found: list[tuple[str, torch.Tensor, int]] = []  # (component, tensor, storage address)
    uses: dict[int, int] = {}
    for key, value in states.items():
        for tensor in tensors_in(value):
            if tensor.layout == torch.strided and tensor.device.type == "cpu":  # dense, here
                address = tensor.untyped_storage().data_ptr()
                uses[address] = uses.get(address, 0) + 1
                found.append((key, tensor, address))
    groups: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
    for key, tensor, address in found:
        if uses[address] == 1 and _packable(tensor):
            groups.setdefault((key, tensor.dtype), []).append(tensor)
    views: dict[str, dict[int, torch.Tensor]] = {}
    for (key, _), group in groups.items():
        replaced = views.setdefault(key, {})
        for batch in _batches(group):
            flat = torch.cat([tensor.ravel() for tensor in batch])
            offset = 0
            for tensor in batch:  # contiguous, so its strides are the flat buffer's too
                replaced[id(tensor)] = flat.as_strided(tensor.shape, tensor.stride(), offset)
                offset += tensor.numel()
    return {key: _replace(value, views[key]) if key in views else value
            for key, value in states.items()}  # fmt: skip


def _batches(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """``tensors`` in runs of at most ``PACK_BUFFER`` bytes (a run of one is left alone)."""
    batch: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        if size + tensor.nbytes > PACK_BUFFER:
            if len(batch) > 1:
                yield batch
            batch, size = [], 0
        batch.append(tensor)
        size += tensor.nbytes
    if len(batch) > 1:
        yield batch


def _packable(tensor: torch.Tensor) -> bool:
    """A plain tensor (a dense CPU one, as ``pack`` picks them) of at most ``PACK_AT_MOST``
    bytes, laid out as a flat buffer's view is: packing it changes nothing but where its
    bytes live."""
    return (
        0 < tensor.nbytes <= PACK_AT_MOST
        and type(tensor) is torch.Tensor
        and not tensor.requires_grad
        and not tensor.is_quantized
        and tensor.is_contiguous()
    )


def _replace(value: Any, tensors: Mapping[int, torch.Tensor]) -> Any:
    """``value`` with each tensor whose id is in ``tensors`` swapped; a container is copied
    (its type and attributes kept, e.g. a ``state_dict()``'s ``_metadata``) only where
    something inside it changed."""
    if isinstance(value, torch.Tensor):
        return tensors.get(id(value), value)
    if isinstance(value, Mapping):
        changed = {}
        for key, item in value.items():
            new = _replace(item, tensors)
            if new is not item:
                changed[key] = new
        if not changed:
            return value
        mapping = copy.copy(value) if isinstance(value, dict) else dict(value)
        mapping.update(changed)
        return mapping
    if isinstance(value, (list, tuple)):
        swapped = [_replace(item, tensors) for item in value]
        if all(new is old for new, old in zip(swapped, value)):
            return value
        if isinstance(value, list):
            return swapped
        return type(value)(*swapped) if hasattr(value, "_fields") else type(value)(swapped)
    return value
