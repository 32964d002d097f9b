"""Optimizer assembly: one MuonAdamW over every parameter group of the model."""

from __future__ import annotations

import logging

from torch import nn

from k3_optim import MuonAdamW, build_parameter_groups, check_parameter_groups

from .config import TrainConfig
from .contract import read_contract

logger = logging.getLogger(__name__)


def build_optimizer(model: nn.Module, config: TrainConfig, *,
                    distributed: bool | None = None, stage: bool = False) -> MuonAdamW:
    """Nesterov Muon for hidden matrices, AdamW for the rest, in one optimizer.

    Every group starts at ``peak_lr``; the loop assigns the scheduled LR to all groups
    before each attempted update (``match_rms_adamw`` makes one LR right for both halves).
    A model that declares its groups (``parameter_groups(lr=, weight_decay=) -> [dict]``
    of the model contract, as ``k3_model.K3Model`` does) is taken at its word, after
    checking that every trainable parameter is in exactly one group. Any other model gets
    ``k3_optim.build_parameter_groups``' name/shape guess, which logs what it decided (a
    model that wants per-head Muon declares its groups).

    ``distributed`` is MuonAdamW's: None detects FSDP2's DTensor parameters (build the
    optimizer after ``fully_shard``); True for DDP's replicated parameters, so each
    matrix is orthogonalized by one rank instead of by all.

    ``stage``: ``model`` is one pipeline stage's cut, whose declared groups may be empty
    (no MLA layer on this stage): those are dropped, since a sharded checkpoint keys a
    group's settings by its parameters' names and could not restore an empty one.
    """
    groups = read_contract(model).parameter_groups(config.peak_lr, config.weight_decay)
    if groups is not None:
        check_parameter_groups(model, groups)
    else:
        logger.info(
            "%s declares no parameter_groups(); routing its parameters by name and shape",
            type(model).__name__,
        )
        groups = build_parameter_groups(model, lr=config.peak_lr,
                                        weight_decay=config.weight_decay)
    if stage:
        groups = [group for group in groups if list(group["params"])]
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
        normuon=config.muon_normuon,
        cautious_weight_decay=config.cautious_weight_decay,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        distributed=distributed,
    )
