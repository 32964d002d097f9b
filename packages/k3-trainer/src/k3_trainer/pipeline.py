"""Pipeline stages through ``torch.distributed.pipelining``: the cut model, its
``PipelineStage``s and the schedule that runs one batch's microbatches (the layouts it
refuses are :func:`k3_trainer.planning.layout.check_launch`'s).

``--pipeline-parallel P`` cuts the decoder blocks into ``P × V`` contiguous stages
(``V = --pp-stages-per-rank``, 2 or more for ``interleaved-1f1b``, exactly 2 for ``zbv``
and ``dualpipev``; stage ``s`` on pipeline rank ``s mod P``, or in a V for those two:
rank ``r`` holds stages ``r`` and ``2P − 1 − r``), through the model spec's hooks
(:class:`PipelineHooks`; K3Model's are :mod:`k3_model.pipeline`). Each rank keeps one
model holding every layer of its stages, under the whole model's parameter names, so the
optimizer, QK-Clip, the balancer and the checkpoint see an ordinary (smaller) model and a
checkpoint does not depend on ``P``.

One process's mathematics: the schedule is built with ``scale_grads=False`` and its loss
function divides each microbatch's mean token loss by the microbatch count of the whole
update (``M × gradient_accumulation_steps``), exactly what one process's gradient
accumulation backpropagates; gradients then sum over microbatches and are not averaged
a second time.

With context parallelism (``--cp N``, :mod:`k3_trainer.context`) the stages run on this
rank's slice of every row: the schedule is given the slices of the token and document
ids (what crosses a boundary is ``(rows, seq_len / N, ·)``) and the whole rows' targets,
so the loss function scores the slice's targets and divides by the whole rows' count
(:class:`~k3_trainer.context.Slices`); the stage's ``dp × cp`` ranks then average the
gradients of ``N`` times that share, which is one process's gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .config import TrainConfig
from .context import Slices

if TYPE_CHECKING:
    from k3_qkclip import QKClipPolicy

    from .distributed import Parallel
    from .models import PipelineHooks
    from .tasks.scoring import ContinuationScores

TokenLosses = Callable[[int, Tensor, Tensor], None]
"""``(microbatch index, each target's loss, targets)``, on the last stage."""


class Pipeline:
    """This rank's stages of ``model`` (cut in place when built) and the schedule that
    runs them (built by :meth:`start`, once the model is sharded).

    :meth:`train` runs one batch's microbatches forward and backward (the gradients
    accumulate in the parameters, each microbatch's loss divided by ``scale``);
    :meth:`evaluate` forward only. Both return this rank's sum of the microbatches'
    losses (zero on a rank without the last stage)."""

    def __init__(self, model: nn.Module, hooks: PipelineHooks, parallel: Parallel,
                 config: TrainConfig) -> None:
        # Here, not at the top: the planning package loads k3_model and the model
        # inventory, which importing the trainer does not need.
        from .planning.layout import V_SHAPED, microbatches, stage_blocks, stage_rank

        self.parallel, self.config, self.hooks = parallel, config, hooks
        self.count = microbatches(config)
        pp = parallel.pipeline
        self.total = total = pp * config.pp_stages_per_rank
        ranges = stage_blocks(hooks.n_layers(model), total)
        self.indices = [s for s in range(total)  # looped, or in a V (zbv, dualpipev)
                        if stage_rank(s, pp, config.pp_schedule) == parallel.pipeline_rank]
        held = [index for s in self.indices for index in ranges[s]]
        order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        self.qk_geometry = _whole_geometry(model, config)
        """The whole model's QK-Clip geometry (None: QK-Clip refuses the model), which the
        run's metadata records whatever the cut, so a checkpoint is portable."""
        hooks.keep(model, held, first=0 in self.indices, last=total - 1 in self.indices)
        self.modules = [hooks.stage(model, ranges[s], first=s == 0, last=s == total - 1)
                        for s in self.indices]
        """Each stage's forward module, in stage order (what FSDP2 shards as a root)."""
        self.has_last = total - 1 in self.indices
        self.slots = ([order[name] for name, _ in model.named_parameters()], len(order))
        """Each kept parameter's index among the whole model's (``model.parameters()``
        order) and their count: :func:`~k3_trainer.distributed.clip_grad_norm` lays the
        stages' norms out as one process would."""
        self.slices = (Slices(parallel.context_rank, parallel.context_parallel)
                       if parallel.context_parallel > 1 else None)
        """This rank's slice of every row under context parallelism (None: whole rows)."""
        self._scale = 1.0
        self._scale_loss: Callable[[Tensor], Tensor] = _same
        self._values: list[Tensor] = []
        self._tokens: TokenLosses | None = None
        self._capture: Callable[[int, Tensor, Tensor], None] | None = None
        self.schedule: Any = None
        self.v_shaped = config.pp_schedule in V_SHAPED
        """A V-shaped schedule (a rank holds two adjacent stages), which torch cannot run
        forward only (:meth:`_forward_through_a_v`)."""

    def start(self) -> None:
        """Build the ``PipelineStage``s and the schedule (after sharding and compile)."""
        from torch.distributed import pipelining

        parallel, config, hooks = self.parallel, self.config, self.hooks
        rows = config.batch_size // self.count
        length = config.seq_len // parallel.context_parallel  # a slice of every row
        stages: list[Any] = []
        for module, s in zip(self.modules, self.indices, strict=True):
            # What crosses a boundary has the parameters' dtype (autocast's matmuls add
            # into that residual stream).
            dtype = next(p.dtype for p in module.parameters() if p.is_floating_point())
            inputs, outputs = module.example_io(  # type: ignore[operator]
                rows, length, dtype)
            stages.append(pipelining.PipelineStage(
                module, s, self.total, parallel.device, group=parallel.pipeline_group,
                input_args=inputs, output_args=outputs))
        last_module, slices = self.modules[-1], self.slices

        def loss_fn(output: Tensor, targets: Tensor) -> Tensor:
            if self._capture is not None:  # scoring (forward only): the outputs themselves
                self._capture(len(self._values), output, targets)
            if slices is not None:  # the slice's share of the whole rows' mean
                token_losses = hooks.loss(last_module, output, slices.own(targets),
                                          reduction="none")
                if self._tokens is not None:
                    self._tokens(len(self._values), slices.spread(token_losses),
                                 slices.mine(targets))
                    loss = token_losses.sum() / targets.numel()
                else:
                    loss = slices.share(token_losses, targets)
            elif self._tokens is None:
                loss = hooks.loss(last_module, output, targets)
            else:  # every target's loss kept (microbatches reach here in order)
                token_losses = hooks.loss(last_module, output, targets, reduction="none")
                self._tokens(len(self._values), token_losses, targets)
                loss = token_losses.sum() / targets.numel()
            loss = loss / self._scale
            self._values.append(loss.detach().float())
            if slices is not None:  # averaged over dp × cp, the shares must sum over cp
                loss = loss * slices.gradient_scale
            return self._scale_loss(loss)

        multi = _multi_stage()
        if config.pp_schedule in multi:
            self.schedule = multi[config.pp_schedule](
                stages, self.count, loss_fn=loss_fn, scale_grads=False)
        else:
            kind = (pipelining.ScheduleGPipe if config.pp_schedule == "gpipe"
                    else pipelining.Schedule1F1B)
            self.schedule = kind(stages[0], self.count, loss_fn=loss_fn, scale_grads=False)

    def train(self, x: Tensor, y: Tensor, scale: int,
              scale_loss: Callable[[Tensor], Tensor] | None = None,
              tokens: TokenLosses | None = None, **kwargs: Tensor) -> Tensor:
        """Forward and backward of the batch ``(x, y)`` in microbatches, each one's mean
        token loss divided by ``scale`` (the update's microbatch count) and passed through
        ``scale_loss`` (the FP16 loss scale) before its backward. Returns the sum of the
        divided losses (unscaled) on the last stage, zero elsewhere. ``tokens``: called on
        the last stage with each microbatch's index, its targets' losses and the targets
        (a mixture's loss by source); the loss is then their sum over the targets."""
        self._scale, self._scale_loss, self._values = float(scale), scale_loss or _same, []
        self._tokens = tokens
        inputs, documents = self._inputs(x, kwargs)
        try:
            self.schedule.step(inputs, target=y, return_outputs=False, **documents)
        finally:
            self._tokens = None
        return self._sum()

    def _inputs(self, x: Tensor, kwargs: dict[str, Tensor]
                ) -> tuple[Tensor, dict[str, Tensor]]:
        """The schedule's token ids and keyword tensors (document ids): this rank's slice
        of every row under context parallelism, else as given."""
        if self.slices is None:
            return x, kwargs
        own = self.slices.own
        return own(x), {name: own(value) for name, value in kwargs.items()}

    @torch.no_grad()
    def evaluate(self, x: Tensor, y: Tensor, **kwargs: Tensor) -> Tensor:
        """The batch's mean token loss (the microbatches' mean) on the last stage, forward
        only; zero elsewhere."""
        self._scale, self._scale_loss, self._values = float(self.count), _same, []
        inputs, documents = self._inputs(x, kwargs)
        if self.v_shaped:
            self._forward_through_a_v(inputs, y, documents)
        else:
            self.schedule.eval(inputs, target=y, **documents)
        return self._sum()

    def _forward_through_a_v(self, inputs: Tensor, y: Tensor, documents: dict[str, Tensor]
                             ) -> None:
        """Forward only under a V-shaped schedule (``zbv``, ``dualpipev``), whose own
        ``eval()`` cannot run: torch's runtime still performs the backward actions there,
        and the hand-over between a rank's two adjacent stages fails ("can't
        steal_bwd_input if this stage doesn't have backward", torch 2.13 and 2.14). A
        training step runs instead, its every loss times zero, and the gradients it leaves
        are dropped: the same forward values and losses, at the cost of a backward."""
        self._scale_loss = _zero
        try:
            with torch.enable_grad():
                self.schedule.step(inputs, target=y, return_outputs=False, **documents)
        finally:
            for module in self.modules:
                for parameter in module.parameters():
                    parameter.grad = None

    @torch.no_grad()
    def score(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """Forward only through the stages: each target's log-probability (float64) and
        whether it is the most likely token, ``y``'s shape, on every rank of this
        pipeline (the last stage's, summed over the pipeline ranks; under context
        parallelism each slice's, summed over the ``cp`` ranks too)."""
        from .tasks.scoring import target_logprobs

        logits = self.hooks.logits
        assert logits is not None, "the model's PipelineHooks have no logits hook"
        found = torch.zeros((2, *y.shape), dtype=torch.float64, device=self.parallel.device)
        rows = y.shape[0] // self.count
        last, slices = self.modules[-1], self.slices

        def capture(index: int, output: Tensor, targets: Tensor) -> None:
            mine = targets if slices is None else slices.own(targets)
            logprob, best = target_logprobs(logits(last, output), mine)
            both = torch.stack([logprob.detach().double(), best.double()])
            at = slice(index * rows, (index + 1) * rows)
            # Under context parallelism the slice's columns, zeros elsewhere (summed below).
            found[:, at] = both if slices is None else slices.spread(both)

        self._capture = capture
        try:
            self.evaluate(x, y)
        finally:
            self._capture = None
        self.parallel.pipeline_sum_(found)
        self.parallel.context_sum_(found)
        return found[0], found[1] > 0.5

    def _sum(self) -> Tensor:
        if not self.has_last:
            return torch.zeros((), device=self.parallel.device)
        return torch.stack(self._values).sum()


def _multi_stage() -> dict[str, Any]:
    from torch.distributed import pipelining

    return {"interleaved-1f1b": pipelining.ScheduleInterleaved1F1B,
            "zbv": pipelining.ScheduleZBVZeroBubble,
            "dualpipev": pipelining.ScheduleDualPipeV}


def _whole_geometry(model: nn.Module, config: TrainConfig) -> dict[str, Any] | None:
    from k3_qkclip import QKClip

    from .checkpoint.compatibility import qk_clip_policy

    try:
        geometry: dict[str, Any] = QKClip(model, qk_clip_policy(config)).geometry()
    except ValueError:
        return None
    return geometry


def stage_qk_policy(model: nn.Module, policy: QKClipPolicy) -> QKClipPolicy:
    """QK-Clip's policy for one stage's cut model: the run's, or off on a stage that holds
    no MLA layer (nothing to observe or rescale there; the stages holding one clip)."""
    from k3_qkclip import QKClip

    try:
        QKClip(model, policy)
    except ValueError:
        return dataclasses.replace(policy, enabled=False)
    return policy


def _same(loss: Tensor) -> Tensor:
    return loss


def _zero(loss: Tensor) -> Tensor:
    return loss * 0.0


class PipelineEvaluation(nn.Module):
    """The pipeline as ``evaluate_split`` calls a model: ``(None, loss)``, forward only
    through the stages (the loss is the last stage's, zero on other ranks: sum it over
    the world, the token counts over the data ranks). ``train``/``eval`` switch the
    rank's model too, so validation never updates the balancer."""

    def __init__(self, pipeline: Pipeline, model: nn.Module) -> None:
        super().__init__()
        self.pipeline, self.held = pipeline, [model]
        self.training = model.training

    def train(self, mode: bool = True) -> PipelineEvaluation:
        self.training = mode
        self.held[0].train(mode)
        return self

    def forward(self, x: Tensor, targets: Tensor, document_ids: Tensor | None = None
                ) -> tuple[None, Tensor]:
        kwargs = {} if document_ids is None else {"document_ids": document_ids}
        return None, self.pipeline.evaluate(x, targets, **kwargs)


class PipelineScoring(nn.Module):
    """The pipeline as task scoring calls a model with ``score_continuations``: every
    (context + continuation) a row of one fixed-shape batch (the stages' ``batch_size ×
    seq_len``, padded after its end: causal, so padding changes nothing before it), run
    forward only through the stages. Every rank scores every document (a stage's data
    ranks run the same batches, as FSDP2's gathers need) and gets the same numbers.
    Rows must fit ``seq_len``: score with ``max_len`` at most ``seq_len``. The batch is
    the stages' own ``batch_size`` (the one ``score_continuations`` is given is not)."""

    def __init__(self, pipeline: Pipeline, model: nn.Module) -> None:
        super().__init__()
        self.pipeline, self.held = pipeline, [model]  # a list: not a submodule

    def score_continuations(self, requests: list[Any], batch_size: int = 16
                            ) -> list[ContinuationScores]:
        from .tasks.scoring import ContinuationScores

        config, device = self.pipeline.config, self.pipeline.parallel.device
        rows = [(r, c, [*request.context, *continuation], len(request.context))
                for r, request in enumerate(requests)
                for c, continuation in enumerate(request.continuations)]
        logliks = [[0.0] * len(request.continuations) for request in requests]
        greedy = [[False] * len(request.continuations) for request in requests]
        model = self.held[0]
        was_training = model.training
        model.eval()  # no balancer update, as validation
        try:
            for start in range(0, len(rows), config.batch_size):
                chunk = rows[start:start + config.batch_size]
                x = torch.zeros(config.batch_size, config.seq_len, dtype=torch.long)
                y = torch.zeros_like(x)
                for i, (_, _, ids, _) in enumerate(chunk):
                    if len(ids) - 1 > config.seq_len:
                        raise ValueError(f"a scored row of {len(ids) - 1} tokens does not "
                                         f"fit the stages' seq_len {config.seq_len}")
                    x[i, :len(ids) - 1] = torch.tensor(ids[:-1])
                    y[i, :len(ids) - 1] = torch.tensor(ids[1:])
                logprob, best = self.pipeline.score(x.to(device), y.to(device))
                for i, (r, c, ids, context) in enumerate(chunk):
                    span = slice(context - 1, len(ids) - 1)  # the continuation's targets
                    logliks[r][c] = float(logprob[i, span].sum())
                    greedy[r][c] = bool(best[i, span].all())
        finally:
            model.train(was_training)
        return [ContinuationScores(a, b) for a, b in zip(logliks, greedy, strict=True)]
