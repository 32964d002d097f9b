"""Decoding state: what each layer keeps between forwards while a model generates.

- **KDA** (:class:`KDAState`): the recurrent state ``[B, H, K, V]`` in fp32 (constant in
  length) and the short convolution's tail, the last ``kernel − 1`` inputs of q, k and v
  side by side (``[B, kernel − 1, 3·H·K]``), both overwritten in place each step.
- **MLA** (:class:`LatentCache`): per token the normalized compressed latent and the key
  slice shared by all heads (rotated when the model uses RoPE), side by side in one
  buffer ``[B, capacity, kv_lora_rank + qk_rope_head_dim]``; never per-head keys or values.
- **GQA** (:class:`KVCache`, comparison layouts): keys and values per key/value head.
- MoE and Attention Residuals are per token: nothing.

Per-token entries live in buffers preallocated to the cache's ``capacity`` (the longest
sequence the caller can reach) and are written at the current position: a step allocates
nothing that grows with the context. Without a capacity the buffers start at the first
forward's length and double when full (amortized, capped at ``max_seq_len``).

Sequences of different lengths share a batch left-padded: :attr:`DecodeCache.real` marks
the real tokens of every cached position, positions count real tokens only, padded keys
are never attended to and padded inputs are zeroed before a KDA layer (so its state and
convolution tail are exactly those of the sequence alone).

A cache forks: :meth:`DecodeCache.select` (rows, in any order and with repeats),
:meth:`DecodeCache.expand` (each row ``k`` times) and :meth:`DecodeCache.clone` copy the
state, so continuations of one context run from one prefill.

``static=True`` (for CUDA graphs): every step attends over the whole buffer (the unwritten
positions are masked) and finds its write position on the device, so a step has the same
shapes and reads nothing back to the host.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from .config import K3Config


@dataclass(frozen=True)
class Step:
    """What one cached forward of ``T`` new tokens needs besides the tokens.

    ``real``: ``[B, T]`` which new tokens are real (False: left padding); ``positions``:
    ``[B, T]`` each token's position in its own sequence; ``slots``: ``[T]`` the cache
    positions this forward writes; ``key_real``: ``[B, limit]`` the real tokens among the
    cache positions a query may read (``limit``: every position written so far, or the
    whole buffer for a static cache); ``capacity``: the buffers' length.
    """

    real: Tensor
    positions: Tensor
    slots: Tensor
    key_real: Tensor
    capacity: int
    padded: bool = True
    """Whether ``real`` may hold padding (False: every new token is real, known on the
    host, so nothing needs zeroing)."""

    @property
    def limit(self) -> int:
        """Cache positions a query may read (the keys' length)."""
        return int(self.key_real.shape[1])

    @functools.cached_property
    def attention_mask(self) -> Tensor:
        """``[B, 1, T, limit]`` bool: query i sees key j when j is at or before it and real
        (a padded query sees itself, so no row is empty); built once per step, for every
        softmax layer."""
        query = self.slots[:, None]
        key = torch.arange(self.limit, device=self.slots.device)[None, :]
        allowed = (key <= query) & (self.key_real[:, None, :] | (key == query))
        return allowed[:, None]

    def write(self, buffer: Tensor | None, new: Tensor) -> Tensor:
        """``new`` (``[B, T, …]``) written into ``buffer`` (``[B, capacity, …]``, None or
        shorter: allocated, or grown keeping what it holds) at this step's slots; returns
        the buffer (callers keep it)."""
        if buffer is None or buffer.shape[1] < self.capacity:
            grown = new.new_zeros((new.shape[0], self.capacity, *new.shape[2:]))
            if buffer is not None:
                grown[:, :buffer.shape[1]] = buffer
            buffer = grown
        buffer.index_copy_(1, self.slots, new.to(buffer.dtype))
        return buffer


def _rows(t: Tensor | None, rows: Tensor) -> Tensor | None:
    return None if t is None else t.index_select(0, rows)


def _size(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _left_padded(tensors: Sequence[Tensor], lengths: Sequence[int], capacity: int) -> Tensor:
    """``tensors`` (``[B_i, ≥ length_i, …]``) stacked along the batch into one zeroed
    ``[ΣB_i, capacity, …]``, each one's first ``length_i`` positions ending at the same
    position (the longest length): shorter ones are left-padded."""
    longest = max(lengths)
    first = tensors[0]
    out = first.new_zeros((sum(t.shape[0] for t in tensors), capacity, *first.shape[2:]))
    row = 0
    for t, n in zip(tensors, lengths):
        out[row:row + t.shape[0], longest - n:longest] = t[:, :n]
        row += t.shape[0]
    return out


class KDAState:
    """One KDA layer's state: recurrent ``state`` (fp32) and the conv ``tail``, the last
    ``kernel − 1`` inputs of q, k and v side by side (``[B, kernel − 1, 3·H·K]``)."""

    kind = "kda"

    def __init__(self, state: Tensor | None = None, tail: Tensor | None = None) -> None:
        self.state, self.tail = state, tail

    def update(self, state: Tensor, tail: Tensor) -> None:
        """Overwrite the state and tail in place (the first update keeps copies)."""
        if self.state is None or self.tail is None:
            self.state = state if state is self.state else state.clone()
            self.tail = tail.clone()
            return
        if state is not self.state:
            self.state.copy_(state)
        self.tail.copy_(tail)

    def select(self, rows: Tensor) -> KDAState:
        return KDAState(_rows(self.state, rows), _rows(self.tail, rows))

    @classmethod
    def merge(cls, entries: Sequence[KDAState], lengths: Sequence[int], capacity: int
              ) -> KDAState:
        """Constant in length: the states and tails stacked along the batch."""
        if any(e.state is None or e.tail is None for e in entries):
            raise ValueError("DecodeCache.merge: an empty layer cache")
        return KDAState(torch.cat([e.state for e in entries if e.state is not None]),
                        torch.cat([e.tail for e in entries if e.tail is not None]))

    def nbytes(self, length: int) -> int:
        return _size(self.state, self.tail)


_Token = TypeVar("_Token", bound="_TokenCache")


class _TokenCache:
    """Per-token entries in buffers ``[B, capacity, …]`` written at each step's slots."""

    kind = ""
    names: tuple[str, ...] = ()

    def __init__(self, *buffers: Tensor | None) -> None:
        self.buffers: list[Tensor | None] = list(buffers) if buffers else \
            [None] * len(self.names)

    def write(self, step: Step, *new: Tensor) -> list[Tensor]:
        """Write this step's entries and return every buffer up to the step's limit."""
        for i, entry in enumerate(new):
            self.buffers[i] = step.write(self.buffers[i], entry)
        return [b[:, :step.limit] for b in self.buffers if b is not None]

    def select(self: _Token, rows: Tensor) -> _Token:
        return type(self)(*(_rows(b, rows) for b in self.buffers))

    @classmethod
    def merge(cls: type[_Token], entries: Sequence[_TokenCache], lengths: Sequence[int],
              capacity: int) -> _Token:
        merged = []
        for i in range(len(cls.names)):
            column = [e.buffers[i] for e in entries]
            present = [b for b in column if b is not None]
            if len(present) < len(column):
                raise ValueError("DecodeCache.merge: an empty layer cache")
            merged.append(_left_padded(present, lengths, capacity))
        return cls(*merged)

    def nbytes(self, length: int) -> int:
        """Bytes of the ``length`` positions written (not the spare capacity)."""
        return sum(_size(b[:, :length]) for b in self.buffers if b is not None)


class LatentCache(_TokenCache):
    """One MLA layer's cache: ``[normalized latent | shared key slice]`` per token."""

    kind = "mla"
    names = ("latent_and_key",)

    def __init__(self, latent_and_key: Tensor | None = None) -> None:
        super().__init__(latent_and_key)


class KVCache(_TokenCache):
    """One GQA layer's keys and values, ``[B, capacity, kv_heads·head_dim]`` (after RoPE)."""

    kind = "gqa"
    names = ("k", "v")


LayerCache = KDAState | LatentCache | KVCache
_KINDS: dict[str, type[KDAState] | type[LatentCache] | type[KVCache]] = {
    "kda": KDAState, "mla": LatentCache, "gqa": KVCache}


class DecodeCache:
    """The decoding state of a batch: one :data:`LayerCache` per layer, which cached
    positions hold real tokens, and how many real tokens each sequence has.

    ``capacity``: the longest sequence (cached positions, padding included) the caller
    will reach; buffers are allocated to it once (None: grown by doubling up to
    ``max_len``). ``static``: see the module docstring.
    """

    def __init__(self, layers: list[LayerCache], *, capacity: int | None = None,
                 max_len: int | None = None, static: bool = False) -> None:
        if static and capacity is None:
            raise ValueError("DecodeCache(static=True) needs a capacity")
        self.layers = layers
        self.capacity, self.max_len, self.static = capacity, max_len, static
        self.real: Tensor | None = None  # [B, buffer length] bool
        self.lengths: Tensor | None = None  # [B] real tokens per sequence
        self.length = 0
        """Positions cached so far (padding included), on the host."""
        self.longest = 0
        """Real tokens of the longest sequence, kept on the host so that a decoding step
        checks ``max_seq_len`` without reading the device (after :meth:`select` of a
        subset, an upper bound)."""
        self.cursor: Tensor | None = None  # static: the next slot, on the device

    @classmethod
    def empty(cls, config: K3Config, capacity: int | None = None, static: bool = False
              ) -> DecodeCache:
        if capacity is not None and not 0 < capacity <= config.max_seq_len:
            raise ValueError(f"DecodeCache: capacity must be in [1, max_seq_len = "
                             f"{config.max_seq_len}], got {capacity}")
        return cls([_KINDS[kind]() for kind in config.layer_types()], capacity=capacity,
                   max_len=config.max_seq_len, static=static)

    @property
    def batch(self) -> int:
        return 0 if self.lengths is None else int(self.lengths.shape[0])

    def _buffer_length(self, needed: int) -> int:
        if self.capacity is not None:
            if needed > self.capacity:
                raise ValueError(f"DecodeCache: {needed} cached positions exceed the "
                                 f"capacity it was made with ({self.capacity})")
            return self.capacity
        have = 0 if self.real is None else int(self.real.shape[1])
        if needed <= have:
            return have
        grown = 2 * have if self.max_len is None else min(2 * have, self.max_len)
        return max(needed, grown)

    def longest_after(self, real: Tensor, padded: bool) -> int:
        """:attr:`longest` once ``real`` (``[B, T]``) is appended: ``+ T`` without padding,
        else one read of the mask (a prefill's)."""
        if not padded:
            return self.longest + int(real.shape[1])
        counts = real.sum(dim=1) if self.lengths is None else self.lengths + real.sum(dim=1)
        return int(counts.max())

    def advance(self, real: Tensor, longest: int, padded: bool = True) -> Step:
        """Append ``real`` (``[B, T]`` bool, the new tokens' mask; :meth:`longest_after`
        gave ``longest``) and describe the step."""
        b, t = real.shape
        device = real.device
        capacity = self._buffer_length(self.length + t)
        if self.lengths is None:
            self.lengths = torch.zeros(b, dtype=torch.long, device=device)
        if self.static:
            if self.cursor is None:
                self.cursor = torch.zeros((), dtype=torch.long, device=device)
            slots = self.cursor + torch.arange(t, device=device)
            self.cursor.add_(t)
        else:
            slots = torch.arange(self.length, self.length + t, device=device)
        counts = real.long().cumsum(dim=1)
        positions = (self.lengths[:, None] + counts - 1).clamp_min(0)
        self.lengths.add_(counts[:, -1])
        if self.real is None or self.real.shape[1] < capacity:
            grown = torch.zeros(b, capacity, dtype=torch.bool, device=device)
            if self.real is not None:
                grown[:, :self.real.shape[1]] = self.real
            self.real = grown
        self.real.index_copy_(1, slots, real)
        self.length += t
        self.longest = longest
        limit = capacity if self.static else self.length
        return Step(real, positions, slots, self.real[:, :limit], capacity, padded)

    def _like(self, layers: list[LayerCache], real: Tensor | None, lengths: Tensor | None,
              length: int, longest: int) -> DecodeCache:
        out = DecodeCache(layers, capacity=self.capacity, max_len=self.max_len,
                          static=self.static)
        out.real, out.lengths, out.length, out.longest = real, lengths, length, longest
        if self.cursor is not None:
            out.cursor = self.cursor.clone()
        return out

    def select(self, rows: Tensor) -> DecodeCache:
        """A new cache of the sequences ``rows`` (a batch index tensor; in any order,
        repeats allowed): a fork, sharing nothing with this one."""
        return self._like([entry.select(rows) for entry in self.layers],
                          _rows(self.real, rows), _rows(self.lengths, rows), self.length,
                          self.longest)

    def expand(self, k: int) -> DecodeCache:
        """Each sequence ``k`` times in a row (rows ``i·k … i·k + k − 1`` continue row i):
        one context prefilled once, then ``k`` continuations of it."""
        if k < 1:
            raise ValueError(f"DecodeCache.expand: k must be ≥ 1, got {k}")
        device = self.lengths.device if self.lengths is not None else None
        return self.select(torch.arange(self.batch, device=device).repeat_interleave(k))

    def clone(self) -> DecodeCache:
        """A copy that decodes on independently."""
        device = self.lengths.device if self.lengths is not None else None
        return self.select(torch.arange(self.batch, device=device))

    @classmethod
    def merge(cls, caches: Sequence[DecodeCache]) -> DecodeCache:
        """One batch of the sequences of ``caches`` (each prefilled on its own, so each
        equals its sequence's full forward exactly), in order, the per-token entries
        left-padded to the longest; the padding is marked not real. The merged buffers
        leave each cache the room it had after its own positions."""
        if any(c.real is None or c.lengths is None for c in caches):
            raise ValueError("DecodeCache.merge needs caches that have been prefilled")
        lengths = [c.length for c in caches]
        longest = max(lengths)
        room = [(c.capacity if c.capacity is not None else c.length) - c.length
                for c in caches]
        capacity = longest + max(room)
        first = caches[0]
        layers: list[LayerCache] = []
        for entries in zip(*(c.layers for c in caches)):
            kind = type(entries[0])
            if any(type(e) is not kind for e in entries):
                raise ValueError("DecodeCache.merge: caches of different models")
            layers.append(kind.merge(entries, lengths, capacity))
        real = _left_padded([c.real for c in caches if c.real is not None], lengths, capacity)
        out = DecodeCache(layers, capacity=capacity if first.capacity is not None else None,
                          max_len=first.max_len, static=first.static)
        out.real = real
        out.lengths = torch.cat([c.lengths for c in caches if c.lengths is not None])
        out.length, out.longest = longest, max(c.longest for c in caches)
        if first.static:
            out.cursor = torch.tensor(longest, device=real.device)
        return out

    def nbytes(self) -> dict[str, int]:
        """Bytes held per kind of layer for the positions cached so far: ``{"kda": …,
        "mla": …, "gqa": …}`` (the batch's)."""
        found = {"kda": 0, "mla": 0, "gqa": 0}
        for entry in self.layers:
            found[entry.kind] += entry.nbytes(self.length)
        return found


@dataclass(frozen=True)
class Decoding:
    """A cached forward in progress: the batch's cache and this forward's step."""

    cache: DecodeCache
    step: Step


def cache_bytes_formula(config: K3Config, context: int, *, dtype_bytes: int = 4,
                        state_bytes: int = 4) -> dict[str, int]:
    """The cache of one sequence at ``context`` tokens, from the config alone: KDA's state
    (``H·K·V·state_bytes`` + the conv tails ``3·(kernel − 1)·H·K·dtype_bytes`` per layer,
    constant) and MLA's latents (``(kv_lora_rank + qk_rope_head_dim)·dtype_bytes`` per
    token per layer, linear); GQA ``2·H_kv·head_dim·dtype_bytes`` per token per layer."""
    kinds = config.layer_types()
    inner = config.kda_n_heads * config.kda_dim
    kda = kinds.count("kda") * (config.kda_n_heads * config.kda_dim * config.kda_dim
                                * state_bytes
                                + 3 * (config.kda_conv_size - 1) * inner * dtype_bytes)
    mla = kinds.count("mla") * context * (config.kv_lora_rank + config.qk_rope_head_dim) \
        * dtype_bytes
    gqa = kinds.count("gqa") * context * 2 * config.kv_heads * config.attn_head_dim \
        * dtype_bytes
    return {"kda": kda, "mla": mla, "gqa": gqa}
