"""k3-model: a compact reference Kimi-K3-style decoder for K3 Train.

GQA or MLA attention that declares its QK-Clip geometry (k3-qkclip), dense or MoE SwiGLU
MLPs with an fp32 sigmoid router and quantile-balanced top-k selection.
"""

from importlib.metadata import PackageNotFoundError, version

from .attention import GQAttention, MLAttention
from .balancer import QuantileBalancer, quantile_bias
from .config import K3Config
from .flops import ParameterCount, count_parameters, flops_per_token
from .mlp import SwiGLU
from .model import Block, K3Model
from .moe import MoE, Router, RoutingStats
from .norm import RMSNorm
from .presets import PRESETS, preset
from .rope import RotaryEmbedding, apply_rotary

try:
    __version__ = version("k3-model")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0+unknown"

__all__ = [
    "PRESETS",
    "Block",
    "GQAttention",
    "K3Config",
    "K3Model",
    "MLAttention",
    "MoE",
    "ParameterCount",
    "QuantileBalancer",
    "RMSNorm",
    "RotaryEmbedding",
    "Router",
    "RoutingStats",
    "SwiGLU",
    "__version__",
    "apply_rotary",
    "count_parameters",
    "flops_per_token",
    "preset",
    "quantile_bias",
]
