"""Cautious weight decay (arXiv 2510.12402): decay only where the update agrees.

Decoupled decay shrinks every coordinate toward zero. Cautious decay applies it only to
coordinates whose update already moves them toward zero, i.e. where
``sign(update) == sign(param)`` for an optimizer that steps ``p ← p − lr·update``; the
other coordinates keep their value apart from the update. No new hyperparameter: the
same ``weight_decay``, masked.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def cautious_decay_(params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor],
                    amount: float, *, foreach: bool = True) -> None:
    """``p ← p − amount·[sign(u) = sign(p) ≠ 0]·p`` for each ``p`` and its ``update`` u.

    The mask compares signs (``sign(sign(u)·p)``, so no tiny product underflows to a
    wrong zero), one temporary per tensor; ``amount`` is ``lr·weight_decay``.
    """
    if not params or amount == 0.0:
        return
    if foreach:
        agree = torch._foreach_sign(list(updates))
        torch._foreach_mul_(agree, list(params))  # sign(u)·p: ±p or 0, exact
        torch._foreach_sign_(agree)  # sign(u)·sign(p)
        torch._foreach_clamp_min_(agree, 0.0)  # 1 where the signs agree, else 0
        torch._foreach_addcmul_(list(params), agree, list(params), value=-amount)
        return
    for p, u in zip(params, updates):
        mask = u.sign().mul_(p).sign_().clamp_min_(0.0)
        p.addcmul_(mask, p, value=-amount)
