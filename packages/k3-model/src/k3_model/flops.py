"""Parameter and training-FLOP counts from a config alone (no model needed), for MFU.

``flops_per_token`` follows the convention of PaLM (Chowdhery et al. 2022, App. B),
nanoGPT and torchtitan so MFU numbers compare across projects: a matmul with ``N``
weights costs ``2N`` FLOPs per token forward and ``4N`` backward (``6N`` in all), and
attention adds ``6·n_layers·n_heads·(qk_dim + v_dim)·seq_len`` per token (scores
``QKᵀ`` and ``softmax·V``, forward ``2·…``, backward twice that), counted over the full
sequence, not halved for the causal mask. Only routed experts a token actually uses
count (active parameters); the embedding lookup is not a matmul, the output head is
(also when tied). QK-Clip's no-grad observation matmul is overhead, not model FLOPs.
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
    embedding lookup and norm weights, plus the head even when tied: the FLOP basis.
    """

    total: int
    embedding: int
    active: int
    matmul: int

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def _attention(c: K3Config) -> tuple[int, int]:
    """(matmul weights, norm weights) of one attention module."""
    d, h = c.d_model, c.n_heads
    if c.attention == "gqa":
        e, kv = c.attn_head_dim, c.kv_heads
        return d * h * e + 2 * d * kv * e + h * e * d, 0
    q_rows = h * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    if c.q_lora_rank:
        q, q_norm = d * c.q_lora_rank + c.q_lora_rank * q_rows, c.q_lora_rank
    else:
        q, q_norm = d * q_rows, 0
    kv_down = d * (c.kv_lora_rank + c.qk_rope_head_dim)
    kv_up = c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim)
    out = h * c.v_head_dim * d
    return q + kv_down + kv_up + out, q_norm + c.kv_lora_rank


def count_parameters(config: K3Config) -> ParameterCount:
    """Total, embedding, active-per-token and matmul parameter counts of ``config``."""
    c = config
    d = c.d_model
    embedding = c.vocab_size * d
    head = c.vocab_size * d
    attn_matmul, attn_norms = _attention(c)
    total = embedding + (0 if c.tie_embeddings else head) + d  # + final norm
    active = total
    matmul = head
    for i in range(c.n_layers):
        norms = 2 * d + attn_norms
        if c.is_moe_layer(i):
            expert = 3 * d * c.moe_d_ff
            router = c.n_experts * d
            shared = c.n_shared_experts * expert
            layer_total = router + c.n_experts * expert + shared
            layer_active = router + c.moe_top_k * expert + shared
        else:
            layer_total = layer_active = 3 * d * c.d_ff
        total += attn_matmul + norms + layer_total
        active += attn_matmul + norms + layer_active
        matmul += attn_matmul + layer_active
    return ParameterCount(total=total, embedding=embedding, active=active, matmul=matmul)


def flops_per_token(config: K3Config, seq_len: int) -> int:
    """Training (forward + backward) FLOPs per token at ``seq_len``:
    ``6·matmul + 6·n_layers·n_heads·(qk_dim + value_dim)·seq_len`` (see module docs)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"flops_per_token: seq_len must be a positive int, got {seq_len!r}")
    c = config
    attention = 6 * c.n_layers * c.n_heads * (c.qk_dim + c.value_dim) * seq_len
    return 6 * count_parameters(c).matmul + attention
