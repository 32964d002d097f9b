"""One rank of a data-parallel test run (``torchrun ... dist_worker.py``), or one process
(``--parallel none``): trains the small model through ``k3_trainer.Trainer`` and saves what
the tests compare to ``OUT/rank{R}.pt``: the logged events, the full (unsharded) weights
and buffers, the balancer biases, and (``--reject-on-rank``) what a refused resume did.

Test code only; the package never imports it.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

from harness import NARROW_TINY_MODEL, seed_all, train_config, tree_digest

import k3_checkpoint
from k3_model import K3Model
from k3_trainer import (
    Callback,
    FP16SkipHarness,
    MetricsLog,
    TokenDataLoader,
    Trainer,
    build_optimizer,
)
from k3_trainer.data import MixtureLoader, Source
from k3_trainer.distributed import init_parallel, shutdown
from k3_trainer.models import get_model_spec
from k3_trainer.pipeline import Pipeline
from k3_trainer.torchrun import leave_worker


def _rng_digest() -> str:
    """The global Python, NumPy and torch CPU generators' states, digested: a rank that
    rolls a refused resume back must leave them as they were."""
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    digest.update(np.random.get_state()[1].tobytes())
    digest.update(repr(random.getstate()).encode())
    return digest.hexdigest()


def local(value: object) -> object:
    """``value`` with every DTensor replaced by this rank's shard (no collective)."""
    if isinstance(value, dict):
        return {key: local(item) for key, item in value.items()}
    if isinstance(value, list):
        return [local(item) for item in value]
    to_local = getattr(value, "to_local", None)
    return to_local() if callable(to_local) else value


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight and buffer, whole (a DTensor shard is gathered; a collective)."""
    out = {}
    for name, value in model.state_dict().items():
        full = getattr(value, "full_tensor", None)
        out[name] = (full() if callable(full) else value).detach().clone()
    return out


class WeightEMA(Callback):
    """A toy stateful callback, added in one place (``callbacks=[...]``): an exponential
    moving average of the whole weights, identical on every rank (a sharded parameter is
    gathered), so the checkpoint keeps it once."""

    name = "ema"

    def __init__(self) -> None:
        self.shadow: dict[str, torch.Tensor] = {}

    def on_step_end(self, trainer: Trainer, stats: dict[str, float]) -> None:
        for name, parameter in trainer.model.named_parameters():
            whole = getattr(parameter, "full_tensor", None)  # a collective under FSDP2
            value = (whole() if callable(whole) else parameter).detach().clone()
            if name in self.shadow:
                self.shadow[name].mul_(0.5).add_(value, alpha=0.5)
            else:
                self.shadow[name] = value

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, torch.Tensor], /) -> None:
        self.shadow = {name: tensor.clone() for name, tensor in state.items()}


class HostReads(Callback):
    """Counts the calls that copy a tensor's value to the host (and so wait for a GPU)
    while active; :meth:`per_update` gives the count between consecutive step ends (the
    host-resident step counters of torch's AdamW excluded, as in test_host_syncs.py)."""

    READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__",
             "__index__")

    def __init__(self) -> None:
        self.calls = 0
        self.marks: list[int] = []
        self.host_resident: set[int] = set()
        self.originals = {name: getattr(torch.Tensor, name) for name in self.READS}

    def __enter__(self) -> HostReads:
        for name, original in self.originals.items():
            def counted(tensor, *args, original=original, **kwargs):
                if id(tensor) not in self.host_resident:
                    self.calls += 1
                return original(tensor, *args, **kwargs)
            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, original)

    def on_step_end(self, trainer: Trainer, stats: dict[str, float]) -> None:
        self.marks.append(self.calls)
        self.host_resident.update(id(s["step"]) for s in trainer.optimizer.state.values()
                                  if isinstance(s.get("step"), torch.Tensor))

    def per_update(self) -> list[int]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


class OverflowOnOneRank(FP16SkipHarness):
    """The FP16 skip path in fp32 with an overflow found only by this rank, at one attempt
    (as when one FSDP2 shard of a gradient holds an inf)."""

    def __init__(self, attempt: int) -> None:
        super().__init__()
        self.attempt, self.calls = attempt, 0

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        self.calls += 1
        if self.calls == self.attempt:
            for flag in self._found_inf_per_device(optimizer).values():
                flag.fill_(1.0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parallel", default="none")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--decay-steps", type=int, help="default: --steps")
    parser.add_argument("--ema", action="store_true", help="add the WeightEMA callback")
    parser.add_argument("--qk-clip-tau", type=float, default=100.0)
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--allow-runtime-change", action="store_true",
                        help="resume a checkpoint of another layout (Trainer.resume's flag)")
    parser.add_argument("--reject-on-rank", type=int)
    parser.add_argument("--overflow-on-rank", type=int)
    parser.add_argument("--expert-parallel", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1,
                        help="pipeline stages (1F1B, 2 microbatches), as the CLI builds them")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--mix", type=Path,
                        help="a second dataset: train on docs=DATA:0.7 and code=MIX:0.3")
    parser.add_argument("--document-masking", action="store_true")
    parser.add_argument("--count-host-reads", action="store_true",
                        help="record the host reads of every update (HostReads)")
    args = parser.parse_args()

    parallel, _ = init_parallel(args.parallel, torch.device("cpu"), args.pp)
    rank = parallel.rank if parallel is not None else 0
    # the data's rank and count: every stage of a data rank reads the same rows
    data_rank, world = ((parallel.data_rank, parallel.data_parallel) if parallel is not None
                        else (0, 1))
    config = train_config(batch_size=args.batch_size, max_steps=args.steps,
                          decay_steps=args.decay_steps or args.steps,
                          checkpoint_interval=args.steps,
                          qk_clip_tau=args.qk_clip_tau,
                          expert_parallel=args.expert_parallel,
                          gradient_accumulation_steps=args.accumulation,
                          document_masking=args.document_masking,
                          **({"pipeline_parallel": args.pp, "pp_microbatches": 2}
                             if args.pp > 1 else {}),
                          # counting host reads: no logging or evaluation in between
                          **({"log_interval": args.steps, "eval_interval": args.steps}
                             if args.count_host_reads else {"eval_interval": 3}))
    seed_all(config.seed)
    model = K3Model(NARROW_TINY_MODEL)
    spec, pipeline = get_model_spec("k3"), None
    if parallel is not None and args.pp > 1:  # cut before sharding, as the CLI does
        assert spec.pipeline is not None
        pipeline = Pipeline(model, spec.pipeline, parallel, config)
    if parallel is not None:
        parallel.shard_experts(model, config.expert_parallel, spec.expert_parallel)
        model.set_balancer_gather(parallel.gather_rows)
        parallel.wrap(model, None if pipeline is None else pipeline.modules)
    if pipeline is not None:
        assert parallel is not None
        pipeline.start()
        parallel.stages = pipeline
    optimizer = build_optimizer(model, config, distributed=True if args.parallel == "ddp"
                                else None, stage=pipeline is not None)
    if args.mix is not None:
        sources = [Source("docs", args.data, 0.7), Source("code", args.mix, 0.3)]
        loaders = [MixtureLoader(sources, split, config.batch_size, config.seq_len,
                                 rank=data_rank, world_size=world) for split in ("train", "val")]
    else:
        loaders = [TokenDataLoader(args.data, split, config.batch_size, config.seq_len,
                                   rank=data_rank, world_size=world)
                   for split in ("train", "val")]
    result: dict = {}
    log = MetricsLog(None)
    scaler = None
    if args.overflow_on_rank is not None:
        scaler = OverflowOnOneRank(2 if rank == args.overflow_on_rank else 0)
    run_config = config
    if args.resume is not None and args.reject_on_rank == rank:
        # this rank's run differs from the checkpoint
        run_config = train_config(**{**config.to_dict(), "peak_lr": 1e-4})
    ema = WeightEMA() if args.ema else None
    reads = HostReads() if args.count_host_reads else None
    callbacks = [c for c in (log, ema, reads) if c is not None]
    trainer = Trainer(model, optimizer, loaders, run_config, parallel=parallel,
                      checkpoint_path=args.checkpoint, callbacks=callbacks, grad_scaler=scaler)
    if args.resume is not None:
        def fingerprint() -> tuple[str, ...]:
            return (tree_digest(full_state(model)), tree_digest(local(optimizer.state_dict())),
                    tree_digest(trainer.state.state_dict()),
                    tree_digest(ema.state_dict() if ema is not None else None),
                    _rng_digest())

        # Move every generator past the checkpoint's saved state (training here draws
        # none), so a load that restored them and a rollback that forgot to put them back
        # would show.
        torch.rand(1), random.random(), np.random.rand()
        before = fingerprint()
        try:
            trainer.resume(args.resume, allow_runtime_change=args.allow_runtime_change)
        except k3_checkpoint.CheckpointError as exc:
            result["refused"] = str(exc)
            result["unchanged"] = before == fingerprint()
            result["cursors"] = [loader.offset for loader in loaders]
    if "refused" not in result:
        if reads is not None:
            with reads:
                trainer.fit()
            result["host_reads_per_update"] = reads.per_update()
            result["moe_layers"] = len(model.moe_layers())
        else:
            trainer.fit()
        result["events"] = [{k: v for k, v in e.items() if k != "time"} for e in log.events]
    result["weights"] = full_state(model)
    if ema is not None:
        result["ema"] = ema.shadow
    result["biases"] = {name: buf.clone() for name, buf in model.named_buffers()
                        if name.endswith("balancer.bias")}
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(result, args.out / f"rank{rank}.pt")
    shutdown(parallel)
    return 0


if __name__ == "__main__":
    leave_worker(main())
