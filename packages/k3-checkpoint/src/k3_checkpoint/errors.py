"""The one exception every checkpoint rejection raises."""

from __future__ import annotations

import os

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint cannot be written, read or resumed; the message says which part and why.

    A ``ValueError`` so callers that already treat bad input as ``ValueError`` keep working.
    ``path`` is the checkpoint file when one is involved and ``reason`` the message without it,
    so a command line can print ``str(error)`` as one line.
    """

    def __init__(self, reason: str, *, path: str | os.PathLike[str] | None = None) -> None:
        self.reason = reason
        self.path = None if path is None else os.fspath(path)
        super().__init__(reason if self.path is None else f"checkpoint {self.path}: {reason}")

    def with_path(self, path: str | os.PathLike[str]) -> CheckpointError:
        """This error naming ``path``, unless it already names a file."""
        if self.path is not None:
            return self
        located = CheckpointError(self.reason, path=path)
        located.__cause__ = self.__cause__
        return located
