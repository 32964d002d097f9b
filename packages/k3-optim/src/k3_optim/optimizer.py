"""MuonAdamW: one ``torch.optim.Optimizer`` with a Muon half and an AdamW half.

Each param group says which half it belongs to with ``use_muon``. Keeping both halves
in one optimizer means one LR assignment, one GradScaler, one state dict and one
``step()`` for the whole model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.optim.adamw import adamw as _torch_adamw

from .decay import cautious_decay_
from .distributed import (
    batch_sharded,
    distributed_orthogonalize,
    local,
    resolve_batch_comm,
    resolve_comm,
    rows_state_like,
)
from .muon import matrix_view_shape, muon_update, orthogonalize
from .newton_schulz import CoefficientSpec, DTypeSpec
from .normuon import RowBlocks, normuon_normalize, second_moment_shape
from .options import validate_options

ParamsT = Iterable[torch.Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, torch.Tensor]]

# Hyperparameters added after 0.1.0, with the behaviour a state dict saved without them had:
# loading one fills them in, so an older run continues as it ran.
LEGACY_HYPERPARAMETERS: dict[str, Any] = {
    "ns_method": "standard", "normuon": False, "normuon_beta2": 0.95, "normuon_eps": 1e-8,
    "cautious_weight_decay": False,
}


class MuonAdamW(torch.optim.Optimizer):
    """Nesterov Muon for hidden matrices and AdamW for everything else.

    Args:
        params: param groups, each with ``use_muon: bool`` (see
            :func:`k3_optim.build_parameter_groups`). A group may override any keyword
            below; Muon groups may also set ``num_heads`` (per-head row blocks of a 2-D
            Q/K/V projection are orthogonalized separately) and ``flatten`` (treat a
            >2-D parameter such as a conv kernel as one ``(out, in·k…)`` matrix instead
            of a batch of matrices).
        lr: learning rate for both halves (with ``update_scale="match_rms_adamw"`` one
            value serves both).
        weight_decay: decoupled decay ``p ← p·(1 − lr·wd)`` in both halves.
        momentum, nesterov: Muon momentum (EMA convention) and Nesterov look-ahead.
        ns_steps, ns_dtype, ns_coefficients, ns_eps: Newton–Schulz settings; ``ns_dtype``
            is ``"auto"`` (bf16 on CUDA, fp32 elsewhere), ``"bf16"``, ``"fp32"``,
            ``"fp64"`` or a torch dtype, independent of the parameter dtype.
        ns_method: ``"standard"`` (iterate on the matrix), ``"gram"`` (iterate on its
            Gram matrix: the same polynomial, fewer products for rectangular matrices)
            or ``"auto"`` (Gram from an aspect ratio of ``GRAM_MIN_ASPECT``, where it is
            the faster one).
        update_scale: ``"match_rms_adamw"`` (0.2·√max(rows, cols)), ``"spectral"``
            (√max(1, rows/cols)) or ``"none"``, computed on the orthogonalized shape.
        normuon, normuon_beta2, normuon_eps: NorMuon: divide each row (output neuron) of
            the orthogonalized update by the root of an EMA (``normuon_beta2``) of its
            mean square plus ``normuon_eps``, then rescale each orthogonalized matrix to
            the Frobenius norm it had, before ``update_scale``.
        cautious_weight_decay: decay only coordinates whose update has the parameter's
            sign (the update already moves them toward zero), in both halves.
        betas, eps: AdamW moments and denominator epsilon.
        foreach, fused: passed to torch's AdamW implementation (``None`` = torch's
            default, so AdamW groups match ``torch.optim.AdamW`` exactly).
        distributed: orthogonalize each Muon matrix once across the ranks of a process
            group instead of on every rank. ``None`` (default): on for DTensor parameters
            (FSDP2 ``fully_shard``), off for plain tensors. ``True``: also for plain
            tensors, which must then be replicated on every rank with identical
            gradients (DDP). ``False``: never (plain tensors only).
        process_group: the group for plain tensors with ``distributed=True`` (default:
            the default group); DTensor parameters use their device mesh's group.
    """

    legacy_hyperparameters: ClassVar[Mapping[str, Any]] = LEGACY_HYPERPARAMETERS
    """Group keys a state dict saved by an earlier k3-optim may lack, with the behaviour it
    had; a checkpoint loader that compares group keys (k3-checkpoint's) accepts their
    absence, since :meth:`load_state_dict` fills them in."""

    def __init__(
        self,
        params: ParamsT,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: DTypeSpec = "auto",
        ns_coefficients: CoefficientSpec = "jordan",
        ns_eps: float = 1e-7,
        ns_method: str = "auto",
        update_scale: str = "match_rms_adamw",
        normuon: bool = False,
        normuon_beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        cautious_weight_decay: bool = False,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        foreach: bool | None = None,
        fused: bool | None = None,
        distributed: bool | None = None,
        process_group: Any = None,
    ) -> None:
        defaults: dict[str, Any] = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            ns_coefficients=ns_coefficients,
            ns_eps=ns_eps,
            ns_method=ns_method,
            update_scale=update_scale,
            normuon=normuon,
            normuon_beta2=normuon_beta2,
            normuon_eps=normuon_eps,
            cautious_weight_decay=cautious_weight_decay,
            num_heads=None,
            flatten=False,
            betas=betas,
            eps=eps,
            foreach=foreach,
            fused=fused,
        )
        validate_options(defaults, where="MuonAdamW")
        if distributed not in (None, True, False):
            raise ValueError(f"MuonAdamW: distributed must be None, True or False, got "
                             f"{distributed!r}")
        if distributed and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "MuonAdamW(distributed=True) needs an initialized process group: call "
                "torch.distributed.init_process_group() first (torchrun sets it up)"
            )
        if process_group is not None and not distributed:
            raise ValueError("MuonAdamW: process_group is used only with distributed=True")
        # Not in ``defaults``: neither belongs in a state dict (a group is not picklable).
        self.distributed = distributed
        self.process_group = process_group
        self._foreach = True  # False: the per-tensor baseline of benchmarks/bench_optim.py
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate a group (``use_muon``, hyperparameters, parameter shapes), then add it."""
        index = len(self.param_groups)
        where = f"param group {index}" + (
            f" ({param_group['name']!r})" if "name" in param_group else ""
        )
        if not isinstance(param_group, dict) or "use_muon" not in param_group:
            raise ValueError(
                f"{where} has no 'use_muon' key: MuonAdamW needs groups that say which half "
                "they use; build them with k3_optim.build_parameter_groups(model) or pass "
                "dicts like {'params': [...], 'use_muon': True}"
            )
        if not isinstance(param_group["use_muon"], bool):
            raise ValueError(f"{where}: 'use_muon' must be True or False")
        validate_options({**self.defaults, **param_group}, where=where)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["use_muon"]:
            names = group.get("param_names") or [f"#{i}" for i in range(len(group["params"]))]
            for name, p in zip(names, group["params"]):
                if p.is_complex():
                    raise ValueError(f"{where}: Muon does not support complex parameter {name}")
                try:
                    matrix_view_shape(
                        p.shape, num_heads=group["num_heads"], flatten=group["flatten"]
                    )
                except ValueError as exc:
                    self.param_groups.pop()
                    raise ValueError(
                        f"{where}: parameter {name} cannot use Muon: {exc}; put 1-D and scalar "
                        "parameters in an AdamW group (use_muon=False)"
                    ) from None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.load_state_dict``, after giving groups saved before a
        hyperparameter existed its old behaviour (:attr:`legacy_hyperparameters`)."""
        groups = [{**LEGACY_HYPERPARAMETERS, **group} for group in state_dict["param_groups"]]
        super().load_state_dict({**state_dict, "param_groups": groups})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step; parameters without a gradient are skipped."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        loads: dict[int, list[float]] = {}  # per process group: NS work owned by each rank
        for index, group in enumerate(self.param_groups):
            if group["use_muon"]:
                self._muon_group_step(index, group, loads)
            else:
                self._adamw_group_step(index, group)
        return loss

    def _params_with_grad(self, index: int, group: dict[str, Any]) -> list[torch.Tensor]:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError(f"MuonAdamW does not support sparse gradients (group {index})")
            if p.grad.is_complex():
                raise RuntimeError(f"MuonAdamW does not support complex gradients (group {index})")
        return params

    def _muon_group_step(
        self, index: int, group: dict[str, Any], loads: dict[int, list[float]]
    ) -> None:
        params = self._params_with_grad(index, group)
        names = group.get("param_names") or [f"#{i}" for i in range(len(group["params"]))]
        name_of = {id(p): n for p, n in zip(group["params"], names)}
        # Stacks split along their batch dimension (expert parallelism) hold whole matrices
        # on each rank: they are orthogonalized where they are, the rest as before.
        rest: list[torch.Tensor] = []
        meshes: dict[int, list[torch.Tensor]] = {}
        for p in params:
            if not batch_sharded(p, flatten=group["flatten"]):
                rest.append(p)
            elif local(p).numel():  # a rank with no matrix of this stack has nothing to do
                meshes.setdefault(id(p.device_mesh), []).append(p)  # type: ignore[attr-defined]
        where = f"param group {index}"
        if rest:
            comm = resolve_comm(rest, [name_of[id(p)] for p in rest], where=where,
                                distributed=self.distributed, process_group=self.process_group)
            self._muon_update(group, rest, comm, loads, local_views=False)
        for subset in meshes.values():
            comm = resolve_batch_comm(subset, [name_of[id(p)] for p in subset], where=where)
            self._muon_update(group, subset, comm, loads, local_views=True)

    def _muon_update(self, group: dict[str, Any], params: list[torch.Tensor],
                     comm: tuple[Any, Any] | None, loads: dict[int, list[float]], *,
                     local_views: bool) -> None:
        """Muon on ``params``: Newton–Schulz here (``comm`` None) or with one owner per
        matrix over ``comm``'s group. ``local_views``: the matrices are this rank's local
        pieces (batch-sharded stacks), not the global parameters."""
        flatten = group["flatten"]
        bufs, second_moments = [], []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                # A DTensor parameter gets a DTensor buffer: momentum is sharded like it.
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            bufs.append(local(state["momentum_buffer"]))
            if group["normuon"]:
                if "row_second_moment" not in state:
                    state["row_second_moment"] = rows_state_like(
                        p, second_moment_shape(p.shape, flatten=flatten),
                        second_moment_shape(local(p).shape, flatten=flatten), dtype=p.dtype)
                second_moments.append(local(state["row_second_moment"]))
        views = [matrix_view_shape(local(p).shape if local_views else p.shape,
                                   num_heads=group["num_heads"], flatten=flatten)
                 for p in params]
        ns = functools.partial(
            orthogonalize,
            ns_steps=group["ns_steps"],
            ns_dtype=group["ns_dtype"],
            ns_coefficients=group["ns_coefficients"],
            ns_eps=group["ns_eps"],
            ns_method=group["ns_method"],
        )
        if comm is None:
            ortho: Callable[[list[torch.Tensor]], list[torch.Tensor]] = functools.partial(
                ns, views=views)
        else:
            process_group, layouts = comm
            ortho = functools.partial(
                distributed_orthogonalize, views=views, layouts=layouts, group=process_group,
                loads=loads.setdefault(id(process_group),
                                       [0.0] * dist.get_world_size(process_group)),
                orthogonalize=ns,
            )
        normalize = None
        if group["normuon"]:
            normalize = functools.partial(
                normuon_normalize, second_moments=second_moments,
                blocks=_row_blocks(params, views, comm, flatten=flatten),
                beta2=group["normuon_beta2"], eps=group["normuon_eps"], flatten=flatten,
                all_reduce=None if comm is None else functools.partial(
                    dist.all_reduce, group=comm[0]))
        muon_update(
            [local(p) for p in params],
            [local(p.grad) for p in params],  # type: ignore[arg-type]
            bufs,
            views,
            lr=float(group["lr"]),
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            nesterov=group["nesterov"],
            update_scale=group["update_scale"],
            orthogonalize=ortho,
            normalize=normalize,
            cautious_weight_decay=group["cautious_weight_decay"],
            foreach=self._foreach,
        )

    def _adamw_group_step(self, index: int, group: dict[str, Any]) -> None:
        params = self._params_with_grad(index, group)
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:
                # Same state layout as torch.optim.AdamW, so the numbers match it exactly.
                state["step"] = (
                    torch.zeros((), dtype=torch.float32, device=p.device)
                    if group["fused"]
                    else torch.tensor(0.0, dtype=_scalar_dtype())
                )
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        weight_decay = group["weight_decay"]
        if group["cautious_weight_decay"] and weight_decay != 0.0:
            # Adam's step has the sign of its new first moment (the denominator and bias
            # correction are positive), so the mask is known before torch's AdamW runs;
            # decay first, as torch's AdamW does, then its step without decay.
            grads = [local(p.grad) for p in params]  # type: ignore[arg-type]
            first_moments = torch._foreach_lerp([local(m) for m in exp_avgs], grads, 1.0 - beta1)
            cautious_decay_([local(p) for p in params], first_moments,
                            float(group["lr"]) * weight_decay)
            weight_decay = 0.0
        _torch_adamw(
            params,
            [p.grad for p in params],  # type: ignore[misc]
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=group["foreach"],
            fused=group["fused"],
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=weight_decay,
            eps=group["eps"],
            maximize=False,
        )


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _row_blocks(params: list[torch.Tensor], views: list[tuple[int, int, int]],
                comm: tuple[Any, Any] | None, *, flatten: bool) -> list[RowBlocks]:
    """Where each parameter's local rows sit among its orthogonalized matrices (NorMuon)."""
    rank = None if comm is None else dist.get_rank(comm[0])
    blocks = []
    for i, (p, (batch, rows, _)) in enumerate(zip(params, views)):
        layout = None if comm is None else comm[1][i]
        if layout is None or layout.rows is None:  # the whole parameter is here
            blocks.append(RowBlocks(0, rows, batch))
            continue
        rows_per_index = 1 if flatten else math.prod(p.shape[1:-1])  # rows per dim-0 index
        start = layout.rows[rank][0]
        blocks.append(RowBlocks(start * rows_per_index, rows, batch, sharded=True))
    return blocks
