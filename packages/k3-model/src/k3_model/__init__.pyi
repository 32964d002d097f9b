"""Type stub of ``k3_model``'s lazily loaded public names: the one list of them
(``lazy_loader.attach_stub`` reads it at import; type checkers read it instead of
``__init__.py``)."""

from .activation_checkpointing import CHECKPOINT_MODES
from .attention import GQAttention, MLAttention
from .attn_res import ResidualRead
from .balancer import QuantileBalancer, expert_counts, quantile_bias
from .cache import DecodeCache
from .config import K3Config
from .context_parallel import ContextParallel, check_context_parallel
from .flops import ParameterCount, count_parameters, flops_per_token, kda_flops_per_token
from .hub import load_pretrained, save_pretrained
from .kda import KimiDeltaAttention, chunk_kda, recurrent_kda
from .loss import chunked_cross_entropy
from .mlp import GatedMLP, SwiGLU, situ_glu
from .model import Block, K3Model
from .moe import Experts, MoE, Router, RoutingStats
from .norm import RMSNorm
from .pipeline import StageForward, keep_stages
from .presets import PRESETS, preset
from .rope import RotaryEmbedding, apply_rotary
from .scoring import Continuations, Scored, score_continuations

__version__: str

__all__ = [
    "CHECKPOINT_MODES",
    "PRESETS",
    "Block",
    "ContextParallel",
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
    "StageForward",
    "SwiGLU",
    "__version__",
    "apply_rotary",
    "check_context_parallel",
    "chunk_kda",
    "chunked_cross_entropy",
    "count_parameters",
    "expert_counts",
    "flops_per_token",
    "kda_flops_per_token",
    "keep_stages",
    "load_pretrained",
    "preset",
    "quantile_bias",
    "recurrent_kda",
    "save_pretrained",
    "score_continuations",
    "situ_glu",
]
