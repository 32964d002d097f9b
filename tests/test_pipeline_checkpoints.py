"""A run at ``--pipeline-parallel 2`` (2 CPU processes, torchrun, gloo) resumes bitwise at
PP 2, and its sharded checkpoint, saved under the whole model's parameter names, loads
whole into one process: ``eval`` scores it as the run logged, ``export`` writes every
parameter equal to the checkpoint's, and that folder starts a one-process run
(``--init-from``). Deselect with ``-m 'not distributed'``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from harness import (
    NARROW_TINY_MODEL,
    assert_bitwise_equal,
    assert_one_line_error,
    k3_train,
    toml_text,
)
from test_distributed_checkpoints import _final_state, _torchrun
from test_distributed_training import TESTS, distributed, needs_torchrun, one_launch_at_a_time

from k3_trainer import read_events
from k3_trainer.checkpoint import find_checkpoint

pytestmark = [distributed, needs_torchrun, one_launch_at_a_time]
STEPS = 4


def _torchrun4(*args: object) -> None:
    from test_distributed_training import _run, torchrun

    result = _run(torchrun(4, *args), timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def _cli(data_dir: Path, config: Path, run_dir: Path, *extra: object) -> list[object]:
    return ["-m", "k3_trainer.cli", "train", "--parallel", "fsdp", "--pp", 2, "--data",
            data_dir, "--config", config, "--device", "cpu", "--decay-steps", STEPS,
            "--run-dir", run_dir, *extra]


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "small.toml"
    path.write_text(toml_text(train={"batch_size": 4, "checkpoint_interval": 2}))
    return path


@pytest.fixture(scope="module")
def continuous(tmp_path_factory, data_dir, config) -> Path:
    run_dir = tmp_path_factory.mktemp("pp") / "continuous"
    _torchrun(*_cli(data_dir, config, run_dir, "--max-steps", STEPS))
    return run_dir


def test_a_pipeline_run_resumes_bitwise(continuous, data_dir, config, tmp_path):
    run_dir = tmp_path / "interrupted"
    _torchrun(*_cli(data_dir, config, run_dir, "--max-steps", 2))
    _torchrun(*_cli(data_dir, config, run_dir, "--max-steps", STEPS, "--resume"))
    a, b = _final_state(continuous, tmp_path), _final_state(run_dir, tmp_path)
    assert a["data_parallel"] == {"mode": "fsdp", "world_size": 2, "pp": 2, "dp": 1}
    assert a["counters"]["step"] == STEPS
    assert_bitwise_equal(a, b)


def test_a_pipeline_checkpoint_loads_whole_into_one_process(continuous, data_dir, tmp_path):
    gathered = _final_state(continuous, tmp_path)["model"]
    assert any(name.startswith("embed.") for name in gathered)  # stage 0's
    assert any(name.startswith("lm_head.") for name in gathered)  # stage 1's
    logged = [e for e in read_events(continuous / "metrics.jsonl") if e["event"] == "eval"][-1]
    evaluated = k3_train("eval", "--run-dir", continuous, "--device", "cpu")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    val_loss = float(evaluated.stdout.split("val_loss ")[1].split(",")[0].split()[0])
    # eval reads its own batches (8 rows, the run's evaluations 4): close, not equal.
    assert val_loss == pytest.approx(logged["val_loss"], rel=0.02)
    out = tmp_path / "export"
    exported = k3_train("export", "--run-dir", continuous, "--out", out)
    assert exported.returncode == 0, exported.stderr[-3000:]
    from k3_model.hub import load_pretrained

    model = load_pretrained(out)  # the exported (renamed) weights, back under our names
    parameters = dict(model.named_parameters())
    assert set(parameters) <= set(gathered)
    for name, value in parameters.items():
        assert torch.equal(value.detach(), gathered[name]), name
    assert json.loads((out / "config.json").read_text())
    started = k3_train("train", "--data", data_dir, "--device", "cpu", "--max-steps", 1,
                       "--run-dir", tmp_path / "continued", "--init-from", out)
    assert started.returncode == 0, started.stderr[-3000:]


def test_a_pipeline_run_sharded_over_data_ranks_resumes_bitwise(data_dir, config, tmp_path):
    """PP 2 × FSDP2 2 × EP 2 (4 processes): each stage's shards, its experts split over
    its data ranks, and the optimizer state, resumed; the checkpoint keys every expert by
    its global index, whole in one process."""
    continuous, interrupted = tmp_path / "continuous", tmp_path / "interrupted"
    experts = ("--expert-parallel", 2)
    _torchrun4(*_cli(data_dir, config, continuous, "--max-steps", STEPS, *experts))
    _torchrun4(*_cli(data_dir, config, interrupted, "--max-steps", 2, *experts))
    _torchrun4(*_cli(data_dir, config, interrupted, "--max-steps", STEPS, "--resume",
                     *experts))
    a, b = _final_state(continuous, tmp_path), _final_state(interrupted, tmp_path)
    assert a["data_parallel"] == {"mode": "fsdp", "world_size": 4, "expert_parallel": 2,
                                  "pp": 2, "dp": 2}
    # Two blocks, the first dense: stage 0 holds no MoE layer and splits nothing.
    stacks = [value for name, value in a["model"].items() if name.endswith("experts.w_up")]
    assert len(stacks) == 1 and stacks[0].shape[0] == NARROW_TINY_MODEL.n_experts  # whole
    assert_bitwise_equal(a, b)


def test_a_pipeline_checkpoint_loads_into_stages_sharded_over_data_ranks(data_dir,
                                                                         tmp_path):
    """PP 2's sharded checkpoint (2 processes, whole stages) loaded by PP 2 × FSDP2 2 (4
    processes, each stage's parameters sharded over its two data ranks): DCP reshards,
    and every tensor gathered back equals the one saved, on both data ranks of each
    stage. (Loaded through ``Trainer.resume`` with ``allow_runtime_change``; the loaded
    run trains no step: ``--steps`` is the checkpoint's.)"""
    worker = [TESTS / "dist_worker.py", "--parallel", "fsdp", "--pp", 2, "--data", data_dir,
              "--steps", 2, "--batch-size", 4]
    checkpoint = tmp_path / "checkpoint.dcp"
    _torchrun(*worker, "--out", tmp_path / "saved", "--checkpoint", checkpoint)
    assert (checkpoint / ".metadata").is_file()
    _torchrun4(*worker, "--out", tmp_path / "loaded", "--resume", checkpoint,
               "--allow-runtime-change")
    saved = {name: value for r in range(2) for name, value in torch.load(
        tmp_path / "saved" / f"rank{r}.pt", weights_only=False)["weights"].items()}
    loaded = [torch.load(tmp_path / "loaded" / f"rank{r}.pt", weights_only=False)
              for r in range(4)]
    assert all("refused" not in result for result in loaded)
    assert not [e for e in loaded[0]["events"] if e["event"] == "train"]  # nothing trained
    held: dict[str, int] = {}
    for result in loaded:
        for name, value in result["weights"].items():
            assert torch.equal(value, saved[name]), name
            held[name] = held.get(name, 0) + 1
    assert held == dict.fromkeys(saved, 2)  # every tensor, on both data ranks of its stage


def test_a_stage_killed_inside_a_checkpoint_write_resumes_bitwise(continuous, data_dir,
                                                                  config, tmp_path):
    """kill -9 of the last stage's rank inside the second sharded write (step 4, its
    shards on disk, nothing published): the job fails, the newest checkpoint is step 2,
    and ``--resume`` from it ends bitwise equal to the uninterrupted run."""
    run_dir = tmp_path / "killed"
    cli = [TESTS / "cli_driver.py", *_cli(data_dir, config, run_dir, "--max-steps", STEPS)[2:]]
    killed = _torchrun(*cli, env={"K3_TEST_KILL_RANK": "1:sharded-write:2"}, ok=False)
    assert "Signal 9 (SIGKILL)" in killed.stderr, killed.stderr[-3000:]  # the kill fired
    assert find_checkpoint(run_dir) == run_dir / "checkpoints" / "step-00000002"
    _torchrun(*cli, "--resume")
    assert_bitwise_equal(_final_state(continuous, tmp_path), _final_state(run_dir, tmp_path))


def test_a_non_finite_qk_logit_on_one_stage_stops_every_stage_before_the_update(
        data_dir, config, tmp_path):
    """QK-Clip's check is a MAX over every stage: the stage holding the MLA layer (rank 1)
    finds +inf in update 3, and no stage steps its optimizer. The stage without an MLA
    layer (rank 0, which writes the run directory) refuses the same update and logs no
    step 3; the run stays at its step-2 checkpoint."""
    run_dir = tmp_path / "qk"
    cli = [TESTS / "cli_driver.py", *_cli(data_dir, config, run_dir, "--max-steps", STEPS)[2:]]
    failed = _torchrun(*cli, env={"K3_TEST_QK_NONFINITE": "1:3"}, ok=False)
    assert failed.returncode != 0
    said = {}  # rank: its "training diverged" line (two ranks' lines may run together)
    for part in failed.stderr.split("k3-train[rank ")[1:]:
        rank, _, rest = part.partition("]: training diverged: ")
        if rank.isdigit() and rest:
            said[int(rank)] = rest.split("nothing was changed", 1)[0]
    assert said, failed.stderr[-3000:]
    assert all(line.startswith("QK-Clip: non-finite max pre-softmax logit")
               for line in said.values())
    if 0 in said:  # when it prints before torchrun stops it (see harness.rank_errors)
        assert "on another pipeline stage" in said[0]
    if 1 in said:
        assert "in module 'layers.1.attn'" in said[1]
    events = list(read_events(run_dir / "metrics.jsonl"))
    assert [e["step"] for e in events if e["event"] == "train"] == [1, 2]
    assert find_checkpoint(run_dir) == run_dir / "checkpoints" / "step-00000002"


def test_activation_checkpointing_under_stages_changes_nothing(continuous, data_dir, config,
                                                               tmp_path):
    """``--activation-checkpointing block`` recomputes each stage's blocks in its backward:
    every logged loss, gradient norm and validation loss is the same bits."""
    run_dir = tmp_path / "checkpointed"
    _torchrun(*_cli(data_dir, config, run_dir, "--max-steps", STEPS,
                    "--activation-checkpointing", "block"))

    def logged(run: Path) -> list[tuple]:
        return [(e["event"], e["step"], e.get("loss"), e.get("grad_norm"), e.get("val_loss"))
                for e in read_events(run / "metrics.jsonl") if e["event"] in ("train", "eval")]

    assert logged(run_dir) == logged(continuous)
    assert any(event == "eval" for event, *_ in logged(run_dir))
    started = [e for e in read_events(run_dir / "metrics.jsonl")
               if e["event"] == "session_start"]
    assert started[0]["activation_checkpointing"] == "block"


def test_a_pipeline_run_resumed_at_another_pp_is_refused_in_one_line(continuous, data_dir,
                                                                    tmp_path):
    """The stages are part of the recorded layout: ``--resume`` in one process refuses a
    ``--pp 2`` run in one line naming what differs, and ``--allow-runtime-change`` does
    not make it continue either: each stage numbers its own optimizer groups, so the
    state continues only at ``--pp 2`` (the weights go anywhere: ``eval`` and ``export``
    above). Nothing is written."""
    alone = tmp_path / "alone"
    shutil.copytree(continuous, alone, symlinks=True)
    before = (alone / "metrics.jsonl").read_bytes()
    args = ["train", "--run-dir", alone, "--resume", "--device", "cpu", "--data", data_dir,
            "--max-steps", STEPS + 1, "--pp", 1]
    assert_one_line_error(k3_train(*args), "data_parallel", code=2)
    refused = k3_train(*args, "--allow-runtime-change")
    assert_one_line_error(refused, "saved at --pp 2, resumed at --pp 1", code=2)
    assert "resume with --pp 2" in refused.stderr
    assert (alone / "metrics.jsonl").read_bytes() == before


def test_a_mixture_s_loss_by_source_under_stages_matches_one_process(data_dir, code_dir,
                                                                     config, tmp_path):
    """The last stage splits each microbatch's target losses by their rows' sources (the
    microbatches are consecutive rows): every logged source's loss is one process's,
    which accumulates the same two microbatches (the MoE balancer updates per forward)."""
    mixture = ["--data", f"code={code_dir}:0.7", "--data", f"docs={data_dir}:0.3"]
    one, staged = tmp_path / "one", tmp_path / "pp"
    accumulated = tmp_path / "accumulated.toml"
    accumulated.write_text(toml_text(train={"batch_size": 2, "gradient_accumulation_steps": 2,
                                            "checkpoint_interval": 2}))
    alone = k3_train("train", *mixture, "--config", accumulated, "--device", "cpu",
                     "--decay-steps", STEPS, "--max-steps", 2, "--run-dir", one)
    assert alone.returncode == 0, alone.stderr[-3000:]
    _torchrun("-m", "k3_trainer.cli", "train", "--parallel", "fsdp", "--pp", 2, *mixture,
              "--config", config, "--device", "cpu", "--decay-steps", STEPS,
              "--max-steps", 2, "--run-dir", staged)

    def train(run: Path) -> list[dict]:
        return [e for e in read_events(run / "metrics.jsonl") if e["event"] == "train"]

    for a, b in zip(train(staged), train(one), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["loss_by_source"].keys() == b["loss_by_source"].keys() == {"code", "docs"}
        assert a["loss_by_source"] == pytest.approx(b["loss_by_source"], rel=1e-6)
