"""How a session says what it does: one line at a time through a ``say`` callable.

The library never decides where its lines go. The command line passes one that prints
``k3-train: …`` (with the rank under torchrun) to stderr; a notebook may collect them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

Say = Callable[[str], None]
"""Receives one line (``note: …``, ``warning: …`` or a plain statement), unprefixed."""


def to_stderr(line: str) -> None:
    """The default: ``k3-train: line`` on stderr."""
    print(f"k3-train: {line}", file=sys.stderr)


def to_stdout(line: str) -> None:
    """Where the outcome goes by default: ``k3-train: line`` on stdout."""
    print(f"k3-train: {line}")
