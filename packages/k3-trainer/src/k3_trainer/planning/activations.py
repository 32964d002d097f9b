"""Activation memory: what autograd keeps between a microbatch's forward and backward.

Counted in elements per token per layer, at 4 bytes each: K3's KDA recurrence, SiTU-GLU,
routers and residual reads compute in fp32 even under bf16 autocast, and the mix saved
under autocast measured 3% above the fp32 run on ``tiny`` (CPU); the terms are read off
the tensors each module saves (``saved_tensors_hooks``), checked within 10% of a real
forward in the tests. ``d`` model width, ``H·K`` KDA's inner width, ``h`` MLA heads,
``qk``/``v``/``nope`` their widths, ``r`` kv_lora_rank, ``ρ`` the rope slice, ``f`` an
expert's width, ``ℓ`` the LatentMoE width, ``E``/``k`` experts and top-k, ``V`` vocab:

- KDA: ``39·H·K`` (q, k, v and their convolutions and norms, the gates, the chunked
  form's per-chunk matrices);
- MLA: ``d + (r + ρ) + r + 2·h·qk + h·(nope + v) + 3·h·v``, plus ``h·T`` scores where
  attention is not fused (``scores=True``: CPU; flash kernels keep a log-sum-exp only);
- GQA: ``d + 2·h·hd + 2·kv·hd + h·hd`` (+ scores likewise);
- dense MLP: ``d + 7·d_ff``; MoE: ``d + E + k·(ℓ + 7·f) + 2ℓ`` plus the shared
  experts' ``d + 7·n_shared·f``;
- around each layer: the two Attention-Residuals reads, ``6·d`` (a plain pre-norm
  residual: ``2·d``); after the last: ``4·d``, and ``V`` fp32 logits unless the loss is
  chunked.

With block activation checkpointing only each block's input (``d``) and the tail are
kept; the backward rebuilds one block at a time (that block's full activations, counted
as a transient). Context parallelism divides the tokens by ``cp``; each MLA layer also
keeps the gathered latents of earlier slices, ``(r + ρ)·T`` elements at bf16.
Autocast over fp32 parameters also saves a bf16 copy of every weight a forward
multiplies by (under FSDP: the gathered, unsharded weight), per microbatch in flight;
with checkpointing only the unchecked ends' weights, and each block's input once more
in bf16 (``2·d`` bytes per token and block).
"""

from __future__ import annotations

from k3_model import K3Config

ELEMENT_BYTES = 4


def layer_elements(config: K3Config, index: int, seq_len: int, *, scores: bool = False) -> int:
    """Elements per token layer ``index`` saves (its mixer, its MLP, the reads around it)."""
    c = config
    d = c.d_model
    kind = c.layer_types()[index]
    if kind == "kda":
        mixer = 39 * c.kda_n_heads * c.kda_dim
    elif kind == "mla":
        h = c.n_heads
        mixer = (d + c.kv_lora_rank + c.qk_rope_head_dim + c.kv_lora_rank + 2 * h * c.qk_dim
                 + h * (c.qk_nope_head_dim + c.v_head_dim) + 3 * h * c.v_head_dim)
        mixer += h * seq_len if scores else 0
    else:
        h, hd, kv = c.n_heads, c.attn_head_dim, c.kv_heads
        mixer = d + 3 * h * hd + 2 * kv * hd + (h * seq_len if scores else 0)
    if c.is_moe_layer(index):
        width = c.moe_width
        mlp = d + c.n_experts + c.moe_top_k * (width + 7 * c.moe_d_ff) + (
            2 * width if c.moe_latent_dim else 0)
        if c.n_shared_experts:
            mlp += d + 7 * c.n_shared_experts * c.moe_d_ff
    else:
        mlp = d + 7 * c.d_ff
    around = 6 * d if c.attn_res_block_size else 2 * d
    return mixer + mlp + around


def tail_elements(config: K3Config) -> int:
    """Elements per token after the last block (final read and norm, logits)."""
    return 4 * config.d_model + (config.vocab_size if config.loss_chunk_size == 0 else 0)


def saved_bytes(config: K3Config, blocks: range, tokens: int, seq_len: int, *,
                checkpointing: bool, last: bool, scores: bool = False) -> int:
    """Bytes one microbatch of ``tokens`` (of sequences ``seq_len`` long) keeps across
    ``blocks`` (a pipeline stage's), with the tail when ``last``."""
    if checkpointing:
        per_token = config.d_model * len(blocks)
    else:
        per_token = sum(layer_elements(config, i, seq_len, scores=scores) for i in blocks)
    if last:
        per_token += tail_elements(config)
    return per_token * tokens * ELEMENT_BYTES


def recompute_bytes(config: K3Config, blocks: range, tokens: int, seq_len: int, *,
                    scores: bool = False) -> int:
    """With block checkpointing: the largest block's activations, rebuilt in the backward."""
    if not len(blocks):
        return 0
    return max(layer_elements(config, i, seq_len, scores=scores) for i in blocks) \
        * tokens * ELEMENT_BYTES


def cp_gathered_bytes(config: K3Config, blocks: range, seq_len: int, batch: int,
                      cp: int) -> int:
    """Context parallelism: each MLA layer keeps every earlier slice's latent and rope key
    (bf16) for its backward; ``(cp − 1)/cp`` of the sequence on the last rank."""
    if cp == 1:
        return 0
    kinds = config.layer_types()
    mla = sum(kinds[i] == "mla" for i in blocks)
    width = config.kv_lora_rank + config.qk_rope_head_dim
    return mla * batch * (seq_len - seq_len // cp) * width * 2
