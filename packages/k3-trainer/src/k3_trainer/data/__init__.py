"""Data: corpora prepared into immutable token shards, and the loader that reads them.

The names load on first use (PEP 562): :mod:`k3_trainer.data.options` stays torch-free
for the command line.
"""

from __future__ import annotations

import lazy_loader

# The public names load on first use, listed once, in __init__.pyi.
__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
