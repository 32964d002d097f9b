"""``TrainConfig``: the recipe of a training run, as validated plain data."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("constant", "cosine")
NS_DTYPES = ("auto", "bf16", "fp32", "fp64")
ACTIVATION_CHECKPOINTING = ("none", "block")


def choices() -> dict[str, tuple[str, ...]]:
    """The allowed values of every string field. Muon's coefficient sets and update scales
    (k3-optim) and QK-Clip's GQA modes (k3-qkclip) come from the packages that implement
    them, so a mode added there is accepted here without a second list; they are imported
    here, not at module import, so the command line answers without importing torch."""
    from k3_optim import COEFFICIENT_SETS, UPDATE_SCALES
    from k3_qkclip import GQA_MODES

    return {"precision": PRECISIONS, "lr_schedule": SCHEDULES, "muon_ns_dtype": NS_DTYPES,
            "muon_ns_coefficients": tuple(COEFFICIENT_SETS),
            "muon_update_scale": tuple(UPDATE_SCALES), "qk_clip_gqa": tuple(GQA_MODES),
            "activation_checkpointing": ACTIVATION_CHECKPOINTING}


class ConfigError(ValueError):
    """A TrainConfig field has an invalid value; the message names the field."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run's recipe, as plain data.

    Intervals and ``max_steps`` count *successful* optimizer updates. ``max_grad_norm=0``
    disables ordinary gradient-norm clipping. ``muon_ns_dtype`` is independent of the
    parameter dtype (parameters stay fp32 masters under bf16/fp16 autocast).
    """

    # batch geometry
    batch_size: int = 16
    seq_len: int = 128
    gradient_accumulation_steps: int = 1
    # optimizer (one peak LR and weight decay for every group: Muon uses match_rms_adamw)
    peak_lr: float = 3e-3
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_ns_dtype: str = "auto"
    muon_ns_coefficients: str = "jordan"
    muon_update_scale: str = "match_rms_adamw"
    max_grad_norm: float = 1.0
    # schedule
    lr_schedule: str = "cosine"
    warmup_steps: int | None = None  # None: min(20, decay_steps // 10)
    decay_steps: int | None = None  # None: max_steps (resolved once, then fixed)
    min_lr_ratio: float = 0.1
    # run length and intervals (successful steps)
    max_steps: int = 300
    log_interval: int = 10
    eval_interval: int = 100
    checkpoint_interval: int = 100
    eval_batches: int = 8
    # precision and QK-Clip
    precision: str = "fp32"
    qk_clip_enabled: bool = True
    qk_clip_tau: float = 100.0
    qk_clip_gqa: str = "query_only"
    # speed (no effect on the trajectory but compile's rounding; see k3_trainer.compiling)
    compile: bool = False  # torch.compile each decoder block (regional); off by default
    activation_checkpointing: str = "none"  # "block": recompute each block in backward
    # reproducibility and debugging
    seed: int = 1337
    overfit_batch: bool = False

    def __post_init__(self) -> None:
        # The cosine horizon defaults to this run's length, and warmup to a tenth of the
        # horizon (at most 20 steps); both are then stored as numbers, so extending
        # max_steps on resume moves neither, and a session that names the planned horizon
        # (--decay-steps) warms up exactly as the uninterrupted run would.
        if isinstance(self.max_steps, int) and not isinstance(self.max_steps, bool):
            if self.decay_steps is None:
                object.__setattr__(self, "decay_steps", self.max_steps)
            if self.warmup_steps is None and isinstance(self.decay_steps, int):
                object.__setattr__(self, "warmup_steps", min(20, self.decay_steps // 10))
        for name in ("batch_size", "seq_len", "gradient_accumulation_steps", "muon_ns_steps",
                     "max_steps", "log_interval", "eval_interval", "checkpoint_interval",
                     "eval_batches", "decay_steps"):
            _positive_int(self, name)
        _int(self, "warmup_steps", low=0)
        _int(self, "seed", low=0)
        for name in ("peak_lr", "qk_clip_tau"):
            _number(self, name, low=0.0, low_open=True)
        for name in ("weight_decay", "max_grad_norm", "adam_eps"):
            _number(self, name, low=0.0)
        for name in ("adam_beta1", "adam_beta2", "muon_momentum"):
            _number(self, name, low=0.0, high=1.0)
        _number(self, "min_lr_ratio", low=0.0, high=1.0, high_closed=True)
        for name in ("muon_nesterov", "qk_clip_enabled", "overfit_batch", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name, allowed in choices().items():
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        if self.lr_schedule == "cosine" and self.warmup_steps >= self.decay_steps:  # type: ignore[operator]
            raise ConfigError(
                f"warmup_steps ({self.warmup_steps}) must be smaller than decay_steps "
                f"({self.decay_steps}) for the cosine schedule"
            )

    @property
    def tokens_per_update(self) -> int:
        return self.batch_size * self.seq_len * self.gradient_accumulation_steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from plain data, rejecting unknown keys by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown TrainConfig field(s): {', '.join(unknown)}")
        return cls(**data)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def _int(cfg: TrainConfig, name: str, *, low: int) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")


def _positive_int(cfg: TrainConfig, name: str) -> None:
    _int(cfg, name, low=1)


def _number(cfg: TrainConfig, name: str, *, low: float, high: float | None = None,
            low_open: bool = False, high_closed: bool = False) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if value < low or (low_open and value == low):
        raise ConfigError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and (value > high or (value == high and not high_closed)):
        raise ConfigError(f"{name} must be {'<=' if high_closed else '<'} {high}, got {value!r}")
