"""Every incompatibility is refused by name, and a refusal changes nothing.

Each case saves a checkpoint, moves the live run away from it (so a partial restore of any
component would show), then hashes model weights, optimizer state, loader cursors and RNG
before and after the refused load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from ckpt_helpers import TRAINER_POLICY, Run, make_run, rewrite, run_fingerprint

from k3_checkpoint import (
    MISSING,
    CheckpointError,
    CompatibilityPolicy,
    load_checkpoint,
    save_checkpoint,
)

Payload = dict[str, Any]


@dataclass(frozen=True)
class Case:
    id: str
    match: str
    doctor: Callable[[Payload], Any] | None = None  # edits the saved payload
    live: Callable[[], Run] | None = None  # a differently built live run
    change: Callable[[Run], Any] | None = None  # edits the live run's inputs or settings
    policy: CompatibilityPolicy | None = None


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _two_groups(model: torch.nn.Module) -> torch.optim.Optimizer:
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": matrices}, {"params": vectors, "weight_decay": 0.0}])


def _reversed(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list(model.parameters())[::-1], lr=3e-3, weight_decay=0.1)


def _refuse_tokenizer(saved: Any, current: Any) -> None:
    raise CheckpointError("tokenizer changed since the checkpoint")


def _set(section: str, **values: Any) -> Callable[[Payload], Any]:
    return lambda payload: payload[section].update(values)


CASES = [
    Case("counter-negative", r"counters .*step=-1", doctor=_set("counters", step=-1)),
    Case("counter-bool", r"tokens_seen=True", doctor=_set("counters", tokens_seen=True)),
    Case(
        "counter-missing",
        r"lack \['skipped_updates'\]",
        doctor=lambda p: p["counters"].pop("skipped_updates"),
    ),
    Case(
        "fixed-batch-offset",
        r"fixed_batch_offset='3'",
        doctor=_set("counters", fixed_batch_offset="3"),
    ),
    Case(
        "train-config",
        r"train_config\.lr: checkpoint 0\.003, current 0\.001",
        change=lambda r: r.train_config.update(lr=1e-3),
    ),
    Case(
        "cosine-decay-settings",
        r"train_config\.min_lr_ratio: checkpoint 0\.1, current 0\.2",
        change=lambda r: r.train_config.update(min_lr_ratio=0.2),
        policy=TRAINER_POLICY,
    ),
    Case(
        "max-steps-shrinks",
        r"train_config\.max_steps: checkpoint 20, current 10 \(it may grow, not shrink\)",
        change=lambda r: r.train_config.update(max_steps=10),
        policy=TRAINER_POLICY,
    ),
    Case(
        "max-steps-below-step",
        r"train_config\.max_steps 20 is smaller than the checkpoint's counters\.step 50",
        doctor=_set("counters", step=50),
        policy=TRAINER_POLICY,
    ),
    Case(
        "custom-policy-check",
        r"tokenizer changed",
        policy=CompatibilityPolicy(check=_refuse_tokenizer),
    ),
    Case(
        "vocab-size",
        r"vocab_size: checkpoint 64, current 65",
        change=lambda r: setattr(r, "vocab_size", 65),
    ),
    Case(
        "model-config",
        r"model_config\.n_layers: checkpoint 1, current 2",
        change=lambda r: r.model_config.update(n_layers=2),
    ),
    Case(
        "runtime-torch-version",
        r"runtime\.torch_version: checkpoint '2\.5\.0'",
        doctor=_set("runtime", torch_version="2.5.0"),
    ),
    Case(
        "runtime-device-type",
        r"runtime\.device_type: checkpoint \['cuda'\], current \['cpu'\]",
        doctor=_set("runtime", device_type=["cuda"]),
    ),
    Case(
        "runtime-param-dtype",
        r"runtime\.param_dtype: checkpoint \['torch\.float32'\], current \['torch\.float64'\]",
        live=lambda: make_run(seed=1, dtype=torch.float64),
    ),
    Case(
        "runtime-threads",
        r"runtime\.num_threads",
        change=lambda r: torch.set_num_threads(torch.get_num_threads() + 1),
    ),
    Case(
        "runtime-determinism",
        r"runtime\.deterministic_algorithms: checkpoint False, current True",
        change=lambda r: torch.use_deterministic_algorithms(True),
    ),
    Case(
        "qk-clip-policy",
        r"qk_clip\.policy\.tau: checkpoint 100\.0, current 30\.0",
        change=lambda r: r.qk_clip_policy.update(tau=30.0),
    ),
    Case(
        "qk-clip-geometry",
        r"qk_clip\.geometry\.attn\.0\.n_heads: checkpoint 2, current 4",
        change=lambda r: r.qk_clip_geometry["attn.0"].update(n_heads=4),
    ),
    Case(
        "qk-clip-dropped",
        r"incompatible qk_clip",
        change=lambda r: (setattr(r, "qk_clip_policy", None), setattr(r, "qk_clip_geometry", None)),
    ),
    Case(
        "optimizer-class",
        r"optimizer_type: checkpoint 'torch\.optim\.adamw\.AdamW', "
        r"current 'torch\.optim\.sgd\.SGD'",
        live=lambda: make_run(seed=1, optimizer=_sgd),
    ),
    Case(
        "optimizer-layout-groups",
        r"incompatible optimizer_layout — \[1\] checkpoint group 0 norm\.weight",
        live=lambda: make_run(seed=1, optimizer=_two_groups),
    ),
    Case(
        "optimizer-layout-order",
        r"incompatible optimizer_layout — \[0\] checkpoint group 0 embed\.weight \[64, 16\]",
        live=lambda: make_run(seed=1, optimizer=_reversed),
    ),
    Case(
        "optimizer-hyperparameter-keys",
        r"group 0 hyperparameter keys differ: only in the checkpoint \[\], only in the "
        r"optimizer \['amsgrad'\]",
        doctor=lambda p: p["optimizer"]["param_groups"][0].pop("amsgrad"),
    ),
    Case(
        "optimizer-state-shape",
        r"optimizer state tensors do not match.*embed\.weight\.exp_avg \[3, 3\] vs \[64, 16\]",
        doctor=lambda p: p["optimizer"]["state"][0].update(exp_avg=torch.zeros(3, 3)),
    ),
    Case(  # per-row statistics are the leading dims ([64]); the trailing ones are not
        "optimizer-state-trailing-dims",
        r"optimizer state tensors do not match.*embed\.weight\.exp_avg \[16\] vs \[64, 16\]",
        doctor=lambda p: p["optimizer"]["state"][0].update(exp_avg=torch.zeros(16)),
    ),
    Case(
        "optimizer-state-unknown-parameter",
        r"optimizer state entry 999 matches no parameter",
        doctor=lambda p: p["optimizer"]["state"].update({999: {}}),
    ),
    Case(
        "model-state-shape",
        r"model state does not fit the module — norm\.weight: checkpoint \[17\]",
        doctor=_set("model", **{"norm.weight": torch.zeros(17)}),
    ),
    Case(
        "model-state-dtype",
        r"up\.bias: checkpoint \[64\] torch\.float64, module \[64\] torch\.float32",
        doctor=lambda p: p["model"].update({"up.bias": p["model"]["up.bias"].double()}),
    ),
    Case(
        "model-state-keys",
        r"missing from the checkpoint \['head\.weight'\]",
        doctor=lambda p: p["model"].pop("head.weight"),
    ),
    Case(
        "loader-identity",
        r"loaders\.train refused its saved state \(ValueError: cursor of other data: "
        r"'train-manifest-sha', this stream 'changed-data'\); nothing was restored",
        live=lambda: make_run(seed=1, digests=("changed-data", "val-manifest-sha")),
    ),
    Case(
        "loader-missing",
        r"loaders differ: checkpoint \['train', 'val'\], current \['train'\]",
        change=lambda r: r.loaders.pop("val"),
    ),
    Case(
        "loader-offset",
        r"loaders\.val refused its saved state \(ValueError: offset -1 is not a non-negative",
        doctor=lambda p: p["loaders"]["val"].update(offset=-1),
    ),
    Case(
        # 'train' is restored first; 'val' then refuses, so 'train' must be rolled back.
        "loader-refuses-its-state",
        r"loaders\.val refused its saved state \(ValueError: offset 5000 is past the end",
        doctor=lambda p: p["loaders"]["val"].update(offset=5000),
    ),
    Case(
        "rng-state",
        r"rng state 'numpy' cannot be restored",
        doctor=lambda p: p["rng"]["numpy"].update(keys=p["rng"]["numpy"]["keys"][:10]),
    ),
    Case(
        "component-state-missing",
        r"payload has no 'counters': the checkpoint has no state for component 'counters'",
        doctor=lambda p: p.pop("counters"),
    ),
    Case(
        "step-limit-counter-missing",
        r"counters\.step in the checkpoint is <missing>, not a non-negative integer",
        doctor=lambda p: p["counters"].pop("step"),
        policy=TRAINER_POLICY,
    ),
    Case(
        "step-limit-counters-malformed",
        r"counters\.step in the checkpoint is <missing>",
        doctor=lambda p: p.update(counters="step=3"),
        policy=TRAINER_POLICY,
    ),
    Case(
        "counters-not-a-mapping",
        r"counters refused its saved state \(ValueError: counters lack",
        doctor=lambda p: p.update(counters=[3, 96, 0]),
    ),
    Case(
        "loader-group-malformed",
        r"loaders differ: checkpoint int, current \['train', 'val'\]",
        doctor=lambda p: p.update(loaders=3),
    ),
    Case(
        "unknown-payload-entry",
        r"incompatible extra — extra: only in the checkpoint \(1\)",
        doctor=lambda p: p.update(extra=1),
    ),
    Case(
        "grad-scaler-state",
        r"grad_scaler must be a mapping or None, got list",
        doctor=lambda p: p.update(grad_scaler=[1.0]),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_incompatibility_is_refused_by_name_and_changes_nothing(case, tmp_path):
    path = tmp_path / "ckpt.k3"
    source = make_run(seed=0)
    for _ in range(3):
        source.step()
    source.grad_scaler = {"scale": 1024.0}
    save_checkpoint(path, **source.save_kwargs())
    saved = run_fingerprint(source)
    if case.doctor is not None:
        rewrite(path, case.doctor)

    live = case.live() if case.live is not None else source
    for _ in range(2):
        live.step()  # every component now differs from the checkpoint
    live.grad_scaler = {"scale": 512.0}
    if case.change is not None:
        case.change(live)
    before = run_fingerprint(live)
    assert all(before[part] != saved[part] for part in saved), "a restore must be visible"

    with pytest.raises(CheckpointError, match=case.match) as raised:
        load_checkpoint(path, **live.load_kwargs(), policy=case.policy)

    assert run_fingerprint(live) == before
    assert str(path) in str(raised.value)


def test_policy_relaxations_are_honoured(tmp_path):
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    save_checkpoint(path, **run.save_kwargs())
    run.train_config.update(log_interval=5)
    torch.set_num_threads(torch.get_num_threads() + 1)
    strict = CompatibilityPolicy(may_differ={"train_config.log_interval"})
    with pytest.raises(CheckpointError, match=r"runtime\.num_threads"):
        load_checkpoint(path, **run.load_kwargs(), policy=strict)
    relaxed = CompatibilityPolicy(
        may_differ={"train_config.log_interval"}, runtime_may_differ={"num_threads"}
    )
    run.step()
    loaded = load_checkpoint(path, **run.load_kwargs(), policy=relaxed)
    assert run.counters["step"] == 1
    threads = torch.get_num_threads()
    assert loaded.accepted_changes == {
        "train_config.log_interval": (MISSING, 5),
        "runtime.num_threads": (threads - 1, threads),
    }
    assert loaded.changes_under("runtime") == {"runtime.num_threads": (threads - 1, threads)}


def test_per_row_state_is_parameter_shaped_and_other_shapes_are_not():
    from k3_checkpoint.layout import parameter_shaped

    assert parameter_shaped((64, 16), (64, 16))
    assert parameter_shaped((64,), (64, 16))  # NorMuon's row_second_moment
    assert parameter_shaped((3, 8), (3, 8, 4))  # per row of each matrix of a stack
    assert not parameter_shaped((16,), (64, 16))
    assert not parameter_shaped((), (64, 16))
    assert not parameter_shaped((64, 16, 1), (64, 16))


class _AdamWGrownAKey(torch.optim.AdamW):
    """An optimizer that gained ``amsgrad`` after a checkpoint was written, and fills it in
    with the behaviour such a checkpoint had when it loads one (as MuonAdamW does)."""

    legacy_hyperparameters: ClassVar[dict[str, Any]] = {"amsgrad": False}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = [{**self.legacy_hyperparameters, **g} for g in state_dict["param_groups"]]
        super().load_state_dict({**state_dict, "param_groups": groups})


def test_a_key_the_optimizer_fills_in_may_be_missing_from_an_older_checkpoint(tmp_path):
    path = tmp_path / "ckpt.k3"
    source = make_run(seed=0)
    source.step()
    save_checkpoint(path, **source.save_kwargs())
    saved = run_fingerprint(source)
    rewrite(path, lambda p: p["optimizer"]["param_groups"][0].pop("amsgrad"))
    grown = lambda m: _AdamWGrownAKey(m.parameters(), lr=3e-3, weight_decay=0.1)  # noqa: E731
    live = make_run(seed=1, optimizer=grown)
    # (the subclass is another optimizer type, which the policy allows here)
    load_checkpoint(path, **live.load_kwargs(), policy=CompatibilityPolicy(
        may_differ={"optimizer_type"}))
    assert live.optimizer.param_groups[0]["amsgrad"] is False
    assert run_fingerprint(live)["optimizer"] == saved["optimizer"]
