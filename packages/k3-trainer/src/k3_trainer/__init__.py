"""k3-trainer: the K3 training runner — the ``Trainer`` and its callbacks, data, evaluation,
checkpoints, observation and the ``k3-train`` command, on one device or many (torchrun).

The public names load on first use (PEP 562), so ``k3-train --help`` and argument errors
answer without importing torch.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import lazy_loader

try:
    __version__ = version("k3-trainer")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0+unknown"

# The public names load on first use, listed once, in __init__.pyi.
__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
__all__ = [*__all__, "__version__"]
