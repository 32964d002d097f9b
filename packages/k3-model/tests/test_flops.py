from __future__ import annotations

import pytest

from k3_model import (
    PRESETS,
    K3Config,
    K3Model,
    count_parameters,
    flops_per_token,
    kda_flops_per_token,
)


def _numel(config: K3Config) -> int:
    return sum(p.numel() for p in K3Model(config).parameters())


def test_gqa_moe_config_against_a_hand_count():
    config = K3Config(
        vocab_size=11, d_model=8, n_layers=3, n_heads=2, n_kv_heads=1,  # head_dim 4
        mlp="moe", n_dense_layers=1, d_ff=12,
        n_experts=4, moe_top_k=1, n_shared_experts=1, moe_d_ff=6,
    )
    embed = head = 11 * 8
    final_norm = 8
    attn = 8 * 8 + 8 * 4 + 8 * 4 + 8 * 8  # q, k, v, o = 192
    norms = 2 * 8  # per block
    dense = 3 * 8 * 12  # gate, up, down = 288
    router, expert = 4 * 8, 3 * 8 * 6  # 32, 144
    moe_total = router + 4 * expert + expert  # 4 routed + 1 shared = 752
    moe_active = router + 1 * expert + expert  # top-1 + shared = 320
    total = embed + head + final_norm + 3 * (attn + norms) + dense + 2 * moe_total
    active = embed + head + final_norm + 3 * (attn + norms) + dense + 2 * moe_active
    matmul = head + 3 * attn + dense + 2 * moe_active
    assert (total, active, matmul) == (2600, 1736, 1592)
    count = count_parameters(config)
    assert (count.total, count.embedding, count.active, count.matmul) == (
        total, embed, active, matmul,
    )
    assert count.non_embedding == total - embed
    assert _numel(config) == total
    # 6 per matmul weight + 6·layers·heads·(qk + v dims)·seq
    assert flops_per_token(config, 10) == 6 * 1592 + 6 * 3 * 2 * (4 + 4) * 10 == 12432


def test_tied_mla_config_with_query_lora_against_a_hand_count():
    config = K3Config(
        vocab_size=11, d_model=8, n_layers=1, n_heads=2, attention="mla",
        q_lora_rank=4, kv_lora_rank=3, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3,
        mlp="dense", d_ff=5, tie_embeddings=True,
    )
    embed = 11 * 8
    q_down, q_norm, q_up = 8 * 4, 4, 4 * 2 * (2 + 2)  # 32, 4, 32
    kv_down, kv_norm, kv_up = 8 * (3 + 2), 3, 3 * 2 * (2 + 3)  # 40, 3, 30
    o_proj = 2 * 3 * 8  # 48
    attn_matmul = q_down + q_up + kv_down + kv_up + o_proj  # 182
    dense = 3 * 8 * 5  # 120
    total = embed + 8 + attn_matmul + q_norm + kv_norm + 2 * 8 + dense  # head is the embedding
    assert total == 421
    count = count_parameters(config)
    assert (count.total, count.active) == (total, total)
    assert count.matmul == embed + attn_matmul + dense == 390  # the tied head still multiplies
    assert _numel(config) == total
    assert flops_per_token(config, 7) == 6 * 390 + 6 * 1 * 2 * (4 + 3) * 7 == 2928


def test_hybrid_latent_moe_attn_res_config_against_a_hand_count():
    config = K3Config(
        vocab_size=11, d_model=8, n_layers=2, n_heads=2, attention="hybrid",  # kda, mla
        kv_lora_rank=3, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3,
        kda_heads=2, kda_head_dim=4, kda_conv_size=4, kda_chunk_size=16,
        attn_res_block_size=1, mlp="moe", n_dense_layers=1, d_ff=5, activation="situ",
        n_experts=4, moe_top_k=1, n_shared_experts=1, moe_d_ff=6, moe_latent_dim=4,
    )
    embed = head = 11 * 8
    final_norm = 8
    reads = (1 + 2 + 1) * (8 + 8)  # layer 0: mlp read; layer 1: both; the final read
    # KDA, inner H·K = 8: q/k/v 3·8·8, convs 3·8·4, f_a 8·4, f_b 4·8, β 8·2, gate 8·8, o 8·8
    kda_matmul = 192 + 96 + 32 + 32 + 16 + 64 + 64  # 496
    kda_vectors = 2 + 8 + 4  # A_log, dt_bias, o_norm
    # Gated NoPE MLA: q 8·2·4, kv_down 8·(3+2), kv_up 3·2·(2+3), o 6·8, gate 8·6
    mla_matmul = 64 + 40 + 30 + 48 + 48  # 230
    mla_norm = 3
    norms = 2 * 8  # per block
    dense = 3 * 8 * 5  # 120
    # LatentMoE: router 4·8, down 8·4, up 4·8, latent norm 4, expert 3·4·6 (latent
    # width), shared expert 3·8·6 (full width)
    router, down, up, latent_norm, expert, shared = 32, 32, 32, 4, 72, 144
    moe_total = router + down + up + latent_norm + 4 * expert + shared  # 532
    moe_matmul = router + down + up + expert + shared  # 312 (top-1)
    total = (embed + head + final_norm + reads + kda_matmul + kda_vectors + norms + dense
             + mla_matmul + mla_norm + norms + moe_total)
    assert total == 1675
    count = count_parameters(config)
    assert count.total == total == _numel(config)
    assert count.active == total - 3 * expert == 1459
    assert count.matmul == head + kda_matmul + dense + mla_matmul + moe_matmul == 1246
    # KDA per token and head, forward, C=16, K=V=4: 2CK+2CK (kkᵀ, qkᵀ) + C(K+V) (solve)
    # + 2CV (intra-chunk output) + 6KV (v', q·S, state update) = 608; training ×3, 2 heads
    kda = 3 * 2 * (2 * 16 * 4 * 2 + 16 * 8 + 2 * 16 * 4 + 6 * 4 * 4)
    assert kda == kda_flops_per_token(config) == 3648
    softmax = 6 * 1 * 2 * (4 + 3) * 10  # the one MLA layer at seq 10
    assert flops_per_token(config, 10) == 6 * 1246 + softmax + kda == 11964


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_preset_counts_match_the_built_model(name):
    assert count_parameters(PRESETS[name]).total == _numel(PRESETS[name])


def test_flops_per_token_rejects_a_bad_sequence_length():
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(PRESETS["tiny"], 0)


@pytest.mark.parametrize("name, total, active, kda, mla", [
    ("kimi-linear-48b-a3b", 49.12e9, 3.48e9, 20, 7),
    ("kimi-k3", 2.779e12, 105.0e9, 69, 24),
])
def test_published_sizes_count_like_their_meta_model(name, total, active, kda, mla):
    """The published presets, built on the meta device (nothing allocated): the arithmetic
    total is the model's numel sum, and the active count is that sum with each MoE layer's
    routed expert stacks taken at top_k/n_experts (a token uses top_k of them)."""
    import torch

    from k3_model.moe import Experts

    config = PRESETS[name]
    with torch.device("meta"):
        model = K3Model(config)
    numel = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for m in model.modules() if isinstance(m, Experts)
                 for p in m.parameters())
    count = count_parameters(config)
    assert count.total == numel
    assert routed % config.n_experts == 0
    assert count.active == numel - routed + routed // config.n_experts * config.moe_top_k
    assert count.total == pytest.approx(total, rel=1e-3)
    assert count.active == pytest.approx(active, rel=1e-2)
    kinds = config.layer_types()
    assert (kinds.count("kda"), kinds.count("mla")) == (kda, mla)
