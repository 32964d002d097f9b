"""k3-model: a compact reference Kimi K3 decoder for K3 Train.

Hybrid Kimi Delta Attention + Gated MLA (which declares its QK-Clip geometry, k3-qkclip),
block Attention Residuals, a dense first layer then LatentMoE with shared experts and an
fp32 sigmoid router with quantile-balanced top-k, SiTU-GLU activations. All-MLA and GQA
layouts remain for comparison.
"""

from importlib.metadata import PackageNotFoundError, version

from .attention import GQAttention, MLAttention
from .attn_res import ResidualRead
from .balancer import QuantileBalancer, expert_counts, quantile_bias
from .checkpointing import CHECKPOINT_MODES
from .config import K3Config
from .flops import ParameterCount, count_parameters, flops_per_token, kda_flops_per_token
from .kda import KimiDeltaAttention, chunk_kda, recurrent_kda
from .loss import chunked_cross_entropy
from .mlp import GatedMLP, SwiGLU, situ_glu
from .model import Block, K3Model
from .moe import Experts, MoE, Router, RoutingStats
from .norm import RMSNorm
from .presets import PRESETS, preset
from .rope import RotaryEmbedding, apply_rotary

try:
    __version__ = version("k3-model")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0+unknown"

__all__ = [
    "CHECKPOINT_MODES",
    "PRESETS",
    "Block",
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
    "SwiGLU",
    "__version__",
    "apply_rotary",
    "chunk_kda",
    "chunked_cross_entropy",
    "count_parameters",
    "expert_counts",
    "flops_per_token",
    "kda_flops_per_token",
    "preset",
    "quantile_bias",
    "recurrent_kda",
    "situ_glu",
]
