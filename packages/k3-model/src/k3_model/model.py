"""K3Model: a Kimi-K3-shaped decoder (hybrid KDA + Gated MLA, LatentMoE, AttnRes).

``forward(x, targets=None) -> (logits, loss)``, loss the mean token cross-entropy
(chunked, and logits None, when ``config.loss_chunk_size > 0``: :mod:`k3_model.loss`). No
state survives a call (every KDA recurrence starts from zero), which is what the trainer
assumes; generation continues from a cache instead (``forward_cached``, ``generate``:
:mod:`k3_model.cache`). Layer l mixes tokens with the kind ``config.layer_types()[l]``
names (KDA, Gated MLA or GQA) and has a dense GLU MLP (the first ``n_dense_layers``) or
a MoE. The residual stream is plain pre-norm, or block Attention Residuals
(:mod:`k3_model.attn_res`) when ``attn_res_block_size > 0``. Either way one
:class:`Block` call is one layer, the unit that activation checkpointing recomputes
(:meth:`K3Model.set_activation_checkpointing`, :mod:`k3_model.activation_checkpointing`).

Context parallelism (:meth:`K3Model.set_context_parallel`, :mod:`k3_model.context_parallel`)
splits one sequence over the ranks of a group, exactly.

The optimizer routing is declared, not guessed: :meth:`K3Model.parameter_groups`
(see :mod:`k3_model.routing`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from .activation_checkpointing import CheckpointMode, check_mode, checkpointed
from .attention import GQAttention, MLAttention, build_attention
from .attn_res import ResidualRead, inverse_rms
from .balancer import QuantileBalancer
from .cache import DecodeCache, Decoding
from .config import K3Config
from .context_parallel import ContextParallel
from .documents import Documents
from .flops import flops_per_token
from .kda import KimiDeltaAttention
from .loss import chunked_cross_entropy
from .mlp import GatedMLP
from .moe import MoE, RoutingStats, decoding
from .norm import RMSNorm
from .rope import RotaryEmbedding
from .routing import parameter_groups


class Block(nn.Module):
    """One layer: ``attn(attn_norm(·))`` then ``mlp(mlp_norm(·))``; with Attention
    Residuals also the two reads ``attn_res`` and ``mlp_res`` that feed them."""

    def __init__(self, config: K3Config, index: int):
        super().__init__()
        self.index = index
        self.kind = config.layer_types()[index]
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn: GQAttention | MLAttention | KimiDeltaAttention = build_attention(
            config, self.kind
        )
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp: MoE | GatedMLP = (
            MoE(config) if config.is_moe_layer(index)
            else GatedMLP(config.d_model, config.d_ff, config.activation)
        )
        if config.attn_res_block_size:
            # Layer 0's attention reads the embedding alone (nothing committed yet).
            self.attn_res = ResidualRead(config.d_model, config.norm_eps) if index else None
            self.mlp_res = ResidualRead(config.d_model, config.norm_eps)

    def mix(self, x: Tensor, rope: tuple[Tensor, Tensor] | None,
            decoding: Decoding | None = None, documents: Documents | None = None) -> Tensor:
        """The token mixer's output for the layer input ``x`` (pre-norm applied here);
        with ``decoding``, continuing from this layer's cache; with ``documents``, every
        document on its own."""
        h = self.attn_norm(x)
        if decoding is not None:
            return self._mix_cached(h, rope, decoding)
        if isinstance(self.attn, KimiDeltaAttention):
            out: Tensor = self.attn(h, documents)
        elif rope is None:
            out = self.attn(h, documents=documents)  # NoPE MLA
        else:
            out = self.attn(h, *rope, documents=documents)
        return out

    def _mix_cached(self, h: Tensor, rope: tuple[Tensor, Tensor] | None,
                    decoding: Decoding) -> Tensor:
        entry = decoding.cache.layers[self.index]
        out: Tensor = self.attn.forward_cached(h, entry, decoding.step, rope)  # type: ignore[arg-type]
        return out

    def feed(self, x: Tensor) -> Tensor:
        """The MLP's output for ``x`` (pre-norm applied here)."""
        out: Tensor = self.mlp(self.mlp_norm(x))
        return out

    def forward(
        self,
        x: Tensor | None,
        rope: tuple[Tensor, Tensor] | None = None,
        blocks: list[Tensor] | None = None,
        block_inv_rms: list[Tensor] | None = None,
        decoding: Decoding | None = None,
        documents: Documents | None = None,
    ) -> Tensor:
        """The layer's output residual state.

        Plain pre-norm residual (``blocks`` None): ``x + mix(x)``, then ``+ feed(·)``.
        Attention Residuals: ``blocks``/``block_inv_rms`` are the committed block sums and
        their :func:`~k3_model.attn_res.inverse_rms`, ``x`` the partial sum of the current
        block (None right after a commit); returns the new partial. One call is one
        layer, the unit :meth:`K3Model.set_activation_checkpointing` recomputes.
        """
        if blocks is None:
            assert x is not None
            x = x + self.mix(x, rope, decoding, documents)
            return x + self.feed(x)
        assert block_inv_rms is not None
        out = self.mix(residual_read(self.attn_res, blocks, block_inv_rms, x), rope, decoding,
                       documents)
        partial = out if x is None else x + out
        return partial + self.feed(residual_read(self.mlp_res, blocks, block_inv_rms, partial))


def residual_read(
    reader: ResidualRead | None, blocks: list[Tensor], inv_rms: list[Tensor],
    partial: Tensor | None,
) -> Tensor:
    """What ``reader`` sees: the softmax mix of the committed blocks and the partial (the
    embedding itself for layer 0's attention, the only read with a single source)."""
    if partial is None and len(blocks) == 1:
        return blocks[0]
    if reader is None:
        raise ValueError("Attention Residuals: a read over several sources needs a reader")
    if partial is None:
        mixed: Tensor = reader(blocks, inv_rms)
    else:
        mixed = reader([*blocks, partial], [*inv_rms, inverse_rms(partial, reader.norm.eps)])
    return mixed


class K3Model(nn.Module):
    """The reference K3 decoder built from a validated :class:`K3Config`."""

    def __init__(self, config: K3Config):
        super().__init__()
        if not isinstance(config, K3Config):
            raise TypeError(f"K3Model needs a K3Config, got {type(config).__name__}")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.rotary = (
            RotaryEmbedding(config.rope_dim, config.max_seq_len, config.rope_theta)
            if config.uses_rope else None
        )
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.final_res = (
            ResidualRead(config.d_model, config.norm_eps) if config.attn_res_block_size else None
        )
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self._checkpointing: CheckpointMode = "none"
        self._context_parallel: ContextParallel | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) matrices; residual output projections (``o_proj``, every
        ``w_down``, the LatentMoE ``up_proj``) shrunk by ``1/√(2·n_layers)`` so the
        residual stream's variance does not grow with depth (GPT-2); norm gains at one;
        balancer buffers at zero. Parameters with a designed init keep it: KDA's
        ``A_log``, ``dt_bias``, convolutions and output norm (the layer's own
        ``reset_parameters``) and the Attention-Residuals pseudo-queries (zero)."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "w_down.weight", "experts.w_down",
                                "up_proj.weight")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, std)
        for module in self.modules():
            if isinstance(module, KimiDeltaAttention | ResidualRead):
                module.reset_parameters()
        for name, buffer in self.named_buffers():
            if name.endswith(("balancer.bias", "balancer.load", "balancer.updates")):
                buffer.zero_()

    @overload
    def forward(self, x: Tensor, targets: None = None, *,
                document_ids: Tensor | None = None, reduction: str = "mean"
                ) -> tuple[Tensor, None]: ...

    @overload
    def forward(self, x: Tensor, targets: Tensor, *,
                document_ids: Tensor | None = None, reduction: str = "mean"
                ) -> tuple[Tensor | None, Tensor]: ...

    def forward(
        self, x: Tensor, targets: Tensor | None = None, *, document_ids: Tensor | None = None,
        reduction: str = "mean",
    ) -> tuple[Tensor | None, Tensor | None]:
        """``(logits, loss)`` for token ids ``x`` ``(B, T)``.

        ``document_ids`` ``(B, T)`` (integers, equal for the tokens of one document,
        non-decreasing along a row) keeps the documents packed into a row apart: KDA's
        state and convolution restart at each document's first token, MLA and GQA attend
        within the document (RoPE at positions within it), so every document's outputs
        are those of the document run alone (:mod:`k3_model.documents`).

        Without ``targets``: logits ``(B, T, vocab)`` and None. With ``targets`` ``(B,
        T)``: the mean token cross-entropy (fp32 under autocast too; target ``-100`` is
        ignored) and the logits, **except with** ``config.loss_chunk_size > 0``: then the
        loss is computed chunk by chunk (:func:`~k3_model.loss.chunked_cross_entropy`)
        precisely so that the logits never exist, and **the logits returned are None**.
        Callers that need logits (sampling, custom evaluation) call ``model(x)``.

        Under context parallelism (:meth:`set_context_parallel`) ``x``, ``targets`` and
        ``document_ids`` are this rank's slice of every row, and the logits and loss are
        the slice's. ``reduction="none"`` returns each target's loss instead of their
        mean, ``(B, T)`` fp32 (0 where the target is -100), with its gradients: what a
        caller needs to split the loss by rows (a mixture's sources) from one forward.
        """
        if reduction not in ("mean", "none"):
            raise ValueError(f"K3Model: reduction must be 'mean' or 'none', got {reduction!r}")
        if x.ndim != 2:
            raise ValueError(
                f"K3Model: x must be (batch, seq) token ids, got shape {tuple(x.shape)}"
            )
        t, cp = x.shape[1], self._context_parallel
        if cp is not None:
            cp.check_slice(t, x.device)
        whole = t if cp is None else t * cp.size
        if whole > self.config.max_seq_len:
            raise ValueError(
                f"K3Model: sequence length {whole} exceeds K3Config.max_seq_len "
                f"({self.config.max_seq_len}); raise max_seq_len or shorten the batch"
            )
        documents = None
        if document_ids is not None:
            chunks = tuple(layer.attn.chunk_size for layer in self.layers
                           if isinstance(layer.attn, KimiDeltaAttention))
            documents = self._documents(document_ids, tuple(x.shape), chunks)
        rope = self._rope(t, documents, x.device)
        h = self.norm(self._layers(self.embed(x), rope, documents=documents))
        if targets is None:
            return self.lm_head(h), None
        if self.config.loss_chunk_size:
            return None, chunked_cross_entropy(
                h, self.lm_head.weight, targets, self.config.loss_chunk_size, reduction)
        logits: Tensor = self.lm_head(h)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                               reduction=reduction)
        # A copy, not a view: FSDP2 warns of a view among a root module's outputs.
        return logits, loss.view(targets.shape).clone() if reduction == "none" else loss

    def _documents(self, ids: Tensor, shape: tuple[int, ...], chunks: tuple[int, ...]
                   ) -> Documents:
        """The :class:`Documents` of tokens shaped ``shape`` from their ``document_ids``
        (``chunks``: the KDA chunk sizes to pack for); under context parallelism ``ids``
        are this rank's slice and the layout comes from the whole rows' ids, gathered, so
        a document that began on an earlier rank keeps its positions and state."""
        cp = self._context_parallel
        if cp is None:
            return Documents.from_ids(ids, shape, chunks)
        if tuple(ids.shape) != tuple(shape):
            raise ValueError(f"document_ids must have the tokens' shape {tuple(shape)}, "
                             f"got {tuple(ids.shape)}")
        return cp.documents(ids, chunks)

    def _rope(self, t: int, documents: Documents | None, device: torch.device
              ) -> tuple[Tensor, Tensor] | None:
        """The rotary tables at the tokens' positions: within their documents ``(B, 1, T,
        ·)``, or in the whole row (this rank's slice of it under context parallelism)."""
        if self.rotary is None:
            return None
        if documents is not None:
            return (self.rotary.cos[documents.positions][:, None],
                    self.rotary.sin[documents.positions][:, None])
        if self._context_parallel is not None:
            positions = self._context_parallel.positions(t, device)
            return self.rotary.cos[positions], self.rotary.sin[positions]
        tables: tuple[Tensor, Tensor] = self.rotary(t)
        return tables

    def _layers(self, h: Tensor, rope: tuple[Tensor, Tensor] | None,
                decoding: Decoding | None = None, documents: Documents | None = None
                ) -> Tensor:
        """Every layer on the embedded tokens ``h``, plain or with Attention Residuals."""
        if self.final_res is not None:
            return self._attn_res_forward(h, rope, decoding, documents)
        for layer in self.layers:
            h = self._run_layer(layer, h, rope, decoding=decoding, documents=documents)
        return h

    @torch.no_grad()
    def forward_cached(self, x: Tensor, cache: DecodeCache, real: Tensor | None = None
                       ) -> Tensor:
        """Logits ``(B, T, vocab)`` for ``T`` new tokens ``x`` continuing the sequences
        ``cache`` holds (:meth:`new_cache`), which it advances: a prefill of any length,
        then one token (or a few) at a time. Equal to the full :meth:`forward` over each
        whole sequence, position by position. ``real`` ``(B, T)`` bool marks left padding
        (False) when prompts of different lengths share one prefill: padded inputs and keys
        are ignored, but KDA's chunks then start at other tokens, so the sums round
        differently (fp32: ~1e-5 relative); :meth:`generate` prefills each length apart
        and merges the caches instead. No gradients."""
        if x.ndim != 2:
            raise ValueError(f"K3Model: x must be (batch, seq) token ids, got shape "
                             f"{tuple(x.shape)}")
        padded = real is not None
        if real is None:
            real = torch.ones(x.shape, dtype=torch.bool, device=x.device)
        longest = cache.longest_after(real, padded)
        if longest > self.config.max_seq_len:
            raise ValueError(f"K3Model: a sequence of {longest} tokens exceeds "
                             f"K3Config.max_seq_len ({self.config.max_seq_len})")
        step = cache.advance(real, longest, padded)
        rope = None
        if self.rotary is not None:
            rope = (self.rotary.cos[step.positions][:, None],
                    self.rotary.sin[step.positions][:, None])
        with decoding():
            h = self._layers(self.embed(x), rope, Decoding(cache, step))
        logits: Tensor = self.lm_head(self.norm(h))
        return logits

    def new_cache(self, capacity: int | None = None, static: bool = False) -> DecodeCache:
        """An empty decoding cache for :meth:`forward_cached` (one entry per layer), its
        per-token buffers allocated once to ``capacity`` positions (None: grown as
        needed); ``static`` for CUDA graphs (see :mod:`k3_model.cache`)."""
        return DecodeCache.empty(self.config, capacity, static)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0, stop_ids: Iterable[int] = (),
                 on_token: Callable[[int, int], None] | None = None,
                 timings: MutableMapping[str, float] | None = None) -> list[list[int]]:
        """New token ids for each prompt, decoded with the cache (see
        :func:`k3_model.generate.generate`)."""
        from .generate import generate

        return generate(self, prompts, max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, seed=seed, stop_ids=stop_ids, on_token=on_token,
                        timings=timings)

    def score_continuations(self, requests: Sequence[Any], *, batch_size: int = 8
                            ) -> list[Any]:
        """Log-likelihoods of each request's continuations given its context, the context
        run once and its decoding state forked (see
        :func:`k3_model.scoring.score_continuations`; a request is anything with
        ``context`` and ``continuations`` token ids)."""
        from .scoring import score_continuations

        return score_continuations(self, requests, batch_size=batch_size)

    def _run_layer(self, layer: nn.Module, *args: Any, **kwargs: Any) -> Tensor:
        """``layer(*args)``, under activation checkpointing when it is on and autograd
        records (an eval or ``no_grad`` forward has nothing to save)."""
        if self._checkpointing == "block" and torch.is_grad_enabled():
            return checkpointed(layer, *args, **kwargs)
        out: Tensor = layer(*args, **kwargs)
        return out

    def _attn_res_forward(self, h: Tensor, rope: tuple[Tensor, Tensor] | None,
                          decoding: Decoding | None = None,
                          documents: Documents | None = None) -> Tensor:
        """Block Attention Residuals (see :mod:`k3_model.attn_res`); block 0 = ``h``.

        The partial sum is committed at each block start *before* the layer runs (its
        attention read sees the same sources either way), so every layer is one call
        with the committed blocks as plain inputs: that call is the checkpointed unit.
        """
        size, eps = self.config.attn_res_block_size, self.config.norm_eps
        blocks: list[Tensor] = []
        inv_rms: list[Tensor] = []
        partial: Tensor | None = h
        for index, layer in enumerate(self.layers):
            if index % size == 0:
                assert partial is not None
                blocks.append(partial)
                inv_rms.append(inverse_rms(partial, eps))
                partial = None
            partial = self._run_layer(layer, partial, rope, list(blocks), list(inv_rms),
                                      decoding=decoding, documents=documents)
        assert self.final_res is not None and partial is not None
        return residual_read(self.final_res, blocks, inv_rms, partial)

    def set_activation_checkpointing(self, mode: str) -> None:
        """``"block"``: recompute each decoder layer's activations in the backward instead
        of keeping them (exactly: bitwise the same losses, gradients and balancer state,
        see :mod:`k3_model.activation_checkpointing`); ``"none"``: keep them. A runtime setting, not
        part of the state dict or the config, so it may change between resumes."""
        self._checkpointing = check_mode(mode)

    @property
    def activation_checkpointing(self) -> str:
        """The current activation-checkpointing mode (``"none"`` or ``"block"``)."""
        return self._checkpointing

    # --- seams for the trainer -----------------------------------------------------------

    def parameter_groups(
        self, lr: float | None = None, weight_decay: float | None = None
    ) -> list[dict[str, Any]]:
        """MuonAdamW param groups, routed explicitly by role (see :mod:`k3_model.routing`)."""
        return parameter_groups(self, lr=lr, weight_decay=weight_decay)

    def set_balancer_gather(self, gather: Callable[[Tensor], Tensor] | None) -> None:
        """Data parallel: ``gather(t)`` returns every rank's rows of ``t`` concatenated in
        rank order, so each MoE balancer solves its bias from the global batch (identical
        on every rank, and equal to one process's with that batch); None turns it off.

        Sets :attr:`~k3_model.QuantileBalancer.token_gather` on every balancer of this
        model (a plain attribute, not in the state dict; other models are unaffected). It
        is read inside the block's forward, so it also works in compiled blocks (changing
        it later recompiles them).
        """
        for module in self.modules():
            if isinstance(module, QuantileBalancer):
                module.token_gather = gather

    def set_context_parallel(self, group: ProcessGroup | None) -> None:
        """Context parallelism over ``group`` (None: off): from now on :meth:`forward`
        takes this rank's contiguous slice ``x[:, r·T/N:(r+1)·T/N]`` of every row (r the
        rank in ``group``, N its size; ``document_ids`` sliced the same way, with ids
        consistent over the whole row) and returns that slice's logits and mean loss,
        every position global (RoPE, causal and document masks; KDA's state and short
        convolution continue across the boundaries: :mod:`k3_model.context_parallel`).
        The mean of the N slice losses is the one-process loss; summing (or averaging
        with the loss averaged) the parameter gradients over the group gives its
        gradients. A runtime setting like :meth:`set_balancer_gather`, not in the state
        dict or the config; a group of one rank is the same as None. Decoding
        (``forward_cached``, ``generate``) ignores it."""
        cp = None if group is None else ContextParallel(group)
        self._context_parallel = None if cp is None or cp.size == 1 else cp
        for module in self.modules():
            if isinstance(module, KimiDeltaAttention | MLAttention | GQAttention):
                module.context_parallel = self._context_parallel

    @property
    def context_parallel(self) -> ContextParallel | None:
        """The context-parallel group this model runs under (None: off)."""
        return self._context_parallel

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token at ``seq_len`` (:func:`k3_model.flops_per_token`), for
        the trainer's MFU."""
        return flops_per_token(self.config, seq_len)

    def moe_layers(self) -> dict[str, MoE]:
        """The MoE layers by module name (``layers.<i>.mlp``), in depth order."""
        return {name: m for name, m in self.named_modules() if isinstance(m, MoE)}

    def set_moe_stats(self, enabled: bool) -> None:
        """Turn routing-statistics collection on or off in every MoE layer."""
        for layer in self.moe_layers().values():
            layer.collect_stats = enabled

    def pop_moe_stats(self) -> dict[str, RoutingStats]:
        """Each MoE layer's statistics since the last call (layers with none are left out)."""
        found = {name: layer.pop_stats() for name, layer in self.moe_layers().items()}
        return {name: stats for name, stats in found.items() if stats is not None}
