"""Generation with the decoding cache: batched prompts, seeded sampling, per-sequence stops.

The prompts are prefilled (one forward per prompt length) and their caches merged into one
left-padded batch, its buffers sized once for the prompt plus the new tokens; then every
step feeds each sequence's new token (one forward of ``B`` tokens), so the cost per token
is one token through the layers plus MLA's attention over the cached latents, instead of
the whole prefix again. Tokens are drawn where the logits are (greedy, temperature, top-k,
top-p) and stay there: the host reads them once at the end, plus one small read every
:data:`STOP_CHECK_EVERY` steps to see whether every sequence has stopped (or one per step
when a caller streams them). A sequence that produced a stop id stops growing (the batch
goes on for the others). Draws come from a ``torch.Generator`` on the model's device
seeded by ``seed``: the same call on the same device gives the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from .cache import DecodeCache
from .config import K3Config

STOP_CHECK_EVERY = 8
"""Decoding steps between two reads of "has every sequence stopped?" when nothing is
streamed (a stopped batch decodes at most this many steps too many, which are dropped)."""


class CachedDecoder(Protocol):
    """What generation needs of a model (:class:`~k3_model.K3Model` has it)."""

    config: K3Config
    training: bool

    def forward_cached(self, x: Tensor, cache: DecodeCache, real: Tensor | None = None
                       ) -> Tensor: ...
    def new_cache(self, capacity: int | None = None, static: bool = False
                  ) -> DecodeCache: ...
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...
    def eval(self) -> Any: ...
    def train(self, mode: bool = True) -> Any: ...


def pick(logits: Tensor, *, temperature: float, top_k: int | None, top_p: float | None,
         generator: torch.Generator) -> Tensor:
    """One token id per row of ``logits`` ``(B, V)``, on the logits' device: the most
    likely with ``temperature == 0``, else a draw (from ``generator``, on that device)
    from the softmax of ``logits / temperature`` limited to the ``top_k`` most likely and
    to the smallest set whose probability reaches ``top_p`` (nucleus)."""
    logits = logits.float()
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


def check_token_ids(ids: Iterable[int], vocab: int, what: str) -> None:
    """Refuse, naming ``what``, a token id outside the model's vocabulary ``[0, vocab)``
    (the embedding would fail on it without saying which)."""
    bad = next((int(t) for t in ids if not 0 <= int(t) < vocab), None)
    if bad is not None:
        raise ValueError(f"{what}: token id {bad} is outside the vocabulary [0, {vocab})")


def _check(prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float,
           top_k: int | None, top_p: float | None, vocab: int, max_len: int) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: give at least one prompt, each of at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be ≥ 1, got {max_new_tokens}")
    if temperature < 0 or (top_k is not None and top_k < 1) or (
            top_p is not None and not 0 < top_p <= 1):
        raise ValueError("generate: temperature must be ≥ 0, top_k ≥ 1 and top_p in (0, 1]")
    check_token_ids((t for p in prompts for t in p), vocab, "generate")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > max_len:
        raise ValueError(f"generate: a prompt of {longest} tokens plus {max_new_tokens} new "
                         f"ones exceeds max_seq_len ({max_len}); shorten the prompt or "
                         "generate fewer tokens")


def prefill(model: CachedDecoder, prompts: Sequence[Sequence[int]], device: torch.device,
            room: int | None = None) -> tuple[DecodeCache, Tensor]:
    """The batch's cache after the prompts, and each prompt's last logits ``(B, V)``.

    Prompts of one length are prefilled together, each length on its own, and the caches
    merged (left-padded): a prompt's prefill is then the very computation of its full
    forward, whereas padding inside one forward would shift KDA's chunk boundaries.
    ``room``: new tokens the cache's buffers are sized for after the longest prompt
    (None: grown as needed).
    """
    groups: dict[int, list[int]] = {}
    for row, prompt in enumerate(prompts):
        groups.setdefault(len(prompt), []).append(row)
    caches, logits, order = [], [], []
    for length, rows in groups.items():
        cache = model.new_cache(None if room is None else length + room)
        ids = torch.tensor([[int(t) for t in prompts[r]] for r in rows], device=device)
        logits.append(model.forward_cached(ids, cache)[:, -1])
        caches.append(cache)
        order.extend(rows)
    if len(caches) == 1:
        return caches[0], logits[0]
    back = torch.empty(len(order), dtype=torch.long)
    back[torch.tensor(order)] = torch.arange(len(order))
    return (DecodeCache.merge(caches).select(back.to(device)),
            torch.cat(logits)[back.to(device)])


@torch.no_grad()
def generate(model: CachedDecoder, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, stop_ids: Iterable[int] = (),
             on_token: Callable[[int, int], None] | None = None,
             timings: MutableMapping[str, float] | None = None) -> list[list[int]]:
    """The new token ids for each prompt (a list of token-id lists), at most
    ``max_new_tokens`` each, a sequence ending at its first token in ``stop_ids`` (which is
    included). ``temperature=0`` is greedy. ``on_token(i, token)`` is called for each new
    token of prompt ``i`` as it is produced (streaming: one read of the tokens per step).
    ``timings``, when given, receives ``prefill_s`` (the prompts' forwards), ``decode_s``
    (every step after it) and ``new_tokens`` (all sequences' together), so that a caller
    can report decoding speed (on CUDA, measuring waits for the device twice more).
    The model's training flag and the global RNG are left as they were; the model runs in
    eval mode meanwhile (no balancer update)."""
    config = model.config
    _check(prompts, max_new_tokens, temperature, top_k, top_p, config.vocab_size,
           config.max_seq_len)
    device = next(model.parameters()).device
    stop_set = {int(t) for t in stop_ids}
    stops = torch.tensor(sorted(stop_set), dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    began = time.perf_counter()
    try:
        cache, logits = prefill(model, prompts, device, room=max_new_tokens)
        if timings is not None:
            _wait(device)
            timings["prefill_s"] = time.perf_counter() - began
            began = time.perf_counter()
        drawn = torch.empty(len(prompts), max_new_tokens, dtype=torch.long, device=device)
        stopped = torch.zeros(len(prompts), dtype=torch.bool, device=device)
        streamed = [False] * len(prompts)  # host copy of `stopped`, when streaming
        for step in range(max_new_tokens):
            tokens = pick(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                          generator=generator)
            drawn[:, step] = tokens
            if stops.numel():
                stopped |= torch.isin(tokens, stops)
            if on_token is not None:
                for row, token in enumerate(tokens.tolist()):
                    if not streamed[row]:
                        on_token(row, token)
                        streamed[row] = token in stop_set
            if step == max_new_tokens - 1 or (
                    stop_set and _all_stopped(step, stopped, streamed, on_token)):
                break
            logits = model.forward_cached(tokens[:, None], cache)[:, -1]
        new = [_until_stop(row, stop_set) for row in drawn[:, :step + 1].tolist()]
    finally:
        model.train(was_training)
    if timings is not None:
        timings["decode_s"] = time.perf_counter() - began
        timings["new_tokens"] = sum(len(row) for row in new)
    return new


def _wait(device: torch.device) -> None:
    """Wait for the device's queued work (a timing boundary)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _all_stopped(step: int, stopped: Tensor, streamed: list[bool],
                 on_token: Callable[[int, int], None] | None) -> bool:
    """Whether every sequence has stopped: known on the host when streaming, else read
    from the device every :data:`STOP_CHECK_EVERY` steps."""
    if on_token is not None:
        return all(streamed)
    return (step + 1) % STOP_CHECK_EVERY == 0 and bool(stopped.all())


def _until_stop(tokens: list[int], stops: set[int]) -> list[int]:
    """``tokens`` up to and including the first stop id."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[:i + 1]
    return tokens
