"""A parallel layout (data/FSDP, expert, pipeline, context) and the checks that refuse
an impossible one, in one place for the planner and the trainer's launch.

Degrees: ``pp`` pipeline ranks (each holding ``stages_per_rank`` stages of
``pp·stages_per_rank`` in all), ``cp`` context-parallel ranks splitting each sequence,
``dp`` data-parallel ranks. FSDP shards over ``dp·cp`` (torchtitan's ``dp_shard_cp``);
expert parallelism folds into it: ``ep`` divides ``dp·cp`` and each routed-expert stack
is split ``ep`` ways, replicated over the other ``dp·cp/ep``. The world is
``dp·cp·pp``.
"""

from __future__ import annotations

from dataclasses import dataclass


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
        stages per rank (``(p − 1)/(m + p − 1)`` without interleaving)."""
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


def validate_layout(layout: ParallelLayout, *, n_blocks: int, world_size: int | None = None,
                    n_experts: int | None = None) -> None:
    """Raise :class:`LayoutError` (one line) for a layout that cannot run: degrees below
    1, a world size that is not ``dp·cp·pp``, ``ep`` not dividing ``dp·cp`` or the
    experts, fewer decoder blocks than stages, fewer 1F1B microbatches than pipeline
    ranks, a batch that does not split into the microbatches, a sequence ``cp`` does not
    divide."""
    for name in ("dp", "ep", "pp", "cp", "stages_per_rank", "microbatches", "batch_size",
                 "seq_len", "grad_accum"):
        if getattr(layout, name) < 1:
            raise LayoutError(f"{name} must be ≥ 1, got {getattr(layout, name)}")
    if world_size is not None and world_size != layout.world_size:
        raise LayoutError(
            f"the world size {world_size} is not dp·cp·pp = {layout.dp}·{layout.cp}·"
            f"{layout.pp} = {layout.world_size}; change --dp, --cp or --pp so their product "
            f"is {world_size}")
    if layout.shard_degree % layout.ep:
        raise LayoutError(f"ep ({layout.ep}) must divide dp·cp ({layout.shard_degree}): "
                          "expert parallelism splits the data-parallel ranks")
    if n_experts is not None and layout.ep > 1 and n_experts % layout.ep:
        raise LayoutError(f"ep ({layout.ep}) must divide the routed experts ({n_experts})")
    if layout.stages > n_blocks:
        raise LayoutError(
            f"pp·stages_per_rank = {layout.stages} stages but the model has {n_blocks} "
            "decoder blocks; use at most one stage per block")
    if layout.pp > 1 and layout.schedule.lower() in ("1f1b", "interleaved1f1b") \
            and layout.microbatches < layout.pp:
        raise LayoutError(
            f"microbatches ({layout.microbatches}) must be ≥ pp ({layout.pp}) for 1F1B; "
            "raise --pp-microbatches")
    if layout.batch_size % layout.microbatches:
        raise LayoutError(
            f"batch_size ({layout.batch_size}) does not split into {layout.microbatches} "
            "microbatches; make it a multiple of --pp-microbatches")
    if layout.seq_len % layout.cp:
        raise LayoutError(f"seq_len ({layout.seq_len}) is not divisible by cp "
                          f"({layout.cp}); make it a multiple of --cp")
