"""``--compile`` under torchrun: 2 CPU ranks (gloo) with regional compile follow eager ranks.

``k3-train train --parallel ddp|fsdp --compile`` compiles each decoder block; FSDP2's
and DDP's hooks stay outside the block graphs, while QK-Clip's observation and the MoE
balancer's all-gather of every rank's tokens run inside them. One eager 2-rank run is the
reference for both wrappers: per-step losses within 1e-3 relative, the same QK-Clip
decisions, the same balancer biases (which need the all-gather: one rank's tokens alone
solve other biases). The FSDP2 run also checkpoints activations, so it runs the whole
recommended stack (checkpointing, compile, ``fully_shard``). Compilation is the cost: about
a minute with a warm inductor cache, a few minutes cold on 2 cores. Deselect with
``-m 'not distributed'``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness import NARROW_TINY_MODEL, toml_text, train_config
from test_distributed_training import _run, needs_torchrun, one_launch_at_a_time, torchrun

from k3_model import K3Model
from k3_trainer.compiling import compiled_regions, prepare_model

STEPS, BATCH = 4, 4
TAU = 0.02  # below the small model's max logits: QK-Clip rescales heads
RUN_TIMEOUT = 900  # a cold inductor cache compiles every block on both ranks

distributed = pytest.mark.distributed


def _train_2_ranks(run_dir: Path, data_dir: Path, config: Path, parallel: str,
                   *extra: object) -> list[dict]:
    """``torchrun ... -m k3_trainer.cli train`` on 2 ranks; rank 0's logged events."""
    done = _run(torchrun(2, "-m", "k3_trainer.cli", "train", "--parallel", parallel, "--data",
                         data_dir, "--config", config, "--device", "cpu", "--run-dir", run_dir,
                         "--max-steps", STEPS, "--decay-steps", STEPS, *extra),
                timeout=RUN_TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["event"] == kind]


pytestmark = one_launch_at_a_time


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "small.toml"
    path.write_text(toml_text(train={"batch_size": BATCH // 2, "qk_clip_tau": TAU,
                                     "eval_interval": 100, "checkpoint_interval": 100}))
    return path


@pytest.fixture(scope="module")
def eager(tmp_path_factory, data_dir, config) -> list[dict]:
    return _train_2_ranks(tmp_path_factory.mktemp("eager") / "run", data_dir, config, "ddp")


@distributed
@needs_torchrun
@pytest.mark.parametrize("parallel, checkpointing", [("ddp", "none"), ("fsdp", "block"),
                                                     ("fsdp-pp2", "none")])
def test_compiled_ranks_follow_eager_ranks(parallel, checkpointing, eager, config, tmp_path,
                                           data_dir):
    """``fsdp-pp2``: two pipeline stages, each compiling its own blocks; one data rank
    reads the whole batch (``--batch-size 4``), the rows the two DDP ranks read. Rank 0
    logs and holds neither the MLA nor the MoE layer: its events carry the other stage's
    QK-Clip and balancer figures (the balancer's own values differ from DDP's, which
    updates once a batch where the pipeline updates after each microbatch)."""
    mode, _, stages = parallel.partition("-pp")
    layout = ("--pp", stages, "--batch-size", BATCH) if stages else ()
    events = _train_2_ranks(tmp_path / "run", data_dir, config, mode, "--compile",
                            "--activation-checkpointing", checkpointing, *layout)
    start, end = _of(events, "session_start")[0], _of(events, "session_end")[-1]
    assert start["compile"] is True and start["activation_checkpointing"] == checkpointing
    assert end["compile_s"] > 0 and _of(eager, "session_end")[-1]["compile_s"] == 0
    ours, reference = _of(events, "train"), _of(eager, "train")
    assert [e["step"] for e in ours] == [e["step"] for e in reference] == [*range(1, STEPS + 1)]
    for a, b in zip(ours, reference):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
        assert a["tokens_seen"] == b["tokens_seen"]
        assert a["qk_heads_clipped"] == b["qk_heads_clipped"]  # observed inside the graphs
        assert {k for k in a if "/" in k} == {k for k in b if "/" in k}  # every layer's
        if stages:  # its balancer updates after each of 2 microbatches, DDP's once a batch
            continue
        for key in ("moe_bias_min", "moe_bias_max"):  # solved from both ranks' tokens
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), key
    assert sum(e["qk_heads_clipped"] for e in ours) > 0
    assert [e["val_loss"] for e in _of(events, "eval")] == pytest.approx(
        [e["val_loss"] for e in _of(eager, "eval")], rel=1e-3)


def test_preparing_twice_keeps_the_first_compiled_call():
    """A session may prepare the model before wrapping it (AC, compile, then shard) and
    ``Trainer.fit()`` prepares it again: the blocks keep their compiled call (nothing runs
    here)."""
    model = K3Model(NARROW_TINY_MODEL)
    config = train_config(compile=True, activation_checkpointing="block")
    prepare_model(model, config)
    first = [region._compiled_call_impl for region in compiled_regions(model)]
    assert all(call is not None for call in first) and len(first) == NARROW_TINY_MODEL.n_layers
    prepare_model(model, config)
    assert [region._compiled_call_impl for region in compiled_regions(model)] == first
    assert model.activation_checkpointing == "block"
