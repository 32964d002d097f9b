"""The nested states a sharded checkpoint holds, and their skeletons.

A component's state is a tree of mappings and lists under its dotted name; the shard
index records its skeleton (where its tensors are), because DCP keeps no trace of an empty
mapping. These helpers build, walk and fill such trees, and map a path in one to DCP's key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


def skeleton(value: Any) -> Any:
    """The shape of a plain state, for the index: its mappings and lists as they are, a
    tensor as a note of its dtype and global shape, any other value as None. DCP writes no
    entry for an empty mapping, so the shards alone could not give the state back whole."""
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    if isinstance(value, dict):
        return {key: skeleton(item) for key, item in value.items()}
    if isinstance(value, list):
        return [skeleton(item) for item in value]
    return None


def tensor_paths(skeleton: Any, path: tuple[str | int, ...]) -> Iterator[tuple[str | int, ...]]:
    """Where a skeleton's tensors are; ``ValueError`` for a skeleton no save writes."""
    if isinstance(skeleton, Mapping):
        for key, node in skeleton.items():
            yield from tensor_paths(node, (*path, str(key)))
    elif isinstance(skeleton, list):
        for index, node in enumerate(skeleton):
            yield from tensor_paths(node, (*path, index))
    elif isinstance(skeleton, str):
        yield path
    elif skeleton is not None:
        raise ValueError(f"the shard index's structure holds a {type(skeleton).__name__} at "
                         f"{dotted(path)}")


def no_tensor(path: tuple[str | int, ...], live: Any) -> torch.Tensor:
    raise AssertionError(f"a template with no tensor met one at {dotted(path)}")


def template(skeleton: Any, live: Any, path: tuple[str | int, ...],
              tensor: Callable[[tuple[str | int, ...], Any], torch.Tensor]) -> Any:
    """A state shaped as ``skeleton`` says, for DCP to read into: ``tensor(path, live
    value)`` where a tensor was saved (checked to be in the shards), None where a value
    was (DCP puts the saved one there)."""
    if isinstance(skeleton, dict):
        return {key: template(node, _child(live, key), (*path, key), tensor)
                for key, node in skeleton.items()}
    if isinstance(skeleton, list):
        return [template(node, _child(live, index), (*path, index), tensor)
                for index, node in enumerate(skeleton)]
    if isinstance(skeleton, str):
        return tensor(path, live)
    return None


def saved_fqns(table: Metadata) -> dict[tuple[str | int, ...], str]:
    """DCP's key of each saved path (its planner data), for names holding dots."""
    return {tuple(path): fqn for fqn, path in (table.planner_data or {}).items()}


def dotted(path: Sequence[str | int]) -> str:
    return ".".join(map(str, path))


def _child(value: Any, key: str | int) -> Any:
    if isinstance(key, str) and isinstance(value, Mapping):
        return value.get(key)
    if isinstance(key, int) and isinstance(value, (list, tuple)) and key < len(value):
        return value[key]
    return None


def put_at(tree: dict[str, Any], parts: Sequence[str], value: Any) -> None:
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def get_at(tree: Mapping[str, Any], parts: Sequence[str]) -> Any:
    node: Any = tree
    for part in parts:
        node = node[part]
    return node


def place_at(root: Any, path: Sequence[str | int], value: Any) -> None:
    """Set ``value`` at ``path`` inside nested mappings and lists (all of it exists: DCP
    reads only what the state it was given holds)."""
    node = root
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
