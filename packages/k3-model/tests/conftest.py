"""Small configurations of each kind, built reproducibly on CPU in fp32."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from k3_model import K3Config, K3Model

sys.path.insert(0, str(Path(__file__).parent))  # ep_workers, for spawned processes

# Small enough that a forward+backward takes milliseconds on 2 CPU cores.
SMALL: dict[str, dict[str, Any]] = {
    "mha": dict(attention="gqa", n_kv_heads=None),
    "gqa": dict(attention="gqa", n_kv_heads=2),
    "mla": dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                v_head_dim=12),
    "mla_qlora": dict(attention="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                      qk_rope_head_dim=8, v_head_dim=12),
    # Kimi K3 layout: KDA then Gated NoPE MLA (last layer), plain residual and MoE
    "hybrid": dict(attention="hybrid", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                   v_head_dim=12, kda_chunk_size=16),
    # ... with Attention Residuals, LatentMoE and SiTU-GLU: every K3 mechanism at once
    "k3": dict(attention="hybrid", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
               v_head_dim=12, kda_chunk_size=16, attn_res_block_size=1, moe_latent_dim=32,
               activation="situ"),
}


def small_config(kind: str = "mla", **overrides: Any) -> K3Config:
    fields: dict[str, Any] = dict(
        vocab_size=64, d_model=48, n_layers=2, n_heads=4, max_seq_len=32, d_ff=96,
        mlp="moe", n_dense_layers=1, n_experts=4, moe_top_k=2, moe_d_ff=32,
    )
    fields.update(SMALL[kind])
    fields.update(overrides)
    return K3Config(**fields)


def small_model(kind: str = "mla", seed: int = 0, **overrides: Any) -> K3Model:
    torch.manual_seed(seed)
    return K3Model(small_config(kind, **overrides))


def tokens(b: int = 2, t: int = 16, vocab: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def make_config() -> Callable[..., K3Config]:
    return small_config


@pytest.fixture
def make_model() -> Callable[..., K3Model]:
    return small_model


@pytest.fixture
def make_tokens() -> Callable[..., torch.Tensor]:
    return tokens
