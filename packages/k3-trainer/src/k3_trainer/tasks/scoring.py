"""Scoring a task: every choice's log-likelihood given its context, then the metrics.

Encoding follows lm-eval: a choice's context is encoded alone, ``context + continuation``
is encoded whole and split at the context's length (so a BPE merge across the boundary
is the continuation's), and the context is preceded by the document-start token when the
model was trained on documents that begin with it (``bos``: the end-of-document token of
today's data, as ``k3-train sample`` does). A model with a ``score_continuations``
method (K3's: each distinct context runs once and its decoding state is forked for its
continuations) scores through it; any other model runs one forward per choice.

Metrics (per task, over its documents):

- ``acc``: the choice with the largest summed log-likelihood is the gold one (lm-eval's).
- ``acc_norm``: the same with each log-likelihood divided by its continuation's length in
  characters (lm-eval's ``acc_norm``, OLMo's ``acc_per_char``).
- ``bpb``: bits per UTF-8 byte of the gold continuations, ``Σ −log p(gold) / (ln 2 ·
  Σ bytes)`` over the documents (like ``val_bpb``, every byte weighs the same), the bytes
  being those of the tokens scored (a context's trailing space moved into the
  continuation counts with it, as it is scored with it).
- ``centered_acc``: ``(acc − b) / (1 − b)`` with ``b`` the chance accuracy (the mean of
  ``1/k`` over documents of k choices): 0 at chance, 1 when perfect (nanochat's centering).

And over the tasks asked, ``core``: the mean ``centered_acc`` (nanochat's CORE
construction over whichever tasks were asked; not comparable with nanochat's 22-task
number).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data import Codec
from .catalog import Document, Task, TaskError

SUMS = ("correct", "correct_norm", "gold_nll", "gold_bytes", "chance", "docs", "skipped")
"""What a task's metrics are made of, summed over documents (and over ranks)."""


@dataclass(frozen=True)
class Scored:
    """One document: each choice's log-likelihood (natural log) and the picks."""

    id: Any
    gold: int
    logliks: tuple[float, ...]
    lengths: tuple[int, ...]  # each continuation's characters
    gold_bytes: int  # UTF-8 bytes of the gold continuation's scored tokens
    dropped: int  # context tokens left out to fit the window (the most of any choice)

    @property
    def pred(self) -> int:
        return max(range(len(self.logliks)), key=lambda i: self.logliks[i])

    @property
    def pred_norm(self) -> int:
        return max(range(len(self.logliks)),
                   key=lambda i: self.logliks[i] / max(self.lengths[i], 1))

    def sums(self) -> list[float]:
        """This document's share of :data:`SUMS`."""
        return [float(self.pred == self.gold), float(self.pred_norm == self.gold),
                -self.logliks[self.gold], float(self.gold_bytes), 1.0 / len(self.logliks),
                1.0, 0.0]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "gold": self.gold, "logliks": list(self.logliks),
                "pred": self.pred, **({"dropped": self.dropped} if self.dropped else {})}


def metrics(sums: Sequence[float]) -> dict[str, float]:
    """``acc``, ``acc_norm``, ``bpb``, ``centered_acc`` and ``docs`` from summed
    :data:`SUMS` (and ``skipped`` when documents were)."""
    total = dict(zip(SUMS, sums))
    docs = total["docs"]
    if not docs:
        raise TaskError(f"no document could be scored ({int(total['skipped'])} skipped: "
                        "their continuations are longer than the model's window)")
    acc, chance = total["correct"] / docs, total["chance"] / docs
    found = {"acc": acc, "acc_norm": total["correct_norm"] / docs,
             "bpb": total["gold_nll"] / (math.log(2) * max(total["gold_bytes"], 1.0)),
             "centered_acc": (acc - chance) / (1.0 - chance), "docs": int(docs)}
    if total["skipped"]:
        found["skipped"] = int(total["skipped"])
    return found


def core(results: dict[str, dict[str, float]]) -> float:
    """The mean ``centered_acc`` over the tasks' metrics."""
    return sum(m["centered_acc"] for m in results.values()) / len(results)


def encode_choice(codec: Codec, context: str, continuation: str, bos: int | None
                  ) -> tuple[list[int], list[int]]:
    """``(context ids, continuation ids)`` as lm-eval splits them (a context's trailing
    whitespace moves to the continuation; the context alone, then context + continuation
    whole, split at the context's length), the context preceded by ``bos`` when given."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    head = [int(t) for t in codec.encode_batch([context])[0]] if context else []
    whole = [int(t) for t in codec.encode_batch([context + continuation])[0]]
    tail = whole[len(head):] or [int(t) for t in codec.encode_batch([continuation])[0]]
    return ([bos] if bos is not None else []) + head, tail


def check_vocabulary(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], vocab_size: int,
                     what: str) -> None:
    """Refuse, naming ``what``, a (context, continuation) whose token ids the model's
    vocabulary cannot hold: the tokenizer and the model disagree."""
    for context, continuation in pairs:
        bad = next((t for t in (*context, *continuation) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise TaskError(f"{what}: the model's vocabulary ({vocab_size} tokens) cannot "
                            f"encode token id {bad}; the tokenizer and the model disagree")


def fit_window(context: Sequence[int], after: int, max_len: int) -> list[int]:
    """The last tokens of ``context`` that fit the model's window ``max_len`` with
    ``after`` more tokens read after them (at least one is kept), as lm-eval truncates on
    the left: a scored continuation less its last token (predicted, never read), or the
    new tokens a generation reads."""
    keep = min(len(context), max(max_len - after, 1))
    return list(context[len(context) - keep:])


@dataclass(frozen=True)
class EncodedDocument:
    """A document's choices as token ids (:func:`encode_choice`) and the UTF-8 bytes of
    its gold continuation's tokens, the bytes its ``bpb`` scores."""

    pairs: list[tuple[list[int], list[int]]]
    gold_bytes: int


def encode_documents(codec: Codec, task: Task, documents: Sequence[Document], *,
                     vocab_size: int, bos: int | None) -> list[EncodedDocument]:
    """Each document's choices encoded (:func:`encode_choice`); refuses a document the
    model's vocabulary cannot hold."""
    table = codec.token_byte_lengths()
    encoded = []
    for doc in documents:
        pairs = [encode_choice(codec, c, k, bos) for c, k in zip(doc.contexts,
                                                                    doc.continuations)]
        check_vocabulary(pairs, vocab_size, f"task {task.name}: document {doc.id!r}")
        gold = pairs[doc.gold][1]
        encoded.append(EncodedDocument(pairs, int(sum(int(table[t]) for t in gold))))
    return encoded


def score_documents(model: nn.Module, codec: Codec, task: Task, documents: Sequence[Document],
                    *, vocab_size: int, max_len: int, bos: int | None, batch_size: int = 16
                    ) -> tuple[list[Scored], int]:
    """Each document's choices scored (see the module docstring), and how many documents
    were skipped because a continuation alone is longer than the model's window
    ``max_len`` (no context could be kept for it)."""
    encoded = encode_documents(codec, task, documents, vocab_size=vocab_size, bos=bos)
    return score_encoded(model, documents, encoded, max_len=max_len, batch_size=batch_size)


def score_encoded(model: nn.Module, documents: Sequence[Document],
                  encoded: Sequence[EncodedDocument], *, max_len: int,
                  batch_size: int = 16) -> tuple[list[Scored], int]:
    """:func:`score_documents` of documents already encoded (:func:`encode_documents`)."""
    fits = [all(len(k) <= max_len for _, k in e.pairs) for e in encoded]
    kept = [(d, e) for d, e, ok in zip(documents, encoded, fits) if ok]
    scored = iter(score_pairs(model, [p for _, e in kept for p in e.pairs], max_len=max_len,
                              batch_size=batch_size))
    out = []
    for doc, e in kept:
        choices = [next(scored) for _ in e.pairs]
        out.append(Scored(doc.id, doc.gold, tuple(c.loglik for c in choices),
                          tuple(len(k) for k in doc.continuations), e.gold_bytes,
                          max(c.dropped for c in choices)))
    return out, len(documents) - len(kept)


@dataclass(frozen=True)
class PairScore:
    """One (context, continuation): its summed log-likelihood, whether every token is the
    most likely one, and the context tokens left out to fit the window."""

    loglik: float
    greedy: bool
    dropped: int


@dataclass(frozen=True)
class _Request:
    """One context and its continuations (token ids), as a model's
    ``score_continuations`` reads them."""

    context: list[int]
    continuations: list[list[int]]


def score_pairs(model: nn.Module, pairs: Sequence[tuple[list[int], list[int]]], *,
                max_len: int, batch_size: int = 16) -> list[PairScore]:
    """Each (context ids, continuation ids) scored, in order. A pair longer than the
    model's window ``max_len`` keeps its context's last tokens, as lm-eval truncates each
    pair (the continuation's last token is predicted, never read). Pairs whose (kept)
    contexts are the same (a question's choices) are one request, so a model with
    ``score_continuations`` runs that context once; a model without it runs one forward
    per pair."""
    requests: list[_Request] = []
    where: list[tuple[int, int]] = []
    dropped: list[int] = []
    index: dict[tuple[int, ...], int] = {}
    for whole, continuation in pairs:
        context = fit_window(whole, len(continuation) - 1, max_len)
        dropped.append(len(whole) - len(context))
        at = index.setdefault(tuple(context), len(requests))
        if at == len(requests):
            requests.append(_Request(list(context), []))
        where.append((at, len(requests[at].continuations)))
        requests[at].continuations.append(list(continuation))
    scorer = getattr(model, "score_continuations", None)
    scored = scorer(requests, batch_size=batch_size) if callable(scorer) else \
        [_score_by_forward(model, r) for r in requests]
    return [PairScore(scored[r].logliks[c], bool(scored[r].greedy[c]), drop)
            for (r, c), drop in zip(where, dropped)]


@dataclass(frozen=True)
class ContinuationScores:
    """One context's continuations as a ``score_continuations`` returns them (what
    :func:`score_pairs` reads): each one's summed log-likelihood, and whether every token
    of it is the most likely one."""

    logliks: list[float]
    greedy: list[bool]


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's log-probability under ``logits`` (``targets``' shape plus the
    vocabulary), in float32, and whether it is the most likely token."""
    logprobs = F.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, targets[..., None])[..., 0], logprobs.argmax(-1) == targets


@torch.no_grad()
def _score_by_forward(model: nn.Module, request: _Request) -> ContinuationScores:
    """One forward of context + continuation per choice (a model without a cache)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        sums, greedy = [], []
        for continuation in request.continuations:
            ids = torch.tensor([[*request.context, *continuation][:-1]], device=device)
            out = model(ids)
            logits: torch.Tensor = out[0] if isinstance(out, tuple) else out
            target = torch.tensor(list(continuation), device=device)
            logprob, best = target_logprobs(logits[0, len(request.context) - 1:], target)
            sums.append(float(logprob.sum()))
            greedy.append(bool(best.all()))
    finally:
        model.train(was_training)
    return ContinuationScores(sums, greedy)
