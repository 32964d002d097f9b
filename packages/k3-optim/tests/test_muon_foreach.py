"""The foreach Muon step equals a plain per-parameter reference, in every layout.

One optimizer holds the layouts a K3 model has — same-shape matrices sharing a bucket,
a tall matrix (its own bucket, iterated on its right side) beside its wide twin, an MoE
expert stack, per-head Q/K blocks — and its fp64 result after a few steps must equal
``optim_reference.muon_reference_step`` applied to each parameter alone.
"""

from __future__ import annotations

import pytest
import torch
from optim_reference import muon_reference_step

from k3_optim import MuonAdamW

# name: (shape, reference layout kwargs, param group key)
LAYOUT = {
    "w1": ((16, 32), {}, "plain"),
    "w2": ((16, 32), {}, "plain"),
    "tall": ((32, 16), {}, "plain"),  # w1/w2's shape transposed: its own bucket, X·h(XᵀX)
    "experts": ((3, 16, 32), {"batch": True}, "plain"),  # 3 more matrices of that bucket
    "odd": ((5, 7), {}, "plain"),
    "q": ((24, 16), {"num_heads": 4}, "heads"),  # 4 per-head 6×16 blocks
    "k": ((12, 16), {"num_heads": 4}, "kv_heads"),  # 4 blocks of 3×16
}


def _run(*, nesterov: bool, weight_decay: float, foreach: bool, steps: int = 3):
    gen = torch.Generator().manual_seed(7)
    params = {n: torch.randn(*s, dtype=torch.float64, generator=gen).requires_grad_()
              for n, (s, _, _) in LAYOUT.items()}
    groups = [
        {"params": [params[n] for n, v in LAYOUT.items() if v[2] == "plain"], "use_muon": True},
        {"params": [params["q"]], "use_muon": True, "num_heads": 4},
        {"params": [params["k"]], "use_muon": True, "num_heads": 4},
    ]
    opt = MuonAdamW(groups, lr=0.03, weight_decay=weight_decay, momentum=0.9,
                    nesterov=nesterov, ns_dtype="fp64")
    opt._foreach = foreach
    refs = {n: p.detach().clone() for n, p in params.items()}
    bufs = {n: torch.zeros_like(r) for n, r in refs.items()}
    for _ in range(steps):
        grads = {n: torch.randn(p.shape, dtype=torch.float64, generator=gen)
                 for n, p in params.items()}
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()
        for n, (_, layout, _) in LAYOUT.items():
            refs[n], bufs[n] = muon_reference_step(
                refs[n], grads[n], bufs[n], lr=0.03, wd=weight_decay, momentum=0.9,
                nesterov=nesterov, scale_rule="match_rms_adamw", **layout)
    return params, opt, refs, bufs


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_step_equals_per_parameter_reference(nesterov, weight_decay, foreach):
    params, opt, refs, bufs = _run(nesterov=nesterov, weight_decay=weight_decay,
                                   foreach=foreach)
    for n, p in params.items():
        torch.testing.assert_close(p.detach(), refs[n], rtol=1e-12, atol=1e-13, msg=n)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], bufs[n], rtol=1e-14,
                                   atol=1e-15, msg=n)


def test_foreach_and_per_tensor_paths_are_bitwise_equal():
    fast = _run(nesterov=True, weight_decay=0.1, foreach=True)[0]
    slow = _run(nesterov=True, weight_decay=0.1, foreach=False)[0]
    for n in LAYOUT:
        assert torch.equal(fast[n], slow[n]), n
