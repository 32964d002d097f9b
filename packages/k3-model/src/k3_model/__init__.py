"""k3-model: a compact reference Kimi K3 decoder for K3 Train.

Hybrid Kimi Delta Attention + Gated MLA (which declares its QK-Clip geometry, k3-qkclip),
block Attention Residuals, a dense first layer then LatentMoE with shared experts and an
fp32 sigmoid router with quantile-balanced top-k, SiTU-GLU activations. All-MLA and GQA
layouts remain for comparison.

The public names load on first use (PEP 562): ``k3_model.config`` and
``k3_model.presets`` are plain data, so a command line can list the presets and the
config's fields without importing torch.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import lazy_loader

try:
    __version__ = version("k3-model")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0+unknown"

# The public names load on first use, listed once, in __init__.pyi.
__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
__all__ = [*__all__, "__version__"]
