"""Pipeline stages of a :class:`~k3_model.K3Model`, cut between decoder blocks.

:func:`keep_stages` deletes from a model every layer (and the embedding, final read, norm
and ``lm_head``) that this rank's stages do not hold, keeping the survivors' names: the
kept layers stay in ``model.layers`` (an ``nn.ModuleList``) under their original
indices, so a parameter is ``layers.5.attn...`` whichever stage holds it and a checkpoint
does not depend on the pipeline degree. :class:`StageForward` is one stage's forward, the
module ``torch.distributed.pipelining.PipelineStage`` runs.

What crosses a stage boundary, explicitly: the residual stream; with block Attention
Residuals the partial sum of the current block *and every committed block* (block 0 is
the embedding), each a ``(B, T, d_model)`` tensor whose gradient travels back (their
inverse RMS is recomputed on the receiving stage, the same values); the document ids
(``document_ids``, integers) reach every stage as a keyword argument of the schedule's
``step``. The MoE balancer's loads need not cross: each MoE layer, its balancer and its
updates live on one stage, which sees every microbatch in order.

Under context parallelism (:meth:`K3Model.set_context_parallel` on the cut model) each
stage runs on this rank's slice of every row, as the whole model would: the token ids,
the document ids and what crosses a boundary are ``(B, T/N, ·)``, and the stage's layers
exchange what they need with the same stage on the other ranks of the group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .attn_res import inverse_rms
from .kda import KimiDeltaAttention
from .model import K3Model, residual_read


def keep_stages(model: K3Model, layers: Sequence[int], *, first: bool, last: bool) -> None:
    """Delete, in place, what this rank's stages do not hold: the layers outside
    ``layers``; the embedding unless ``first``; the final read, norm and ``lm_head``
    unless ``last``. The survivors keep their names (``layers.<i>``). Tied embeddings
    cannot be split across stages (refused)."""
    if model.config.tie_embeddings and not (first and last):
        raise ValueError("pipeline stages: tie_embeddings shares the embedding with lm_head, "
                         "which live on the first and last stage; untie them")
    kept = nn.ModuleList()
    for index in sorted(layers):
        kept.add_module(str(index), model.layers[index])
    model.layers = kept
    if not first:
        model.embed = None  # type: ignore[assignment]
    if not last:
        model.norm = None  # type: ignore[assignment]
        model.lm_head = None  # type: ignore[assignment]
        model.final_res = None


class StageForward(nn.Module):
    """One pipeline stage of a (cut) :class:`K3Model`: its layers ``layers`` (contiguous),
    the embedding on the first stage, the final read and norm on the last.

    ``forward(*inputs, document_ids=None)``: the first stage takes the token ids, every
    other stage what its predecessor returned, ``(residual, *committed_blocks)`` (the
    residual alone without Attention Residuals). The last stage returns the normed hidden
    state ``(B, T, d_model)``; ``lm_head`` and the loss are the schedule's loss function's
    (:meth:`loss`), so that the loss chunking of ``config.loss_chunk_size`` holds too.
    """

    def __init__(self, model: K3Model, layers: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.first, self.last = first, last
        self.model = [model]  # not a submodule: its parameters are the stage's own below
        held = dict(model.layers.named_children())
        self.blocks = nn.ModuleList()
        for index in layers:
            self.blocks.add_module(str(index), held[str(index)])
        self.embed = model.embed if first else None
        self.final_res = model.final_res if last else None
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self._chunks = tuple(block.attn.chunk_size for block in self.blocks
                             if isinstance(block.attn, KimiDeltaAttention))

    def forward(self, *inputs: Tensor, document_ids: Tensor | None = None
                ) -> Tensor | tuple[Tensor, ...]:
        model, size = self.model[0], self.config.attn_res_block_size
        if self.first:
            (x,) = inputs
            assert self.embed is not None
            h: Tensor = self.embed(x)
            blocks: list[Tensor] = []
        else:
            h, *blocks = inputs
        shape = tuple(h.shape[:2])
        if model.context_parallel is not None:  # this rank's slice of every row
            model.context_parallel.check_slice(shape[1], h.device)
        documents = (None if document_ids is None
                     else model._documents(document_ids, shape, self._chunks))
        rope = model._rope(shape[1], documents, h.device)
        if size:
            eps = self.config.norm_eps
            inv_rms = [inverse_rms(block, eps) for block in blocks]
            partial: Tensor | None = h
            for layer in self.blocks:
                if int(layer.index) % size == 0:  # type: ignore[arg-type]
                    assert partial is not None
                    blocks.append(partial)
                    inv_rms.append(inverse_rms(partial, eps))
                    partial = None
                partial = model._run_layer(layer, partial, rope, list(blocks), list(inv_rms),
                                           documents=documents)
            assert partial is not None
            if not self.last:
                return (partial, *blocks)
            assert self.final_res is not None
            h = residual_read(self.final_res, blocks, inv_rms, partial)
        else:
            for layer in self.blocks:
                h = model._run_layer(layer, h, rope, documents=documents)
            if not self.last:
                return h
        assert self.norm is not None
        out: Tensor = self.norm(h)
        return out

    def example_io(self, rows: int, seq_len: int, dtype: torch.dtype = torch.float32
                   ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """Meta tensors shaped like one microbatch's stage inputs and outputs (``seq_len``
        the tokens of a row this stage runs: a slice's under context parallelism), so that
        ``PipelineStage`` needs no shape-inference forward (which would update the MoE
        balancers once more than one process does). The floating tensors that cross a
        boundary require grad: ``PipelineStage`` reads its static metadata's
        ``requires_grad`` to decide whether a received activation gets a gradient and
        whether one is sent back, so without it every earlier stage's gradient is lost."""
        d = self.config.d_model
        size = self.config.attn_res_block_size
        indices = [int(layer.index) for layer in self.blocks]  # type: ignore[arg-type]

        def crossing(stop: int) -> tuple[Tensor, ...]:
            committed = -(-stop // size) if size else 0  # blocks begun before layer ``stop``
            return tuple(torch.empty(rows, seq_len, d, dtype=dtype, device="meta",
                                     requires_grad=True)
                         for _ in range(1 + committed))

        inputs = ((torch.empty(rows, seq_len, dtype=torch.int64, device="meta"),)
                  if self.first else crossing(indices[0]))
        outputs = ((torch.empty(rows, seq_len, d, dtype=dtype, device="meta",
                                requires_grad=True),)
                   if self.last else crossing(indices[-1] + 1))
        return inputs, outputs

    def logits(self, hidden: Tensor) -> Tensor:
        """The last stage's ``hidden`` state through ``lm_head``: every position's logits
        (a task's log-likelihoods under stages)."""
        assert self.lm_head is not None
        out: Tensor = self.lm_head(hidden)
        return out

    def loss(self, hidden: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
        """The mean token cross-entropy of the last stage's ``hidden`` state, computed as
        :meth:`K3Model.forward` does (chunked when ``config.loss_chunk_size``);
        ``reduction="none"``: each target's loss, ``targets``' shape."""
        assert self.lm_head is not None
        from .loss import chunked_cross_entropy

        if self.config.loss_chunk_size:
            return chunked_cross_entropy(hidden, self.lm_head.weight, targets,
                                         self.config.loss_chunk_size, reduction)
        logits = self.logits(hidden)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 targets.flatten(), reduction=reduction)
        return loss.view(targets.shape) if reduction == "none" else loss
