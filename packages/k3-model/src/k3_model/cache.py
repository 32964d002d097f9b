"""Decoding state: what each layer keeps between forwards while a model generates.

- **KDA**: the recurrent state ``[B, H, K, V]`` in fp32 (constant in length) and the short
  convolution's tail, the last ``kernel − 1`` inputs of q, k and v (``[B, kernel − 1,
  H·K]`` each).
- **MLA**: per token the normalized compressed latent ``[B, T, kv_lora_rank]`` and the key
  slice shared by all heads ``[B, T, qk_rope_head_dim]`` (rotated when the model uses
  RoPE), never the per-head keys and values (those are expanded from the latent).
- **GQA** (comparison layouts): keys and values per key/value head, after RoPE.
- MoE and Attention Residuals are per token: nothing.

Sequences of different lengths share a batch left-padded: :attr:`DecodeCache.real` marks
the real tokens of every cached position, positions count real tokens only, padded keys
are never attended to and padded inputs are zeroed before a KDA layer (so its state and
convolution tail are exactly those of the sequence alone).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import K3Config


@dataclass
class KDAState:
    """One KDA layer's state: recurrent ``state`` (fp32) and the conv ``tails`` (q, k, v)."""

    state: Tensor | None = None
    tails: tuple[Tensor, Tensor, Tensor] | None = None


@dataclass
class LatentCache:
    """One MLA layer's cache: the normalized ``latent`` and the shared key slice per token."""

    latent: Tensor | None = None
    k_shared: Tensor | None = None


@dataclass
class KVCache:
    """One GQA layer's keys and values per key/value head (after RoPE)."""

    k: Tensor | None = None
    v: Tensor | None = None


LayerCache = KDAState | LatentCache | KVCache


@dataclass(frozen=True)
class Step:
    """What one cached forward of ``T`` new tokens needs besides the tokens.

    ``real``: ``[B, T]`` which new tokens are real (False: left padding); ``positions``:
    ``[B, T]`` each token's position in its own sequence; ``key_real``: ``[B, past + T]``
    the real tokens among every cached position after this forward; ``past``: positions
    cached before it.
    """

    real: Tensor
    positions: Tensor
    key_real: Tensor
    past: int
    padded: bool = True
    """Whether ``real`` may hold padding (False: every new token is real, known on the
    host, so nothing needs zeroing)."""

    @functools.cached_property
    def attention_mask(self) -> Tensor:
        """``[B, 1, T, past + T]`` bool: query i sees key j when j is at or before it and
        real (a padded query sees itself, so no row is empty); built once per step, for
        every softmax layer."""
        t, total = self.real.shape[1], self.key_real.shape[1]
        query = torch.arange(t, device=self.real.device)[:, None] + self.past
        key = torch.arange(total, device=self.real.device)[None, :]
        allowed = (key <= query) & (self.key_real[:, None, :] | (key == query))
        return allowed[:, None]


@dataclass
class DecodeCache:
    """The decoding state of a batch: one :data:`LayerCache` per layer, which cached
    positions hold real tokens, and how many real tokens each sequence has."""

    layers: list[LayerCache]
    real: Tensor | None = None
    lengths: Tensor | None = None
    longest: int = 0
    """Real tokens of the longest sequence, kept on the host so that a decoding step checks
    ``max_seq_len`` without reading the device (after :meth:`select` of a subset, an upper
    bound)."""

    @classmethod
    def empty(cls, config: K3Config) -> DecodeCache:
        kinds = {"kda": KDAState, "mla": LatentCache, "gqa": KVCache}
        return cls([kinds[kind]() for kind in config.layer_types()])

    @property
    def length(self) -> int:
        """Positions cached so far (padding included)."""
        return 0 if self.real is None else int(self.real.shape[1])

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
        past = self.length
        if self.lengths is None:
            self.lengths = torch.zeros(real.shape[0], dtype=torch.long, device=real.device)
        counts = real.long().cumsum(dim=1)
        positions = (self.lengths[:, None] + counts - 1).clamp_min(0)
        self.lengths = self.lengths + counts[:, -1]
        self.real = real if self.real is None else torch.cat([self.real, real], dim=1)
        self.longest = longest
        return Step(real, positions, self.real, past, padded)

    @classmethod
    def merge(cls, caches: Sequence[DecodeCache]) -> DecodeCache:
        """One batch of the sequences of ``caches`` (each prefilled on its own, so each
        equals its sequence's full forward exactly), in order, the per-token entries
        left-padded to the longest; the padding is marked not real."""
        if any(c.real is None or c.lengths is None for c in caches):
            raise ValueError("DecodeCache.merge needs caches that have been prefilled")
        length = max(c.length for c in caches)
        pads = [length - c.length for c in caches]
        layers: list[LayerCache] = []
        for entries in zip(*(c.layers for c in caches)):
            if isinstance(entries[0], KDAState):
                kda = [_kda(e) for e in entries]
                layers.append(KDAState(torch.cat([state for state, _ in kda]), (
                    torch.cat([tails[0] for _, tails in kda]),
                    torch.cat([tails[1] for _, tails in kda]),
                    torch.cat([tails[2] for _, tails in kda]))))
            elif isinstance(entries[0], LatentCache):
                pairs = [_pair(e.latent, e.k_shared) for e in entries
                         if isinstance(e, LatentCache)]
                layers.append(LatentCache(_left_padded([a for a, _ in pairs], pads, 1),
                                          _left_padded([b for _, b in pairs], pads, 1)))
            else:
                pairs = [_pair(e.k, e.v) for e in entries if isinstance(e, KVCache)]
                layers.append(KVCache(_left_padded([a for a, _ in pairs], pads, 2),
                                      _left_padded([b for _, b in pairs], pads, 2)))
        real = _left_padded([c.real for c in caches if c.real is not None], pads, 1)
        lengths = torch.cat([c.lengths for c in caches if c.lengths is not None])
        return cls(layers, real, lengths, max(c.longest for c in caches))

    def select(self, rows: Tensor) -> DecodeCache:
        """The cache of the sequences ``rows`` (a batch index tensor), in that order."""
        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.index_select(0, rows)

        layers: list[LayerCache] = []
        for entry in self.layers:
            if isinstance(entry, KDAState):
                tails = entry.tails
                layers.append(KDAState(pick(entry.state), None if tails is None else (
                    tails[0].index_select(0, rows), tails[1].index_select(0, rows),
                    tails[2].index_select(0, rows))))
            elif isinstance(entry, LatentCache):
                layers.append(LatentCache(pick(entry.latent), pick(entry.k_shared)))
            else:
                layers.append(KVCache(pick(entry.k), pick(entry.v)))
        return DecodeCache(layers, pick(self.real), pick(self.lengths), self.longest)

    def nbytes(self) -> dict[str, int]:
        """Bytes held per kind of layer: ``{"kda": …, "mla": …, "gqa": …}`` (the batch's)."""
        found = {"kda": 0, "mla": 0, "gqa": 0}
        for entry in self.layers:
            if isinstance(entry, KDAState):
                tensors = [entry.state, *(entry.tails or ())]
                kind = "kda"
            elif isinstance(entry, LatentCache):
                tensors, kind = [entry.latent, entry.k_shared], "mla"
            else:
                tensors, kind = [entry.k, entry.v], "gqa"
            found[kind] += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return found


def _kda(entry: LayerCache) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    if not isinstance(entry, KDAState) or entry.state is None or entry.tails is None:
        raise ValueError("DecodeCache.merge: caches of different models")
    return entry.state, entry.tails


def _pair(a: Tensor | None, b: Tensor | None) -> tuple[Tensor, Tensor]:
    if a is None or b is None:
        raise ValueError("DecodeCache.merge: an empty layer cache")
    return a, b


def _left_padded(tensors: list[Tensor], pads: list[int], dim: int) -> Tensor:
    """``tensors`` concatenated along the batch, each first padded with ``pads`` zeros
    (False for a mask) at the front of ``dim``."""
    out = []
    for t, pad in zip(tensors, pads):
        shape = list(t.shape)
        shape[dim] = pad
        out.append(torch.cat([t.new_zeros(shape), t], dim=dim))
    return torch.cat(out)


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
