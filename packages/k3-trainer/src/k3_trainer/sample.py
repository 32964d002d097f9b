"""Sampling continuations from a trained model (``k3-train sample``).

A model with a ``generate`` method (K3's keeps KDA's recurrent state and MLA's latent
cache) decodes with it, all samples in one batch. Any other model falls back to
:func:`sample_tokens`, which recomputes the forward over the context for every new token
(quadratic, but it needs nothing from the model beyond its forward).
Draws use one CPU ``torch.Generator`` seeded by the caller, so a seed gives the same text
on any device whose logits agree.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from k3_checkpoint import capture_rng, restore_rng

from .data import Codec, document_start


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn: ``temperature == 0`` takes the most likely token; ``top_k``
    keeps only the k most likely and ``top_p`` the smallest set whose probability reaches
    p before drawing; ``seed`` seeds the draws; ``num_samples`` continuations of the one
    prompt."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    seed: int = 0
    top_p: float | None = None
    num_samples: int = 1

    def __post_init__(self) -> None:
        if self.temperature < 0 or (self.top_k is not None and self.top_k < 1) or (
                self.top_p is not None and not 0 < self.top_p <= 1) or self.num_samples < 1:
            raise ValueError("sample: temperature must be >= 0, top_k >= 1, top_p in (0, 1] "
                             "and num_samples >= 1")


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The next token after one row of ``logits`` ``(V,)``, drawn on the CPU by
    ``sampling``'s rule (the rule a model's own ``generate`` is given by name)."""
    logits = logits.float().cpu()
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.numel():
        logits[logits < torch.topk(logits, sampling.top_k).values[-1]] = float("-inf")
    if sampling.top_p is not None and sampling.top_p < 1.0:
        ordered, order = logits.sort(descending=True)
        probs = ordered.softmax(dim=-1)
        logits[order[probs.cumsum(dim=-1) - probs >= sampling.top_p]] = float("-inf")
    return int(torch.multinomial(logits.softmax(dim=-1), 1, generator=generator))


@torch.no_grad()
def sample_tokens(model: nn.Module, prompt: Sequence[int], sampling: Sampling, *,
                  max_seq_len: int, device: torch.device | str, stop_id: int | None = None
                  ) -> list[int]:
    """Up to ``sampling.max_new_tokens`` ids drawn after ``prompt`` by recomputing the
    forward over the context (truncated to ``max_seq_len``) for every token; stops after
    ``stop_id``. The global RNG and the model's training flag are left as they were."""
    if not prompt:
        raise ValueError("sample: the prompt must hold at least one token")
    device = torch.device(device)
    generator = torch.Generator().manual_seed(sampling.seed)
    context = list(prompt)
    new: list[int] = []
    was_training, rng = model.training, capture_rng()
    model.eval()
    try:
        for _ in range(sampling.max_new_tokens):
            x = torch.tensor([context[-max_seq_len:]], dtype=torch.long, device=device)
            logits = model(x)
            logits = (logits[0] if isinstance(logits, tuple) else logits)[:, -1]
            token = pick(logits[0], sampling, generator)
            context.append(token)
            new.append(token)
            if token == stop_id:
                break
    finally:
        model.train(was_training)
        restore_rng(rng)
    return new


def context_room(prompt_tokens: int, max_new_tokens: int, max_seq_len: int) -> tuple[int, int]:
    """``(prompt tokens kept, new tokens)`` when decoding with a cache, which holds the whole
    sequence in ``max_seq_len``: the whole prompt and as many new tokens as fit after it;
    but never fewer new tokens than half the window (or ``max_new_tokens``) — a prompt
    that leaves less keeps its last tokens instead."""
    new_tokens = min(max_new_tokens, max(max_seq_len - prompt_tokens,
                                         min(max_new_tokens, max_seq_len // 2), 1))
    return min(prompt_tokens, max_seq_len - new_tokens), new_tokens


class TextStream:
    """Prints one sample's text as its tokens arrive, holding back a token that ends in
    the middle of a UTF-8 character until the next one completes it."""

    def __init__(self, codec: Codec, write: Callable[[str], object] | None = None) -> None:
        self.codec = codec
        self.write = write if write is not None else sys.stdout.write
        self.tokens: list[int] = []
        self.shown = 0

    def __call__(self, _row: int, token: int) -> None:
        self.tokens.append(token)
        text = self.codec.decode(self.tokens)
        if text.endswith("\ufffd"):
            return
        self.write(text[self.shown:])
        self.shown = len(text)
        sys.stdout.flush()


def sample_text(model: nn.Module, codec: Codec, prompt: str, sampling: Sampling, *,
                max_seq_len: int, device: torch.device | str,
                stream: TextStream | None = None,
                timings: MutableMapping[str, float] | None = None) -> list[str]:
    """``sampling.num_samples`` texts, each ``prompt`` followed by a continuation.

    The context starts with :func:`~k3_trainer.data.document_start` (the end-of-document
    token, as every document after the first does in the shards), and each sample stops
    when the model ends the document. With a
    ``generate`` method the prompt and the new tokens must fit in ``max_seq_len`` together
    (the cache holds the whole sequence): see :func:`context_room`. ``stream`` (one sample
    only) receives the tokens as they are produced; ``timings`` receives ``decode_s`` and
    ``new_tokens`` (and ``prefill_s`` from a model's ``generate``).
    """
    start = document_start(codec)
    ids = [start, *codec.encode_batch([prompt])[0].tolist()] if prompt else [start]
    generate = getattr(model, "generate", None)
    if callable(generate):
        kept, new_tokens = context_room(len(ids), sampling.max_new_tokens, max_seq_len)
        ids = ids[-kept:]
        rng = capture_rng()
        try:
            continuations = generate([ids] * sampling.num_samples, new_tokens,
                                     temperature=sampling.temperature, top_k=sampling.top_k,
                                     top_p=sampling.top_p, seed=sampling.seed,
                                     stop_ids=(codec.eod_id,), on_token=stream,
                                     timings=timings)
        finally:
            restore_rng(rng)
    else:
        began = time.perf_counter()
        continuations = [sample_tokens(model, ids, Sampling(
            sampling.max_new_tokens, sampling.temperature, sampling.top_k,
            sampling.seed + i, sampling.top_p), max_seq_len=max_seq_len, device=device,
            stop_id=codec.eod_id) for i in range(sampling.num_samples)]
        if timings is not None:
            timings["decode_s"] = time.perf_counter() - began
            timings["new_tokens"] = sum(len(c) for c in continuations)
    return [prompt + codec.decode(new) for new in continuations]
