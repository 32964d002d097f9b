"""The exceptions checkpoint rejections raise: one base class, and the two refusals a caller
may want to answer by kind (the metadata, a component's state) rather than by message."""

from __future__ import annotations

import os

__all__ = ["CheckpointError", "ComponentRefused", "IncompatibleCheckpoint"]


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

    def _renamed(self, reason: str, path: str | None) -> CheckpointError:
        """A copy of this error (its class and structured fields kept) with another reason
        or path."""
        located = type(self).__new__(type(self))
        located.__dict__.update(self.__dict__)
        located.reason, located.path = reason, path
        located.args = (reason if path is None else f"checkpoint {path}: {reason}",)
        located.__cause__ = self.__cause__
        return located

    def with_path(self, path: str | os.PathLike[str]) -> CheckpointError:
        """This error naming ``path``, unless it already names a file."""
        if self.path is not None:
            return self
        return self._renamed(self.reason, os.fspath(path))

    def with_hint(self, hint: str) -> CheckpointError:
        """This error, of the same kind, with ``hint`` (what to do about it) appended."""
        return self._renamed(f"{self.reason}; {hint}", self.path)


class IncompatibleCheckpoint(CheckpointError):
    """The saved metadata differs from the current run where the policy refuses it.

    ``sections`` names the refused top-level metadata keys (``"runtime"``,
    ``"train_config"``, ...) in the caller's order, the first being the one the message
    details; ``paths`` every refused metadata path (``"train_config.decay_steps"``)."""

    def __init__(self, reason: str, *, sections: tuple[str, ...], paths: tuple[str, ...],
                 path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(reason, path=path)
        self.sections, self.paths = sections, paths


class ComponentRefused(CheckpointError):
    """A component's ``load_state_dict`` refused its saved state (nothing was restored).

    ``component`` names it (``"loaders"``); ``error`` is what it raised, also the
    ``__cause__``, so a caller can answer by that exception's type."""

    def __init__(self, reason: str, *, component: str, error: BaseException,
                 path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(reason, path=path)
        self.component, self.error = component, error
