"""Log-likelihoods of continuations, each context run once and its decoding state forked.

Ranked-classification tasks (ARC, HellaSwag, PIQA …) and lm-eval's ``loglikelihood`` ask
for ``log p(continuation | context)`` of several continuations of one context. Running
``context + continuation`` through the model once per continuation repeats the context k
times; here each context is prefilled once (contexts of a batch grouped by length and
merged, exactly as :func:`~k3_model.generate.prefill` does for prompts), the cache is
expanded to one row per continuation (:meth:`~k3_model.cache.DecodeCache.expand`'s
fork), and every continuation of the batch runs as one cached forward, right-padded
(padding after a token never changes it: the model is causal).

A context whose tokens plus its longest continuation (less its last token, which is
predicted, never read) exceed ``max_seq_len`` keeps its last tokens, as lm-eval truncates
on the left; :attr:`Scored.dropped` says how many were dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .generate import CachedDecoder, check_token_ids, prefill


@dataclass(frozen=True)
class Continuations:
    """One context and its candidate continuations (token ids; each at least one token)."""

    context: Sequence[int]
    continuations: Sequence[Sequence[int]]


@dataclass(frozen=True)
class Scored:
    """Per continuation, in order: the summed natural-log probability of its tokens given
    the context (``logliks``) and whether each of its tokens is the most likely one
    (``greedy``, lm-eval's ``is_greedy``); ``dropped``: context tokens left out to fit."""

    logliks: list[float]
    greedy: list[bool]
    dropped: int = 0


def _window(request: Continuations, max_len: int) -> tuple[list[int], int]:
    """The context tokens kept (its last ones) so that the context and every continuation
    but its last token fit in ``max_len``, and how many were dropped."""
    context = [int(t) for t in request.context]
    longest = max(len(c) for c in request.continuations)
    if longest > max_len:
        raise ValueError(f"score: a continuation of {longest} tokens exceeds max_seq_len "
                         f"({max_len})")
    keep = min(len(context), max_len - (longest - 1))
    return context[len(context) - keep:], len(context) - keep


def _check(requests: Sequence[Continuations], vocab: int) -> None:
    for n, request in enumerate(requests):
        if not request.context or not request.continuations or any(
                len(c) == 0 for c in request.continuations):
            raise ValueError(f"score: request {n} needs a non-empty context and at least "
                             "one continuation, each of at least one token")
        check_token_ids((*request.context, *(t for c in request.continuations for t in c)),
                        vocab, f"score: request {n}")


@torch.no_grad()
def score_continuations(model: CachedDecoder, requests: Sequence[Continuations], *,
                        batch_size: int = 8) -> list[Scored]:
    """:class:`Scored` for each request, ``batch_size`` requests (contexts) per prefill.
    The model runs in eval mode (no balancer update) and its training flag is restored."""
    if batch_size < 1:
        raise ValueError(f"score: batch_size must be ≥ 1, got {batch_size}")
    _check(requests, model.config.vocab_size)
    was_training = model.training
    model.eval()
    try:
        out: list[Scored] = []
        for batch in _batches(requests, batch_size, model.config.max_seq_len):
            out.extend(_score_batch(model, batch))
    finally:
        model.train(was_training)
    return out


def _batches(requests: Sequence[Continuations], size: int, max_len: int
             ) -> list[list[tuple[Continuations, tuple[list[int], int]]]]:
    """Consecutive requests (with their context windows) grouped by at most ``size``, a
    group closed early where its longest context and longest continuation would not fit
    ``max_len`` together (the continuations run right-padded to the group's longest)."""
    batches: list[list[tuple[Continuations, tuple[list[int], int]]]] = []
    context = longest = 0
    for request in requests:
        window = _window(request, max_len)
        width = max(len(c) for c in request.continuations)
        grown = (max(context, len(window[0])), max(longest, width))
        if batches and len(batches[-1]) < size and grown[0] + grown[1] - 1 <= max_len:
            batches[-1].append((request, window))
            context, longest = grown
        else:
            batches.append([(request, window)])
            context, longest = len(window[0]), width
    return batches


def _score_batch(model: CachedDecoder,
                 batch: list[tuple[Continuations, tuple[list[int], int]]]) -> list[Scored]:
    device = next(model.parameters()).device
    requests = [r for r, _ in batch]
    windows = [w for _, w in batch]
    longest = max(len(c) for r in requests for c in r.continuations)
    cache, last = prefill(model, [w for w, _ in windows], device, room=longest - 1)
    counts = [len(r.continuations) for r in requests]
    conts = [[int(t) for t in c] for r in requests for c in r.continuations]
    rows = torch.arange(len(requests), device=device).repeat_interleave(
        torch.tensor(counts, device=device))
    # logits predicting each continuation token: the context's last, then the forward's
    logits = last.index_select(0, rows)[:, None]
    if longest > 1:
        fed = torch.zeros(len(conts), longest - 1, dtype=torch.long)
        for i, c in enumerate(conts):
            fed[i, :len(c) - 1] = torch.tensor(c[:-1])
        logits = torch.cat([logits, model.forward_cached(fed.to(device), cache.select(rows))],
                           dim=1)
    targets = torch.zeros(len(conts), longest, dtype=torch.long)
    real = torch.zeros(len(conts), longest, dtype=torch.bool)
    for i, c in enumerate(conts):
        targets[i, :len(c)], real[i, :len(c)] = torch.tensor(c), True
    targets, real = targets.to(device), real.to(device)
    logprobs = F.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(-1, targets[..., None])[..., 0].masked_fill(~real, 0.0)
    greedy = (logprobs.argmax(dim=-1) == targets) | ~real
    sums, alls = picked.double().sum(dim=1).tolist(), greedy.all(dim=1).tolist()
    scored, at = [], 0
    for k, (_, dropped) in zip(counts, windows):
        scored.append(Scored(sums[at:at + k], alls[at:at + k], dropped))
        at += k
    return scored
