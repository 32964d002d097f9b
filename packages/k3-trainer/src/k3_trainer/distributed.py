"""Data parallelism through torch's own engine: torchrun's environment, DDP or FSDP2.

One process per device, launched by ``torchrun``. :func:`init_parallel` joins the process
group torchrun describes (gloo on CPU, nccl on CUDA) and returns a :class:`Parallel`:
the rank and world size, the collectives the loop needs (a loss mean, a MAX for QK-Clip,
found-inf for the FP16 skip, a flag that is true on every rank when true on one), and
:meth:`Parallel.wrap`, which shards the model with ``fully_shard`` (each decoder block,
then the root) or wraps it in ``DistributedDataParallel``. ``--parallel none`` never
touches ``torch.distributed``: the one-process path stays exactly as it was.

The layout is a device mesh (``torch.distributed.device_mesh``) with named dimensions
``pp`` (pipeline stages, :mod:`k3_trainer.pipeline`), ``dp`` (data ranks, from which
experts are carved) and ``cp`` (context-parallel ranks, which read the same rows and
each hold a slice of them, :mod:`k3_trainer.context`): :class:`Parallel` owns each
dimension's process group and every collective says which one it means (a stage's own
tensors meet over ``dp × cp``, its ``shard_group``; what every rank must agree on, over
the world). Without pipeline or context parallelism ``dp`` is the world.

Expert parallelism (``--expert-parallel N``, FSDP2 only) is set up here too, through the
model's own hooks (:class:`~k3_trainer.models.ExpertParallel` of its spec):
:meth:`Parallel.shard_experts` gives each rank ``E/N`` routed experts of every MoE layer,
:meth:`Parallel.wrap` keeps those parameters out of ``fully_shard``, and
:meth:`Parallel.finish_gradients` turns their gradients into the data-parallel mean.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .config import ConfigError
from .contract import read_contract
from .torchrun import MODES, launched_world_size

if TYPE_CHECKING:
    from .models import ExpertParallel


class Parallel:
    """This process's place in a data-parallel run, and the collectives the trainer uses.

    ``module`` is what the loop calls forward on: the DDP wrapper under ``ddp``, the
    sharded model itself under ``fsdp`` (``fully_shard`` works in place), set by
    :meth:`wrap`. Checkpoints, QK-Clip and diagnostics keep using the model itself.
    """

    def __init__(self, mode: str, device: torch.device, pipeline: int = 1,
                 context: int = 1) -> None:
        self.mode = mode
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.module: nn.Module | None = None
        self.stages: Any = None
        """This rank's pipeline stages and their schedule (a ``k3_trainer.pipeline.Pipeline``,
        which imports this module), what the loop runs a batch through instead of
        ``module`` (None: the whole model is here); set by the builder."""
        self.expert_parallel = 1
        self._experts: ExpertParallel | None = None
        self.pipeline = pipeline
        """Pipeline stages (ranks along ``pp``); 1: every rank holds the whole model."""
        self.context_parallel = context
        """Context-parallel ranks (along ``cp``): each holds a slice of the same rows."""
        self.data_parallel = self.world_size // (pipeline * context)
        """Data ranks (along ``dp``): the ranks that read different rows."""
        self.mesh: Any = None
        self.data_group: Any = None  # None: the world (no pipeline), as before
        self.pipeline_group: Any = None
        self.context_group: Any = None  # None: no context parallelism
        self.shard_group: Any = None
        """The ranks holding this stage's layers, over which FSDP2 shards them (dp × cp):
        the world without pipeline stages (None), else this stage's."""
        self.shard_mesh: Any = None
        """A 1-D device mesh of :attr:`shard_group` under pipeline stages (None without)."""
        self.pipeline_rank, self.data_rank, self.context_rank = 0, self.rank, 0
        if pipeline > 1 or context > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(device.type,
                                         (pipeline, self.data_parallel, context),
                                         mesh_dim_names=("pp", "dp", "cp"))
            self.data_group = self.mesh["dp"].get_group()
            self.pipeline_group = self.mesh["pp"].get_group()
            self.pipeline_rank = self.mesh.get_local_rank("pp")
            self.data_rank = self.mesh.get_local_rank("dp")
            self.context_group = self.mesh["cp"].get_group() if context > 1 else None
            self.context_rank = self.mesh.get_local_rank("cp")
        if pipeline > 1 and context > 1:
            # Each stage's dp × cp ranks as one dimension of a second mesh over the same
            # ranks (a stage's ranks are contiguous in the (pp, dp, cp) mesh).
            self.shard_mesh = init_device_mesh(
                device.type, (pipeline, self.data_parallel * context),
                mesh_dim_names=("pp", "dp_cp"))["dp_cp"]
        elif pipeline > 1:
            self.shard_mesh = self.mesh["dp"]
        if self.shard_mesh is not None:
            self.shard_group = self.shard_mesh.get_group()

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes the run directory (metrics, run.json, checkpoint, report)."""
        return self.rank == 0

    def describe(self) -> dict[str, Any]:
        """What the run record and the checkpoint's metadata say about the parallel layout
        (``expert_parallel`` only when on, so other runs' metadata stays as it was)."""
        layout: dict[str, Any] = {"mode": self.mode, "world_size": self.world_size}
        if self.expert_parallel > 1:
            layout["expert_parallel"] = self.expert_parallel
        if self.pipeline > 1:
            layout.update(pp=self.pipeline, dp=self.data_parallel)
        if self.context_parallel > 1:
            layout.update(cp=self.context_parallel, dp=self.data_parallel)
        return layout

    # --- expert parallelism --------------------------------------------------------------

    def shard_experts(self, model: nn.Module, degree: int,
                      experts: ExpertParallel | None) -> None:
        """Keep ``n_experts/degree`` routed experts of every MoE layer on this rank (in
        place, before :meth:`wrap`), through the model's own hooks ``experts`` (its spec's;
        None: the model cannot split its experts); ``degree`` 1 does nothing. Under
        pipeline stages, after the cut: the groups are carved from each stage's ranks, and
        a stage without an MoE layer (a dense first block) joins the mesh with nothing to
        split. Raises ``ConfigError`` for a layout that cannot work."""
        if degree == 1:
            return
        if self.mode != "fsdp":
            raise ConfigError(f"--expert-parallel {degree} needs --parallel fsdp: DDP offers no "
                              "public way to keep the expert parameters out of its all-reduce")
        ranks = self.world_size // self.pipeline  # the expert groups' ranks: one stage's
        if ranks % degree:
            raise ConfigError(f"--expert-parallel {degree} must divide the world size "
                              f"{self.world_size} (--nproc × nodes)" if self.pipeline == 1
                              else f"--expert-parallel {degree} must divide each stage's "
                              f"{ranks} ranks")
        count = 0 if experts is None else experts.n_experts(model)
        if experts is not None and self.pipeline > 1:  # a stage may hold no MoE layer
            count = int(self._all_reduce(torch.tensor([float(count)]), dist.ReduceOp.MAX,
                                         self.pipeline_group)[0])
        if experts is None or not count:
            raise ConfigError(f"--expert-parallel {degree}: the model has no MoE layer "
                              "whose experts it can split")
        if count % degree:
            raise ConfigError(f"--expert-parallel {degree} must divide n_experts ({count})")
        if self.pipeline > 1:  # the expert groups are carved from each stage's ranks
            experts.shard(model, self.world_size, degree, self.device.type,
                          stages=self.pipeline)
        else:
            experts.shard(model, self.world_size, degree, self.device.type)
        self.expert_parallel, self._experts = degree, experts

    def finish_gradients(self, model: nn.Module) -> None:
        """After the update's last backward: the expert gradients become the mean over
        every rank's tokens, as FSDP2 has made the others (nothing without experts)."""
        if self._experts is not None:
            self._experts.reduce_gradients(model)

    def moved_bytes(self, model: nn.Module) -> int:
        """Bytes this rank's expert all-to-alls sent to other ranks since the last call."""
        return 0 if self._experts is None else self._experts.moved_bytes(model)

    # --- model -------------------------------------------------------------------------

    def wrap(self, model: nn.Module, stages: list[nn.Module] | None = None) -> nn.Module:
        """Shard (``fsdp``) or replicate (``ddp``) ``model`` for training; returns the module
        to call forward on. Build the optimizer afterwards (FSDP2 swaps in DTensors).

        Under pipeline stages the schedule calls each stage's forward module (``stages``),
        not the model: FSDP2 shards each block, then each stage module as a root, over the
        ``dp`` dimension, keeping parameters gathered between microbatches; with one data
        rank nothing is sharded. Expert-parallel experts are sharded by expert already, on
        their own mesh: FSDP2 leaves them out."""
        ignored: set[nn.Parameter] = set()
        if self._experts is not None:
            ignored = set(self._experts.parameters(model))
        if stages is not None:
            if self.data_parallel * self.context_parallel > 1:
                from torch.distributed.fsdp import fully_shard

                mesh = self.shard_mesh
                for block in read_contract(model).blocks():
                    fully_shard(block, mesh=mesh, reshard_after_forward=False,
                                ignored_params=ignored)
                for stage in stages:
                    fully_shard(stage, mesh=mesh, reshard_after_forward=False,
                                ignored_params=ignored)
            self.module = model
            return model
        if self.mode == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for block in read_contract(model).blocks():
                if block is not model:
                    fully_shard(block, ignored_params=ignored)
            fully_shard(model, ignored_params=ignored)
            self.module = model
        else:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            # forward_sync_buffers=False: the balancer's buffers are kept identical by its own
            # all-gather, and a silent broadcast would hide a rank that drifted.
            self.module = DistributedDataParallel(model, device_ids=ids,
                                                  forward_sync_buffers=False)
        return self.module

    @contextlib.contextmanager
    def full_parameters(self, model: nn.Module) -> Iterator[None]:
        """Every parameter of ``model`` whole on this rank meanwhile, so that each rank can
        run its own forwards (each rank scoring its share of an evaluation). DDP: they are
        already. FSDP2: every sharded module is unsharded (all-gathered, through its public
        ``unshard``) and told not to reshard after a forward, so the forwards inside issue
        no collective; on the way out they are resharded and told to reshard again.
        Expert-parallel experts live on their own ranks: refused."""
        if self.mode != "fsdp":
            yield
            return
        if self.expert_parallel > 1:
            raise ConfigError("evaluating on each rank's share needs every expert on every "
                              "rank; with --expert-parallel > 1 score the checkpoint "
                              "afterwards (k3-train eval --tasks)")
        from torch.distributed.fsdp import FSDPModule

        sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
        blocks = [m for m in sharded if m is not model]
        for module in blocks:
            module.set_reshard_after_forward(False, recurse=False)
        for module in sharded:
            module.unshard()
        try:
            yield
        finally:
            for module in blocks:
                module.set_reshard_after_forward(True, recurse=False)
            for module in sharded:
                module.reshard()

    def release(self) -> None:
        """Drop the wrapper; call before the process group is destroyed.

        DDP's C++ reducer holds the process group. Were the reducer the last holder, the
        gloo group would be destroyed inside the reducer's destructor, which runs with the
        GIL held and joins gloo's worker threads, while a worker may be waiting for the
        GIL to free a finished collective's tensors: a rank that hangs at exit (seen once
        in CI, stuck in that join). The reducer goes now, while the group is still registered,
        even if something (an exception's traceback) still holds the wrapper; the group
        is then destroyed from Python, whose binding releases the GIL first.
        """
        module, self.module = self.module, None
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(module, DistributedDataParallel):
            for name in ("logger", "reducer"):  # the logger holds the reducer too
                module.__dict__.pop(name, None)

    # --- collectives -------------------------------------------------------------------

    def mean_item_and_signal(self, loss: Tensor, signum: int) -> tuple[float, int]:
        """The mean of ``loss`` over the ranks and the largest stop signal any rank has
        received (0: none), in the one collective and the one host read that the
        finite-loss check makes anyway. Each rank adds a one-hot of its signal beside its
        loss, so the sums say which signals arrived anywhere, whatever their mix. ``signum``
        may be ``signal.NSIG``, one past every real signal: the trainer's "a background
        checkpoint write failed", which outranks them all. Under pipeline stages only the
        last stage has a loss (the others pass zero): the sum is over the world, the mean
        over the data ranks."""
        values = torch.zeros(1 + signal.NSIG, dtype=torch.float32, device=loss.device)
        values[0] = loss.detach().float()
        if signum:
            values[signum] = 1.0
        summed = self.sum_(values).tolist()
        return summed[0] / self.data_parallel, max(
            (number for number in range(1, signal.NSIG + 1) if summed[number]), default=0)

    def sum_(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over every rank, in place; returns it."""
        return self._all_reduce(tensor, dist.ReduceOp.SUM)

    def max_(self, tensor: Tensor) -> Tensor:
        """MAX of ``tensor`` over every rank, in place (found-inf, stop flags); returns it."""
        return self._all_reduce(tensor, dist.ReduceOp.MAX)

    def data_max_(self, tensor: Tensor) -> Tensor:
        """MAX over the ranks holding this stage's layers, in place (QK-Clip's per-head
        logits of the MLA layers this stage holds: each data rank's rows, each
        context-parallel rank's queries); returns it."""
        return self._all_reduce(tensor, dist.ReduceOp.MAX, self.shard_group)

    def data_sum_(self, tensor: Tensor) -> Tensor:
        """Sum over the data ranks of this stage, in place; returns it."""
        return self._all_reduce(tensor, dist.ReduceOp.SUM, self.data_group)

    def context_sum_(self, tensor: Tensor) -> Tensor:
        """Sum over the context-parallel ranks of this data rank and stage, in place (each
        slice's scores of the same rows); nothing without context parallelism."""
        if self.context_parallel == 1:
            return tensor
        return self._all_reduce(tensor, dist.ReduceOp.SUM, self.context_group)

    def pipeline_sum_(self, tensor: Tensor) -> Tensor:
        """Sum over the stages of this data rank, in place (the squared gradient norms of
        every stage's parameters); nothing without pipeline stages."""
        if self.pipeline == 1:
            return tensor
        return self._all_reduce(tensor, dist.ReduceOp.SUM, self.pipeline_group)

    def pipeline_gather(self, value: Any) -> list[Any]:
        """Every pipeline rank's ``value`` (a small picklable object: a log window's
        per-layer figures) in pipeline-rank order, for this data rank's stages;
        ``[value]`` without pipeline stages."""
        if self.pipeline == 1:
            return [value]
        found: list[Any] = [None] * self.pipeline
        dist.all_gather_object(found, value, group=self.pipeline_group)
        return found

    def any(self, flag: bool) -> bool:
        """True on every rank when true on at least one (a rejection anywhere is one
        everywhere)."""
        return bool(self.max_(torch.tensor([1.0 if flag else 0.0])).item())

    def _all_reduce(self, tensor: Tensor, op: Any, group: Any = None) -> Tensor:
        """In place over ``group`` (None: the world); a host tensor under nccl travels
        through the device and back."""
        if dist.get_backend() == "nccl" and tensor.device.type == "cpu":
            on_device = tensor.to(self.device)
            dist.all_reduce(on_device, op=op, group=group)
            tensor.copy_(on_device)
        else:
            dist.all_reduce(tensor, op=op, group=group)
        return tensor

    def gather_rows(self, tensor: Tensor) -> Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 in rank order: the rows one
        process with the whole global batch would hold (the MoE balancer's tokens; under
        context parallelism every slice's tokens, in another order, which the balancer's
        sort does not see)."""
        parts = [torch.empty_like(tensor)
                 for _ in range(self.data_parallel * self.context_parallel)]
        dist.all_gather(parts, tensor.contiguous(), group=self.shard_group)
        return torch.cat(parts)

    def sync_found_inf(self, scaler: torch.amp.GradScaler,
                       optimizer: torch.optim.Optimizer) -> None:
        """Make the scaler's found-inf flags the MAX over ranks, in place, after
        ``unscale_``: ``scaler.step`` and ``update`` then skip (and back off) on every rank
        or on none. Under FSDP2 each rank unscales only its own gradient shards."""
        if not scaler.is_enabled():
            return
        found = scaler._found_inf_per_device(optimizer)  # private: see precision.py
        for flag in found.values():
            self.max_(flag)

    def barrier(self) -> None:
        dist.barrier()


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float,
                   parallel: Parallel | None = None,
                   slots: tuple[list[int], int] | None = None) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters on several device meshes (FSDP2's
    and expert parallelism's), whose DTensor gradients cannot meet in one foreach call:
    each mesh's norm is reduced over its own ranks, the total clips every group. One mesh
    or none: torch's function itself (the norm is made whole, a plain tensor). Under
    pipeline stages (``parallel.pipeline > 1``) every stage clips by the norm of the whole
    model: ``slots`` (each parameter's index in the whole model, and their count; from
    :attr:`~k3_trainer.pipeline.Pipeline.slots`) lays every stage's per-parameter norms
    out in the whole model's order, so that with unsharded stages the norm is bitwise
    the one process's; otherwise (or sharded stages) the stages' squares are summed."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    meshes: dict[int, list[nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            meshes.setdefault(id(getattr(p, "device_mesh", None)), []).append(p)
    staged = parallel is not None and parallel.pipeline > 1
    if len(meshes) <= 1 and not staged:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    plain = not any(hasattr(p.grad, "full_tensor") for p in parameters)
    if staged and slots is not None and len(meshes) <= 1 and plain:
        assert parallel is not None
        whole = _slotted_norm(parameters, slots, parallel)
        clip_grads_with_norm_(parameters, max_norm, whole)
        return whole
    norms = []
    for group in meshes.values():
        part = get_total_norm([p.grad for p in group if p.grad is not None])
        norms.append(part.full_tensor() if hasattr(part, "full_tensor") else part)
    total: Tensor = torch.linalg.vector_norm(torch.stack(norms)) if norms else \
        torch.zeros((), device=parallel.device if parallel is not None else None)
    if staged:
        assert parallel is not None
        total = parallel.pipeline_sum_(total.float().square().reshape(1)).sqrt().reshape(())
    for group in meshes.values():
        clip_grads_with_norm_(group, max_norm, total)
    return total


def _slotted_norm(parameters: list[nn.Parameter], slots: tuple[list[int], int],
                  parallel: Parallel) -> Tensor:
    """The whole model's gradient norm from this stage's plain gradients: each
    parameter's norm in its whole-model slot (zeros elsewhere, exact under a sum), the
    vector summed over the stages, then normed as ``get_total_norm`` norms its stack."""
    from torch.nn.utils import get_total_norm

    positions, count = slots
    grads = [(position, p.grad) for position, p in zip(positions, parameters, strict=True)
             if p.grad is not None]
    vector = torch.zeros(count, dtype=grads[0][1].dtype if grads else torch.float32,
                         device=parallel.device)
    for position, grad in grads:
        vector[position] = get_total_norm([grad])
    whole: Tensor = torch.linalg.vector_norm(parallel.pipeline_sum_(vector))
    return whole


def init_parallel(mode: str, device: torch.device, pipeline: int = 1, context: int = 1
                  ) -> tuple[Parallel | None, torch.device]:
    """Join torchrun's process group for ``mode`` (``ddp``/``fsdp``); returns the
    :class:`Parallel` and this rank's device (``cuda:LOCAL_RANK`` on CUDA).

    ``none`` returns ``(None, device)`` and refuses a multi-process launch, which would
    otherwise train the same model N times side by side.
    """
    if mode not in MODES:
        raise ConfigError(f"--parallel: expected one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none":
        if launched_world_size() > 1:
            raise ConfigError(f"launched with {launched_world_size()} processes but "
                              "--parallel none; pass --parallel ddp or --parallel fsdp")
        return None, device
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise ConfigError(f"--parallel {mode} needs torchrun's environment ({', '.join(missing)} "
                          "unset): launch with `torchrun --nproc_per_node N $(which k3-train) "
                          "train ...` or `k3-train train --nproc N ...`")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        _import_compiler_before_the_group()
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    return Parallel(mode, device, pipeline, context), device


def _import_compiler_before_the_group() -> None:
    """Import ``torch._dynamo`` before the process group exists, so the group can be freed.

    DDP's constructor imports it (to read its ``optimize_ddp`` mode). Imported for the first
    time while a group exists, it keeps references to that group inside torch, out of
    Python's ``gc`` (measured on torch 2.13: ten of them), which ``destroy_process_group``
    cannot drop: the group and its gloo threads (``pt_gloo_runloop``, ``gloo_tcp_loop``)
    outlived the run into interpreter exit, where rank 0 sometimes aborted under load
    ("terminate called without an active exception"). Imported first, it holds no group,
    and a bare DDP session's :func:`shutdown` ends every gloo thread while the interpreter
    is whole (tests/test_distributed_teardown.py). After a whole ``k3-train`` DDP session
    the group also lives on in the session's own reference cycles (trainer, model, DDP
    wrapper, callbacks) until a garbage-collection pass, which the interpreter's exit may
    run after gloo's threads meet it; under FSDP2 the device mesh outlives the session in
    DTensor's sharding results, which torch keeps in caches no public API clears. Hence
    :func:`k3_trainer.torchrun.leave_worker`. Only a module import (the one the constructor
    makes anyway); no private API is called.
    """
    import torch._dynamo  # noqa: F401


def shutdown(parallel: Parallel | None, *, clean: bool = True) -> None:
    """Leave the process group; after a clean run, together (a rank that tears gloo down
    while another still finishes its work can leave that one waiting forever). The model
    wrapper is released first (:meth:`Parallel.release`)."""
    if parallel is not None and dist.is_initialized():
        parallel.release()
        if clean:
            dist.barrier()
        dist.destroy_process_group()
