"""Named model sizes. ``preset(name, **overrides)`` returns a validated :class:`K3Config`.

Every preset is Kimi-K3-shaped: hybrid KDA + Gated MLA (NoPE; MLA every 4th and the last
layer), block Attention Residuals, a dense first layer then LatentMoE with shared
experts, SiTU-GLU.

| name  | for                | params (active) | KDA + MLA, heads | MoE: E/k, shared, latent |
|-------|--------------------|-----------------|------------------|--------------------------|
| tiny  | CPU demo and tests | 1.37 M (0.92 M) | 3 + 1, 4 heads   | 8/2, 1, 64 of 128        |
| small | CPU or small GPU   | 52 M (37 M)     | 6 + 2, 6 heads   | 16/2, 1, 192 of 384      |
| base  | one GPU            | 1.04 B (0.36 B) | 12 + 4, 16 heads | 64/6, 2, 512 of 1024     |
| kimi-k3 | planning (meta) | 2.78 T (105 B) | 69 + 24, 96 heads | 896/16, 2, 3584 of 7168 |

Two presets carry published shapes, for planning on the meta device (``k3-train plan``)
or loading published weights: ``kimi-linear-48b-a3b`` (Moonshot's Kimi Linear 48B-A3B)
and ``kimi-k3`` (the Kimi K3 card).

Override any field, e.g. ``preset("small", vocab_size=50304)`` to match a tokenizer, or
``preset("tiny", attention="mla")`` for an all-MLA model of equal width (RoPE, no gate).
A dense llama-style baseline of ``tiny``'s active size is ``preset("tiny",
attention="gqa", n_kv_heads=2, mlp="dense", activation="swiglu", d_ff=432,
attn_res_block_size=0)``. How ``tiny`` trains against it, against all-MLA and without
AttnRes, with its training recipe's alternatives: BENCHMARKS.md, "Training quality"
(``hatch run bench:quality``); ``small`` inherits ``tiny``'s recipe, unmeasured.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from .config import K3Config

# What makes a preset K3-shaped: hybrid KDA + Gated MLA (NoPE), Attention Residuals,
# a dense first layer then LatentMoE with shared experts, SiTU-GLU everywhere.
_K3: dict[str, Any] = dict(attention="hybrid", full_attention_every=4, mlp="moe", n_dense_layers=1,
           activation="situ")
# Kimi Linear (Moonshot's hub model, what transformers' kimi_linear runs): hybrid KDA +
# MLA (NoPE, no output gate), KDA's softplus decay and low-rank output gate, SwiGLU, a plain
# residual, routed experts at full width.
_KIMI_LINEAR: dict[str, Any] = dict(
    attention="hybrid", full_attention_every=4, mlp="moe", n_dense_layers=1,
    activation="swiglu", mla_gate=False, mla_norm_eps=1e-6,
    kda_decay="softplus", attn_res_block_size=0, moe_latent_dim=0)

PRESETS: Mapping[str, K3Config] = MappingProxyType(
    {
        # Byte-level vocabulary; trains visibly on 2 CPU cores in minutes.
        "tiny": K3Config(
            vocab_size=256, d_model=128, n_layers=4, n_heads=4, max_seq_len=256, **_K3,
            kda_chunk_size=32, attn_res_block_size=2,
            q_lora_rank=0, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
            v_head_dim=32, d_ff=384,
            n_experts=8, moe_top_k=2, n_shared_experts=1, moe_d_ff=128, moe_latent_dim=64,
        ),
        "small": K3Config(
            vocab_size=32768, d_model=384, n_layers=8, n_heads=6, max_seq_len=1024, **_K3,
            attn_res_block_size=4,
            q_lora_rank=0, kv_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=32,
            v_head_dim=64, d_ff=1024,
            n_experts=16, moe_top_k=2, n_shared_experts=1, moe_d_ff=256, moe_latent_dim=192,
        ),
        # GPU-sized.
        "base": K3Config(
            vocab_size=65536, d_model=1024, n_layers=16, n_heads=16, max_seq_len=4096, **_K3,
            attn_res_block_size=4,
            q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
            v_head_dim=64, d_ff=2816,
            n_experts=64, moe_top_k=6, n_shared_experts=2, moe_d_ff=512, moe_latent_dim=512,
            loss_chunk_size=2048,  # never a (tokens, 65536) fp32 logits tensor
        ),
        # tiny's size in Kimi Linear's form: exports to the kimi_linear hub format.
        "kimi-linear-tiny": K3Config(
            vocab_size=256, d_model=128, n_layers=4, n_heads=4, max_seq_len=256,
            **_KIMI_LINEAR, kda_chunk_size=32, kda_output_gate_rank=32,
            q_lora_rank=0, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
            v_head_dim=32, d_ff=384,
            n_experts=8, moe_top_k=2, n_shared_experts=1, moe_d_ff=128, routed_scaling=2.446,
        ),
        # moonshotai/Kimi-Linear-48B-A3B's published shape (96 GB of bf16 weights: build it
        # on the meta device to inspect it, or load the published weights on a GPU host).
        "kimi-linear-48b-a3b": K3Config(
            vocab_size=163840, d_model=2304, n_layers=27, n_heads=32, max_seq_len=1048576,
            **_KIMI_LINEAR, kda_head_dim=128, kda_output_gate_rank=128,
            q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, d_ff=9216,
            n_experts=256, moe_top_k=8, n_shared_experts=1, moe_d_ff=1024,
            routed_scaling=2.446, loss_chunk_size=2048,
        ),
        # Kimi K3's published shape (the model card: 93 layers, 69 KDA + 24 Gated MLA,
        # hidden 7168, 96 heads, LatentMoE 896 experts top-16 + 2 shared, latent 3584,
        # expert width 3072, vocab 160K, AttnRes blocks of 12, context 1M; ~2.7 T
        # parameters, 5.4 TB of bf16 weights): for planning on the meta device. The card
        # does not give the dense first layer's width (K2's 18432 here), nor KDA's head
        # width (128, Kimi Linear's, 96 heads) or the shared experts' (the expert width).
        "kimi-k3": K3Config(
            vocab_size=163840, d_model=7168, n_layers=93, n_heads=96, max_seq_len=1048576,
            **_K3, attn_res_block_size=12, kda_head_dim=128,
            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, d_ff=18432,
            n_experts=896, moe_top_k=16, n_shared_experts=2, moe_d_ff=3072,
            moe_latent_dim=3584, loss_chunk_size=2048,
        ),
    }
)


def preset(name: str, **overrides: Any) -> K3Config:
    """The named preset with ``overrides`` applied (re-validated; unknown fields rejected)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
