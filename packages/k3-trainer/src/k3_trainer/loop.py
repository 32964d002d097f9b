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
from .config import TrainConfig, TrainState
from .data import DataExhausted, TokenDataLoader, check_vocab_fits
from .diagnostics import MoEDiagnostics
from .evaluate import evaluate
from .metrics import MetricsLog
from .precision import autocast, make_grad_scaler, validate_master_weights, validate_precision
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
) -> TrainState:
    """Train until ``state.step == config.max_steps``; returns the final counters.

    ``state`` is the restored counters of a resumed session (fresh when None). ``log``
    receives the events; ``checkpoint_path`` (None: never save) is rewritten atomically
    on checkpoint steps. ``grad_scaler`` replaces the precision's scaler, which lets a
    test harness exercise the FP16 skip path on CPU. ``on_update(state, stats)`` is
    called after every successful update (the CLI's progress bar). ``diagnostics=False``
    leaves out MoE routing statistics and the window's QK-Clip summary (QK-Clip itself
    still runs).
    """
    device = torch.device(device)
    state = state if state is not None else TrainState()
    log = log if log is not None else MetricsLog(None)
    profiler = profiler if profiler is not None else TrainingProfiler(device)
    if grad_scaler is None:
        validate_precision(config.precision, device)
    validate_master_weights(model, config.precision)
    check_vocab_fits(train_loader, _vocab_size(model))

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
    with profiler, moe_diagnostics as moe, QKClip(model, qk_clip_policy(config)) as qk_clip:
        log.write("session_start", step=state.step, tokens_seen=state.tokens_seen,
                  max_steps=config.max_steps, precision=config.precision, device=str(device))
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
                        _, loss = model(x, targets=y)
                    value = loss.item()
                if not math.isfinite(value):
                    raise FloatingPointError(f"Non-finite training loss at step {step}")
                with profiler.region("train/backward"):
                    scaler.scale(loss / config.gradient_accumulation_steps).backward()
                update_loss += value / config.gradient_accumulation_steps
                update_tokens += y.numel()
                state.tokens_seen += y.numel()

            with profiler.region("train/optimizer"):
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    model.parameters(), config.max_grad_norm or float("inf"),
                    error_if_nonfinite=not scaler.is_enabled(),
                ).item()
                previous_scale = scaler.get_scale()
                qk_clip.validate()
                scaler.step(optimizer)
                scaler.update()
                state.grad_scaler_state = scaler.state_dict() if scaler.is_enabled() else None
                skipped = scaler.get_scale() < previous_scale
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
                       log, checkpoint_path, profiler, window, moe)
    log.write("session_end", step=state.step, tokens_seen=state.tokens_seen,
              skipped_updates=state.skipped_updates, **profiler.summary())
    return state


def _auxiliary(model: nn.Module, optimizer: torch.optim.Optimizer,
               train_loader: TokenDataLoader, val_loader: TokenDataLoader,
               config: TrainConfig, device: torch.device, state: TrainState, log: MetricsLog,
               checkpoint_path: str | Path | None, profiler: TrainingProfiler,
               window: TrainingWindow, moe: MoEDiagnostics) -> None:
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
            val_loss = evaluate(model, val_loader, device, config.eval_batches, config.precision)
        log.write("eval", step=state.step, val_loss=val_loss, tokens_seen=state.tokens_seen)
    if checkpoint_path is not None and (final or state.step % config.checkpoint_interval == 0):
        with profiler.region("checkpoint"):
            digest = save_checkpoint(checkpoint_path, model, optimizer, state, config,
                                     train_loader, val_loader)
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

