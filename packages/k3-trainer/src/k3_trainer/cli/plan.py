"""``k3-train plan``: memory per GPU, FLOPs and step time of a layout, or the layouts that
fit (``--suggest``), from a preset, a hub folder or a config file; nothing allocated."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from ..config import ConfigError
from ..planning import LayoutError, Options, ParallelLayout, gpu, inventory, make_plan, suggest
from ..planning.model import planned_model
from ..planning.plan import Plan
from .options import PlanCommand

GiB = 2**30


def model_config(command: PlanCommand) -> Any:
    """The model of ``--preset``, ``--model DIR`` or ``--config FILE`` (exactly one)."""
    from ..session.config_file import read_toml

    toml = None if command.config is None else read_toml(command.config)
    return planned_model(command.preset, command.model, toml)


def _layout(command: PlanCommand, world: int) -> ParallelLayout:
    pp, cp = command.pp, command.cp
    if command.dp is None and world % (pp * cp):
        raise ConfigError(f"plan: {world} GPUs do not divide into pp·cp = {pp * cp}; "
                          "change --pp or --cp")
    dp = command.dp if command.dp is not None else world // (pp * cp)
    return ParallelLayout(dp=dp, ep=command.ep, pp=pp, cp=cp,
                          stages_per_rank=command.pp_stages_per_rank,
                          microbatches=command.pp_microbatches or pp,
                          batch_size=command.batch_size, seq_len=command.seq_len,
                          grad_accum=command.grad_accum)


def _gb(n: float) -> str:
    return f"{n / GiB:,.1f} GiB"


def _lines(plan: Plan, tokens: float | None) -> list[str]:
    lay = plan.layout
    out = [f"layout dp {lay.dp} × pp {lay.pp} (×{lay.stages_per_rank} stages/rank, "
           f"{lay.microbatches} microbatches, bubble {lay.bubble:.1%}) × cp {lay.cp}, ep "
           f"{lay.ep} = {lay.world_size} GPUs; {lay.global_tokens:,} tokens/step"]
    peak_rank = max(range(lay.pp), key=lambda r: sum(s.total_bytes for s in plan.stages
                                                      if s.pp_rank == r))
    shown = [s for s in plan.stages
             if len(plan.stages) <= 8 or s.pp_rank == peak_rank or s is plan.stages[-1]]
    for s in shown:
        out.append(
            f"  stage {s.stage} (rank {s.pp_rank}, blocks {s.blocks[0]}–{s.blocks[-1]}): "
            f"params {_gb(s.params_bytes)}, grads {_gb(s.grads_bytes)}, optimizer "
            f"{_gb(s.optimizer_bytes)}, activations {_gb(s.activations_bytes)}, buffers "
            f"{_gb(s.buffers_bytes)}" + (f", decode cache {_gb(s.decode_cache_bytes)}"
                                         if s.decode_cache_bytes else "")
            + f" = {_gb(s.total_bytes)}")
    if len(shown) < len(plan.stages):
        out.append(f"  ({len(plan.stages) - len(shown)} other stages; shown: the most "
                   f"loaded pipeline rank {peak_rank} and the last stage)")
    verdict = "fits" if plan.fits else "does NOT fit"
    checkpointing = "block" if plan.options.checkpointing else "none"
    out.append(f"  peak {_gb(plan.peak_bytes)} per GPU against a budget of "
               f"{_gb(plan.budget_bytes)} ({plan.gpu.name}: {_gb(plan.gpu.memory_bytes)} less "
               f"{plan.options.headroom:.0%} headroom), {plan.options.sharding}, activation "
               f"checkpointing {checkpointing}: {verdict}")
    extra = plan.extra
    out.append(f"  sends {extra['comm_overlapped_bytes'] / 1e9:,.1f} GB/step overlapped with "
               f"compute (FSDP), {extra['comm_exposed_bytes'] / 1e9:,.1f} GB exposed (expert "
               f"all-to-all) at {plan.options.network_gbps:,.0f} Gb/s: compute "
               f"{extra['compute_time_s']:.2f} s, communication "
               f"{extra['comm_overlapped_s']:.2f} s overlapped + {extra['comm_exposed_s']:.2f} s")
    out.append(f"  {plan.flops_per_step:.3e} FLOPs/step; at {plan.options.mfu:.0%} MFU "
               f"{plan.step_time_s:.2f} s/step, {plan.tokens_per_s:,.0f} tokens/s"
               + (f", {plan.days(tokens):.1f} days for {tokens:.3g} tokens" if tokens else ""))
    return out


def run(command: PlanCommand, notes: tuple[str, ...] = ()) -> int:
    config = model_config(command)
    inv = inventory(config)
    try:
        device = gpu(command.gpu, command.gpu_memory, command.peak_tflops)
    except ValueError as exc:
        raise ConfigError(f"plan: {exc}") from None
    if not 0 <= command.headroom < 1:
        raise ConfigError(f"plan: --headroom must be in [0, 1), got {command.headroom}")
    if command.network_gbps <= 0:
        raise ConfigError(f"plan: --network-gbps must be > 0, got {command.network_gbps}")
    options = Options(precision=command.precision, sharding=command.sharding,
                      checkpointing=command.activation_checkpointing,
                      normuon=command.normuon, mfu=command.mfu, headroom=command.headroom,
                      decode_batch=command.decode_batch, decode_context=command.decode_context,
                      network_gbps=command.network_gbps)
    world = command.nodes * command.gpus_per_node
    layout = _layout(command, world)
    try:
        if layout.world_size != world:
            raise LayoutError(f"dp·cp·pp = {layout.world_size} but --nodes × "
                              f"--gpus-per-node = {world}; change --dp")
        plans = (suggest(inv, world, layout.batch_size * layout.dp, replace(layout, cp=1),
                         device, options, max_cp=command.cp)
                 if command.suggest else [make_plan(inv, layout, device, options)])
    except (LayoutError, ValueError) as exc:
        raise ConfigError(f"plan: {exc}") from None
    head = {"model": {"params": inv.total, "active_params": inv.active}}
    if command.json:
        if command.suggest:
            layouts = []
            for p in plans:
                d = p.to_dict()
                layouts.append({**d["layout"], **d, "layout": None})
            print(json.dumps({**head, **(plans[0].to_dict() if plans else {}),
                              "layouts": layouts}))
        else:
            print(json.dumps(plans[0].to_dict()))
        return 0
    print(f"model: {inv.total:,} parameters ({inv.total / 1e9:,.2f} B), "
          f"{inv.active:,} active per token ({inv.active / 1e9:,.2f} B)")
    if command.suggest:
        if not plans:
            print("no layout of these GPUs is valid for this model and batch")
            return 0
        print("\n".join(_table(plans, world)))
        print("the first in full:" if plans[0].fits else "none fits; the smallest in full:")
    print("\n".join(_lines(plans[0], command.tokens)))
    return 0


def _table(plans: list[Plan], world: int) -> list[str]:
    """``--suggest``: one line per layout, best first."""
    lay, first = plans[0].layout, plans[0]
    sequences = lay.dp * lay.batch_size * lay.grad_accum
    out = [f"layouts of {world} × {first.gpu.name} for {sequences:,} sequences of "
           f"{lay.seq_len:,} tokens per step ({lay.global_tokens:,} tokens), budget "
           f"{_gb(first.budget_bytes)} per GPU, at {first.options.mfu:.0%} MFU; best first "
           "(v: stages per rank; micro: microbatches, or gradient-accumulation splits "
           "without a pipeline; shard: fsdp or zero1; ckpt: activation checkpointing):",
           f"  {'dp':>5} {'pp':>3} {'v':>2} {'cp':>3} {'ep':>4} {'micro':>5} {'shard':>5} "
           f"{'ckpt':>5} "
           f"{'peak GiB':>9} {'fits':>4} {'bubble':>6} {'tokens/s':>11} {'days/T tok':>10}"]
    for p in plans:
        a = p.layout
        micro = a.microbatches if a.pp > 1 else a.grad_accum
        out.append(f"  {a.dp:>5} {a.pp:>3} {a.stages_per_rank:>2} {a.cp:>3} {a.ep:>4} "
                   f"{micro:>5} {p.options.sharding:>5} "
                   f"{'block' if p.options.checkpointing else 'none':>5} "
                   f"{p.peak_bytes / GiB:>9,.1f} {'yes' if p.fits else 'NO':>4} "
                   f"{a.bubble:>6.1%} {p.tokens_per_s:>11,.0f} {p.days(1e12):>10,.1f}")
    return out


__all__ = ["model_config", "run"]
