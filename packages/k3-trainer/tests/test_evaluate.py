"""evaluate(): token weighting, every RNG restored, the training flag restored on failure."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from k3_trainer import DataExhausted, evaluate
from k3_trainer.evaluation import evaluate_split


class ListLoader:
    """A validation loader over fixed batches (what evaluate() needs: reset, next_batch)."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches, self.position = batches, 0

    def reset(self) -> None:
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position == len(self.batches):
            raise DataExhausted("end of the split")
        self.position += 1
        return self.batches[self.position - 1]


class Bigram(nn.Module):
    """Logits from a table; loss as a K3Model computes it (mean over scored targets)."""

    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.table = nn.Parameter(torch.randn(vocab, vocab, generator=g))

    def forward(self, x, targets=None):
        logits = self.table[x]
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batches(masks: tuple[int, ...] = (0, 5, 9), seed: int = 1
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for masked in masks:  # batches of 2x6 targets, the first ``masked`` of each not scored
        x = torch.randint(0, 11, (2, 6), generator=g)
        y = torch.randint(0, 11, (2, 6), generator=g)
        y.view(-1)[:masked] = -100
        out.append((x, y))
    return out


def test_the_mean_is_over_scored_tokens_not_over_batches():
    model, batches = Bigram(), _batches()
    loss = evaluate(model, ListLoader(batches), "cpu", max_batches=3)
    with torch.no_grad():
        per_token = torch.cat([
            F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), reduction="none")
            [y.view(-1) >= 0] for x, y in batches])
        batch_means = [float(model(x, y)[1]) for x, y in batches]
    assert per_token.numel() == 12 + 7 + 3
    assert loss == pytest.approx(per_token.mean().item(), rel=1e-6)
    assert abs(loss - sum(batch_means) / 3) > 1e-3  # the unweighted mean is a different number


class ByteListLoader(ListLoader):
    """A ListLoader with a bytes-per-token table, as a TokenDataLoader over a prepared split."""

    token_bytes = np.arange(1, 12)  # token t stands for t + 1 UTF-8 bytes


def _scored_losses(model: nn.Module, batches) -> tuple[torch.Tensor, list[float]]:
    """Every scored target's loss, and each batch's own mean loss."""
    with torch.no_grad():
        per_token = torch.cat([
            F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), reduction="none")
            [y.view(-1) >= 0] for x, y in batches])
        return per_token, [float(model(x, y)[1]) for x, y in batches]


def test_evaluate_split_weights_by_scored_tokens_on_one_rank_and_across_ranks():
    """Batches (and ranks) with different numbers of scored targets: the loss is the mean
    over those targets, not the mean of the batch (or rank) means, and the token and byte
    counts are of exactly the scored targets."""
    model = Bigram()
    ranks = [_batches(), _batches((11, 2, 9), seed=2)]  # 12+7+3 and 1+10+3 scored targets
    alone = [evaluate_split(model, ByteListLoader(b), "cpu", max_batches=3) for b in ranks]
    for batches, result in zip(ranks, alone):
        per_token, batch_means = _scored_losses(model, batches)
        scored = torch.cat([y[y >= 0] for _, y in batches])
        assert result.tokens == per_token.numel() == scored.numel()
        assert result.bytes == int((scored + 1).sum())
        assert result.loss == pytest.approx(per_token.mean().item(), rel=1e-6)
        assert abs(result.loss - sum(batch_means) / len(batch_means)) > 1e-3
    assert [r.tokens for r in alone] == [22, 14]

    def all_reduce(sums: torch.Tensor) -> None:  # rank 0's view: add rank 1's sums
        other = alone[1]
        sums += torch.tensor([other.loss * other.tokens, other.tokens, other.bytes],
                             dtype=sums.dtype)

    both = evaluate_split(model, ByteListLoader(ranks[0]), "cpu", max_batches=3,
                          all_reduce=all_reduce)
    per_token, batch_means = _scored_losses(model, ranks[0] + ranks[1])
    assert both.tokens == 36 and both.bytes == alone[0].bytes + alone[1].bytes
    assert both.loss == pytest.approx(per_token.mean().item(), rel=1e-6)
    assert abs(both.loss - sum(batch_means) / 6) > 1e-3
    assert abs(both.loss - (alone[0].loss + alone[1].loss) / 2) > 1e-3  # not a mean of ranks


def test_a_batch_with_every_target_masked_adds_nothing():
    model, batches = Bigram(), _batches()
    x, y = batches[0]
    empty = (x, torch.full_like(y, -100))
    assert evaluate(model, ListLoader([batches[0], empty]), "cpu", 2) == pytest.approx(
        evaluate(model, ListLoader([batches[0]]), "cpu", 1))


class DrawsEverywhere(Bigram):
    """A model whose eval forward draws from Python, NumPy and torch RNG (dropout-like)."""

    def forward(self, x, targets=None):
        random.random()
        np.random.rand()
        torch.rand(1)
        return super().forward(x, targets)


def test_every_rng_is_restored():
    model = DrawsEverywhere()
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    evaluate(model, ListLoader(_batches()), "cpu", max_batches=3)
    assert random.getstate() == before[0]
    assert np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])


class Fails(Bigram):
    def forward(self, x, targets=None):
        raise RuntimeError("boom")


@pytest.mark.parametrize("was_training", [True, False])
def test_the_training_flag_comes_back_after_an_exception(was_training):
    model = Fails()
    model.train(was_training)
    with pytest.raises(RuntimeError, match="boom"):
        evaluate(model, ListLoader(_batches()), "cpu", max_batches=3)
    assert model.training is was_training
