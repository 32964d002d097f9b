"""The pickle module a payload is written with: Python's own, with the memo turned off and
no empty hook dict per tensor.

Python's pickler memoizes everything it writes (a PUT after each object) so that a second
reference to an object can be a GET. A checkpoint is a tree, so almost no PUT is ever used,
yet every one costs the loader: torch's weights-only unpickler is a pure-Python loop that
tests an opcode against each kind in turn, and the memo opcodes come last. In a 4.2 MiB
checkpoint the memo opcodes were 41% of the pickle's 3,921, and unpickling without them took
23% less time (9.3 -> 7.1 ms; the repository's ``BENCHMARKS.md``). The price: what a GET
stood for (``_rebuild_tensor_v2``, a storage type, a repeated key) is written out again, a
few kilobytes. For the same reason each tensor's never-saved backward hooks are written as
``None`` rather than torch's empty ``OrderedDict`` (``Pickler.reducer_override``): 0.3 ms less
to load the same checkpoint, and 0.3 ms less to write it.

The file is an ordinary pickle either way, read by ``torch.load`` and this package alike. An
object referenced twice is written twice and loads as two equal objects (tensors still share
their storage: torch writes each storage once). A reference cycle cannot be written; the
save refuses it with a ``CheckpointError`` (component states are trees, so a checkpoint has
none). Python's documentation calls ``Pickler.fast`` deprecated; should a Python drop it, the
attribute would do nothing and payloads would be written memoized, as valid as before."""

from __future__ import annotations

import pickle
from collections import OrderedDict
from typing import Any

import torch

from .errors import CheckpointError

__all__ = ["Pickler"]

_REBUILD_TENSOR = torch._utils._rebuild_tensor_v2


class Pickler(pickle.Pickler):
    """``pickle.Pickler`` in fast mode (no memo, so no PUT or GET opcodes) that writes no
    empty hook dict per tensor."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fast = True

    def reducer_override(self, obj: Any) -> Any:
        """A dense tensor as torch reduces it, but with ``None`` for its backward hooks where
        torch writes an empty ``OrderedDict`` (hooks are never saved): per tensor, one opcode
        instead of a GLOBAL, a call and the weights-only unpickler's allow-list check of that
        call. The tensor loads with no hooks either way (``None`` is what a new tensor has).
        Anything else is pickled as Python and torch would pickle it."""
        if type(obj) is not torch.Tensor:
            return NotImplemented
        reduced = obj.__reduce_ex__(2)  # type: ignore[no-untyped-call]  # torch.save writes 2
        if len(reduced) == 2 and reduced[0] is _REBUILD_TENSOR:
            arguments = reduced[1]
            hooks = arguments[5] if len(arguments) > 5 else None
            if type(hooks) is OrderedDict and not hooks:
                return (_REBUILD_TENSOR, (*arguments[:5], None, *arguments[6:]))
        return reduced

    def dump(self, obj: Any) -> None:
        try:
            super().dump(obj)
        except ValueError as error:
            if "cyclic" not in str(error):  # fast mode's "can't pickle cyclic objects"
                raise
            raise CheckpointError(
                "the payload contains a reference cycle (an object that contains itself); a "
                "checkpoint stores trees of plain data and tensors"
            ) from error
