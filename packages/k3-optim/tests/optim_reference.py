"""Independent float64 references for the tests: one matrix at a time, plain loops."""

from __future__ import annotations

import math

import torch

from k3_optim import COEFFICIENT_SETS, POLAR_EXPRESS_SAFETY


def ns_reference(G: torch.Tensor, coefficients="jordan", steps=5, eps=1e-7) -> torch.Tensor:
    """The quintic iteration of DESIGN §3 on one matrix, in float64."""
    if isinstance(coefficients, str):
        triples = COEFFICIENT_SETS[coefficients]
        factor = POLAR_EXPRESS_SAFETY if coefficients == "polar_express" else 1.0
    else:
        triples, factor = coefficients, 1.0
    X = G.to(torch.float64).clone()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    X = X / (torch.sqrt((X * X).sum()) * factor + eps)
    for i in range(steps):
        a, b, c = triples[min(i, len(triples) - 1)]
        A = X @ X.T
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.T if tall else X


def muon_reference_step(p, g, buf, *, lr, wd, momentum, nesterov, scale_rule, num_heads=None,
                        batch=False, flatten=False, coefficients="jordan", steps=5):
    """One Muon step on float64 tensors; returns (new_p, new_buf)."""
    buf = momentum * buf + (1.0 - momentum) * g
    u = (1.0 - momentum) * g + momentum * buf if nesterov else buf
    if num_heads:
        mats = u.reshape(num_heads, u.shape[0] // num_heads, u.shape[1])
    elif u.ndim == 2:
        mats = u[None]
    elif flatten:
        mats = u.reshape(1, u.shape[0], -1)
    else:
        assert batch
        mats = u.reshape(-1, u.shape[-2], u.shape[-1])
    rows, cols = mats.shape[1], mats.shape[2]
    ortho = torch.stack([ns_reference(m, coefficients, steps) for m in mats]).reshape(p.shape)
    scale = {
        "match_rms_adamw": 0.2 * math.sqrt(max(rows, cols)),
        "spectral": math.sqrt(max(1.0, rows / cols)),
        "none": 1.0,
    }[scale_rule]
    return p * (1.0 - lr * wd) - lr * scale * ortho, buf
