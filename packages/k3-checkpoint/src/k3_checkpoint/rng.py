"""Capture and restore every global random generator a training step can draw from.

Python's ``random``, NumPy's global ``RandomState``, torch's CPU generator and, once CUDA is in
use, each CUDA device's generator. The captured form loads under ``weights_only=True``: plain
data plus tensors (generator words as int64, torch states as uint8; a tensor is one pickle
record where 624 pickled ints would be 624 steps of the pure-Python safe unpickler).
Restoring first validates every part on a scratch generator of its kind (never a global one,
never drawn from) and only then sets the globals, so a bad state changes none of them.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from .errors import CheckpointError

__all__ = [
    "ValidRng", "capture_rng", "cuda_device_count", "restore_rng", "validate_rng_state",
]  # fmt: skip

_PARTS = ("python", "numpy", "torch_cpu", "torch_cuda")


def capture_rng() -> dict[str, Any]:
    """The current state of every global generator, as checkpoint-safe data.

    CUDA generators are captured only when CUDA is initialized: a process that never touched
    CUDA has drawn nothing from it, and capturing would create a context on every device.
    """
    version, internal, gauss_next = random.getstate()
    numpy_state = np.random.get_state(legacy=True)
    if not isinstance(numpy_state, tuple):  # only MT19937 has the legacy tuple form
        raise CheckpointError("NumPy's global generator is not MT19937 and cannot be captured")
    kind, keys, position, has_gauss, cached_gaussian = numpy_state
    return {
        "python": {
            "version": version,
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "bit_generator": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": list(torch.cuda.get_rng_state_all()) if _cuda_in_use() else [],
    }


class ValidRng(NamedTuple):
    """Every generator's state in its library's own form, each already accepted by a
    throwaway generator of its kind (what ``validate_rng_state`` returns)."""

    python: Any
    numpy: Any
    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor]

    def restore(self) -> None:
        """Set every global generator to these states (they were validated, so all are set)."""
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda:
            torch.cuda.set_rng_state_all(self.torch_cuda)


def validate_rng_state(state: Mapping[str, Any], *, cuda_may_differ: bool = False) -> ValidRng:
    """Raise ``CheckpointError`` unless ``restore_rng(state)`` would succeed; change nothing.
    Returns the validated states: their ``restore()`` does what ``restore_rng`` would, without
    validating again (a loader checks first and restores last)."""
    if not isinstance(state, Mapping) or set(state) != set(_PARTS):
        found = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise CheckpointError(f"rng state must have exactly the parts {list(_PARTS)}, got {found}")
    part = "python"
    try:
        python = state["python"]
        python_state = (python["version"], _words(python["state"]), python["gauss_next"])
        random.Random().setstate(python_state)
        part = "numpy"
        numpy = state["numpy"]
        numpy_state = (
            numpy["bit_generator"],
            np.asarray(_words(numpy["keys"]), dtype=np.uint32),
            numpy["pos"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
        if len(numpy_state[1]) != 624 or not 0 <= numpy_state[2] <= 624:
            raise ValueError("MT19937 needs 624 keys and a position in 0..624")
        _scratch_numpy_generator().set_state(numpy_state)
        part = "torch_cpu"
        cpu_state = state["torch_cpu"]
        _check_byte_tensor(cpu_state)
        torch.Generator().set_state(cpu_state)
        part = "torch_cuda"
        cuda_states = list(state["torch_cuda"])
        for tensor in cuda_states:
            _check_byte_tensor(tensor)
        available = cuda_device_count()
        if cuda_states and len(cuda_states) != available:
            if not cuda_may_differ:
                raise ValueError(
                    f"saved for {len(cuda_states)} CUDA devices, {available} available"
                )
            cuda_states = []
        for index, tensor in enumerate(cuda_states):
            torch.Generator(device=f"cuda:{index}").set_state(tensor)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, OverflowError) as error:
        raise CheckpointError(f"rng state '{part}' cannot be restored: {error}") from error
    return ValidRng(python_state, numpy_state, cpu_state, cuda_states)


def restore_rng(state: Mapping[str, Any], *, cuda_may_differ: bool = False) -> None:
    """Set every global generator to ``state`` (from ``capture_rng``), all or none of them.

    With ``cuda_may_differ``, CUDA states saved for another device count are skipped instead
    of refused (a resume on another machine; its CUDA streams are then fresh).
    """
    validate_rng_state(state, cuda_may_differ=cuda_may_differ).restore()


def cuda_device_count() -> int:
    """CUDA devices this process can restore generator states to (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cuda_in_use() -> bool:
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


@functools.cache
def _scratch_numpy_generator() -> np.random.RandomState:
    """A generator of this process's own that validation sets and never draws from: seeding a
    new one for each validation cost more than the rest of NumPy's check.
    ``set_state`` holds the generator's lock, so concurrent loads are safe."""
    return np.random.RandomState()


def _words(value: object) -> tuple[int, ...]:
    """Generator words from their int64 tensor (one pickle record, not 600 pickled ints)."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 1:
        raise TypeError(f"expected a 1-D int64 tensor, got {value!r:.80}")
    # Checked in Python, not with tensor min()/max(): a process's first call of those is
    # slow, and on the critical path of every resume.
    words = tuple(value.tolist())
    if words and not (min(words) >= 0 and max(words) < 1 << 32):
        raise ValueError("generator words must fit in 32 bits")
    return words


def _check_byte_tensor(value: object) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise TypeError(f"expected a 1-D uint8 tensor, got {value!r:.80}")
