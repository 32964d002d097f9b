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

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .attention import GQAttention, MLAttention
    from .attn_res import ResidualRead
    from .balancer import QuantileBalancer, expert_counts, quantile_bias
    from .cache import DecodeCache
    from .checkpointing import CHECKPOINT_MODES
    from .config import K3Config
    from .flops import ParameterCount, count_parameters, flops_per_token, kda_flops_per_token
    from .hub import load_pretrained, save_pretrained
    from .kda import KimiDeltaAttention, chunk_kda, recurrent_kda
    from .loss import chunked_cross_entropy
    from .mlp import GatedMLP, SwiGLU, situ_glu
    from .model import Block, K3Model
    from .moe import Experts, MoE, Router, RoutingStats
    from .norm import RMSNorm
    from .presets import PRESETS, preset
    from .rope import RotaryEmbedding, apply_rotary
    from .scoring import Continuations, Scored, score_continuations

_EXPORTS = {
    "GQAttention": ".attention",
    "MLAttention": ".attention",
    "ResidualRead": ".attn_res",
    "QuantileBalancer": ".balancer",
    "expert_counts": ".balancer",
    "quantile_bias": ".balancer",
    "DecodeCache": ".cache",
    "CHECKPOINT_MODES": ".checkpointing",
    "K3Config": ".config",
    "ParameterCount": ".flops",
    "count_parameters": ".flops",
    "flops_per_token": ".flops",
    "kda_flops_per_token": ".flops",
    "load_pretrained": ".hub",
    "save_pretrained": ".hub",
    "KimiDeltaAttention": ".kda",
    "chunk_kda": ".kda",
    "recurrent_kda": ".kda",
    "chunked_cross_entropy": ".loss",
    "GatedMLP": ".mlp",
    "SwiGLU": ".mlp",
    "situ_glu": ".mlp",
    "Block": ".model",
    "K3Model": ".model",
    "Experts": ".moe",
    "MoE": ".moe",
    "Router": ".moe",
    "RoutingStats": ".moe",
    "RMSNorm": ".norm",
    "PRESETS": ".presets",
    "preset": ".presets",
    "RotaryEmbedding": ".rope",
    "apply_rotary": ".rope",
    "Continuations": ".scoring",
    "Scored": ".scoring",
    "score_continuations": ".scoring",
}

try:
    __version__ = version("k3-model")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0+unknown"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'k3_model' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "CHECKPOINT_MODES",
    "PRESETS",
    "Block",
    "Continuations",
    "DecodeCache",
    "Experts",
    "GQAttention",
    "GatedMLP",
    "K3Config",
    "K3Model",
    "KimiDeltaAttention",
    "MLAttention",
    "MoE",
    "ParameterCount",
    "QuantileBalancer",
    "RMSNorm",
    "ResidualRead",
    "RotaryEmbedding",
    "Router",
    "RoutingStats",
    "Scored",
    "SwiGLU",
    "__version__",
    "apply_rotary",
    "chunk_kda",
    "chunked_cross_entropy",
    "count_parameters",
    "expert_counts",
    "flops_per_token",
    "kda_flops_per_token",
    "load_pretrained",
    "preset",
    "quantile_bias",
    "recurrent_kda",
    "save_pretrained",
    "score_continuations",
    "situ_glu",
]
