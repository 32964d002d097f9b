"""Context parallelism: one sequence split into contiguous slices over a process group.

Rank r of a group of N holds tokens ``[r·T/N, (r+1)·T/N)`` of every row. What each
token mixer needs from the earlier slices, it fetches with one autograd-aware all-gather
(:meth:`ContextParallel.gather`; its backward is a reduce-scatter that returns each rank
the gradients the others computed for its tensors):

- **KDA** (:mod:`k3_model.state_passing`): every slice's ``[S₀ | M]``, an H×K×V final
  state and an H×K×K transition per row, chained into the incoming state; plus the
  short convolution's halo, the previous slice's last ``kernel − 1`` projected q/k/v
  (:meth:`ContextParallel.previous`).
- **MLA**: every slice's compressed latent and shared key slice (``kv_lora_rank +
  qk_rope_head_dim`` values per token), expanded into keys and values on each rank.
- **GQA**: every slice's (rotated) keys and values.

Attention then runs with global positions: a lower-right causal mask (query i of slice r
sees keys ``≤ r·T/N + i``) or, with documents, the block-diagonal mask of
:class:`~k3_model.documents.Documents` built from the whole rows' ids. Everything else
(norms, Attention Residuals, MoE, the loss) is per token and needs nothing.

Every rank runs the same operations in the same order whatever its rank (the rank only
selects data), so the collectives of the forward, of an activation-checkpointing
recomputation and of the backward line up on every rank. The exchanges run outside
``torch.compile`` graphs (a graph break each).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from k3_qkclip import head_max_logits, observed_attention

from .config import K3Config
from .documents import Documents

_F = TypeVar("_F", bound=Callable[..., Any])


def _eager(fn: _F) -> _F:
    """``fn`` run eagerly even when called from compiled code (a collective inside)."""
    return cast(_F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]


# torch 2.13 renamed the single-tensor collectives (the old names warn); older torch has
# only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _all_gather(tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's ``tensor`` (equal shapes, at least 1-D) stacked: ``(size, *shape)``."""
    size = dist.get_world_size(group)
    out = tensor.new_empty(size * tensor.shape[0], *tensor.shape[1:])
    _all_gather_single(out, tensor.contiguous(), group=group)
    return out.view(size, *tensor.shape)


class _Gather(torch.autograd.Function):
    """All-gather into a new leading dimension; the backward reduce-scatters (sums) the
    gradients so each rank gets every rank's gradient for its own tensor."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _all_gather(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        mine = grad.new_empty(grad.shape[1:])
        _reduce_scatter_single(mine, grad.reshape(-1, *grad.shape[2:]).contiguous(),
                               op=dist.ReduceOp.SUM, group=ctx.group)
        return mine, None


class ContextParallel:
    """This rank's place in a context-parallel group and the exchanges the layers use.

    Built by :meth:`k3_model.K3Model.set_context_parallel`; a runtime setting, never in
    a checkpoint. ``rank``/``size`` are the rank in and the size of ``group``.
    """

    def __init__(self, group: dist.ProcessGroup):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("context parallelism needs an initialized torch.distributed "
                               "process group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._checked: set[int] = set()

    def __repr__(self) -> str:
        return f"ContextParallel(rank={self.rank}, size={self.size})"

    def __deepcopy__(self, memo: dict[int, Any]) -> ContextParallel:
        """A copied model runs in the same group (a process group cannot be copied)."""
        return self

    @_eager
    def gather(self, tensor: Tensor) -> Tensor:
        """Every rank's ``tensor`` stacked in rank order, ``(size, *tensor.shape)``;
        gradients flow back to the rank each part came from."""
        out: Tensor = _Gather.apply(tensor, self.group)  # type: ignore[no-untyped-call]
        return out

    def previous(self, tail: Tensor) -> Tensor:
        """The previous rank's ``tail`` (zeros on rank 0, still through the gather so
        that every rank takes part in its backward)."""
        parts = self.gather(tail)
        first = torch.tensor(self.rank == 0, device=tail.device)
        return torch.where(first, torch.zeros_like(tail), parts[max(self.rank - 1, 0)])

    def visible(self, tensor: Tensor, dim: int) -> Tensor:
        """Ranks ``0 … rank``'s ``tensor`` concatenated along its sequence dimension
        ``dim``: the keys (or what makes them) this rank's queries may attend to."""
        return torch.cat(self.gather(tensor)[: self.rank + 1].unbind(0), dim=dim)

    @_eager
    def check_slice(self, length: int, device: torch.device) -> None:
        """Refuse slices of different lengths on different ranks (one exchange and one
        host read the first time a length is seen, none after)."""
        if length in self._checked:
            return
        seen = _all_gather(torch.tensor([length], device=device), self.group).flatten().tolist()
        if len(set(seen)) != 1:
            raise ValueError(f"context parallelism: every rank must hold an equal slice of "
                             f"the sequence, got slice lengths {seen} over the {self.size} "
                             "ranks; split each row into equal contiguous slices")
        self._checked.add(length)

    def positions(self, length: int, device: torch.device) -> Tensor:
        """The global positions ``(length,)`` of this rank's tokens."""
        return torch.arange(self.rank * length, (self.rank + 1) * length, device=device)

    @_eager
    def documents(self, ids: Tensor, chunk_sizes: tuple[int, ...]) -> Documents:
        """This slice's :class:`Documents` from its ``ids`` ``(B, T/N)``: the whole rows'
        ids are gathered (integers, no gradient), so a document that began on an earlier
        rank keeps its positions, its mask and its (not restarted) KDA state."""
        if ids.dim() != 2:
            raise ValueError(f"document_ids must be (batch, seq), got shape {tuple(ids.shape)}")
        whole = _all_gather(ids, self.group).transpose(0, 1).flatten(1, 2)
        length = ids.shape[1]
        return Documents.from_ids(whole, tuple(whole.shape), chunk_sizes,
                                  start=self.rank * length, length=length)


def check_context_parallel(config: K3Config, seq_len: int, cp: int) -> None:
    """Refuse a context-parallel degree ``cp`` the model cannot run at ``seq_len`` tokens
    per row, with a one-line ``ValueError`` naming the fix (for a launch planner)."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ValueError(f"--context-parallel must be a positive int, got {cp!r}")
    if seq_len > config.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds K3Config.max_seq_len "
                         f"({config.max_seq_len}); raise max_seq_len or shorten the sequence")
    if seq_len % cp:
        raise ValueError(f"--seq-len {seq_len} is not divisible by --context-parallel {cp}: "
                         "each rank holds an equal contiguous slice; use a multiple of it")
    if "kda" in config.layer_types() and cp > 1:
        chunk = config.kda_chunk_size
        if seq_len // cp < chunk:
            raise ValueError(f"--context-parallel {cp} leaves {seq_len // cp} tokens per "
                             f"rank, less than one KDA chunk ({chunk}); use "
                             f"--context-parallel ≤ {max(1, seq_len // chunk)} or a longer "
                             "--seq-len")


def context_attention(q: Tensor, keys: Tensor, values: Tensor, observer: Any,
                      mask: Tensor | None) -> Tensor:
    """Causal attention of this slice's queries ``(B, H, T, E)`` over the keys and values
    of slices ``0 … rank`` ``(B, H_kv, S, ·)``, ``S`` ending at this slice's last token.

    Without ``mask``: the lower-right causal mask (query i sees keys ``≤ S − T + i``),
    which fused kernels run without materializing it. With ``mask`` (bool ``(B, 1, T,
    S)``, documents): that mask. A QK-Clip ``observer`` records each head's max logit
    over the visible pairs (the earlier slices' keys and this slice's own, causally).
    """
    if mask is not None:
        return observed_attention(q, keys, values, observer, causal=False, mask=mask)
    t, s = q.shape[2], keys.shape[2]
    if observer is not None and observer.active:
        earlier = head_max_logits(q, keys[:, :, : s - t], causal=False)
        own = head_max_logits(q, keys[:, :, s - t:], causal=True)
        observer.record(torch.maximum(earlier, own))
    if keys.shape[1] != q.shape[1]:  # the causal-bias kernels take no grouped heads
        repeat = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(repeat, dim=1)
        values = values.repeat_interleave(repeat, dim=1)
    out: Tensor = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=causal_lower_right(t, s))
    return out


__all__ = ["ContextParallel", "check_context_parallel", "context_attention"]
