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


def normuon_reference(O, v, *, beta2, eps, rows_per_block, flatten=False):
    """NorMuon (DESIGN §11) on one parameter's orthogonalized update, row by row in
    float64: the EMA of each row's mean square, each row divided by its root plus eps,
    each block of ``rows_per_block`` rows rescaled to its norm before. Returns (new_O,
    new_v)."""
    rows = (O.reshape(O.shape[0], -1) if flatten else O.reshape(-1, O.shape[-1])).double()
    v = beta2 * v.reshape(-1).double() + (1.0 - beta2) * (rows * rows).mean(dim=1)
    out = torch.empty_like(rows)
    for start in range(0, rows.shape[0], rows_per_block):
        block = rows[start:start + rows_per_block]
        normed = block / (torch.sqrt(v[start:start + rows_per_block]) + eps)[:, None]
        out[start:start + rows_per_block] = normed * torch.sqrt((block * block).sum()
                                                                / (normed * normed).sum())
    return out.reshape(O.shape), v


def muon_reference_step(p, g, buf, *, lr, wd, momentum, nesterov, scale_rule, num_heads=None,
                        batch=False, flatten=False, coefficients="jordan", steps=5,
                        normuon=None, cautious=False):
    """One Muon step on float64 tensors; returns (new_p, new_buf), or (new_p, new_buf,
    new_v) with ``normuon={"v": v, "beta2": b, "eps": e}``. ``cautious``: decay only
    where the final update and ``p`` have the same sign."""
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
    v = None
    if normuon is not None:
        ortho, v = normuon_reference(ortho, normuon["v"], beta2=normuon["beta2"],
                                     eps=normuon["eps"], rows_per_block=rows, flatten=flatten)
    if cautious:
        agree = [1.0 if u * q > 0 else 0.0
                 for u, q in zip(ortho.reshape(-1).tolist(), p.reshape(-1).tolist())]
        mask = torch.tensor(agree, dtype=p.dtype).reshape(p.shape)
        new_p = p - lr * wd * mask * p - lr * scale * ortho
    else:
        new_p = p * (1.0 - lr * wd) - lr * scale * ortho
    return (new_p, buf) if v is None else (new_p, buf, v.reshape(normuon["v"].shape))
