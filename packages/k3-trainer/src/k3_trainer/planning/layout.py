"""A parallel layout (data/FSDP, expert, pipeline, context) and the checks that refuse
an impossible one, in one place for the planner and the trainer's launch.

Degrees: ``pp`` pipeline ranks (each holding ``stages_per_rank`` stages of
``pp·stages_per_rank`` in all), ``cp`` context-parallel ranks splitting each sequence,
``dp`` data-parallel ranks. FSDP shards over ``dp·cp`` (torchtitan's ``dp_shard_cp``);
expert parallelism folds into it: ``ep`` divides ``dp·cp`` and each routed-expert stack
is split ``ep`` ways, replicated over the other ``dp·cp/ep``. The world is
``dp·cp·pp``.

:func:`validate_layout` is the one decision on whether a layout can run: ``k3-train
plan`` calls it for every layout it sizes or suggests, and ``k3-train train`` through
:func:`check_launch`, which first refuses what this trainer does not run yet (a
combination, a flag without the degree it tunes, a model without the hooks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config import ConfigError, TrainConfig

if TYPE_CHECKING:
    from ..models import ModelSpec

INTERLEAVED = "interleaved-1f1b"
ONE_F_ONE_B = ("1f1b", INTERLEAVED)
"""The schedules that keep at most ``pp`` microbatches in flight, so need that many."""
V_SHAPED = ("zbv", "dualpipev")
"""Schedules of exactly two stages per rank placed in a V (rank r holds stages r and
2P − 1 − r, so the embedding and the head share rank 0); torch's need at least as many
microbatches as stages."""
MULTI_STAGE = (INTERLEAVED, *V_SHAPED)
"""The schedules that run more than one stage per rank."""


def stage_rank(stage: int, pp: int, schedule: str) -> int:
    """The pipeline rank that holds ``stage``: looped (``stage mod pp``), or in a V for
    :data:`V_SHAPED` schedules."""
    if schedule.lower() in V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


class LayoutError(ValueError):
    """A layout that cannot run; the message is one line naming the field and the fix."""


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of one layout and its batch: ``batch_size`` sequences of ``seq_len``
    tokens per data-parallel rank and optimizer step (before gradient accumulation),
    cut into ``microbatches`` for the pipeline; ``grad_accum`` such batches per step."""

    dp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1
    stages_per_rank: int = 1
    microbatches: int = 1
    batch_size: int = 1
    seq_len: int = 4096
    grad_accum: int = 1
    schedule: str = "1f1b"

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.pp

    @property
    def stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def shard_degree(self) -> int:
        """Ranks a non-expert parameter is sharded over (FSDP over ``dp·cp``)."""
        return self.dp * self.cp

    @property
    def bubble(self) -> float:
        """Idle fraction of a 1F1B pipeline step: ``(p − 1)/(v·m + p − 1)`` with ``v``
        stages per rank (``(p − 1)/(m + p − 1)`` without interleaving). For ``zbv`` and
        ``dualpipev`` an upper bound: their split backward fills part of it."""
        p, m, v = self.pp, self.microbatches, self.stages_per_rank
        return (p - 1) / (v * m + p - 1)

    @property
    def global_tokens(self) -> int:
        """Tokens per optimizer step over the whole world."""
        return self.dp * self.batch_size * self.seq_len * self.grad_accum


def stage_blocks(n_blocks: int, stages: int) -> list[range]:
    """Decoder blocks of each pipeline stage: contiguous, as even as possible, the first
    ``n_blocks % stages`` stages one block longer (the embedding rides on stage 0, the
    output norm and ``lm_head`` on the last)."""
    base, extra = divmod(n_blocks, stages)
    out, start = [], 0
    for s in range(stages):
        size = base + (s < extra)
        out.append(range(start, start + size))
        start += size
    return out


def microbatches(config: TrainConfig) -> int:
    """The microbatches a batch is cut into under pipeline stages (``pp_microbatches``,
    default the stage count)."""
    return config.pp_microbatches or config.pipeline_parallel * config.pp_stages_per_rank


def validate_layout(layout: ParallelLayout, *, n_blocks: int | None,
                    world_size: int | None = None, n_experts: int | None = None) -> None:
    """Raise :class:`LayoutError` (one line) for a layout that cannot run: degrees below
    1, a world size that is not ``dp·cp·pp``, ``ep`` not dividing ``dp·cp`` or the
    experts, more stages than decoder blocks (``n_blocks`` None: the model declares
    none), fewer 1F1B microbatches than pipeline ranks, a batch that does not split into
    the microbatches, a sequence ``cp`` does not divide."""
    for name in ("dp", "ep", "pp", "cp", "stages_per_rank", "microbatches", "batch_size",
                 "seq_len", "grad_accum"):
        if getattr(layout, name) < 1:
            raise LayoutError(f"{name} must be ≥ 1, got {getattr(layout, name)}")
    if world_size is not None and world_size != layout.world_size:
        raise LayoutError(
            f"the world size {world_size} is not dp·cp·pp = {layout.dp}·{layout.cp}·"
            f"{layout.pp} = {layout.world_size}; the processes must be a multiple of "
            f"cp·pp = {layout.cp * layout.pp}")
    if layout.shard_degree % layout.ep:
        raise LayoutError(f"ep ({layout.ep}) must divide dp·cp ({layout.shard_degree}): "
                          "expert parallelism splits the data-parallel ranks")
    if n_experts is not None and layout.ep > 1 and n_experts % layout.ep:
        raise LayoutError(f"ep ({layout.ep}) must divide the routed experts ({n_experts})")
    if layout.stages > 1 and layout.stages > (n_blocks or 0):
        raise LayoutError(
            f"pp·stages_per_rank = {layout.stages} stages but the model has {n_blocks or 0} "
            "decoder blocks; use at most one stage per block")
    if layout.pp > 1 and layout.schedule.lower() in ONE_F_ONE_B \
            and layout.microbatches < layout.pp:
        raise LayoutError(
            f"microbatches ({layout.microbatches}) must be ≥ pp ({layout.pp}) for 1F1B; "
            "raise --pp-microbatches")
    if layout.pp > 1 and layout.schedule.lower() in V_SHAPED:
        if layout.stages_per_rank != 2:
            raise LayoutError(f"{layout.schedule} runs exactly 2 stages per rank, got "
                              f"{layout.stages_per_rank}; use --pp-stages-per-rank 2")
        if layout.microbatches < layout.stages:
            raise LayoutError(
                f"microbatches ({layout.microbatches}) must be ≥ the stages "
                f"({layout.stages}) for {layout.schedule}; raise --pp-microbatches")
    if layout.batch_size % layout.microbatches:
        raise LayoutError(
            f"batch_size ({layout.batch_size}) does not split into {layout.microbatches} "
            "microbatches; make it a multiple of --pp-microbatches")
    if layout.seq_len % layout.cp:
        raise LayoutError(f"seq_len ({layout.seq_len}) is not divisible by cp "
                          f"({layout.cp}); make it a multiple of --cp")


def launch_layout(config: TrainConfig, mode: str, world_size: int) -> ParallelLayout:
    """The layout ``world_size`` processes launched with ``config`` make: ``dp`` the
    processes over ``cp·pp``; ``ep`` only under FSDP2 (``mode`` none/ddp/fsdp)."""
    pp, cp = config.pipeline_parallel, config.context_parallel
    return ParallelLayout(
        dp=max(world_size // (pp * cp), 1),
        ep=config.expert_parallel if mode == "fsdp" else 1, pp=pp, cp=cp,
        stages_per_rank=config.pp_stages_per_rank,
        microbatches=microbatches(config) if pp > 1 else 1, batch_size=config.batch_size,
        seq_len=config.seq_len, grad_accum=config.gradient_accumulation_steps,
        schedule=config.pp_schedule)


def check_launch(config: TrainConfig, mode: str, world_size: int, *,
                 n_blocks: int | None, spec: ModelSpec | None = None,
                 model_config: Any = None) -> None:
    """Refuse, in one :class:`~k3_trainer.config.ConfigError` line, a layout ``k3-train
    train`` cannot launch, before any process group exists: what this trainer does not
    run (stages or context parallelism without FSDP2, in-loop downstream tasks with
    experts split but no stages, a model without the hooks: in-loop downstream tasks
    under stages need its logits hook), then :func:`validate_layout`,
    the planner's own decision, on the layout ``world_size`` processes make of
    ``config`` (``mode`` none/ddp/fsdp)."""
    pp, per_rank, cp = config.pipeline_parallel, config.pp_stages_per_rank, config.context_parallel
    if pp == 1 and (per_rank != 1 or config.pp_microbatches is not None):
        raise ConfigError("--pp-stages-per-rank and --pp-microbatches need "
                          "--pipeline-parallel 2 or more")
    for flag, degree in (("--pipeline-parallel", pp), ("--context-parallel", cp)):
        if degree > 1 and mode != "fsdp":
            raise ConfigError(f"{flag} {degree} needs --parallel fsdp (FSDP2 shards the "
                              "parameters over the data ranks; DDP is not supported with it)")
    if pp > 1 and (config.pp_schedule in MULTI_STAGE) != (per_rank > 1):
        raise ConfigError(f"--pp-schedule {config.pp_schedule} needs --pp-stages-per-rank 2 "
                          "or more" if per_rank == 1 else f"--pp-stages-per-rank {per_rank} "
                          f"needs --pp-schedule {INTERLEAVED}, zbv or dualpipev")
    if pp == 1 and config.downstream is not None and config.expert_parallel > 1:
        raise ConfigError("--downstream scores each rank's share of the documents with every "
                          "expert, which --expert-parallel splits over the ranks; score the "
                          "checkpoints afterwards (k3-train eval --tasks), or add pipeline "
                          "stages (--pp), which score through the experts where they live")
    if pp > 1 and config.downstream is not None and spec is not None and (
            spec.pipeline is None or spec.pipeline.logits is None):
        raise ConfigError(f"--downstream with --pipeline-parallel > 1: the model "
                          f"{spec.name!r} declares no logits hook for its last stage; "
                          "score the checkpoints afterwards (k3-train eval --tasks)")
    if cp > 1 and spec is not None:
        if spec.context_parallel is None:
            raise ConfigError(f"--context-parallel: the model {spec.name!r} declares no "
                              "way to split a sequence over ranks")
        spec.context_parallel.check(model_config, config.seq_len, cp)
    try:
        validate_layout(launch_layout(config, mode, world_size), n_blocks=n_blocks,
                        world_size=world_size)
    except LayoutError as refused:
        raise ConfigError(str(refused)) from None
