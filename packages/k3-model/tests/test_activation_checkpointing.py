"""Activation checkpointing ("block"): bitwise the training of "none", with less saved."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from k3_model import K3Model
from k3_qkclip import QKClip, QKClipPolicy


def _train(model: K3Model, steps: int, make_tokens) -> list[Tensor]:
    """``steps`` AdamW updates with QK-Clip observing and clipping; the losses. (k3-model
    does not depend on k3-optim; tests/ repeats this with MuonAdamW and the trainer.)"""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    with QKClip(model, QKClipPolicy(tau=1.0)) as qk_clip:  # low τ: clipping happens
        for step in range(steps):
            qk_clip.reset()
            x, y = make_tokens(t=12, seed=10 + step), make_tokens(t=12, seed=20 + step)
            _, loss = model(x, targets=y)
            loss.backward()
            optimizer.step()
            qk_clip.apply()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("kind", ["k3", "hybrid", "mla"])
def test_block_checkpointing_trains_bitwise_like_none(kind: str, make_model,
                                                      make_tokens) -> None:
    plain = make_model(kind, moe_balance_rate=0.5, loss_chunk_size=7 if kind == "k3" else 0)
    ckpt = make_model(kind, moe_balance_rate=0.5, loss_chunk_size=7 if kind == "k3" else 0)
    ckpt.load_state_dict(plain.state_dict())
    for moe in ckpt.moe_layers().values():
        moe.collect_stats = True
    for moe in plain.moe_layers().values():
        moe.collect_stats = True
    ckpt.set_activation_checkpointing("block")
    want = _train(plain, 4, make_tokens)
    got = _train(ckpt, 4, make_tokens)
    assert torch.equal(torch.stack(got), torch.stack(want))
    plain_state, ckpt_state = plain.state_dict(), ckpt.state_dict()
    assert plain_state.keys() == ckpt_state.keys()
    for name, value in plain_state.items():
        assert torch.equal(ckpt_state[name], value), name
    # The balancer moved (so replaying its choices mattered) and counted each forward once.
    biases = [m.balancer.bias for m in plain.moe_layers().values()]
    assert any(b.abs().sum() > 0 for b in biases)
    for name, moe in ckpt.moe_layers().items():
        assert int(moe.balancer.updates) == 4
        stats, expected = moe.pop_stats(), plain.moe_layers()[name].pop_stats()
        assert stats is not None and expected is not None
        assert stats.forwards == 4 and torch.equal(stats.tokens_per_expert,
                                                   expected.tokens_per_expert)


def test_gradients_bitwise_equal_and_mode_switches_live(make_model, make_tokens) -> None:
    model = make_model("k3")
    x, y = make_tokens(t=12), make_tokens(t=12, seed=2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {}
    for mode in ("none", "block"):
        model.load_state_dict(state)  # the balancer state too: both runs route alike
        model.set_activation_checkpointing(mode)
        assert model.activation_checkpointing == mode
        model.zero_grad(set_to_none=True)
        model(x, targets=y)[1].backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()
                       if p.grad is not None}
        assert model.state_dict().keys() == state.keys()
    assert grads["none"].keys() == grads["block"].keys()
    for name, g in grads["none"].items():
        assert torch.equal(grads["block"][name], g), name


def test_rejects_unknown_mode(make_model) -> None:
    with pytest.raises(ValueError, match="none, block"):
        make_model().set_activation_checkpointing("full")


def test_eval_and_no_grad_forwards_are_untouched(make_model, make_tokens) -> None:
    model = make_model("k3").eval()
    x = make_tokens(t=12)
    want = model(x)[0]
    model.set_activation_checkpointing("block")
    torch.testing.assert_close(model(x)[0], want, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], want, rtol=0, atol=0)


def forward_bytes(model: K3Model, x: Tensor, y: Tensor) -> int:
    """Bytes allocated by the training forward and still alive after it (what the graph
    keeps for the backward, plus the loss): the profiler's net allocations. Deterministic
    for fixed shapes, unlike a timing."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(x, targets=y)[1]
    loss.backward()
    return sum(event.self_cpu_memory_usage for event in prof.key_averages())


@pytest.mark.parametrize("kind", ["k3", "mla"])
def test_keeps_at_least_half_less_after_the_forward(kind: str, make_model,
                                                    make_tokens) -> None:
    model = make_model(kind, n_layers=4)
    x, y = make_tokens(b=4, t=32), make_tokens(b=4, t=32, seed=2)
    plain = forward_bytes(model, x, y)
    model.set_activation_checkpointing("block")
    block = forward_bytes(model, x, y)
    assert 0 < 2 * block <= plain  # measured: 21x (k3) and 11x (mla) less


def test_no_host_read_with_chunked_loss_and_checkpointing(make_model, make_tokens,
                                                          monkeypatch) -> None:
    """Neither feature adds a device→host read to a training forward+backward."""
    model = make_model("k3", loss_chunk_size=5).train()
    model.set_activation_checkpointing("block")
    x, y = make_tokens(t=12), make_tokens(t=12, seed=2)
    reads: list[str] = []
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__",
                 "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    model(x, targets=y)[1].backward()
    monkeypatch.undo()
    assert reads == []
