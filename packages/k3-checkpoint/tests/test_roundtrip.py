"""Save then load restores every component bitwise, and training continues as if uninterrupted."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from ckpt_helpers import TRAINER_POLICY, make_run, run_fingerprint, train_config

from k3_checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    inspect_checkpoint,
    load_checkpoint,
    optimizer_layout,
    read_payload,
    save_checkpoint,
)


def test_round_trip_restores_every_component_bitwise(tmp_path):
    run = make_run(seed=0)
    for _ in range(3):
        run.step()
    run.grad_scaler = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                       "growth_interval": 2000, "_growth_tracker": 7}  # fmt: skip
    run.counters["fixed_batch_offset"] = 96
    path = tmp_path / "ckpt.k3"
    digest = save_checkpoint(path, **run.save_kwargs())
    saved = run_fingerprint(run)
    saved_counters = dict(run.counters)

    scaler = run.grad_scaler
    for _ in range(2):  # move every component away from the checkpoint
        run.step()
    run.grad_scaler = None
    assert all(run_fingerprint(run)[part] != saved[part] for part in saved)
    for parameter in run.model.parameters():  # a half-accumulated attempt, to be discarded
        parameter.grad = torch.ones_like(parameter)

    loaded = load_checkpoint(path, **run.load_kwargs())

    assert run_fingerprint(run) == saved
    assert loaded.digest == digest and len(digest) == 32  # XXH3-128, hex
    assert run.counters == saved_counters
    assert run.grad_scaler == scaler
    assert loaded.metadata["train_config"] == {**train_config(), "betas": [0.9, 0.95]}  # plain
    assert loaded.metadata["model_config"] == run.model_config
    assert loaded.accepted_changes == {}
    assert all(parameter.grad is None for parameter in run.model.parameters())
    assert not (tmp_path / "ckpt.k3.tmp").exists()


def test_resumed_training_matches_uninterrupted_training_bitwise(tmp_path):
    path = tmp_path / "ckpt.k3"
    original = make_run(seed=0)
    for _ in range(3):
        original.step()
    save_checkpoint(path, **original.save_kwargs())
    for _ in range(3):
        original.step()

    # A different seed: the fresh run's weights, moments, cursors and RNG all differ, and
    # building it draws from the generators, so only a complete restore can match.
    resumed = make_run(seed=123)
    load_checkpoint(path, **resumed.load_kwargs())
    for _ in range(3):
        resumed.step()

    assert run_fingerprint(resumed) == run_fingerprint(original)
    assert resumed.counters == original.counters


def test_optimizer_hyperparameters_come_from_the_checkpoint(tmp_path):
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    run.optimizer.param_groups[0]["lr"] = 1.25e-3  # the schedule's value at the boundary
    save_checkpoint(path, **run.save_kwargs())

    fresh = make_run(seed=5)
    assert fresh.optimizer.param_groups[0]["lr"] != 1.25e-3
    load_checkpoint(path, **fresh.load_kwargs())
    assert fresh.optimizer.param_groups[0]["lr"] == 1.25e-3


def test_real_grad_scaler_state_round_trips(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    scaler.scale(torch.ones(2, requires_grad=True).sum())  # materialises the scale
    run = make_run()
    run.step()
    run.grad_scaler = scaler.state_dict()
    path = tmp_path / "ckpt.k3"
    save_checkpoint(path, **run.save_kwargs())

    restored = torch.amp.GradScaler("cpu")
    resumed = make_run(seed=1)
    load_checkpoint(path, **resumed.load_kwargs())
    restored.load_state_dict(resumed.grad_scaler)
    assert restored.state_dict() == scaler.state_dict()


def test_trainer_policy_accepts_a_larger_max_steps(tmp_path):
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    save_checkpoint(path, **run.save_kwargs())
    run.train_config = train_config(max_steps=40)
    loaded = load_checkpoint(path, **run.load_kwargs(), policy=TRAINER_POLICY)
    assert loaded.metadata["train_config"]["max_steps"] == 20  # what was saved
    assert loaded.accepted_changes == {"train_config.max_steps": (20, 40)}
    with pytest.raises(CheckpointError, match=r"train_config\.max_steps"):
        load_checkpoint(path, **run.load_kwargs())  # the default policy: exact equality


def test_payload_holds_the_documented_fields(tmp_path):
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    save_checkpoint(path, **run.save_kwargs())
    payload = read_payload(path)
    assert payload["format_version"] == FORMAT_VERSION == 7
    assert set(payload) == {
        "format_version", "model", "optimizer", "optimizer_type", "optimizer_layout",
        "counters", "grad_scaler", "train_config", "model_config", "vocab_size", "qk_clip",
        "loaders", "runtime", "rng", "components",
    }  # fmt: skip
    assert payload["components"] == ["counters", "grad_scaler", "loaders", "model", "optimizer"]
    assert payload["optimizer_type"] == "torch.optim.adamw.AdamW"
    assert payload["optimizer_layout"][0] == {
        "group": 0, "name": "embed.weight", "shape": [64, 16], "dtype": "torch.float32",
    }  # fmt: skip
    assert payload["loaders"]["train"] == run.loaders["train"].state_dict()
    assert payload["qk_clip"] == {"policy": run.qk_clip_policy, "geometry": run.qk_clip_geometry}
    assert set(payload["rng"]) == {"python", "numpy", "torch_cpu", "torch_cuda"}


def test_layout_prefers_the_optimizers_own_parameter_names():
    model = torch.nn.Linear(3, 2)
    named = torch.optim.AdamW([("proj.w", model.weight), ("proj.b", model.bias)])
    assert [entry["name"] for entry in optimizer_layout(named, model)] == ["proj.w", "proj.b"]
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    assert [entry["name"] for entry in optimizer_layout(plain, model)] == ["weight", "bias"]
    stranger = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(CheckpointError, match="not a parameter of the model"):
        optimizer_layout(stranger, model)


def test_inspect_summarizes_without_a_model(tmp_path):
    path = tmp_path / "ckpt.k3"
    run = make_run()
    for _ in range(2):
        run.step()
    digest = save_checkpoint(path, **run.save_kwargs())
    summary = inspect_checkpoint(path)
    parameters = sum(parameter.numel() for parameter in run.model.parameters())
    assert summary.entries["counters"]["step"] == 2
    assert summary.entries["counters"]["tokens_seen"] == 64
    assert summary.digest == digest
    assert summary.tensor_bytes["model"] == 4 * parameters
    # AdamW: two moments per parameter plus a scalar step each.
    assert summary.tensor_bytes["optimizer"] == 2 * 4 * parameters + 4 * len(
        list(run.model.parameters())
    )
    assert summary.tensor_bytes["train_config"] == 0
    assert summary.entries["model"]["norm.weight"] == "<tensor [16] torch.float32>"
    assert summary.file_bytes == path.stat().st_size
    text = "\n".join(summary.lines())
    assert "step=2" in text and "torch.optim.adamw.AdamW" in text and digest[:16] in text
    assert f"{summary.tensor_bytes['model'] / 1024:.1f} KiB of tensors" in text


def test_loading_consumes_no_randomness_before_restoring_it(tmp_path):
    # RNG is restored last, so draws made by anything during the load cannot leak into the
    # resumed streams: the first draws after loading equal the first draws after saving.
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    save_checkpoint(path, **run.save_kwargs())
    expected = (random.random(), np.random.random(), torch.rand(1).item())
    load_checkpoint(path, **make_run(seed=9).load_kwargs())
    assert (random.random(), np.random.random(), torch.rand(1).item()) == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_run_round_trips_and_a_cpu_run_is_refused(tmp_path):
    path = tmp_path / "ckpt.k3"
    run = make_run(seed=0, device="cuda")
    for _ in range(2):
        run.step()
    save_checkpoint(path, **run.save_kwargs())
    saved = run_fingerprint(run)
    assert read_payload(path)["runtime"]["device_type"] == ["cuda"]
    assert len(read_payload(path)["rng"]["torch_cuda"]) == torch.cuda.device_count()

    resumed = make_run(seed=3, device="cuda")
    resumed.step()
    load_checkpoint(path, **resumed.load_kwargs())
    assert run_fingerprint(resumed) == saved
    assert all(p.device.type == "cuda" for p in resumed.model.parameters())
    state = resumed.optimizer.state[next(iter(resumed.model.parameters()))]
    assert state["exp_avg"].device.type == "cuda"

    cpu_run = make_run(seed=3)
    cpu_run.step()
    before = run_fingerprint(cpu_run)
    with pytest.raises(CheckpointError, match=r"runtime\.device_type: checkpoint \['cuda'\]"):
        load_checkpoint(path, **cpu_run.load_kwargs())
    assert run_fingerprint(cpu_run) == before
