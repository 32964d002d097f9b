"""Data parallelism through torch's own engine: torchrun's environment, DDP or FSDP2.

One process per device, launched by ``torchrun``. :func:`init_parallel` joins the process
group torchrun describes (gloo on CPU, nccl on CUDA) and returns a :class:`Parallel`:
the rank and world size, the collectives the loop needs (a loss mean, a MAX for QK-Clip,
found-inf for the FP16 skip, a flag that is true on every rank when true on one), and
:meth:`Parallel.wrap`, which shards the model with ``fully_shard`` (each decoder block,
then the root) or wraps it in ``DistributedDataParallel``. ``--parallel none`` never
touches ``torch.distributed``: the one-process path stays exactly as it was.

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

    def __init__(self, mode: str, device: torch.device) -> None:
        self.mode = mode
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.module: nn.Module | None = None
        self.expert_parallel = 1
        self._experts: ExpertParallel | None = None

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
        return layout

    # --- expert parallelism --------------------------------------------------------------

    def shard_experts(self, model: nn.Module, degree: int,
                      experts: ExpertParallel | None) -> None:
        """Keep ``n_experts/degree`` routed experts of every MoE layer on this rank (in
        place, before :meth:`wrap`), through the model's own hooks ``experts`` (its spec's;
        None: the model cannot split its experts); ``degree`` 1 does nothing. Raises
        ``ConfigError`` for a layout that cannot work."""
        if degree == 1:
            return
        if self.mode != "fsdp":
            raise ConfigError(f"--expert-parallel {degree} needs --parallel fsdp: DDP offers no "
                              "public way to keep the expert parameters out of its all-reduce")
        if self.world_size % degree:
            raise ConfigError(f"--expert-parallel {degree} must divide the world size "
                              f"{self.world_size} (--nproc × nodes)")
        count = 0 if experts is None else experts.n_experts(model)
        if experts is None or not count:
            raise ConfigError(f"--expert-parallel {degree}: the model has no MoE layer "
                              "whose experts it can split")
        if count % degree:
            raise ConfigError(f"--expert-parallel {degree} must divide n_experts ({count})")
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

    def wrap(self, model: nn.Module) -> nn.Module:
        """Shard (``fsdp``) or replicate (``ddp``) ``model`` for training; returns the module
        to call forward on. Build the optimizer afterwards (FSDP2 swaps in DTensors)."""
        if self.mode == "fsdp":
            from torch.distributed.fsdp import fully_shard

            ignored: set[nn.Parameter] = set()
            if self._experts is not None:  # sharded by expert already, on their own mesh
                ignored = set(self._experts.parameters(model))
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
        checkpoint write failed", which outranks them all."""
        values = torch.zeros(1 + signal.NSIG, dtype=torch.float32, device=loss.device)
        values[0] = loss.detach().float()
        if signum:
            values[signum] = 1.0
        summed = self.sum_(values).tolist()
        return summed[0] / self.world_size, max(
            (number for number in range(1, signal.NSIG + 1) if summed[number]), default=0)

    def sum_(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        return self._all_reduce(tensor, dist.ReduceOp.SUM)

    def max_(self, tensor: Tensor) -> Tensor:
        """MAX of ``tensor`` over the ranks, in place (QK-Clip's per-head logits); returns it."""
        return self._all_reduce(tensor, dist.ReduceOp.MAX)

    def any(self, flag: bool) -> bool:
        """True on every rank when true on at least one (a rejection anywhere is one
        everywhere)."""
        return bool(self.max_(torch.tensor([1.0 if flag else 0.0])).item())

    def _all_reduce(self, tensor: Tensor, op: Any) -> Tensor:
        """In place; a host tensor under nccl travels through the device and back."""
        if dist.get_backend() == "nccl" and tensor.device.type == "cpu":
            on_device = tensor.to(self.device)
            dist.all_reduce(on_device, op=op)
            tensor.copy_(on_device)
        else:
            dist.all_reduce(tensor, op=op)
        return tensor

    def gather_rows(self, tensor: Tensor) -> Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 in rank order: the rows one
        process with the whole global batch would hold (the MoE balancer's tokens)."""
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
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


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters on several device meshes (FSDP2's
    and expert parallelism's), whose DTensor gradients cannot meet in one foreach call:
    each mesh's norm is reduced over its own ranks, the total clips every group. One mesh
    or none: torch's function itself (the norm is made whole, a plain tensor)."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    meshes: dict[int, list[nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            meshes.setdefault(id(getattr(p, "device_mesh", None)), []).append(p)
    if len(meshes) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    norms = []
    for group in meshes.values():
        part = get_total_norm([p.grad for p in group if p.grad is not None])
        norms.append(part.full_tensor() if hasattr(part, "full_tensor") else part)
    total: Tensor = torch.linalg.vector_norm(torch.stack(norms))
    for group in meshes.values():
        clip_grads_with_norm_(group, max_norm, total)
    return total


def init_parallel(mode: str, device: torch.device) -> tuple[Parallel | None, torch.device]:
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
    return Parallel(mode, device), device


def _import_compiler_before_the_group() -> None:
    """Import ``torch._dynamo`` before the process group exists, so the group can be freed.

    DDP's constructor imports it (to read its ``optimize_ddp`` mode). Imported for the first
    time while a group exists, it keeps references to that group inside torch, out of
    Python's ``gc`` (measured on torch 2.13: ten of them), which ``destroy_process_group``
    cannot drop: the group and its gloo threads (``pt_gloo_runloop``, ``gloo_tcp_loop``)
    outlived the run into interpreter exit, where rank 0 sometimes aborted under load
    ("terminate called without an active exception"). Imported first, it holds no group,
    and a bare DDP session's :func:`shutdown` ends every gloo thread while the interpreter
    is whole (tests/test_distributed_teardown.py). A full ``k3-train`` DDP run still keeps
    its group past :func:`shutdown` through another holder, not yet found (#61 item 5).
    Only a module import (the one the constructor makes anyway); no private API is called.
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
