"""Generation with the decoding cache: batched prompts, seeded sampling, per-sequence stops.

The prompts are prefilled (one forward per prompt length) and their caches merged into one
left-padded batch; then every step feeds each sequence's new token (one forward of ``B``
tokens), so the cost per token is one token through the layers plus MLA's attention over
the cached latents, instead of the whole prefix again. A sequence that produced a stop id
stops growing (the batch goes on for the others). Draws come from one CPU
``torch.Generator`` seeded by ``seed``: the same call gives the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from .cache import DecodeCache
from .config import K3Config


class CachedDecoder(Protocol):
    """What generation needs of a model (:class:`~k3_model.K3Model` has it)."""

    config: K3Config
    training: bool

    def forward_cached(self, x: Tensor, cache: DecodeCache, real: Tensor | None = None
                       ) -> Tensor: ...
    def new_cache(self) -> DecodeCache: ...
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...
    def eval(self) -> Any: ...
    def train(self, mode: bool = True) -> Any: ...


def pick(logits: Tensor, *, temperature: float, top_k: int | None, top_p: float | None,
         generator: torch.Generator) -> Tensor:
    """One token id per row of ``logits`` ``(B, V)``: the most likely with
    ``temperature == 0``, else a draw from the softmax of ``logits / temperature`` limited
    to the ``top_k`` most likely and to the smallest set whose probability reaches
    ``top_p`` (nucleus), on the CPU."""
    logits = logits.float().cpu()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        cutoff = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
        drop = before >= top_p  # never the most likely one (its "before" is 0)
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]


def _check(prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float,
           top_k: int | None, top_p: float | None, vocab: int, max_len: int) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: give at least one prompt, each of at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be ≥ 1, got {max_new_tokens}")
    if temperature < 0 or (top_k is not None and top_k < 1) or (
            top_p is not None and not 0 < top_p <= 1):
        raise ValueError("generate: temperature must be ≥ 0, top_k ≥ 1 and top_p in (0, 1]")
    bad = [t for p in prompts for t in p if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"generate: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > max_len:
        raise ValueError(f"generate: a prompt of {longest} tokens plus {max_new_tokens} new "
                         f"ones exceeds max_seq_len ({max_len}); shorten the prompt or "
                         "generate fewer tokens")


def prefill(model: CachedDecoder, prompts: Sequence[Sequence[int]], device: torch.device
            ) -> tuple[DecodeCache, Tensor]:
    """The batch's cache after the prompts, and each prompt's last logits ``(B, V)``.

    Prompts of one length are prefilled together, each length on its own, and the caches
    merged (left-padded): a prompt's prefill is then the very computation of its full
    forward, whereas padding inside one forward would shift KDA's chunk boundaries.
    """
    groups: dict[int, list[int]] = {}
    for row, prompt in enumerate(prompts):
        groups.setdefault(len(prompt), []).append(row)
    caches, logits, order = [], [], []
    for rows in groups.values():
        cache = model.new_cache()
        ids = torch.tensor([[int(t) for t in prompts[r]] for r in rows], device=device)
        logits.append(model.forward_cached(ids, cache)[:, -1])
        caches.append(cache)
        order.extend(rows)
    merged = DecodeCache.merge(caches) if len(caches) > 1 else caches[0]
    back = torch.empty(len(order), dtype=torch.long)
    back[torch.tensor(order)] = torch.arange(len(order))
    return merged.select(back.to(device)), torch.cat(logits)[back.to(device)]


@torch.no_grad()
def generate(model: CachedDecoder, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, stop_ids: Iterable[int] = (),
             on_token: Callable[[int, int], None] | None = None) -> list[list[int]]:
    """The new token ids for each prompt (a list of token-id lists), at most
    ``max_new_tokens`` each, a sequence ending at its first token in ``stop_ids`` (which is
    included). ``temperature=0`` is greedy. ``on_token(i, token)`` is called for each new
    token of prompt ``i`` as it is produced (streaming). The model's training flag and
    the global RNG are left as they were; the model runs in eval mode meanwhile (no
    balancer update)."""
    config = model.config
    _check(prompts, max_new_tokens, temperature, top_k, top_p, config.vocab_size,
           config.max_seq_len)
    device = next(model.parameters()).device
    stops = {int(t) for t in stop_ids}
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    try:
        cache, logits = prefill(model, prompts, device)
        new: list[list[int]] = [[] for _ in prompts]
        running = [True] * len(prompts)
        for step in range(max_new_tokens):
            tokens = pick(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                          generator=generator)
            for row, token in enumerate(tokens.tolist()):
                if running[row]:
                    new[row].append(token)
                    if on_token is not None:
                        on_token(row, token)
                    running[row] = token not in stops
            if not any(running) or step == max_new_tokens - 1:
                break
            logits = model.forward_cached(tokens[:, None].to(device), cache)[:, -1]
    finally:
        model.train(was_training)
    return new
