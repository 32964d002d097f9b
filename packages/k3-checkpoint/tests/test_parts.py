"""The public building blocks on their own: RNG, runtime signature, policy and plain data."""

from __future__ import annotations

import enum
import random

import numpy as np
import pytest
import torch
from ckpt_helpers import tree_digest

from k3_checkpoint import (
    MISSING,
    CheckpointError,
    CompatibilityPolicy,
    capture_rng,
    restore_rng,
    runtime_signature,
    validate_rng_state,
)
from k3_checkpoint.plain import differences, to_plain


def _draws() -> tuple[object, ...]:
    return (
        [random.random() for _ in range(3)],
        random.gauss(0.0, 1.0),  # Python caches the second Gaussian of each pair
        np.random.standard_normal(3).tolist(),  # so does NumPy (odd count leaves one cached)
        np.random.randint(0, 1 << 30, size=4).tolist(),
        torch.rand(4).tolist(),
        torch.randn(3).tolist(),
    )


def test_restore_rng_is_exact_including_cached_gaussians():
    random.gauss(0.0, 1.0)
    np.random.standard_normal(1)
    state = capture_rng()
    assert state["numpy"]["has_gauss"] == 1 and state["python"]["gauss_next"] is not None
    expected = _draws()
    _draws()  # move every generator on
    restore_rng(state)
    assert _draws() == expected


def test_validating_changes_nothing_and_its_result_restores_exactly():
    state = capture_rng()
    expected = _draws()
    moved = tree_digest(capture_rng())
    valid = validate_rng_state(state)
    assert tree_digest(capture_rng()) == moved  # validating drew from no global generator
    valid.restore()
    assert _draws() == expected


def test_capture_holds_no_reference_to_live_generators():
    state = capture_rng()
    frozen = tree_digest(state)
    _draws()
    assert tree_digest(state) == frozen


@pytest.mark.parametrize(
    ("part", "bad", "match"),
    [
        (
            "python",
            {"version": 3, "state": torch.zeros(10, dtype=torch.int64), "gauss_next": None},
            "'python'",
        ),
        ("numpy", {"bit_generator": "PCG64"}, "'numpy'"),
        (
            "python",
            {"version": 3, "state": torch.full((625,), -1, dtype=torch.int64), "gauss_next": None},
            "'python'.*32 bits",
        ),
        ("numpy", "words", "'numpy'.*32 bits"),
        ("torch_cpu", torch.zeros(10, dtype=torch.uint8), "'torch_cpu'"),
        ("torch_cpu", [1, 2, 3], "'torch_cpu'.*1-D uint8 tensor"),
        ("torch_cuda", [torch.zeros(16, dtype=torch.uint8)] * 9, "'torch_cuda'"),
    ],
    ids=[
        "python-short",
        "numpy-kind",
        "python-negative",
        "numpy-33-bits",
        "torch-size",
        "torch-type",
        "cuda-count",
    ],
)
def test_a_bad_part_restores_nothing(part, bad, match):
    state = capture_rng()
    _draws()
    before = tree_digest(capture_rng())
    if bad == "words":  # a key past 32 bits
        bad = {**state["numpy"], "keys": state["numpy"]["keys"].clone().fill_(1 << 32)}
    broken = {**state, part: bad}
    with pytest.raises(CheckpointError, match=f"rng state {match}"):
        validate_rng_state(broken)
    with pytest.raises(CheckpointError, match=f"rng state {match}"):
        restore_rng(broken)  # the earlier, valid parts were not applied either
    assert tree_digest(capture_rng()) == before


def test_rng_state_needs_exactly_its_parts():
    state = capture_rng()
    del state["torch_cuda"]
    with pytest.raises(CheckpointError, match="exactly the parts"):
        restore_rng(state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generators_are_captured_and_restored():
    torch.cuda.init()
    state = capture_rng()
    assert len(state["torch_cuda"]) == torch.cuda.device_count()
    expected = torch.rand(5, device="cuda").tolist()
    torch.rand(5, device="cuda")
    restore_rng(state)
    assert torch.rand(5, device="cuda").tolist() == expected


def test_runtime_signature_reflects_the_settings_that_change_arithmetic():
    model = torch.nn.Linear(2, 2).double()
    base = runtime_signature(model)
    assert base["torch_version"] == str(torch.__version__)
    assert type(base["torch_version"]) is str  # not TorchVersion: weights_only refuses it
    assert base["device_type"] == ["cpu"] and base["param_dtype"] == ["torch.float64"]
    torch.set_num_threads(torch.get_num_threads() + 1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    changed = runtime_signature(model)
    assert changed["num_threads"] == base["num_threads"] + 1
    assert changed["deterministic_algorithms"] is True
    assert changed["deterministic_warn_only"] is True
    assert set(changed) == {
        "torch_version", "cuda_version", "device_type", "param_dtype", "num_threads",
        "deterministic_algorithms", "deterministic_warn_only", "cudnn_deterministic",
        "cudnn_benchmark", "float32_matmul_precision",
    }  # fmt: skip


def test_mixed_dtypes_are_all_recorded():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).to(torch.bfloat16))
    assert runtime_signature(model)["param_dtype"] == ["torch.bfloat16", "torch.float32"]


# -- policy ------------------------------------------------------------------------------


def _compare(policy, saved, current, step=3):
    """``policy.compare`` on train configs, with ``step`` as the saved counter."""
    payload = {"counters": {"step": step}}
    return policy.compare({"train_config": saved}, {"train_config": current}, payload)


def test_policy_default_is_exact_equality():
    policy = CompatibilityPolicy()
    assert _compare(policy, {"lr": 1.0}, {"lr": 1.0}) == {}
    with pytest.raises(CheckpointError, match=r"train_config\.lr: checkpoint 1\.0, current 2\.0"):
        _compare(policy, {"lr": 1.0}, {"lr": 2.0})
    with pytest.raises(CheckpointError, match=r"train_config\.seed: not in the checkpoint"):
        _compare(policy, {"lr": 1.0}, {"lr": 1.0, "seed": 1})
    with pytest.raises(CheckpointError, match=r"train_config\.seed: only in the checkpoint"):
        _compare(policy, {"lr": 1.0, "seed": 1}, {"lr": 1.0})


def test_policy_fields_relax_only_what_they_name():
    policy = CompatibilityPolicy(
        may_grow={"train_config.max_steps"},
        may_differ={"train_config.log_every"},
        step_limit=("train_config.max_steps", "counters.step"),
    )
    accepted = _compare(
        policy,
        {"max_steps": 10, "log_every": 1, "lr": 1.0},
        {"max_steps": 30, "log_every": 5, "lr": 1.0},
        step=10,
    )
    assert accepted == {"train_config.max_steps": (10, 30), "train_config.log_every": (1, 5)}
    with pytest.raises(CheckpointError, match="may grow, so it must be a number"):
        _compare(policy, {"max_steps": 10}, {"max_steps": "30"}, step=1)
    with pytest.raises(
        CheckpointError, match=r"is smaller than the checkpoint's counters\.step 12"
    ):
        _compare(policy, {"max_steps": 10}, {"max_steps": 11}, step=12)
    with pytest.raises(CheckpointError, match=r"train_config\.lr"):
        _compare(policy, {"max_steps": 1, "lr": 1.0}, {"max_steps": 1, "lr": 0.5}, step=1)
    for step in (-1, True, "3", None):
        with pytest.raises(CheckpointError, match=r"counters\.step in the checkpoint is"):
            _compare(policy, {"max_steps": 10}, {"max_steps": 10}, step=step)


def test_a_policy_path_covers_everything_below_it():
    policy = CompatibilityPolicy(may_differ={"train_config.logging"}, runtime_may_differ={"a"})
    saved = {"train_config": {"logging": {"every": 1, "sink": "x"}}, "runtime": {"a": 1, "b": 2}}
    current = {"train_config": {"logging": {"every": 5}}, "runtime": {"a": 3, "b": 2}}
    assert policy.compare(saved, current, {}) == {
        "train_config.logging.every": (1, 5),
        "train_config.logging.sink": ("x", MISSING),
        "runtime.a": (1, 3),
    }
    with pytest.raises(CheckpointError, match=r"incompatible runtime — runtime\.b.*bitwise"):
        policy.compare(saved, {**current, "runtime": {"a": 1, "b": 3}}, {})


def test_policy_refuses_ambiguous_construction():
    with pytest.raises(TypeError, match="not a str"):
        CompatibilityPolicy(may_grow="max_steps")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="both in may_grow and may_differ"):
        CompatibilityPolicy(may_grow={"a"}, may_differ={"a"})
    with pytest.raises(TypeError, match=r"step_limit takes \(current metadata path"):
        CompatibilityPolicy(step_limit="max_steps")  # type: ignore[arg-type]
    assert CompatibilityPolicy(may_grow=["a"]).may_grow == frozenset({"a"})


def test_bool_and_int_are_different_config_values():
    assert differences({"flag": True}, {"flag": 1}, "c") == ["c.flag: checkpoint True, current 1"]
    assert differences({"x": [1, True]}, {"x": [1, 1]}, "c") != []
    assert differences({"x": [1, 2.0]}, {"x": [1, 2]}, "c") == []


# -- plain data --------------------------------------------------------------------------


class _Mode(enum.Enum):
    FAST = "fast"


def test_to_plain_normalises_and_names_what_it_refuses():
    assert to_plain({"betas": (0.9, 0.95), "n": np.int64(3), "x": np.float32(0.5)}, "c") == {
        "betas": [0.9, 0.95],
        "n": 3,
        "x": 0.5,
    }
    assert type(to_plain({"n": np.int64(3)}, "c")["n"]) is int
    with pytest.raises(CheckpointError, match=r"c\.mode is the enum .*store its \.value"):
        to_plain({"mode": _Mode.FAST}, "c")
    with pytest.raises(CheckpointError, match=r"c\.inner has the non-string key 1"):
        to_plain({"inner": {1: 2}}, "c")
    with pytest.raises(CheckpointError, match=r"c\.items\[1\] is a builtins\.object"):
        to_plain({"items": [1, object()]}, "c")
