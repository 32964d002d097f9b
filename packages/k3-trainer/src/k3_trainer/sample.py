"""Sampling a continuation from a trained model (``k3-train sample``).

No KV cache: each new token recomputes the forward over the context, truncated to the
model's ``max_seq_len``. That is quadratic in the length but simple and exact, which is
what a check of a run needs. Draws use one CPU ``torch.Generator`` seeded by the caller,
so a seed gives the same text on any device whose logits agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from k3_checkpoint import capture_rng, restore_rng

from .data import Codec


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn: ``temperature == 0`` takes the most likely token; ``top_k``
    keeps only the k most likely before drawing; ``seed`` seeds the draws."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    seed: int = 0


@torch.no_grad()
def sample_tokens(model: nn.Module, prompt: Sequence[int], sampling: Sampling, *,
                  max_seq_len: int, device: torch.device | str, stop_id: int | None = None
                  ) -> list[int]:
    """Up to ``sampling.max_new_tokens`` ids drawn after ``prompt`` (stops after
    ``stop_id``). The global RNG and the model's training flag are left as they were."""
    max_new_tokens, temperature = sampling.max_new_tokens, sampling.temperature
    top_k, seed = sampling.top_k, sampling.seed
    if not prompt:
        raise ValueError("sample: the prompt must hold at least one token")
    if temperature < 0 or (top_k is not None and top_k < 1):
        raise ValueError("sample: temperature must be >= 0 and top_k >= 1")
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    context = list(prompt)
    new: list[int] = []
    was_training, rng = model.training, capture_rng()
    model.eval()
    try:
        for _ in range(max_new_tokens):
            x = torch.tensor([context[-max_seq_len:]], dtype=torch.long, device=device)
            logits = model(x)
            logits = (logits[0] if isinstance(logits, tuple) else logits)[0, -1].float().cpu()
            if temperature == 0:
                token = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.numel():
                    cutoff = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < cutoff, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            context.append(token)
            new.append(token)
            if token == stop_id:
                break
    finally:
        model.train(was_training)
        restore_rng(rng)
    return new


def sample_text(model: nn.Module, codec: Codec, prompt: str, sampling: Sampling, *,
                max_seq_len: int, device: torch.device | str) -> str:
    """``prompt`` followed by its sampled continuation, decoded.

    The context starts with the end-of-document token, as every document after the first
    does in the shards, and sampling stops when the model ends the document.
    """
    ids = [codec.eod_id, *codec.encode_batch([prompt])[0].tolist()] if prompt else [codec.eod_id]
    new = sample_tokens(model, ids, sampling, max_seq_len=max_seq_len, device=device,
                        stop_id=codec.eod_id)
    return prompt + codec.decode(new)
