"""Continuations scored from a forked decoding state equal one full forward per
(context, continuation)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_generate import _config, _model

from k3_model import Continuations, K3Model, score_continuations


def _full(model: K3Model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """log p(continuation | context) and is-greedy from one forward of both (the last
    token is predicted, never read)."""
    ids = torch.tensor([(context + continuation)[:-1]])
    with torch.no_grad():
        logprobs = F.log_softmax(model(ids)[0][0].float(), dim=-1)
    rows = logprobs[len(context) - 1:]
    target = torch.tensor(continuation)
    total = float(rows.gather(-1, target[:, None]).sum())
    return total, bool((rows.argmax(-1) == target).all())


def _requests(seed: int, chunk: int) -> list[Continuations]:
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=generator).tolist()

    return [Continuations(ids(n), [ids(m) for m in lengths]) for n, lengths in (
        (chunk + 1, [1, 3, 7, 2]), (5, [4, 4]), (chunk - 1, [9, 1, 2]), (5, [6]),
        (2 * chunk + 3, [2, 5, 3, 3]))]


@pytest.mark.parametrize("name", ["tiny", "kimi-linear-tiny", "mla-rope", "gqa", "base"])
def test_forked_scores_equal_one_full_forward_per_continuation(name):
    model = _model(_config(name))
    requests = _requests(1, model.config.kda_chunk_size)
    for batch_size in (1, 3):
        got = score_continuations(model, requests, batch_size=batch_size)
        for request, scored in zip(requests, got):
            assert scored.dropped == 0
            for continuation, loglik, greedy in zip(request.continuations, scored.logliks,
                                                    scored.greedy):
                expected, expected_greedy = _full(model, list(request.context),
                                                  list(continuation))
                assert loglik == pytest.approx(expected, rel=1e-5, abs=1e-5)
                assert greedy == expected_greedy


def test_the_greedy_continuation_is_marked_greedy():
    model = _model(_config("tiny"))
    context = [3, 1, 4, 1, 5]
    greedy = model.generate([context], 4, temperature=0)[0]
    (scored,) = score_continuations(model, [Continuations(context, [greedy, greedy[:2],
                                                                   [(greedy[0] + 1) % 256]])])
    assert scored.greedy == [True, True, False]


def test_a_context_beyond_the_window_keeps_its_last_tokens():
    model = _model(_config("tiny").replace(max_seq_len=32))
    generator = torch.Generator().manual_seed(2)
    context = torch.randint(0, 256, (40,), generator=generator).tolist()
    continuations = [[7, 8, 9, 10], [11]]
    (scored,) = score_continuations(model, [Continuations(context, continuations)])
    assert scored.dropped == 40 - (32 - 3)  # the longest continuation's 3 fed tokens fit
    kept = context[scored.dropped:]
    for continuation, loglik in zip(continuations, scored.logliks):
        assert loglik == pytest.approx(_full(model, kept, continuation)[0], rel=1e-5)


@pytest.mark.parametrize(("requests", "message"), [
    ([Continuations([], [[1]])], "non-empty context"),
    ([Continuations([1], [])], "at least one continuation"),
    ([Continuations([1], [[2], []])], "each of at least one token"),
    ([Continuations([1], [[256]])], "outside the vocabulary"),
    ([Continuations([1], [[1] * 600])], "exceeds max_seq_len"),
])
def test_bad_requests_are_refused(requests, message):
    with pytest.raises(ValueError, match=message):
        score_continuations(_model(_config("tiny")), requests)


def test_scoring_leaves_the_model_as_it_was():
    model = _model(_config("base")).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    score_continuations(model, _requests(3, model.config.kda_chunk_size))
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
