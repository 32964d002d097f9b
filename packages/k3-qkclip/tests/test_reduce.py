"""The data-parallel hook: observations are MAX-reduced over ranks before validation, so
every rank clips by the maxima of all of them (a fake reduction stands in for the others)."""

from __future__ import annotations

import math

import pytest
import torch

from k3_qkclip import QKClip, QKClipPolicy


def test_reduced_maxima_decide_validation_and_clipping(make, make_batch, observe_logits):
    model, x = make("mha"), make_batch()
    s = observe_logits(model, x)[""]
    tau = float(s.max()) + 1.0  # this rank alone would clip nothing
    other = torch.full_like(s, -math.inf)
    other[0] = tau * 2  # "another rank" saw head 0 at twice τ
    calls = []

    def reduce_max(t: torch.Tensor) -> None:
        calls.append(t.clone())
        torch.maximum(t, other, out=t)

    with QKClip(model, QKClipPolicy(tau=tau), reduce_max=reduce_max) as clip:
        clip.reset()
        model(x).sum().backward()
        clip.validate(bool(clip.nonfinite()))
        report = clip.apply()
    assert len(calls) == 1 and torch.equal(calls[0], s)  # one collective, of this rank's maxima
    reduced = report.modules[""].max_logits
    assert reduced[0] == tau * 2 and torch.equal(reduced[1:], s[1:])
    assert report.modules[""].heads_clipped == 1
    assert report.modules[""].min_gamma == pytest.approx(0.5)


def test_a_nonfinite_maximum_on_another_rank_is_refused_here(make, make_batch):
    model, x = make("mha"), make_batch()

    def reduce_max(t: torch.Tensor) -> None:
        t[1] = math.inf

    with QKClip(model, QKClipPolicy(), reduce_max=reduce_max) as clip:
        clip.reset()
        model(x).sum().backward()
        with pytest.raises(FloatingPointError, match="head 1"):
            clip.validate()
