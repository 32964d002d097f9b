"""``train``: the update loop, in the order the spec gives it.

One attempted update: reset QK observations → schedule LR for ``step + 1`` on every
group → per microbatch: data, forward under autocast, finite-loss check, backward,
token count → unscale, clip, ``qk_clip.validate()`` → ``scaler.step``/``update`` →
``qk_clip.apply()`` after a real step (``reset()`` after a skipped one) → clear grads.
A successful update then advances ``step`` and runs whatever log/eval/checkpoint is due.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from k3_model import K3Config, flops_per_token
from k3_qkclip import QKClip

from .checkpointing import qk_clip_policy, save_checkpoint
from .compiling import CompileClock, prepare_model
from .config import TrainConfig, TrainState
from .data import DataExhausted, TokenDataLoader, check_vocab_fits
from .diagnostics import MoEDiagnostics
from .distributed import Parallel
from .evaluate import evaluate_split
from .metrics import MetricsLog
from .precision import (
    autocast,
    make_grad_scaler,
    overflow_flag,
    validate_grad_scaler,
    validate_master_weights,
    validate_precision,
)
from .profiling import TrainingProfiler
from .schedule import learning_rate_at_step
from .window import TrainingWindow

MAX_CONSECUTIVE_SKIPS = 32
Batch = tuple[torch.Tensor, torch.Tensor]


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_loader: TokenDataLoader,
    val_loader: TokenDataLoader,
    config: TrainConfig,
    device: torch.device | str,
    *,
    state: TrainState | None = None,
    log: MetricsLog | None = None,
    checkpoint_path: str | Path | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    profiler: TrainingProfiler | None = None,
    on_update: Callable[[TrainState, dict[str, Any]], None] | None = None,
    diagnostics: bool = True,
    parallel: Parallel | None = None,
) -> TrainState:
    """Train until ``state.step == config.max_steps``; returns the final counters.

    ``state`` is the restored counters of a resumed session (fresh when None). ``log``
    receives the events; ``checkpoint_path`` (None: never save) is rewritten atomically
    on checkpoint steps. ``grad_scaler`` replaces the precision's scaler; it must fit the
    precision (enabled for fp16 only), except :class:`~k3_trainer.FP16SkipHarness`, the
    named way to exercise the FP16 skip path in fp32 on CPU. ``on_update(state, stats)`` is
    called after every successful update (the CLI's progress bar). ``diagnostics=False``
    leaves out MoE routing statistics and the window's QK-Clip summary (QK-Clip itself
    still runs).

    ``parallel`` (data parallel, :mod:`k3_trainer.distributed`): forward runs on
    ``parallel.module`` (``model`` is the unwrapped model, or the sharded one under
    FSDP2); the logged loss and the finite-loss check use the mean over ranks, tokens
    count every rank, QK-Clip maxima and FP16 found-inf are reduced over ranks, and only
    rank 0 writes checkpoints. The loaders must read this rank's rows.
    """
    device = torch.device(device)
    state = state if state is not None else TrainState()
    log = log if log is not None else MetricsLog(None)
    profiler = profiler if profiler is not None else TrainingProfiler(device)
    validate_precision(config.precision, device)
    if grad_scaler is not None:
        validate_grad_scaler(grad_scaler, config.precision)
    validate_master_weights(model, config.precision)
    check_vocab_fits(train_loader, _vocab_size(model))

    prepare_model(model, config)
    forward = parallel.module if parallel is not None and parallel.module is not None else model
    world = parallel.world_size if parallel is not None else 1
    model.train()
    optimizer.zero_grad(set_to_none=True)
    scaler = grad_scaler if grad_scaler is not None else make_grad_scaler(device, config.precision)
    if scaler.is_enabled() and state.grad_scaler_state is not None:
        scaler.load_state_dict(state.grad_scaler_state)
    fixed_batch: Batch | None = None
    if config.overfit_batch and state.fixed_batch_offset is not None:
        fixed_batch = _to_device(train_loader.batch_at(state.fixed_batch_offset), device)

    window = TrainingWindow(device, precision=config.precision,
                            flops_per_token=model_flops_per_token(model, config.seq_len))
    consecutive_skips = 0
    moe_diagnostics = MoEDiagnostics(model, enabled=diagnostics)
    compile_clock = CompileClock()
    qk_reduce = parallel.max_ if parallel is not None else None
    with profiler, moe_diagnostics as moe, \
            QKClip(model, qk_clip_policy(config), reduce_max=qk_reduce) as qk_clip, \
            compile_clock:
        log.write("session_start", step=state.step, tokens_seen=state.tokens_seen,
                  max_steps=config.max_steps, precision=config.precision, device=str(device),
                  compile=config.compile,
                  activation_checkpointing=config.activation_checkpointing)
        while state.step < config.max_steps:
            step = state.step + 1
            profiler.begin_attempt(step)
            qk_clip.reset()
            lr = learning_rate_at_step(config, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            update_loss, update_tokens = 0.0, 0

            for _ in range(config.gradient_accumulation_steps):
                with profiler.region("train/data"):
                    (x, y), fixed_batch = _get_training_batch(
                        train_loader, device, config, state, fixed_batch
                    )
                with profiler.region("train/forward"):
                    with autocast(device, config.precision):
                        _, loss = forward(x, targets=y)
                    value = loss.item() if parallel is None else parallel.mean_item(loss)
                if not math.isfinite(value):
                    raise FloatingPointError(f"Non-finite training loss at step {step}")
                with profiler.region("train/backward"):
                    scaler.scale(loss / config.gradient_accumulation_steps).backward()
                update_loss += value / config.gradient_accumulation_steps
                update_tokens += y.numel() * world
                state.tokens_seen += y.numel() * world

            with profiler.region("train/optimizer"):
                scaler.unscale_(optimizer)
                if parallel is not None:
                    parallel.sync_found_inf(scaler, optimizer)
                norm = torch.nn.utils.clip_grad_norm_(
                    model.parameters(), config.max_grad_norm or float("inf"))
                if parallel is not None and hasattr(norm, "full_tensor"):
                    norm = norm.full_tensor()  # FSDP2: the norm of every rank's shards
                # The update's one host read: pre-clip norm, QK observations' finiteness and
                # the scaler's found-inf, together (see _host_values).
                grad_norm, qk_nonfinite, overflow = _host_values(
                    norm, qk_clip.nonfinite(), overflow_flag(scaler, optimizer))
                if not scaler.is_enabled() and not math.isfinite(grad_norm):
                    raise FloatingPointError(
                        f"Non-finite gradient norm at step {step} (the loss was finite: "
                        f"{update_loss:.6g}); lower the LR or max_grad_norm, or check the data")
                qk_clip.validate(qk_nonfinite)
                scaler.step(optimizer)
                scaler.update()
                # The spec's "the scale dropped": GradScaler.update() multiplies the scale by
                # backoff_factor (< 1) exactly when unscale_ found an inf/NaN, which is also
                # exactly when scaler.step skipped the optimizer. Reading found-inf with the
                # norm spares the two get_scale() syncs; the scaler state is read when a
                # checkpoint or the session end needs it.
                skipped = overflow
                with profiler.region("train/qk_clip"):
                    if skipped:
                        qk_clip.reset()
                    else:
                        report = qk_clip.apply()
                        if diagnostics:
                            window.add_qk(report)
                optimizer.zero_grad(set_to_none=True)
            profiler.attempt_done()

            if skipped:
                state.skipped_updates += 1
                consecutive_skips += 1
                window.skipped += 1
                state.grad_scaler_state = scaler.state_dict()
                log.write("overflow", step=step, scale=scaler.get_scale(),
                          skipped_updates=state.skipped_updates, tokens_seen=state.tokens_seen)
                if consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
                    raise FloatingPointError(
                        f"{MAX_CONSECUTIVE_SKIPS} consecutive FP16 overflows at step {step}: "
                        "the loss scale cannot recover; lower the LR or use bf16"
                    )
                continue
            consecutive_skips = 0
            state.step = step
            window.add(update_loss, update_tokens, grad_norm, lr)
            if on_update is not None:
                on_update(state, {"loss": update_loss, "lr": lr, "grad_norm": grad_norm,
                                  "tokens_per_s": window.tokens_per_s(profiler)})
            _auxiliary(model, optimizer, train_loader, val_loader, config, device, state,
                       log, checkpoint_path, profiler, window, moe, scaler, parallel)
    state.grad_scaler_state = scaler.state_dict() if scaler.is_enabled() else None
    log.write("session_end", step=state.step, tokens_seen=state.tokens_seen,
              skipped_updates=state.skipped_updates, compile_s=round(compile_clock.seconds, 3),
              **profiler.summary())
    return state


def _host_values(norm: torch.Tensor, qk_nonfinite: torch.Tensor | None,
                 overflow: torch.Tensor | None) -> tuple[float, bool, bool]:
    """``(grad_norm, qk_nonfinite, overflow)`` on the host in one device→host copy.

    Per update the loop syncs once per microbatch (the spec's finite-loss check) and once
    here; everything else (QK statistics, MoE routing counts) stays on the device until
    a logging boundary reads it.
    """
    parts = [norm.detach().float().reshape(1)]
    for flag in (qk_nonfinite, overflow):
        if flag is not None:
            parts.append(flag.to(parts[0].device, torch.float32).reshape(1))
    values = torch.cat(parts).tolist()
    qk = bool(values[1]) if qk_nonfinite is not None else False
    inf = bool(values[-1]) if overflow is not None else False
    return values[0], qk, inf


def _auxiliary(model: nn.Module, optimizer: torch.optim.Optimizer,
               train_loader: TokenDataLoader, val_loader: TokenDataLoader,
               config: TrainConfig, device: torch.device, state: TrainState, log: MetricsLog,
               checkpoint_path: str | Path | None, profiler: TrainingProfiler,
               window: TrainingWindow, moe: MoEDiagnostics,
               scaler: torch.amp.GradScaler, parallel: Parallel | None = None) -> None:
    """Logging, evaluation and checkpointing due at this successful step (all on the last)."""
    final = state.step == config.max_steps
    if final or state.step % config.log_interval == 0:
        with profiler.region("log"):
            log.write("train", step=state.step, tokens_seen=state.tokens_seen,
                      skipped_updates=state.skipped_updates,
                      **window.summary(profiler), **moe.summary())
            window.reset(profiler)
    if final or state.step % config.eval_interval == 0:
        with profiler.region("eval"):
            result = evaluate_split(model, val_loader, device, config.eval_batches,
                                    config.precision,
                                    all_reduce=parallel.sum_ if parallel is not None else None)
        log.write("eval", step=state.step, val_loss=result.loss, val_bpb=result.bpb,
                  tokens_seen=state.tokens_seen)
    if checkpoint_path is not None and (final or state.step % config.checkpoint_interval == 0):
        with profiler.region("checkpoint"):
            state.grad_scaler_state = scaler.state_dict() if scaler.is_enabled() else None
            digest = save_checkpoint(checkpoint_path, model, optimizer, state, config,
                                     train_loader, val_loader, parallel=parallel)
        log.write("checkpoint", step=state.step, path=str(checkpoint_path), digest=digest)


def _get_training_batch(train_loader: TokenDataLoader, device: torch.device,
                        config: TrainConfig, state: TrainState,
                        fixed_batch: Batch | None) -> tuple[Batch, Batch | None]:
    """The next training batch, and the fixed overfit batch (if that mode is on).

    An exhausted loader is reset to offset zero here (discarding the incomplete tail);
    the loader itself never wraps. Overfit mode picks the batch at the cursor once,
    records its offset in ``state``, and rereads it without moving the cursor.
    """
    if config.overfit_batch:
        if fixed_batch is None:
            if state.fixed_batch_offset is None:
                state.fixed_batch_offset = train_loader.offset
            fixed_batch = _to_device(train_loader.batch_at(state.fixed_batch_offset), device)
        return fixed_batch, fixed_batch
    try:
        batch = train_loader.next_batch()
    except DataExhausted:
        train_loader.reset()
        batch = train_loader.next_batch()
    return _to_device(batch, device), fixed_batch


def _to_device(batch: Batch, device: torch.device) -> Batch:
    x, y = batch
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def model_flops_per_token(model: nn.Module, seq_len: int) -> float | None:
    """Training FLOPs per token from the model (``flops_per_token(seq_len)``) or, for a
    k3-model ``K3Model``, its config; None when unknown (MFU is then reported as None)."""
    own = getattr(model, "flops_per_token", None)
    if callable(own):
        return float(own(seq_len))
    config = getattr(model, "config", None)
    if isinstance(config, K3Config):
        return float(flops_per_token(config, seq_len))
    return None


def _vocab_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "vocab_size", 0)) or (1 << 62)

