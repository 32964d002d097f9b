"""Named model sizes. ``preset(name, **overrides)`` returns a validated :class:`K3Config`.

| name  | for                    | params (active) | attention         | MLP                    |
|-------|------------------------|-----------------|-------------------|------------------------|
| tiny  | CPU demo and tests     | 1.8 M (0.9 M)   | MLA, 4 heads      | 1 dense + 3 MoE 8/2    |
| small | CPU or small GPU       | 54 M (33 M)     | MLA, 6 heads      | 1 dense + 5 MoE 16/2   |
| base  | GPU-sized (one GPU)    | 1.7 B (0.35 B)  | MLA+q-LoRA, 16 h  | 1 dense + 15 MoE 64/6  |

(MoE E/k: experts / top-k, plus one shared expert.)
Every preset has MoE layers and QK-Clip-observed attention, so each mechanism runs in
the demo. Override any field, e.g. ``preset("small", vocab_size=50304)`` to match a
tokenizer, or ``preset("tiny", attention="gqa", n_kv_heads=2)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .config import K3Config

PRESETS: Mapping[str, K3Config] = MappingProxyType(
    {
        # Byte-level vocabulary; trains visibly on 2 CPU cores in minutes.
        "tiny": K3Config(
            vocab_size=256, d_model=128, n_layers=4, n_heads=4, max_seq_len=256,
            attention="mla", q_lora_rank=0, kv_lora_rank=64,
            qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            mlp="moe", d_ff=384, n_dense_layers=1,
            n_experts=8, moe_top_k=2, n_shared_experts=1, moe_d_ff=128,
        ),
        "small": K3Config(
            vocab_size=32768, d_model=384, n_layers=6, n_heads=6, max_seq_len=1024,
            attention="mla", q_lora_rank=0, kv_lora_rank=96,
            qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64,
            mlp="moe", d_ff=1024, n_dense_layers=1,
            n_experts=16, moe_top_k=2, n_shared_experts=1, moe_d_ff=256,
        ),
        # GPU-sized: about 1.7 B parameters, ~0.35 B active per token.
        "base": K3Config(
            vocab_size=65536, d_model=1024, n_layers=16, n_heads=16, max_seq_len=4096,
            attention="mla", q_lora_rank=384, kv_lora_rank=256,
            qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
            mlp="moe", d_ff=2816, n_dense_layers=1,
            n_experts=64, moe_top_k=6, n_shared_experts=1, moe_d_ff=512,
        ),
    }
)


def preset(name: str, **overrides: Any) -> K3Config:
    """The named preset with ``overrides`` applied (re-validated; unknown fields rejected)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
