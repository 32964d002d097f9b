"""Pipeline stages (``--pipeline-parallel 2``) on 2 CPU processes (torchrun, gloo), and on
4 with FSDP2 over 2 data ranks per stage, against
one process that accumulates the same microbatches (tests/pipeline_worker.py), and the
layouts refused before any process group. Deselect with ``-m 'not distributed'``.

What must hold: the loss at every step equal to one process's within 1e-6 relative; the
gradient norm and every parameter after the first update bitwise equal (the stages'
gradients are the one process's, and clipping lays the stages' norms out in its order);
every parameter after three updates within 2e-5 relative, 1e-6 over the whole model
(a later step's embedding gradient sums the stages' contributions in another order, which
a few small AdamW parameters of KDA amplify; see the k3-trainer README).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import assert_one_line_error, k3_train, subprocess_env
from test_distributed_training import (
    _run,
    distributed,
    needs_torchrun,
    one_launch_at_a_time,
    torchrun,
)

from k3_trainer import read_events

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "pipeline_worker.py"
STEPS = 3

pytestmark = [one_launch_at_a_time, distributed]


def _reference(out: Path, microbatches: int, *args: str, data_ranks: int = 1) -> dict:
    done = subprocess.run([sys.executable, str(WORKER), "--reference", "--out", str(out),
                           "--steps", str(STEPS), "--microbatches", str(microbatches),
                           "--data-ranks", str(data_ranks), *args],
                          capture_output=True, text=True, env=subprocess_env(), timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out / "rank0.pt", weights_only=False)


def _pipelined(out: Path, *args: object, processes: int = 2) -> list[dict]:
    result = _run(torchrun(processes, WORKER, "--out", out, "--steps", STEPS, *args),
                  timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, dict]:
    root = tmp_path_factory.mktemp("reference")
    return {m: _reference(root / str(m), m) for m in (2, 4)}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / a.double().norm().clamp_min(1e-30))


@needs_torchrun
@pytest.mark.parametrize(("schedule", "per_rank", "microbatches"), [
    ("gpipe", 1, 2), ("1f1b", 1, 2), ("interleaved-1f1b", 2, 4), ("zbv", 2, 4),
    ("dualpipev", 2, 4)])
def test_two_stages_match_one_process(schedule, per_rank, microbatches, references,
                                      tmp_path):
    reference = references[microbatches]
    ranks = _pipelined(tmp_path, "--schedule", schedule, "--stages-per-rank", per_rank,
                       "--microbatches", microbatches)
    # Both stages report the (summed) loss and the norm of the whole model's gradients.
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["norms"] == ranks[1]["norms"]
    assert ranks[0]["losses"] == pytest.approx(reference["losses"], rel=1e-6)
    assert ranks[0]["norms"][0] == reference["norms"][0]
    held = [set(rank["state"]) for rank in ranks]
    assert not held[0] & held[1]  # each parameter and buffer lives on one stage
    assert held[0] | held[1] == set(reference["state"])  # under its one-process name
    first = {**ranks[0]["first"], **ranks[1]["first"]}
    for name, tensor in reference["first"].items():
        assert torch.equal(first[name], tensor), name
    last = {**ranks[0]["state"], **ranks[1]["state"]}
    worst = max(_relative(tensor, last[name]) for name, tensor in reference["state"].items())
    assert worst < 2e-5
    names = sorted(reference["state"])
    whole = torch.cat([reference["state"][n].double().flatten() for n in names])
    ours = torch.cat([last[n].double().flatten() for n in names])
    assert _relative(whole, ours) < 1e-6


@needs_torchrun
def test_in_float64_every_parameter_matches_one_process(tmp_path):
    """The fp32 check above allows 2e-5 per tensor for rounding, not for a difference in
    the mathematics: with the parameters, the residual stream and Newton–Schulz in
    float64 (the model still computes its loss and KDA's gates in fp32, as always) every
    parameter after three 1F1B updates equals one process's within 1e-6 relative."""
    reference = _reference(tmp_path / "reference", 2, "--float64")
    ranks = _pipelined(tmp_path / "pp", "--schedule", "1f1b", "--float64")
    assert ranks[0]["losses"] == pytest.approx(reference["losses"], rel=1e-6)
    last = {**ranks[0]["state"], **ranks[1]["state"]}
    assert all(tensor.dtype == torch.float64 for tensor in last.values()
               if tensor.is_floating_point())
    worst = max(_relative(tensor, last[name]) for name, tensor in reference["state"].items())
    assert worst < 1e-6


@needs_torchrun
@pytest.mark.parametrize(("flags", "message"), [
    (("--pp", 2), "--pipeline-parallel 2 needs --parallel fsdp"),
    (("--pp", 2, "--parallel", "fsdp"), "the world size 1 is not dp·cp·pp"),
])
def test_an_impossible_pipeline_layout_is_refused_in_one_line(flags, message, tmp_path,
                                                               data_dir):
    run_dir = tmp_path / "run"
    result = k3_train("train", "--data", data_dir, "--device", "cpu", "--max-steps", 1,
                      "--run-dir", run_dir, *flags)
    assert_one_line_error(result, message, code=2)
    assert not run_dir.exists()


def _train_v(run_dir: Path, data: Path, schedule: str, *flags: object) -> list[dict]:
    """``k3-train train --pp 2`` on 2 ranks under a V-shaped schedule; its events."""
    done = _run(torchrun(2, "-m", "k3_trainer.cli", "train", "--run-dir", run_dir, "--data",
                         data, "--parallel", "fsdp", "--pp", 2, "--pp-schedule", schedule,
                         "--pp-stages-per-rank", 2, "--pp-microbatches", 4, "--batch-size", 4,
                         "--seq-len", 64, "--max-steps", STEPS, "--eval-batches", 2, *flags),
                timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return read_events(run_dir / "metrics.jsonl")


@needs_torchrun
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_a_v_shaped_schedule_validates_as_one_process_does(schedule, tmp_path, data_dir):
    """torch's V-shaped schedules cannot run forward only (their ``eval()`` fails at the
    hand-over between a rank's two adjacent stages), so validation runs a training step
    whose losses are multiplied by zero and drops its gradients. The validation loss
    equals one process evaluating the checkpoint, and (``zbv``) the training is that of a
    run validating only at its end."""
    run_dir = tmp_path / "v"
    events = _train_v(run_dir, data_dir, schedule, "--eval-interval", 1)
    logged = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in logged] == list(range(1, STEPS + 1))
    alone = k3_train("eval", "--run-dir", run_dir, "--device", "cpu", "--batches", 2)
    assert alone.returncode == 0, alone.stderr[-3000:]
    val_loss = float(alone.stdout.split("val_loss ")[1].split(",")[0])
    assert val_loss == pytest.approx(logged[-1]["val_loss"], abs=6e-5)  # printed to 4 places
    if schedule == "zbv":
        once = _train_v(tmp_path / "once", data_dir, schedule, "--eval-interval", 100)
        assert [e["loss"] for e in events if e["event"] == "train"] == \
            [e["loss"] for e in once if e["event"] == "train"]
        assert [e for e in once if e["event"] == "eval"][-1]["val_loss"] == logged[-1]["val_loss"]


@needs_torchrun
def test_two_stages_sharded_over_two_data_ranks_with_experts_match_one_process(tmp_path):
    """Kimi K2's layout at its smallest, PP 2 × FSDP2 2 × EP 2 on 4 processes: each
    stage's parameters sharded over its data ranks, its routed experts split over them
    (the all-to-alls inside the stage), the balancer gathering both data ranks' rows (the
    reference composes each microbatch of both ranks' rows in rank order, as that gather
    does). FSDP2's reduce-scatter and the experts' exchanges sum in another order than
    one process, so nothing is bitwise here."""
    reference = _reference(tmp_path / "reference", 2, data_ranks=2)
    ranks = _pipelined(tmp_path / "pp", "--expert-parallel", 2, processes=4)
    assert ranks[0]["losses"] == pytest.approx(reference["losses"], rel=1e-6)
    assert ranks[0]["norms"] == pytest.approx(reference["norms"], rel=1e-6)
    last = {**ranks[0]["state"], **ranks[1]["state"]}
    assert set(last) == set(reference["state"])
    worst = max(_relative(tensor, last[name]) for name, tensor in reference["state"].items())
    assert worst < 1e-3
    names = sorted(reference["state"])
    whole = torch.cat([reference["state"][n].double().flatten() for n in names])
    ours = torch.cat([last[n].double().flatten() for n in names])
    assert _relative(whole, ours) < 1e-6
