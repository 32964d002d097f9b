"""Parameter and training-FLOP counts from a config alone (no model needed), for MFU.

``flops_per_token`` follows the convention of PaLM (Chowdhery et al. 2022, App. B),
nanoGPT and torchtitan so MFU numbers compare across projects: a matmul with ``N``
weights costs ``2N`` FLOPs per token forward and ``4N`` backward (``6N`` in all); a
depthwise KDA convolution weight also multiplies once per token, so it counts the same.
Softmax attention (MLA, GQA layers) adds ``6·n_heads·(qk_dim + v_dim)·seq_len`` per
token and layer (scores ``QKᵀ`` and ``softmax·V``, forward ``2·…``, backward twice
that), over the full sequence, not halved for the causal mask. A KDA layer adds, per
token and head, three times its chunked forward (chunk ``C``, key dim ``K``, value
dim ``V``; every term a multiply-add = 2 FLOPs, averaged over the chunk's C tokens):

    2CK (k·kᵀ within the chunk) + 2CK (q·kᵀ) + C(K+V) (triangular solve for w and u)
    + 2CV (intra-chunk output) + 2KV (v' = u − wS) + 2KV (q·S) + 2KV (state update)

Only routed experts a token actually uses count (active parameters); the embedding
lookup is not a matmul, the output head is (also when tied). Elementwise work (norms,
gates, the Attention-Residuals reads, the decay) and QK-Clip's no-grad observation
matmul are overhead, not model FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import K3Config


@dataclass(frozen=True)
class ParameterCount:
    """Parameter counts of a :class:`K3Config`'s model.

    ``total``: every parameter once (a tied head is the embedding) — equals
    ``sum(p.numel() for p in K3Model(config).parameters())``. ``embedding``: the input
    table ``vocab·d_model``. ``active``: parameters a token touches (unused routed experts
    left out). ``matmul``: weights a token multiplies by, i.e. ``active`` without the
    embedding lookup and elementwise parameters (norm gains, ``A_log``, ``dt_bias``,
    pseudo-queries), plus the head even when tied: the FLOP basis.
    """

    total: int
    embedding: int
    active: int
    matmul: int

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def _mla(c: K3Config) -> tuple[int, int]:
    """(matmul weights, elementwise weights) of one MLA module."""
    d, h = c.d_model, c.n_heads
    q_rows = h * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    if c.q_lora_rank:
        q, q_norm = d * c.q_lora_rank + c.q_lora_rank * q_rows, c.q_lora_rank
    else:
        q, q_norm = d * q_rows, 0
    kv_down = d * (c.kv_lora_rank + c.qk_rope_head_dim)
    kv_up = c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim)
    out = h * c.v_head_dim * d
    gate = d * h * c.v_head_dim if c.mla_gated else 0
    return q + kv_down + kv_up + out + gate, q_norm + c.kv_lora_rank


def _gqa(c: K3Config) -> tuple[int, int]:
    d, h, e, kv = c.d_model, c.n_heads, c.attn_head_dim, c.kv_heads
    return d * h * e + 2 * d * kv * e + h * e * d, 0


def _kda(c: K3Config) -> tuple[int, int]:
    """(matmul + conv weights, elementwise weights) of one KDA module."""
    d, h, k = c.d_model, c.kda_n_heads, c.kda_dim
    inner = h * k
    qkv, conv = 3 * d * inner, 3 * inner * c.kda_conv_size
    forget = d * k + k * inner  # f_a, f_b
    rank = c.kda_output_gate_rank
    gate = rank * (d + inner) if rank else d * inner  # g_a, g_b or g_proj
    beta, out = d * h, inner * d
    return qkv + conv + forget + beta + gate + out, h + inner + k  # A_log, dt_bias, o_norm


_MIXERS = {"mla": _mla, "gqa": _gqa, "kda": _kda}


def _moe(c: K3Config) -> tuple[int, int, int]:
    """(total, active matmul, elementwise) parameters of one MoE layer."""
    d, latent, width = c.d_model, c.moe_latent_dim, c.moe_width
    expert = 3 * width * c.moe_d_ff
    router = c.n_experts * d
    shared = c.n_shared_experts * 3 * d * c.moe_d_ff
    projections = 2 * d * latent
    fixed = router + shared + projections
    return fixed + c.n_experts * expert, fixed + c.moe_top_k * expert, latent


def count_parameters(config: K3Config) -> ParameterCount:
    """Total, embedding, active-per-token and matmul parameter counts of ``config``."""
    c = config
    d = c.d_model
    embedding = c.vocab_size * d
    head = c.vocab_size * d
    # AttnRes: a pseudo-query and a norm per read; two reads per layer, none before layer
    # 0's attention, one before the output norm: 2·n_layers reads.
    reads = 2 * c.n_layers * 2 * d if c.attn_res_block_size else 0
    total = embedding + (0 if c.tie_embeddings else head) + d + reads  # + final norm
    active = total
    matmul = head
    for i, kind in enumerate(c.layer_types()):
        mixer, mixer_elementwise = _MIXERS[kind](c)
        elementwise = 2 * d + mixer_elementwise
        if c.is_moe_layer(i):
            layer_total, layer_matmul, moe_elementwise = _moe(c)
            elementwise += moe_elementwise
        else:
            layer_total = layer_matmul = 3 * d * c.d_ff
        total += mixer + elementwise + layer_total
        active += mixer + elementwise + layer_matmul
        matmul += mixer + layer_matmul
    return ParameterCount(total=total, embedding=embedding, active=active, matmul=matmul)


def kda_flops_per_token(config: K3Config) -> int:
    """Training FLOPs per token of one KDA layer's chunked recurrence (module docs)."""
    c = config
    chunk, k = c.kda_chunk_size, c.kda_dim
    v = k
    forward = 4 * chunk * k + chunk * (k + v) + 2 * chunk * v + 6 * k * v
    return 3 * c.kda_n_heads * forward


def flops_per_token(config: K3Config, seq_len: int) -> int:
    """Training (forward + backward) FLOPs per token at ``seq_len``: ``6·matmul`` plus
    each softmax layer's ``6·n_heads·(qk_dim + value_dim)·seq_len`` plus each KDA layer's
    :func:`kda_flops_per_token` (see module docs)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"flops_per_token: seq_len must be a positive int, got {seq_len!r}")
    c = config
    kinds = c.layer_types()
    softmax_layers = sum(kind != "kda" for kind in kinds)
    attention = 6 * softmax_layers * c.n_heads * (c.qk_dim + c.value_dim) * seq_len
    recurrence = (len(kinds) - softmax_layers) * kda_flops_per_token(c)
    return 6 * count_parameters(c).matmul + attention + recurrence
