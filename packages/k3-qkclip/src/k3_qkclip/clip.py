"""QKClip: the context manager that observes, validates and applies QK-Clip on a model.

Lifecycle of one attempted update (the trainer's loop, in order)::

    with QKClip(model, policy) as qk_clip:
        ...
        qk_clip.reset()                 # start of the attempt
        for microbatch: forward/backward  # observers fold in per-head max logits
        clip_grad_norm_(...)
        qk_clip.validate()              # before the optimizer mutates anything
        scaler.step(optimizer); scaler.update()
        report = qk_clip.apply() if not skipped else qk_clip.reset()

``apply()`` rescales the *post-step* weights from logits measured on the *pre-step*
weights (Kimi K2, §2.1): it never changes the current step's forward or backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn

from .clip_report import QKClipModuleReport, QKClipReport
from .observe import QKObserver
from .plan import ModulePlan
from .policy import QKClipPolicy
from .spec import QKSpec

SPEC_METHOD = "qk_clip_spec"
OBSERVER_ATTR = "qk_observer"
GEOMETRY_VERSION = 1


class QKClip:
    """Per-head max-logit observation and post-step query/key rescaling for ``model``.

    Declaring modules are the submodules with a ``qk_clip_spec()`` method (returning a
    :class:`QKSpec`) and a ``qk_observer`` attribute; they are found and their
    declarations checked at construction. Entering the context installs one
    :class:`QKObserver` per module; leaving restores the attribute, so a model outside
    the context runs plain attention.

    Data parallel: ``reduce_max(t)`` all-reduces a tensor in place with MAX over the
    ranks (e.g. ``lambda t: dist.all_reduce(t, dist.ReduceOp.MAX)``). The observations
    are then reduced in :meth:`nonfinite` (and :meth:`validate` without an argument), so
    every rank validates and clips the same heads by the same factors.
    """

    def __init__(self, model: nn.Module, policy: QKClipPolicy | None = None, *,
                 reduce_max: Callable[[Tensor], object] | None = None):
        if policy is None:
            policy = QKClipPolicy()
        if not isinstance(policy, QKClipPolicy):
            raise TypeError(f"QKClip: policy must be a QKClipPolicy, got {type(policy).__name__}")
        self.model = model
        self.policy = policy
        self.reduce_max = reduce_max
        self._plans = _discover(model, policy)
        if not self._plans and policy.enabled:
            raise ValueError(
                f"QKClip: no module of {type(model).__name__} declares QK-Clip geometry "
                f"(a `{SPEC_METHOD}()` method returning a QKSpec and a `{OBSERVER_ATTR} = None` "
                "attribute); declare it in the attention class, or use "
                "QKClipPolicy(enabled=False) to train without QK-Clip"
            )
        self._observers: dict[str, QKObserver] = {}
        self._saved: list[tuple[nn.Module, bool, Any]] = []
        self._entered = False

    @property
    def module_names(self) -> list[str]:
        """Paths of the declaring modules, in ``named_modules()`` order."""
        return [p.name for p in self._plans]

    @property
    def active(self) -> bool:
        """True inside the ``with`` block."""
        return self._entered

    # --- context -----------------------------------------------------------------------

    def __enter__(self) -> QKClip:
        if self._entered:
            raise RuntimeError("QKClip: this context is already active")
        for plan in self._plans:
            if getattr(plan.module, OBSERVER_ATTR, None) is not None:
                raise RuntimeError(f"QKClip: module {plan.name!r} is already observed")
        for plan in self._plans:
            module = plan.module
            own = OBSERVER_ATTR in module.__dict__
            self._saved.append((module, own, module.__dict__.get(OBSERVER_ATTR)))
            observer = QKObserver(module, plan.name, plan.spec.n_heads, plan.device)
            setattr(module, OBSERVER_ATTR, observer)
            self._observers[plan.name] = observer
        self._entered = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for module, own, previous in reversed(self._saved):
            if own:
                setattr(module, OBSERVER_ATTR, previous)
            else:
                delattr(module, OBSERVER_ATTR)
        self._saved.clear()
        self._observers.clear()
        self._entered = False

    def _require_active(self, what: str) -> None:
        if not self._entered:
            raise RuntimeError(f"QKClip.{what}() called outside `with QKClip(...)`")

    # --- lifecycle ---------------------------------------------------------------------

    def reset(self) -> None:
        """Discard all observations (start of an attempt, or after a skipped step)."""
        self._require_active("reset")
        for observer in self._observers.values():
            observer.reset()

    def nonfinite(self) -> Tensor | None:
        """A 0-dim bool tensor on the device: does an observed head hold NaN or +inf?

        No host sync: a caller that reads other device values at this point anyway (the
        trainer reads the gradient norm) reads this flag with them and passes it to
        :meth:`validate`, which then needs no sync of its own. None without observers.
        """
        self._require_active("nonfinite")
        observers = list(self._observers.values())
        if not observers:
            return None
        device = observers[0].value.device
        values = torch.cat([o.value.to(device) for o in observers])
        if self.reduce_max is not None:  # one collective for every module's heads
            self.reduce_max(values)
            parts = torch.split(values, [o.n_heads for o in observers])
            for observer, part in zip(observers, parts):
                observer.replace(part)
        return (torch.isnan(values) | (values == math.inf)).any()

    def validate(self, nonfinite: bool | None = None) -> None:
        """Raise ``FloatingPointError`` if an observed head's max logit is NaN or +inf.

        Call it after gradient clipping and before the optimizer step: it mutates
        nothing, so a rejection leaves weights and optimizer state untouched. One host
        sync for all modules, or none when ``nonfinite`` is the host value of
        :meth:`nonfinite` read since the last observation.
        """
        self._require_active("validate")
        observers = list(self._observers.values())
        if not observers:
            return
        if nonfinite is None:
            flag = self.nonfinite()
            nonfinite = bool(flag) if flag is not None else False
        if nonfinite:
            problems = [
                f"{o.name!r} head {head} ({value})"
                for o in observers
                for head, value in enumerate(o.value.tolist())
                if math.isnan(value) or value == math.inf
            ]
            raise FloatingPointError(
                "QK-Clip: non-finite max pre-softmax logit in module "
                + ", ".join(problems)
                + "; the forward produced NaN/inf attention scores (check the loss scale, "
                "learning rate and data); nothing was changed"
            )
        for observer in observers:
            observer.unvalidated = False

    def apply(self) -> QKClipReport:
        """Rescale heads whose max logit exceeded τ, clear the observations, report.

        Call only after a successful optimizer step. Validates first if observations
        arrived since the last :meth:`validate`. With ``policy.enabled=False`` nothing
        is rescaled (the report still carries the observed maxima). No host sync.
        """
        self._require_active("apply")
        if any(o.unvalidated for o in self._observers.values()):
            self.validate()
        tau = self.policy.tau
        reports: dict[str, QKClipModuleReport] = {}
        for plan in self._plans:
            observer = self._observers[plan.name]
            max_logits = observer.value
            if self.policy.enabled and observer.observed:
                gamma, gamma_kv = plan.gammas(max_logits, tau)
                plan.rescale(gamma, gamma_kv)
            else:
                gamma = torch.ones_like(max_logits)
            reports[plan.name] = QKClipModuleReport(max_logits, gamma)
            observer.reset()
        return QKClipReport(reports, tau, self.policy.enabled)

    def max_logits(self) -> dict[str, Tensor]:
        """Current per-head observations ``{module: (n_heads,) fp32}`` (snapshots)."""
        self._require_active("max_logits")
        return {name: o.value for name, o in self._observers.items()}

    def geometry(self) -> dict[str, Any]:
        """Plain-data QK-Clip geometry, for a checkpoint to store and compare on resume."""
        return {
            "version": GEOMETRY_VERSION,
            "modules": {plan.name: plan.geometry() for plan in self._plans},
        }


def _discover(model: nn.Module, policy: QKClipPolicy) -> list[ModulePlan]:
    """Find declaring modules, bind their specs, and refuse doubly declared weights."""
    plans: list[ModulePlan] = []
    owners: dict[int, str] = {}
    for name, module in model.named_modules():
        declare = getattr(module, SPEC_METHOD, None)
        if declare is None:
            continue
        where = f"QK-Clip declaration of module {name!r}"
        if not callable(declare):
            raise TypeError(f"{where}: {SPEC_METHOD} must be a method returning a QKSpec")
        if not hasattr(module, OBSERVER_ATTR):
            raise ValueError(
                f"{where}: the module has no `{OBSERVER_ATTR}` attribute; add "
                f"`{OBSERVER_ATTR} = None` to the class and pass `self.{OBSERVER_ATTR}` to "
                "observed_attention() in forward"
            )
        try:
            spec = declare()
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        if not isinstance(spec, QKSpec):
            raise TypeError(f"{where}: {SPEC_METHOD}() returned {type(spec).__name__}, not QKSpec")
        plan = ModulePlan(name, module, spec, policy)
        for target in plan.targets:
            if target.factor_index is None:
                continue
            for pname, tensor in target.tensors:
                owner = owners.setdefault(id(tensor), name)
                if owner != name:
                    raise ValueError(
                        f"{where}: {pname!r} is also declared by module {owner!r}; "
                        "a weight would be rescaled twice"
                    )
        plans.append(plan)
    return plans
