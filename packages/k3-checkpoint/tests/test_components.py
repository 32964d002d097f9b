"""Components beyond model and optimizer: one more is one more entry, and restores are
all or none."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ckpt_helpers import make_run, rewrite, run_fingerprint

from k3_checkpoint import (
    CheckpointError,
    CompatibilityPolicy,
    load_checkpoint,
    read_payload,
    save_checkpoint,
)


class Ema:
    """A stateful part a trainer might add later: plain data and a tensor."""

    def __init__(self, width: int = 4) -> None:
        self.decay = 0.99
        self.shadow = torch.zeros(width)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay = state["decay"]
        self.shadow.copy_(state["shadow"])


class HalfLoads:
    """A component whose load_state_dict changes itself, then refuses a saved 7 (careless)."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]
        if self.value == 7:
            raise ValueError("refused after changing itself")


def test_a_new_component_is_one_more_entry(tmp_path):
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    ema = Ema()
    ema.shadow += 3.0
    save_checkpoint(path, {**run.components(), "ema": ema}, run.metadata())
    assert torch.equal(read_payload(path)["ema"]["shadow"], torch.full((4,), 3.0))

    fresh = Ema()
    load_checkpoint(path, {**make_run(seed=2).components(), "ema": fresh}, run.metadata())
    assert torch.equal(fresh.shadow, torch.full((4,), 3.0)) and fresh.decay == 0.99

    with pytest.raises(CheckpointError, match=r"holds components this load has none for: "
                                              r"\['ema'\]"):
        load_checkpoint(path, make_run(seed=2).components(), run.metadata())


def test_a_subset_load_reads_the_components_asked_for_and_leaves_the_rest(tmp_path):
    """What a read-only use asks for (the model, here) is checked and restored; the saved
    optimizer, its records and the other components are neither compared nor read, so a
    component added later to the training side changes nothing for it."""
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    save_checkpoint(path, {**run.components(), "ema": Ema()}, run.metadata())
    assert read_payload(path)["components"] == sorted([*run.components(), "ema"])

    fresh = make_run(seed=2)
    before = fresh.optimizer.state_dict()
    load_checkpoint(path, {"model": fresh.model}, run.metadata(), subset=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.state_dict().values(),
                                                 run.model.state_dict().values()))
    assert fresh.optimizer.state_dict() == before  # not asked for, not touched

    with pytest.raises(CheckpointError, match="checkpoint has no state for component 'extra'"):
        load_checkpoint(path, {"model": fresh.model, "extra": Ema()}, run.metadata(),
                        subset=True)
    with pytest.raises(CheckpointError, match="incompatible"):  # metadata is still compared
        load_checkpoint(path, {"model": fresh.model}, {**run.metadata(), "vocab_size": -1},
                        subset=True)


def test_a_subset_load_of_a_file_that_does_not_name_its_components(tmp_path):
    """A 0.1.0 payload has no ``components`` list: what is neither the library's nor
    current metadata is taken as a component, optimizer records included."""
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    save_checkpoint(path, run.components(), run.metadata())
    rewrite(path, lambda payload: payload.pop("components"))
    fresh = make_run(seed=2)
    load_checkpoint(path, {"model": fresh.model}, run.metadata(), subset=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.state_dict().values(),
                                                 run.model.state_dict().values()))


def test_a_refusing_component_is_undone_with_everything_restored_before_it(tmp_path):
    """Restore order: components judged by their own load_state_dict first (here counters,
    grad_scaler, both loaders, then the careless one), then weights and optimizer, RNG last.
    The refusal comes after four restores and one self-change; all are undone."""
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    run.grad_scaler = {"scale": 8.0}
    careless = HalfLoads()
    careless.value = 7
    save_checkpoint(path, {**run.components(), "careless": careless}, run.metadata())

    live = make_run(seed=3)
    live.step()
    live.grad_scaler = {"scale": 2.0}
    live_careless = HalfLoads()
    before = run_fingerprint(live)
    with pytest.raises(CheckpointError, match=r"careless refused its saved state \(ValueError"):
        load_checkpoint(path, {**live.components(), "careless": live_careless}, live.metadata())
    assert run_fingerprint(live) == before and live_careless.value == 0


def test_groups_must_hold_the_same_names(tmp_path):
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    save_checkpoint(path, **run.save_kwargs())
    extra = {**run.components(), "loaders": {**run.loaders, "test": make_run().loaders["val"]}}
    with pytest.raises(CheckpointError, match=r"loaders differ: checkpoint \['train', 'val'\], "):
        load_checkpoint(path, extra, run.metadata())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_policy_giving_up_the_device_skips_foreign_cuda_generators(tmp_path):
    path = tmp_path / "ckpt.k3"
    run = make_run()
    run.step()
    save_checkpoint(path, **run.save_kwargs())

    def from_a_gpu_host(payload: dict[str, Any]) -> None:
        payload["runtime"]["device_type"] = ["cuda"]
        payload["rng"]["torch_cuda"] = [torch.zeros(16, dtype=torch.uint8)]

    rewrite(path, from_a_gpu_host)
    live = make_run(seed=5)
    with pytest.raises(CheckpointError, match=r"runtime\.device_type: checkpoint \['cuda'\]"):
        load_checkpoint(path, **live.load_kwargs())
    policy = CompatibilityPolicy(runtime_may_differ={"device_type"})
    loaded = load_checkpoint(path, **live.load_kwargs(), policy=policy)
    assert loaded.accepted_changes == {
        "runtime.device_type": (["cuda"], ["cpu"]),
        "rng.torch_cuda": ("1 devices", "0 devices"),
    }
    assert run_fingerprint(live)["model"] == run_fingerprint(run)["model"]
