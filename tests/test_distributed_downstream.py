"""Downstream tasks in a 2-rank run (torchrun, gloo): each rank scores a share of the
documents and the sums are combined, so the numbers equal one process scoring the same
checkpoint (``k3-train eval --tasks``); under FSDP2 the shards are gathered for the
evaluation and training goes on sharded, under context parallelism on slices, under
pipeline stages through the stages. Deselect with ``-m 'not distributed'``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import k3_train, toml_text
from test_distributed_training import _run, needs_torchrun, second_launch_lane, torchrun

pytestmark = second_launch_lane

STEPS, LIMIT = 4, 6


@pytest.mark.distributed
@needs_torchrun
@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "fsdp-cp2", "fsdp-pp2", "fsdp-cp2-pp2",
                                      "fsdp-pp2-ep2"])
def test_two_ranks_score_the_tasks_as_one_process_does(parallel, tmp_path, data_dir):
    """``fsdp-cp2``: context parallelism 2, where training runs on half-rows and each rank
    scores whole documents of its share through the decoding path, which context
    parallelism does not slice (the training losses are unchanged). ``fsdp-pp2``: two
    pipeline stages; the documents go forward only through the stages, padded to the
    stages' fixed ``batch × seq_len`` (here the model's window, so no context is cut).
    ``fsdp-cp2-pp2`` (4 processes): the same through stages that each run on their
    rank's half of every row, the slices' scores summed over ``cp``. ``fsdp-pp2-ep2`` (4
    processes, Kimi K2's layout): two stages over two data ranks, each MoE layer's
    experts split over them, the documents scored through the experts where they live.
    The runs without scoring are left to ``fsdp-pp2``, whose scoring path these are."""
    mode, _, degree = parallel.partition("-")
    layout = {"cp2": {"seq_len": 64, "context_parallel": 2},
              "pp2": {"seq_len": 256, "pipeline_parallel": 2},
              "cp2-pp2": {"seq_len": 256, "pipeline_parallel": 2, "context_parallel": 2},
              "pp2-ep2": {"seq_len": 256, "pipeline_parallel": 2, "expert_parallel": 2},
              }.get(degree, {})
    processes = 4 if degree in ("cp2-pp2", "pp2-ep2") else 2

    def train(name: str, **downstream: object) -> tuple[Path, list[dict]]:
        config = tmp_path / f"{name}.toml"
        config.write_text(toml_text(train={"batch_size": 2, "checkpoint_interval": 2,
                                           **layout, **downstream}))
        run_dir = tmp_path / name
        done = _run(torchrun(processes, "-m", "k3_trainer.cli", "train", "--run-dir", run_dir,
                             "--data", data_dir, "--config", config, "--max-steps", STEPS,
                             "--parallel", mode), timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        return run_dir, [json.loads(line) for line in
                         (run_dir / "metrics.jsonl").read_text().splitlines()]

    run_dir, events = train("scored", downstream="arc_easy,winogrande",
                            downstream_interval=2, downstream_limit=LIMIT)
    downstream = [e for e in events if e["event"] == "eval" and "downstream" in e]
    assert [e["step"] for e in downstream] == [2, 4]
    if processes == 2:  # scoring changed nothing of the training: a run without it
        _, plain = train("plain")
        assert [e["loss"] for e in events if e["event"] == "train"] == \
            [e["loss"] for e in plain if e["event"] == "train"]
    out = tmp_path / "one.json"
    alone = k3_train("eval", "--run-dir", run_dir, "--tasks", "arc_easy,winogrande",
                     "--limit", LIMIT, "--output", out)
    assert alone.returncode == 0, alone.stderr
    written = json.loads(out.read_text())
    for name, found in downstream[-1]["downstream"]["tasks"].items():
        assert found["docs"] == LIMIT
        assert written["tasks"][name]["metrics"] == pytest.approx(found, rel=1e-6)
    assert written["core"] == pytest.approx(downstream[-1]["downstream"]["core"], rel=1e-6)
