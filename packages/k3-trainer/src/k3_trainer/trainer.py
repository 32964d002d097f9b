"""``Trainer``: one training run's parts, built once, and ``fit()``, the update loop of the
training contract (``docs/training-contract.md``).

One attempted update, in the contract's order: reset QK observations → schedule LR for
``step + 1`` on every group → per microbatch: data, forward under autocast, finite-loss
check, backward, token count → unscale, clip, ``qk_clip.validate()`` →
``scaler.step``/``update`` → ``qk_clip.apply()`` after a real step (``reset()`` after a
skipped one) → clear grads. A successful update then advances ``step`` and runs whatever
log/evaluation/checkpoint is due (all three on the last step). A stop requested meanwhile
(:meth:`Trainer.request_stop`, a signal) ends the session at that boundary, saved.
"""

from __future__ import annotations

import logging
import math
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from k3_qkclip import QKClip, QKClipPolicy

from .callbacks import Callback, Callbacks
from .checkpoint import (
    TRAINER_POLICY,
    Checkpointer,
    CheckpointHistory,
    CheckpointStore,
    CheckpointWriteError,
    FixedPath,
    Resumed,
    qk_clip_policy,
    run_metadata,
)
from .checkpoint.agreement import raise_on_every_rank
from .checkpoint.components import CALLBACKS, COUNTERS, GRAD_SCALER, LOADERS, MODEL, OPTIMIZER
from .checkpoint.saves import WRITE_FAILED, Saves
from .compiling import CompileClock, prepare_model
from .config import TrainConfig
from .context import ContextSlices, Slices
from .contract import ModelContract, check_model, check_takes_documents, takes_reduction
from .data import BatchLoader, DataExhausted, check_vocab_fits
from .data.documents import document_boundary, document_ids
from .distributed import Parallel, clip_grad_norm
from .evaluation import evaluate_split
from .interrupt import TrainingInterrupted
from .observe import MoEDiagnostics, TrainingProfiler, TrainingWindow, event_record
from .observe.sources import SourceLosses
from .observe.stages import combine_stages, layer_figures
from .pipeline import Pipeline, PipelineEvaluation, TokenLosses, stage_qk_policy
from .precision import (
    autocast,
    make_grad_scaler,
    overflow_flag,
    validate_grad_scaler,
    validate_master_weights,
    validate_precision,
)
from .schedule import learning_rate_at_step
from .state import ScalerState, TrainState

MAX_CONSECUTIVE_SKIPS = 32
Batch = tuple[torch.Tensor, torch.Tensor]  # as data.protocol's

logger = logging.getLogger(__name__)


class Loaders(NamedTuple):
    """The training stream and the validation split (a plain ``(train, val)`` tuple too)."""

    train: BatchLoader
    val: BatchLoader


class _Attempt(NamedTuple):
    """What one attempted update produced."""

    step: int
    lr: float
    loss: float
    tokens: int
    grad_norm: float
    skipped: bool


class Trainer:
    """A training run: model, optimizer, loaders, config and parallel setup, held together.

    ``model`` is the unwrapped model (or the FSDP2-sharded one); under DDP the forward runs
    on ``parallel.module``. ``checkpoint_path`` (None: never saved) is where checkpoint
    steps save: a path, rewritten atomically, or a
    :class:`~k3_trainer.checkpoint.CheckpointHistory` (a folder per step, a ``latest``
    pointer, old ones pruned); :attr:`checkpointer` also resumes. With
    ``config.async_checkpoint`` a save only copies the state, and the write runs on a worker
    thread while training goes on (one in flight; a failed write stops the run at the next
    boundary, raising :class:`~k3_trainer.checkpoint.CheckpointWriteError`). ``callbacks`` observe
    the run (:class:`~k3_trainer.Callback`); a stateful one is checkpointed with the rest.
    ``grad_scaler`` replaces the precision's scaler; it must fit the precision (enabled for
    fp16 only), except :class:`~k3_trainer.FP16SkipHarness`, the named way to exercise the
    FP16 skip path in fp32 on CPU. ``diagnostics`` (default True) adds MoE routing
    statistics and the QK-Clip summary to each log window.

    Data parallel: the logged loss and the finite-loss check use the mean over ranks,
    tokens count every rank, QK-Clip maxima and FP16 found-inf are reduced over ranks, and
    the checkpoint is written by rank 0 (DDP) or by every rank's shards (FSDP2). The
    loaders must read this rank's rows (its data rank's: the ranks of a context-parallel
    group read the same rows).

    Context parallel (``parallel.context_parallel > 1``, :mod:`k3_trainer.context`): the
    model must already run on slices over ``parallel.context_group`` (its spec's
    ``context_parallel.set_group``); the trainer gives it this rank's slice of every row
    and validates under the same layout.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loaders: tuple[BatchLoader, BatchLoader], config: TrainConfig, *,
                 parallel: Parallel | None = None,
                 checkpoint_path: str | Path | CheckpointStore | None = None,
                 callbacks: Iterable[Callback] = (),
                 grad_scaler: torch.amp.GradScaler | None = None) -> None:
        self.pipeline: Pipeline | None = parallel.stages if parallel is not None else None
        """This rank's pipeline stages and their schedule (None: the whole model here)."""
        self.contract: ModelContract = check_model(model)
        self.model, self.optimizer, self.config, self.parallel = model, optimizer, config, parallel
        self.loaders = Loaders(*loaders)
        self.device = parallel.device if parallel is not None else _device_of(model)
        validate_precision(config.precision, self.device)
        if grad_scaler is not None:
            validate_grad_scaler(grad_scaler, config.precision)
        validate_master_weights(model, config.precision)
        vocab = self.contract.vocab_size
        if vocab is not None:
            check_vocab_fits(self.loaders.train, vocab)
        self.forward = parallel.module if parallel is not None and parallel.module else model
        self.slices: Slices | None = None
        """This rank's slice of the rows under context parallelism (None: whole rows, or
        pipeline stages, which slice the rows themselves)."""
        if parallel is not None and parallel.context_parallel > 1 and self.pipeline is None:
            self.slices = Slices(parallel.context_rank, parallel.context_parallel)
            self.forward = ContextSlices(self.forward, self.slices)
        self._document_boundary: int | None = None
        """The end-of-document id when documents are kept apart (``document_masking``)."""
        if config.document_masking:
            check_takes_documents(model)
            self._document_boundary = document_boundary(self.loaders.train)
        self.world = parallel.data_parallel if parallel is not None else 1
        self.scaler = grad_scaler or make_grad_scaler(self.device, config.precision)
        self.callbacks = Callbacks(callbacks)
        self.profiler = TrainingProfiler(self.device)
        # The run's own instruments, built once: the log window and the MoE diagnostics.
        self.window = TrainingWindow(self.device, precision=config.precision,
                                     flops_per_token=self.contract.flops_per_token(config.seq_len))
        row_sources = getattr(self.loaders.train, "row_sources", None)
        self.by_source: SourceLosses | None = None
        """A mixture's training loss by source (when the model gives each target's loss)."""
        if callable(row_sources) and not config.overfit_batch and takes_reduction(model):
            self.by_source = SourceLosses(list(self.loaders.train.sources),  # type: ignore[attr-defined]
                                          self.device)
        self.moe = MoEDiagnostics(
            self.contract,
            moved_bytes=(lambda: parallel.moved_bytes(self.model))
            if parallel is not None and parallel.expert_parallel > 1 else None)
        self._fixed_batch: Batch | None = None  # overfit mode: read once, at state's offset
        self.diagnostics = True
        self.state = TrainState()
        if config.overfit_batch:
            train = self.loaders.train
            self.state.fixed_batch_limit = train.num_tokens - train.tokens_per_batch - 1
        sharded = parallel is not None and parallel.mode == "fsdp"
        self.store: CheckpointStore | None = (
            FixedPath(checkpoint_path, sharded) if isinstance(checkpoint_path, (str, Path))
            else checkpoint_path)
        self._stop_signal: int | None = None
        self._agreed_stop = 0  # the largest signal any rank had, as of the last loss reduce
        self.checkpointer = Checkpointer(self.states(),
                                         run_metadata(self.contract, config, parallel,
                                                      None if self.pipeline is None
                                                      else self.pipeline.qk_geometry),
                                         TRAINER_POLICY, parallel)
        self.saves = Saves(self.checkpointer, self.store, parallel,
                           background=config.async_checkpoint, event=self._event,
                           region=self.profiler.region, stop=self.request_stop)
        """The run's saves (in the background with ``config.async_checkpoint``)."""

    @property
    def checkpoint_path(self) -> Path | None:
        """Where the last checkpoint went (before any: the path or the history's folder)."""
        return self.saves.path

    @checkpoint_path.setter
    def checkpoint_path(self, path: Path | None) -> None:
        self.saves.path = path

    def states(self) -> dict[str, Any]:
        """Everything a checkpoint saves and restores: the one place to add a stateful part
        of the run (a stateful callback adds itself under ``callbacks``)."""
        states: dict[str, Any] = {
            MODEL: self.model,
            OPTIMIZER: self.optimizer,
            COUNTERS: self.state,
            GRAD_SCALER: ScalerState(self.scaler),
            LOADERS: {"train": self.loaders.train, "val": self.loaders.val},
        }
        if self.callbacks.states():
            states[CALLBACKS] = self.callbacks.states()
        return states

    def resume(self, path: str | Path, *, allow_runtime_change: bool = False,
               new_phase: bool = False) -> Resumed:
        """Restore the run from the checkpoint at ``path`` (see :meth:`Checkpointer.load`):
        :attr:`state` then holds the saved counters. ``new_phase``: this run starts a new
        phase, whose decay (``lr_schedule``, ``decay_steps``, ``decay_fraction``,
        ``decay_shape``, ``min_lr_ratio``) may differ from the checkpoint's; its loaders say
        themselves whether they take another data's cursors (``MixtureLoader(adopt=True)``).

        Resuming from a checkpoint of this trainer's history continues the run from it:
        the checkpoints written after it move to ``superseded-N/`` (see
        :meth:`CheckpointHistory.continue_from`)."""
        resumed = self.checkpointer.load(path, allow_runtime_change=allow_runtime_change,
                                         new_phase=new_phase)
        self._fixed_batch = None  # reread at the restored offset
        history = self.store if isinstance(self.store, CheckpointHistory) else None
        if history is not None and resumed.path is not None and \
                resumed.path.parent.resolve() == history.root.resolve():
            failure = None
            if self.parallel is None or self.parallel.is_main:
                try:
                    history.continue_from(resumed.path)
                except OSError as error:
                    failure = error
            raise_on_every_rank(self.parallel, failure,
                                "rank 0 could not reorganize the checkpoint history")
        return resumed

    @property
    def diagnostics(self) -> bool:
        """Whether log windows carry the MoE routing statistics and the QK-Clip summary
        (default True); training is bitwise the same either way."""
        return self._diagnostics

    @diagnostics.setter
    def diagnostics(self, on: bool) -> None:
        self._diagnostics = bool(on)
        self.moe.enabled = self._diagnostics

    # --- the loop ------------------------------------------------------------------------

    def fit(self) -> TrainState:
        """Train until ``state.step == config.max_steps``; returns the final counters.

        On failure every callback hears of it (``on_error``); at the end, trained, stopped
        or failed, every callback is closed (``close``)."""
        try:
            return self._fit()
        except TrainingInterrupted:
            raise
        except BaseException as error:
            self.callbacks.error(self, error)
            raise
        finally:
            self.callbacks.close()

    def _fit(self) -> TrainState:
        config = self.config
        prepare_model(self.model, config)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.window.reset(None)
        if self.by_source is not None:
            self.by_source.reset()
        qk_reduce = self.parallel.data_max_ if self.parallel is not None else None
        compile_clock = CompileClock()
        with self.profiler, self.moe, compile_clock, \
                QKClip(self.model, self._qk_policy(), reduce_max=qk_reduce) as qk_clip:
            self._event("session_start", step=self.state.step,
                        tokens_seen=self.state.tokens_seen, max_steps=config.max_steps,
                        precision=config.precision, device=str(self.device),
                        compile=config.compile,
                        activation_checkpointing=config.activation_checkpointing)
            failure: BaseException | None
            try:
                stop = self._train(qk_clip)
            except CheckpointWriteError as error:  # a save failed (its own or the last one)
                self.saves.drain()
                stop, failure = None, error
            except BaseException:
                self.saves.drain()  # the save in flight still lands; the error goes on
                raise
            else:
                failure = self.saves.finish()
        if failure is not None:
            self._event("session_end", step=self.state.step,
                        tokens_seen=self.state.tokens_seen, checkpoint_failed=str(failure))
            self._stop_signal, self._agreed_stop = None, 0
            raise failure
        self._event("session_end", step=self.state.step, tokens_seen=self.state.tokens_seen,
                    skipped_updates=self.state.skipped_updates,
                    compile_s=(None if compile_clock.seconds is None
                               else round(compile_clock.seconds, 3)),
                    **self.profiler.summary(),
                    **({"interrupted": signal.Signals(stop).name} if stop is not None else {}))
        if stop is not None:
            self._stop_signal, self._agreed_stop = None, 0  # spent: a later fit() trains on
            raise TrainingInterrupted(self.state.step, stop, self.checkpoint_path)
        return self.state

    def _train(self, qk_clip: QKClip) -> int | None:
        """Updates until the last step or a stop every rank agreed on (returned; saved
        there, unless it is a failed checkpoint write's)."""
        config = self.config
        consecutive_skips = 0
        stop = None
        while self.state.step < config.max_steps and stop is None:
            attempt = self._attempt(qk_clip)
            if attempt.skipped:
                consecutive_skips += 1
                self._skipped(attempt, consecutive_skips)
            else:
                consecutive_skips = 0
                self._succeeded(attempt)
                self._boundary()
            stop = self._stop_requested()
        if stop is None and self.parallel is not None:
            stop = self._stop_agreed_at_the_end()
        if stop is not None and stop != WRITE_FAILED and self.store is not None and \
                self.saves.saved_step != self.state.step:
            self.save_checkpoint()
        return None if stop == WRITE_FAILED else stop

    def request_stop(self, signum: int = signal.SIGINT) -> None:
        """Stop at the next update boundary: ``fit()`` finishes the attempt under way,
        saves the checkpoint there (when it has a path) and raises
        :class:`~k3_trainer.interrupt.TrainingInterrupted`. Safe to call from a signal
        handler (see :class:`~k3_trainer.interrupt.StopOnSignal`)."""
        self._stop_signal = int(signum)

    def _stop_requested(self) -> int | None:
        """The signal to stop on after this update. Data parallel: the one every rank
        learnt from the update's loss reduce (so every rank stops at the same step, with
        no collective of its own; a signal that arrives later stops the next update)."""
        if self.parallel is None:
            return self._stop_signal
        return self._agreed_stop or None

    def _stop_agreed_at_the_end(self) -> int | None:
        """A signal that arrived during the last update, after its loss reduce: one more
        agreement, once per session, so the run still ends as interrupted."""
        assert self.parallel is not None
        signum = float(self._stop_signal or 0)
        return int(self.parallel.max_(torch.tensor([signum])).item()) or None

    def _mean_loss(self, loss: torch.Tensor) -> float:
        """This microbatch's loss averaged over the ranks, agreeing on stop signals too."""
        assert self.parallel is not None
        value, signum = self.parallel.mean_item_and_signal(loss, self._stop_signal or 0)
        self._agreed_stop = max(self._agreed_stop, signum)
        return value

    def _attempt(self, qk_clip: QKClip) -> _Attempt:
        """One attempted update for successful step ``state.step + 1``, in the order of the
        training contract (docs/training-contract.md, §1)."""
        config, profiler, scaler = self.config, self.profiler, self.scaler
        step = self.state.step + 1
        self.callbacks.attempt_start(self, step)
        qk_clip.reset()
        lr = learning_rate_at_step(config, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum, tokens = 0.0, 0

        for _ in range(config.gradient_accumulation_steps):
            with profiler.region("train/data"):
                x, y = self._training_batch()
            if self.pipeline is not None:
                loss_sum += self._pipeline_microbatches(x, y, step)
                tokens += y.numel() * self.world
                self.state.tokens_seen += y.numel() * self.world
                continue
            with profiler.region("train/forward"):
                documents = {} if self._document_boundary is None else {
                    "document_ids": document_ids(x, self._document_boundary)}
                with autocast(self.device, config.precision):
                    loss = self._loss(x, y, documents)
                value = loss.item() if self.parallel is None else self._mean_loss(loss)
            if not math.isfinite(value):
                raise FloatingPointError(f"Non-finite training loss at step {step}")
            if self.slices is not None:  # the shares' gradients sum over cp (see .context)
                loss = loss * self.slices.gradient_scale
            with profiler.region("train/backward"):
                scaler.scale(loss / config.gradient_accumulation_steps).backward()  # type: ignore[no-untyped-call]
            loss_sum += value / config.gradient_accumulation_steps
            tokens += y.numel() * self.world
            self.state.tokens_seen += y.numel() * self.world

        with profiler.region("train/optimizer"):
            if self.parallel is not None:
                self.parallel.finish_gradients(self.model)
            scaler.unscale_(self.optimizer)
            if self.parallel is not None:
                self.parallel.sync_found_inf(scaler, self.optimizer)
            # FSDP2 and expert parallelism: the norm of every rank's shards, whole.
            norm = clip_grad_norm(list(self.model.parameters()),
                                  config.max_grad_norm or float("inf"), self.parallel,
                                  None if self.pipeline is None else self.pipeline.slots)
            # The update's one host read: pre-clip norm, QK observations' finiteness and
            # the scaler's found-inf, together (see _host_values).
            observed = qk_clip.nonfinite()
            grad_norm, qk_nonfinite, overflow = _host_values(
                norm, observed if self.pipeline is None else self._on_any_stage(observed),
                overflow_flag(scaler, self.optimizer))
            if not scaler.is_enabled() and not math.isfinite(grad_norm):
                raise FloatingPointError(
                    f"Non-finite gradient norm at step {step} (the loss was finite: "
                    f"{loss_sum:.6g}); lower the LR or max_grad_norm, or check the data")
            qk_clip.validate(qk_nonfinite)
            if qk_nonfinite and observed is None:  # a stage without MLA stops alike
                raise FloatingPointError(
                    "QK-Clip: non-finite max pre-softmax logit on another pipeline stage "
                    "(its ranks name the module); nothing was changed")
            scaler.step(self.optimizer)
            scaler.update()
            # The contract's "the scaler skipped": GradScaler.update() multiplies the scale by
            # backoff_factor (< 1) exactly when unscale_ found an inf/NaN, which is also
            # exactly when scaler.step skipped the optimizer. Reading found-inf with the
            # norm spares the two get_scale() syncs; the scaler state is read when a
            # checkpoint or the session end needs it.
            if self.by_source is not None and overflow:
                self.by_source.discard()
            elif self.by_source is not None:
                self.by_source.commit()
            with profiler.region("train/qk_clip"):
                if overflow:
                    qk_clip.reset()
                else:
                    report = qk_clip.apply()
                    if self.diagnostics:
                        self.window.add_qk(report)
            self.optimizer.zero_grad(set_to_none=True)
        profiler.attempt_done()
        self.callbacks.attempt_end(self, step)
        return _Attempt(step, lr, loss_sum, tokens, grad_norm, overflow)

    def _on_any_stage(self, flag: torch.Tensor | None) -> torch.Tensor:
        """QK-Clip's non-finite flag as a MAX over every stage (a stage without an MLA
        layer observes nothing), so every rank refuses the update or none does: one
        all-reduce on the device, read with the norm."""
        assert self.parallel is not None
        value = torch.zeros(1, device=self.device) if flag is None else \
            flag.to(self.device, torch.float32).reshape(1)
        return self.parallel.max_(value)[0] > 0

    def _qk_policy(self) -> QKClipPolicy:
        policy = qk_clip_policy(self.config)
        return policy if self.pipeline is None else stage_qk_policy(self.model, policy)

    def _pipeline_microbatches(self, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
        """One batch through the pipeline schedule, forward and backward; returns its
        share of the update's mean loss (over the data ranks), checked finite."""
        assert self.pipeline is not None
        accumulation = self.config.gradient_accumulation_steps
        documents = {} if self._document_boundary is None else {
            "document_ids": document_ids(x, self._document_boundary)}
        with self.profiler.region("train/pipeline"), autocast(self.device,
                                                              self.config.precision):
            local = self.pipeline.train(x, y, accumulation * self.pipeline.count,
                                        self.scaler.scale, self._source_tokens(),
                                        **documents)
        if self.scaler.is_enabled():
            # Only the last stage scales a loss, and GradScaler creates its scale at its
            # first scale() call: without this one, unscale_ refuses on the other stages.
            # Their gradients carry the last stage's factor, which equals theirs (every
            # stage's scaler starts alike and found-inf is a MAX over every rank).
            self.scaler.scale(torch.zeros((), device=self.device))
        value = self._mean_loss(local)
        if not math.isfinite(value):
            raise FloatingPointError(f"Non-finite training loss at step {step}")
        return value

    def _source_tokens(self) -> TokenLosses | None:
        """For a mixture under pipeline stages: each microbatch's target losses to their
        rows' sources (the microbatches are consecutive rows of the batch)."""
        if self.by_source is None:
            return None
        by_source = self.by_source
        sources = self.loaders.train.row_sources().to(  # type: ignore[attr-defined]
            self.device, non_blocking=True)

        def add(index: int, token_losses: torch.Tensor, targets: torch.Tensor) -> None:
            rows = targets.shape[0]
            by_source.add(token_losses, targets, sources[index * rows:(index + 1) * rows])

        return add

    def _loss(self, x: torch.Tensor, y: torch.Tensor, documents: dict[str, Any]
              ) -> torch.Tensor:
        """The microbatch's mean token loss; for a mixture, from each target's loss, whose
        rows also go to their sources' sums (on the device: no host read)."""
        if self.by_source is None:
            _, loss = self.forward(x, targets=y, **documents)
            return loss  # type: ignore[no-any-return]
        _, token_losses = self.forward(x, targets=y, reduction="none", **documents)
        sources = self.loaders.train.row_sources()  # type: ignore[attr-defined]
        scored = y if self.slices is None else self.slices.mine(y)  # each token counted once
        self.by_source.add(token_losses, scored, sources.to(self.device, non_blocking=True))
        return token_losses.sum() / y.numel()  # type: ignore[no-any-return]

    def _skipped(self, attempt: _Attempt, consecutive: int) -> None:
        """An FP16 overflow skipped the update: count it; the same step is tried again with
        the next data."""
        self.state.skipped_updates += 1
        self.window.skipped += 1
        self._event("overflow", step=attempt.step, scale=self.scaler.get_scale(),
                    skipped_updates=self.state.skipped_updates,
                    tokens_seen=self.state.tokens_seen)
        if consecutive >= MAX_CONSECUTIVE_SKIPS:
            raise FloatingPointError(
                f"{MAX_CONSECUTIVE_SKIPS} consecutive FP16 overflows at step {attempt.step}: "
                "the loss scale cannot recover; lower the LR or use bf16")

    def _succeeded(self, attempt: _Attempt) -> None:
        self.state.step = attempt.step
        self.window.add(attempt.loss, attempt.tokens, attempt.grad_norm, attempt.lr)
        self.callbacks.step_end(self, {"loss": attempt.loss, "lr": attempt.lr,
                                       "grad_norm": attempt.grad_norm,
                                       "tokens_per_s": self.window.tokens_per_s(self.profiler)})

    # --- the auxiliary boundary -------------------------------------------------------------

    def _boundary(self) -> None:
        """Logging, evaluation and checkpointing due at this successful step (all on the
        last)."""
        step, config = self.state.step, self.config
        final = step == config.max_steps
        if final or step % config.log_interval == 0:
            self.log_window()
        if final or step % config.eval_interval == 0:
            self.evaluate()
        if self.store is not None and (final or step % config.checkpoint_interval == 0):
            self.save_checkpoint()
        else:
            self.saves.poll()

    def log_window(self) -> None:
        """Report the log window's summary (``train`` event) and start a new window."""
        with self.profiler.region("log"):
            by_source = getattr(self.loaders.train, "tokens_by_source", None)
            losses = {} if self.by_source is None else {"loss_by_source": self.by_source.summary(
                self.parallel.sum_ if self.parallel is not None else None)}
            figures = {**self.window.summary(self.profiler),
                       **self.moe.summary(self.window.updates + self.window.skipped)}
            if self.parallel is not None and self.pipeline is not None:
                # Each stage observed only its own layers: every stage's, as one process's.
                figures.update(combine_stages(
                    self.parallel.pipeline_gather(layer_figures(figures))))
            self._event("train", step=self.state.step, tokens_seen=self.state.tokens_seen,
                        **({"tokens_by_source": by_source()} if callable(by_source) else {}),
                        **losses,
                        skipped_updates=self.state.skipped_updates,
                        **figures)
            self.window.reset(self.profiler)

    def evaluate(self) -> None:
        """Evaluate the fixed validation prefix (``eval`` event)."""
        with self.profiler.region("eval"):
            evaluated = self.model if self.pipeline is None else PipelineEvaluation(
                self.pipeline, self.model)
            if self.slices is not None:
                evaluated = self.forward
            result = evaluate_split(
                evaluated, self.loaders.val, self.device,
                self.config.validation_batches(self.loaders.val.tokens_per_batch),
                self.config.precision,
                all_reduce=(None if self.parallel is None else self.parallel.sum_
                            if self.pipeline is None and self.slices is None
                            else self._pipeline_eval_sum),
                document_boundary=self._document_boundary)
        by_source = {} if result.by_source is None else {"val_by_source": {
            name: {"val_loss": part.loss, "val_bpb": part.bpb, "val_tokens": part.tokens}
            for name, part in result.by_source.items()}}
        self._event("eval", step=self.state.step, val_loss=result.loss, val_bpb=result.bpb,
                    val_tokens=result.tokens, tokens_seen=self.state.tokens_seen, **by_source)

    def _pipeline_eval_sum(self, sums: torch.Tensor) -> None:
        """``[loss·tokens, tokens, bytes]``: the loss lives on the last stage (summed over
        the world), the counts on every stage (summed over the data ranks). Context
        parallel likewise: each rank of a ``cp`` group has its slices' share of the loss
        and the whole rows' counts."""
        assert self.parallel is not None
        total = self.parallel.sum_(sums[:1].clone())
        self.parallel.data_sum_(sums)
        sums[0] = total[0]

    def save_checkpoint(self) -> str:
        """Write the checkpoint at this update boundary; returns its digest (``""`` when it
        is written in the background: its ``checkpoint`` event carries the digest once it
        is durable). A write still in flight is waited for first (its failure raised on
        every rank)."""
        return self.saves.save(self.state.step)

    # --- helpers ---------------------------------------------------------------------------

    def _event(self, name: str, **fields: Any) -> None:
        self.callbacks.event(self, event_record(name, **fields))

    def emit(self, event: str, **fields: Any) -> None:
        """Publish a ``metrics.jsonl`` event from a callback (an ``eval`` event of its own
        results, say): every callback's hook for ``event`` sees it, metrics.jsonl records
        it."""
        self._event(event, **fields)

    def _training_batch(self) -> Batch:
        """The next training batch, or the fixed overfit batch (if that mode is on).

        An exhausted loader is reset to offset zero here (discarding the incomplete tail);
        the loader itself never wraps. Overfit mode picks the batch at the cursor once,
        records its offset in ``state``, and rereads it without moving the cursor.
        """
        train = self.loaders.train
        if self.config.overfit_batch:
            if self._fixed_batch is None:
                if self.state.fixed_batch_offset is None:
                    self.state.fixed_batch_offset = train.offset
                self._fixed_batch = _to_device(train.batch_at(self.state.fixed_batch_offset),
                                               self.device)
            return self._fixed_batch
        try:
            batch = train.next_batch()
        except DataExhausted:
            train.reset()
            batch = train.next_batch()
        pop_epochs = getattr(train, "pop_epochs", None)
        for source, epoch in pop_epochs() if callable(pop_epochs) else ():
            logger.warning("data source %r ran out at step %d and starts over (epoch %d): "
                           "its tokens are now seen again", source, self.state.step + 1, epoch)
            self._event("epoch", step=self.state.step + 1, source=source, epoch=epoch)
        return _to_device(batch, self.device)


def _host_values(norm: torch.Tensor, qk_nonfinite: torch.Tensor | None,
                 overflow: torch.Tensor | None) -> tuple[float, bool, bool]:
    """``(grad_norm, qk_nonfinite, overflow)`` on the host in one device→host copy.

    Per update the loop syncs once per microbatch (the contract's finite-loss check) and once
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


def _to_device(batch: Batch, device: torch.device) -> Batch:
    x, y = batch
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def _device_of(model: torch.nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")
