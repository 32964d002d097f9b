"""The plan of one layout: per pipeline stage's most loaded rank, the memory it needs;
per step, the FLOPs, the time at an assumed MFU and the tokens per second.

Memory of a rank = model state (:mod:`.memory`) + activations of the microbatches in
flight (:mod:`.activations`; 1F1B keeps ``min(m, pp − r)`` on pipeline rank ``r``,
without a pipeline one; interleaved 1F1B with ``v`` stages per rank warms up with more,
Megatron-LM's factor ``1 + (p − 1)/(p·v)`` of the first rank, applied to every rank) +
transient buffers where known (FSDP's gathered block and its
prefetch, the expert all-to-all's send and receive rows, the recomputed block under
checkpointing) + the decoding cache if asked. What no formula here knows (allocator
fragmentation, NCCL's own buffers, kernels' workspaces) is the ``headroom`` fraction of
the GPU's memory kept free: a layout fits when its total is at most
``(1 − headroom)·memory``.

FLOPs per step are :func:`k3_model.flops_per_token` (``6·N_matmul`` plus the softmax
attention and KDA chunk terms, its module documents them) times the step's tokens; the
step time is ``compute / (1 − bubble) + max(0, overlapped − compute) + exposed`` with
``compute = (FLOPs + recomputed) / (world · peak · MFU)`` and the communication terms
of :mod:`.comm` at ``network_gbps``, where
``recomputed`` is zero without activation checkpointing and, with block checkpointing,
the blocks' forward once more (a third of their training FLOPs: all but the output
head's ``6·V·d`` per token). The MFU is the assumed fraction of peak the GPUs deliver on
the FLOPs they execute; kernel launch gaps, load imbalance and the communication
:mod:`.comm` does not count are inside that one input.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from k3_model import K3Config, flops_per_token
from k3_model.cache import cache_bytes_formula

from . import activations as act
from .comm import traffic
from .gpus import GPU
from .inventory import FIRST, LAST, Inventory
from .layout import ParallelLayout, stage_blocks, stage_rank, validate_layout
from .memory import largest_block_bytes, matmul_weights, state_bytes

SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True)
class Options:
    """What the plan assumes beyond the layout."""

    precision: str = "bf16"
    sharding: str = "fsdp"
    checkpointing: bool = False
    normuon: bool = False
    mfu: float = 0.4
    headroom: float = 0.1
    decode_batch: int = 0
    decode_context: int = 0
    scores: bool = False
    """Count softmax attention's score matrix (unfused attention, as on CPU)."""
    network_gbps: float = 400.0
    """Network bandwidth per GPU in Gb/s for the communication terms (:mod:`.comm`)."""


@dataclass(frozen=True)
class StagePlan:
    stage: int
    pp_rank: int
    blocks: list[int]
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    buffers_bytes: int
    decode_cache_bytes: int

    @property
    def total_bytes(self) -> int:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes
                + self.activations_bytes + self.buffers_bytes + self.decode_cache_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "pp_rank": self.pp_rank,
                "blocks": [self.blocks[0], self.blocks[-1]] if self.blocks else [],
                "params_bytes": self.params_bytes, "grads_bytes": self.grads_bytes,
                "optimizer_bytes": self.optimizer_bytes,
                "activations_bytes": self.activations_bytes,
                "buffers_bytes": self.buffers_bytes,
                "decode_cache_bytes": self.decode_cache_bytes,
                "total_bytes": self.total_bytes}


@dataclass(frozen=True)
class Plan:
    layout: ParallelLayout
    gpu: GPU
    options: Options
    params: int
    active_params: int
    stages: list[StagePlan]
    flops_per_step: float
    step_time_s: float
    tokens_per_s: float
    fits: bool
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        """The most loaded rank's total: each pipeline rank sums its stages' state,
        activations and caches, and adds the largest of their transient buffers (one
        stage runs at a time)."""
        held: dict[int, int] = {}
        transient: dict[int, int] = {}
        for s in self.stages:
            held[s.pp_rank] = held.get(s.pp_rank, 0) + s.total_bytes - s.buffers_bytes
            transient[s.pp_rank] = max(transient.get(s.pp_rank, 0), s.buffers_bytes)
        return max(held[r] + transient[r] for r in held)

    @property
    def budget_bytes(self) -> int:
        return int(self.gpu.memory_bytes * (1 - self.options.headroom))

    def days(self, tokens: float) -> float:
        return tokens / self.tokens_per_s / SECONDS_PER_DAY

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {"model": {"params": self.params, "active_params": self.active_params},
                "layout": {"dp": lay.dp, "pp": lay.pp, "ep": lay.ep, "cp": lay.cp,
                           "stages_per_rank": lay.stages_per_rank,
                           "microbatches": lay.microbatches, "batch_size": lay.batch_size,
                           "seq_len": lay.seq_len, "grad_accum": lay.grad_accum,
                           "world_size": lay.world_size, "bubble": lay.bubble},
                "gpu": {"name": self.gpu.name, "memory_bytes": self.gpu.memory_bytes,
                        "peak_flops": self.gpu.peak_flops},
                "precision": self.options.precision, "sharding": self.options.sharding,
                "activation_checkpointing": self.options.checkpointing,
                "mfu": self.options.mfu, "headroom": self.options.headroom,
                "stages": [s.to_dict() for s in self.stages],
                "peak_bytes": self.peak_bytes, "budget_bytes": self.budget_bytes,
                "fits": self.fits, "flops_per_step": self.flops_per_step,
                "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "tokens_per_step": lay.global_tokens, "network_gbps": self.options.network_gbps,
                **self.extra}


def make_plan(inv: Inventory, layout: ParallelLayout, gpu: GPU,
              options: Options | None = None) -> Plan:
    """The plan of ``layout`` for the model of ``inv`` (validated first: a layout that
    cannot run raises :class:`~.layout.LayoutError`)."""
    options = options or Options()
    config: K3Config = inv.config
    validate_layout(layout, n_blocks=config.n_layers,
                    n_experts=config.n_experts if config.mlp == "moe" else None)
    groups = stage_blocks(config.n_layers, layout.stages)
    micro_batch = layout.batch_size // layout.microbatches
    tokens = micro_batch * layout.seq_len // layout.cp
    stages = []
    for s, blocks in enumerate(groups):
        pp_rank = stage_rank(s, layout.pp, layout.schedule)
        owned = set(blocks) | ({FIRST} if s == 0 else set()) | (
            {LAST} if s == layout.stages - 1 else set())
        states = state_bytes(inv, owned, shard=layout.shard_degree, ep=layout.ep,
                             precision=options.precision, sharding=options.sharding,
                             normuon=options.normuon)
        in_flight = min(layout.microbatches, layout.pp - pp_rank) if layout.pp > 1 else 1
        interleaving = 1 + (layout.pp - 1) / (layout.pp * layout.stages_per_rank) \
            if layout.stages_per_rank > 1 else 1.0
        last = s == layout.stages - 1
        saved = act.saved_bytes(config, blocks, tokens, layout.seq_len,
                                checkpointing=options.checkpointing, last=last,
                                scores=options.scores)
        saved += act.cp_gathered_bytes(config, blocks, layout.seq_len, micro_batch,
                                       layout.cp)
        if options.precision == "bf16":  # autocast's bf16 copy of each fp32 weight
            if options.checkpointing:  # blocks rebuild theirs; their inputs also in bf16
                ends = owned - set(blocks)
                saved += 2 * matmul_weights(inv, ends, ep=layout.ep)
                saved += 2 * config.d_model * len(blocks) * tokens
            else:
                saved += 2 * matmul_weights(inv, owned, ep=layout.ep)
        buffers = 0
        if options.checkpointing:
            buffers += act.recompute_bytes(config, blocks, tokens, layout.seq_len,
                                           scores=options.scores)
        if layout.shard_degree > 1 and options.sharding == "fsdp":
            buffers += 2 * largest_block_bytes(inv, set(blocks), precision=options.precision)
        if layout.ep > 1 and config.mlp == "moe":
            buffers += 2 * 2 * tokens * config.moe_top_k * config.moe_width  # bf16 rows
        cache = 0
        if options.decode_batch and options.decode_context:
            kinds = config.layer_types()
            one = cache_bytes_formula(config, options.decode_context, dtype_bytes=2)
            for kind in ("kda", "mla", "gqa"):  # this stage's share of each kind's layers
                here = sum(kinds[i] == kind for i in blocks)
                cache += options.decode_batch * one[kind] * here // max(1, kinds.count(kind))
        stages.append(StagePlan(s, pp_rank, list(blocks), states.params, states.grads,
                                states.optimizer, int(saved * in_flight * interleaving),
                                buffers, cache))
    per_token = flops_per_token(config, layout.seq_len)
    flops = float(per_token) * layout.global_tokens
    executed = flops
    if options.checkpointing:
        head = 6 * config.vocab_size * config.d_model
        executed += (per_token - head) / 3 * layout.global_tokens
    compute = executed / (layout.world_size * gpu.peak_flops * options.mfu)
    sent = traffic(inv, layout, precision=options.precision, sharding=options.sharding)
    bandwidth = options.network_gbps * 1e9 / 8
    overlapped, exposed = sent.overlapped_bytes / bandwidth, sent.exposed_bytes / bandwidth
    step = compute / (1 - layout.bubble) + max(0.0, overlapped - compute) + exposed
    plan = Plan(layout, gpu, options, inv.total, inv.active, stages, flops, step,
                layout.global_tokens / step, fits=True,
                extra={"comm_overlapped_bytes": sent.overlapped_bytes,
                       "comm_exposed_bytes": sent.exposed_bytes,
                       "compute_time_s": compute, "comm_overlapped_s": overlapped,
                       "comm_exposed_s": exposed})
    return replace(plan, fits=plan.peak_bytes <= plan.budget_bytes)
