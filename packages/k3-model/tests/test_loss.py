"""Chunked cross-entropy: the plain loss and gradients, without the logits tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from k3_model import K3Config, chunked_cross_entropy


def _inputs(n: int = 2, t: int = 13, d: int = 16, vocab: int = 50, masked: bool = True,
            dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, t, d, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, d, generator=gen, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (n, t), generator=gen)
    if masked:
        targets[0, :5] = -100
        targets[1, -1] = -100
    return hidden, weight, targets


def _plain(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float().flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("chunk", [1, 5, 7, 26, 1000])  # uneven last chunk; chunk > tokens
@pytest.mark.parametrize("masked", [False, True])
def test_equals_plain_loss_and_gradients(chunk: int, masked: bool) -> None:
    hidden, weight, targets = _inputs(masked=masked, dtype=torch.float32)
    want = _plain(hidden, weight, targets)
    want_h, want_w = torch.autograd.grad(want, (hidden, weight))
    got = chunked_cross_entropy(hidden, weight, targets, chunk)
    got_h, got_w = torch.autograd.grad(got, (hidden, weight))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_h, want_h, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-6)


def test_upstream_gradient_scales_and_all_masked_is_nan() -> None:
    hidden, weight, targets = _inputs(dtype=torch.float32)
    (3.0 * chunked_cross_entropy(hidden, weight, targets, 4)).backward()
    want_h = torch.autograd.grad(3.0 * _plain(hidden, weight, targets), hidden)[0]
    torch.testing.assert_close(hidden.grad, want_h, rtol=0, atol=1e-6)
    assert chunked_cross_entropy(hidden, weight, torch.full_like(targets, -100), 4).isnan()


def test_bf16_autocast_matches_the_plain_path() -> None:
    hidden, weight, targets = _inputs(t=8, vocab=40, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(F.linear(hidden, weight).float().flatten(0, 1),
                               targets.flatten())
        got = chunked_cross_entropy(hidden, weight, targets, 3)
    assert got.dtype == torch.float32
    want_h, want_w = torch.autograd.grad(want, (hidden, weight))
    got_h, got_w = torch.autograd.grad(got, (hidden, weight))
    assert got_h.dtype == hidden.dtype and got_w.dtype == weight.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # same bf16 logits
    torch.testing.assert_close(got_h, want_h, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(got_w, want_w, rtol=2e-2, atol=2e-3)


def test_rejects_bad_arguments() -> None:
    hidden, weight, targets = _inputs()
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_cross_entropy(hidden, weight, targets, 0)
    with pytest.raises(ValueError, match="targets"):
        chunked_cross_entropy(hidden, weight, targets[:, :-1], 4)
    with pytest.raises(ValueError, match="loss_chunk_size"):
        K3Config(loss_chunk_size=-1)


def test_model_loss_and_gradients_match_the_plain_model(make_model, make_tokens) -> None:
    x = make_tokens(t=12)
    y = make_tokens(t=12, seed=2)
    y[0, :3] = -100
    plain = make_model("k3")
    chunked = make_model("k3", loss_chunk_size=5)
    chunked.load_state_dict(plain.state_dict())
    logits, want = plain(x, targets=y)
    none, got = chunked(x, targets=y)
    assert logits is not None and none is None  # the chunked path has no logits to return
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    want.backward()
    got.backward()
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters(), strict=True):
        assert q.grad is not None and p.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6, msg=name)
    plain.eval(), chunked.eval()  # the training forwards moved both balancers alike
    sampled, _ = chunked(x)  # without targets the logits are there
    torch.testing.assert_close(sampled, plain(x)[0], rtol=0, atol=0)


def saved_bytes(fn: object) -> int:
    """Bytes of the tensors autograd saves for the backward while ``fn()`` runs."""
    total = 0

    def pack(t: Tensor) -> Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()  # type: ignore[operator]
    return total


def test_saves_far_less_than_the_logits_at_a_large_vocabulary() -> None:
    vocab, t, d = 32768, 1024, 64
    hidden = torch.randn(t, d, requires_grad=True)
    weight = torch.randn(vocab, d, requires_grad=True)
    targets = torch.randint(0, vocab, (t,))
    plain = saved_bytes(lambda: _plain(hidden[None], weight, targets[None]))
    chunked = saved_bytes(lambda: chunked_cross_entropy(hidden, weight, targets, 128))
    logits_fp32 = t * vocab * 4
    assert plain >= logits_fp32  # the plain path keeps at least the fp32 logits
    assert plain - chunked >= logits_fp32
    # What it keeps: its inputs (hidden, weight, targets) plus a few floats per token.
    assert chunked <= hidden.nbytes + weight.nbytes + 4 * t * 8
