"""Optimizer assembly: one MuonAdamW over every parameter group of the model."""

from __future__ import annotations

from torch import nn

from k3_optim import MuonAdamW, build_parameter_groups

from .config import TrainConfig


def build_optimizer(model: nn.Module, config: TrainConfig) -> MuonAdamW:
    """Nesterov Muon for hidden matrices, AdamW for the rest, in one optimizer.

    Every group starts at ``peak_lr``; the loop assigns the scheduled LR to all groups
    before each attempted update (``match_rms_adamw`` makes one LR right for both halves).
    A model may name per-head Q/K/V weights with ``muon_per_head() -> {pattern: heads}``.
    """
    per_head_fn = getattr(model, "muon_per_head", None)
    groups = build_parameter_groups(
        model,
        lr=config.peak_lr,
        weight_decay=config.weight_decay,
        per_head=per_head_fn() if callable(per_head_fn) else None,
    )
    return MuonAdamW(
        groups,
        lr=config.peak_lr,
        weight_decay=config.weight_decay,
        momentum=config.muon_momentum,
        nesterov=config.muon_nesterov,
        ns_steps=config.muon_ns_steps,
        ns_dtype=config.muon_ns_dtype,
        ns_coefficients=config.muon_ns_coefficients,
        update_scale=config.muon_update_scale,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
    )
