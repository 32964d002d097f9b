from __future__ import annotations

import io

import pytest
import torch
from optim_reference import muon_reference_step
from torch import nn

from k3_optim import MuonAdamW, build_parameter_groups


def _grads(shapes, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(*s, dtype=torch.float64, generator=gen) for s in shapes] for _ in range(steps)
    ]


@pytest.mark.parametrize("scale_rule", ["match_rms_adamw", "spectral", "none"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_matches_hand_reference(scale_rule, nesterov):
    shapes = [(12, 20), (20, 12), (4, 6, 10)]
    params = [torch.randn(*s, dtype=torch.float64).requires_grad_() for s in shapes]
    refs = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(r) for r in refs]
    opt = MuonAdamW(
        [{"params": params, "use_muon": True}],
        lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov,
        ns_dtype="fp64", update_scale=scale_rule,
    )
    for grads in _grads(shapes, 3):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads):
            refs[i], bufs[i] = muon_reference_step(
                refs[i], g, bufs[i], lr=0.02, wd=0.1, momentum=0.9, nesterov=nesterov,
                scale_rule=scale_rule, batch=refs[i].ndim == 3,
            )
    for p, r, b in zip(params, refs, bufs):
        torch.testing.assert_close(p.detach(), r, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], b, rtol=1e-12, atol=1e-14)


def test_per_head_and_flatten_match_reference():
    q = torch.randn(24, 16, dtype=torch.float64, requires_grad=True)  # 4 heads of 6 rows
    conv = torch.randn(8, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    opt = MuonAdamW(
        [{"params": [q], "use_muon": True, "num_heads": 4},
         {"params": [conv], "use_muon": True, "flatten": True}],
        lr=0.05, weight_decay=0.0, ns_dtype="fp64", ns_coefficients="polar_express",
    )
    q_ref, conv_ref = q.detach().clone(), conv.detach().clone()
    q_buf, conv_buf = torch.zeros_like(q_ref), torch.zeros_like(conv_ref)
    for gq, gc in _grads([q.shape, conv.shape], 2, seed=3):
        q.grad, conv.grad = gq.clone(), gc.clone()
        opt.step()
        common = dict(lr=0.05, wd=0.0, momentum=0.95, nesterov=True,
                      scale_rule="match_rms_adamw", coefficients="polar_express")
        q_ref, q_buf = muon_reference_step(q_ref, gq, q_buf, num_heads=4, **common)
        conv_ref, conv_buf = muon_reference_step(conv_ref, gc, conv_buf, flatten=True, **common)
    torch.testing.assert_close(q.detach(), q_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(conv.detach(), conv_ref, rtol=1e-10, atol=1e-12)
    # Per-head differs from orthogonalizing the whole matrix.
    whole = muon_reference_step(q.detach(), gq, torch.zeros_like(q_ref), lr=0.05, wd=0.0,
                                momentum=0.95, nesterov=True, scale_rule="none")[0]
    per_head = muon_reference_step(q.detach(), gq, torch.zeros_like(q_ref), lr=0.05, wd=0.0,
                                   momentum=0.95, nesterov=True, scale_rule="none", num_heads=4)[0]
    assert not torch.allclose(whole, per_head)


def test_batched_buckets_equal_one_param_at_a_time():
    shapes = [(16, 32)] * 3 + [(32, 16), (2, 16, 32)]
    grads = _grads(shapes, 2, seed=5)
    together = [torch.randn(*s, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
                .requires_grad_() for i, s in enumerate(shapes)]
    alone = [p.detach().clone().requires_grad_() for p in together]
    opt = MuonAdamW([{"params": together, "use_muon": True}], ns_dtype="fp64")
    opts = [MuonAdamW([{"params": [p], "use_muon": True}], ns_dtype="fp64") for p in alone]
    for step_grads in grads:
        for p, q, g in zip(together, alone, step_grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        for o in opts:
            o.step()
    for p, q in zip(together, alone):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_adamw_groups_match_torch_adamw_bitwise():
    torch.manual_seed(0)
    a = [torch.randn(7, 5, requires_grad=True), torch.randn(5, requires_grad=True)]
    b = [p.detach().clone().requires_grad_() for p in a]
    hp = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours = MuonAdamW([{"params": a, "use_muon": False}], **hp)
    theirs = torch.optim.AdamW(b, **hp)
    for _ in range(5):
        grads = [torch.randn_like(p) for p in a]
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert torch.equal(ours.state[p]["exp_avg_sq"], theirs.state[q]["exp_avg_sq"])


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32),
                         nn.Linear(32, 16, bias=False), nn.Linear(16, 50))


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 50, (4, 6), generator=gen)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_state_dict_round_trip_is_bitwise():
    model = _tiny_model()
    opt = MuonAdamW(build_parameter_groups(model), lr=0.01)
    _train(model, opt, 3, seed=1)
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, blob)
    _train(model, opt, 3, seed=2)  # the uninterrupted run

    blob.seek(0)
    saved = torch.load(blob, weights_only=True)
    resumed = _tiny_model(seed=99)
    resumed.load_state_dict(saved["model"])
    # A different lr here: the effective hyperparameters come from the saved state.
    resumed_opt = MuonAdamW(build_parameter_groups(resumed), lr=0.5)
    resumed_opt.load_state_dict(saved["opt"])
    _train(resumed, resumed_opt, 3, seed=2)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


def test_params_without_grad_are_untouched():
    used = torch.randn(8, 8, requires_grad=True)
    unused = torch.randn(8, 8, requires_grad=True)
    bias = torch.randn(8, requires_grad=True)
    before = unused.detach().clone(), bias.detach().clone()
    opt = MuonAdamW([{"params": [used, unused], "use_muon": True},
                     {"params": [bias], "use_muon": False}], weight_decay=0.5)
    used.grad = torch.randn(8, 8)
    opt.step()
    assert torch.equal(unused, before[0]) and torch.equal(bias, before[1])
    assert unused not in opt.state and bias not in opt.state
    assert used in opt.state


def test_grad_scaler_lr_scheduler_and_zero_grad():
    model = _tiny_model()
    opt = MuonAdamW(build_parameter_groups(model), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randint(0, 50, (2, 5))
    for _ in range(2):
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        scaler.scale(loss).backward()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        sched.step()
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert all(p.grad is None for p in model.parameters())
    assert all(g["lr"] == pytest.approx(0.0025) for g in opt.param_groups)
    # An inf gradient makes the scaler skip the step: nothing changes.
    before = [p.detach().clone() for p in model.parameters()]
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    scaler.scale(loss).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    scaler.step(opt)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_scheduler_lr_reaches_the_update():
    def run(lr):
        p = torch.ones(6, 6, dtype=torch.float64, requires_grad=True)
        opt = MuonAdamW([{"params": [p], "use_muon": True}], lr=lr, weight_decay=0.0)
        p.grad = torch.eye(6, dtype=torch.float64)
        opt.step()
        return p.detach() - 1.0

    torch.testing.assert_close(run(0.2), 2.0 * run(0.1))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ns_dtype": "fp16"}, "dtype"),
        ({"ns_coefficients": "cubic"}, "coefficient set"),
        ({"update_scale": "rms"}, "update_scale"),
        ({"lr": -1.0}, "lr"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"momentum": 1.0}, "momentum"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"eps": float("nan")}, "eps"),
        ({"ns_steps": 0}, "steps"),
    ],
)
def test_bad_hyperparameters_raise(kwargs, match):
    p = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match=match):
        MuonAdamW([{"params": [p], "use_muon": True}], **kwargs)
    with pytest.raises(ValueError, match=match):  # the same checks per group
        MuonAdamW([{"params": [p], "use_muon": True, **kwargs}])


def test_bad_groups_raise():
    vec = torch.randn(4, requires_grad=True)
    with pytest.raises(ValueError, match="use_muon"):
        MuonAdamW([torch.randn(3, 3, requires_grad=True)])
    with pytest.raises(ValueError, match="at least 2 dims"):
        MuonAdamW([{"params": [vec], "use_muon": True}])
    with pytest.raises(ValueError, match="num_heads"):
        MuonAdamW([{"params": [torch.randn(6, 4, requires_grad=True)], "use_muon": True,
                    "num_heads": 4}])


def test_complex_and_sparse_gradients_raise():
    p = torch.randn(4, 4, requires_grad=True)
    opt = MuonAdamW([{"params": [p], "use_muon": True}])
    p.grad = torch.randn(4, 4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    e = torch.randn(4, 4, dtype=torch.complex64, requires_grad=True)
    opt = MuonAdamW([{"params": [e], "use_muon": False}])
    e.grad = torch.randn(4, 4, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match="complex"):
        opt.step()
