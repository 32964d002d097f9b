"""Context-parallel training (``--context-parallel N``, alias ``--cp``) on CPU processes
(torchrun, gloo) against one process, through the command line.

The model (KDA + MLA, a quantile-balanced MoE, Attention Residuals) trains with documents
kept apart on a corpus of short documents, so documents cross the slices' boundaries, and
with a QK-Clip threshold below its logits, so heads are rescaled every step from the MAX
over every rank's queries. Rows of 48 tokens split into slices of 24 (not a multiple of
the KDA chunk of 16). CP 2 × FSDP 2 (4 processes, 2 data ranks), CP 2 alone and CP 2
with the experts split over the same 2 ranks (2 processes) each match one process on the
same global batch, and CP 2 × PP 2 (4 processes) one process accumulating the pipeline's
microbatches: losses, validation losses and weights within 1e-6 (fp32; only reduction
orders differ). CP runs resume bitwise, with and without stages, and one process
evaluates a checkpoint; what cannot run is refused in one line before any process
group. Deselect with ``-m 'not distributed'``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from harness import (
    NARROW_TINY_OVERRIDES,
    assert_bitwise_equal,
    assert_one_line_error,
    k3_train,
    toml_text,
)
from test_distributed_checkpoints import _final_state
from test_distributed_training import (
    _run,
    distributed,
    needs_torchrun,
    one_launch_at_a_time,
    torchrun,
)

from k3_trainer import read_events

STEPS, ROWS, SEQ, TAU = 3, 4, 48, 0.02
MODEL = {**NARROW_TINY_OVERRIDES, "kda_chunk_size": 16, "max_seq_len": 64}
TRAIN = {"seq_len": SEQ, "document_masking": True, "qk_clip_tau": TAU, "log_interval": 1,
         "eval_interval": STEPS, "eval_batches": 2, "checkpoint_interval": 1,
         "peak_lr": 3e-3}
LAYOUTS = {"cp2-fsdp2": (4, 2, ("--activation-checkpointing", "block")), "cp2": (2, 2, ()),
           "cp2-ep2": (2, 2, ("--expert-parallel", 2)),
           "cp2-pp2": (4, 2, ("--pipeline-parallel", 2, "--activation-checkpointing", "block"))}
"""``{name: (processes, context-parallel degree, other flags)}``: CP 2 × FSDP 2 (each
block recomputed in the backward, collectives included), CP 2 alone, CP 2 with each
MoE layer's experts split over the same 2 ranks, and CP 2 × PP 2 (two stages, each on
its two ranks' slices, blocks recomputed; FSDP2 over each stage's CP ranks)."""
MICROBATCHED = {"cp2-pp2": "one-microbatched"}
"""The layouts whose reference is one process accumulating the same microbatches (the
pipeline's two of ROWS / 2 rows: the MoE balancer updates after each, as one process's
gradient accumulation does)."""


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "cp.toml"
    path.write_text(toml_text(model=MODEL, train=TRAIN))
    return path


def _train(run_dir: Path, data: Path | list[str], config: Path, processes: int, cp: int,
           *extra: object) -> None:
    """``k3-train train`` in one process or under torchrun, on the global batch of ROWS
    rows (each data rank reads ROWS / data ranks of them, the ranks over ``cp`` and the
    pipeline stages); ``data`` a folder or the sources of a mixture."""
    sources = [data] if isinstance(data, Path) else data
    pp = int(extra[extra.index("--pipeline-parallel") + 1]) if "--pipeline-parallel" in extra \
        else 1
    args = ["train", *[arg for source in sources for arg in ("--data", source)],
            "--config", config, "--device", "cpu", "--run-dir",
            run_dir, "--decay-steps", STEPS, "--batch-size", ROWS * cp * pp // processes,
            *extra]
    if processes == 1:
        done = k3_train(*args)
    else:
        # One thread per rank: up to 4 ranks share the machine's cores.
        done = _run(torchrun(processes, "-m", "k3_trainer.cli", *args, "--parallel", "fsdp",
                             "--cp", cp), timeout=300, env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, code_dir, config) -> dict[str, Path]:
    """``{layout: run_dir}`` of uninterrupted runs, one process's included."""
    out = {}
    # The same ROWS per update in two microbatches, validating the same 2 × ROWS rows.
    microbatched = ("--batch-size", ROWS // 2, "--gradient-accumulation-steps", 2,
                    "--eval-batches", 4)
    for name, (processes, cp, extra) in {"one": (1, 1, ()), **LAYOUTS,
                                         "one-microbatched": (1, 1, microbatched)}.items():
        out[name] = tmp_path_factory.mktemp(name) / "run"
        _train(out[name], code_dir, config, processes, cp, "--max-steps", STEPS, *extra)
    return out


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == kind]


pytestmark = [distributed, needs_torchrun, one_launch_at_a_time]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_training_matches_one_process(layout, runs, tmp_path):
    reference = runs[MICROBATCHED.get(layout, "one")]
    ours, one = _events(runs[layout], "train"), _events(reference, "train")
    assert [e["step"] for e in ours] == list(range(1, STEPS + 1))
    for a, b in zip(ours, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["tokens_seen"] == b["tokens_seen"] == a["step"] * ROWS * SEQ
        assert a["qk_heads_clipped"] == b["qk_heads_clipped"]  # the MAX over cp
    assert sum(e["qk_heads_clipped"] for e in ours) > 0
    [val], [measured] = _events(runs[layout], "eval"), _events(reference, "eval")
    assert val["val_loss"] == pytest.approx(measured["val_loss"], rel=1e-6)
    assert val["val_tokens"] == measured["val_tokens"]
    state, alone = _final_state(runs[layout], tmp_path), _final_state(reference, tmp_path)
    processes, cp, extra = LAYOUTS[layout]
    pp = 2 if layout == "cp2-pp2" else 1
    assert state["data_parallel"] == {"mode": "fsdp", "world_size": processes, "cp": cp,
                                      "dp": processes // cp // pp,
                                      **({"expert_parallel": 2} if layout == "cp2-ep2"
                                         else {"pp": 2} if pp > 1 else {})}
    record = json.loads((runs[layout] / "run.json").read_text())
    assert record["sessions"][-1]["data_parallel"] == state["data_parallel"]
    assert record["train_config"]["context_parallel"] == cp
    assert state["model"].keys() == alone["model"].keys()
    # Every weight, buffer (the balancer's biases, solved from every slice's tokens) and
    # counter within 1e-6 of one process's, relative or absolute (the weights are O(0.01)
    # to O(1); the largest difference measured was 3e-7, on KDA's dt_bias, whose small
    # gradients AdamW normalizes).
    for name, weight in alone["model"].items():
        torch.testing.assert_close(state["model"][name], weight, rtol=1e-6, atol=1e-6,
                                   msg=name)


def test_a_context_parallel_run_resumes_bitwise_and_loads_into_one_process(
        runs, config, code_dir, tmp_path):
    run_dir = tmp_path / "resumed"
    processes, cp, _ = LAYOUTS["cp2"]
    _train(run_dir, code_dir, config, processes, cp, "--max-steps", 2)
    _train(run_dir, code_dir, config, processes, cp, "--max-steps", STEPS, "--resume")
    assert_bitwise_equal(_final_state(runs["cp2"], tmp_path), _final_state(run_dir, tmp_path))
    # One process reads the sharded checkpoint whole and measures the logged loss again.
    evaluated = k3_train("eval", "--run-dir", runs["cp2-fsdp2"], "--device", "cpu")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    logged = _events(runs["cp2-fsdp2"], "eval")[-1]
    val_loss = float(evaluated.stdout.split("val_loss ")[1].split(",")[0].split()[0])
    assert val_loss == pytest.approx(logged["val_loss"], abs=6e-5)  # printed to 4 decimals
    assert f"({logged['val_tokens']:,} tokens in " in evaluated.stdout
    # ...exports it, and a fresh one-process run starts from the export.
    hub = tmp_path / "hub"
    exported = k3_train("export", "--run-dir", runs["cp2-fsdp2"], "--out", hub)
    assert exported.returncode == 0, exported.stderr[-3000:]
    fresh = tmp_path / "fresh"
    started = k3_train("train", "--run-dir", fresh, "--data", code_dir, "--device", "cpu",
                       "--init-from", hub, "--seq-len", SEQ, "--batch-size", ROWS,
                       "--max-steps", 1, "--eval-batches", 2)
    assert started.returncode == 0, started.stderr[-3000:]
    [first] = _events(fresh, "eval")
    assert first["val_loss"] < _events(runs["one"], "train")[0]["loss"]  # a smoke check
    # ...and one process continues it: another layout, so only when allowed.
    alone = tmp_path / "alone"
    shutil.copytree(runs["cp2"], alone, symlinks=True)
    args = ["train", "--run-dir", alone, "--resume", "--device", "cpu", "--data", code_dir,
            "--max-steps", STEPS + 1, "--cp", 1]
    assert_one_line_error(k3_train(*args), "data_parallel", code=2)
    continued = k3_train(*args, "--allow-runtime-change")
    assert continued.returncode == 0, continued.stderr[-3000:]
    [changed] = _events(alone, "runtime_changed")
    assert "data_parallel.cp" in changed["changes"]
    assert [e["step"] for e in _events(alone, "train")][-1] == STEPS + 1


def test_a_run_on_slices_of_pipeline_stages_resumes_bitwise(runs, config, code_dir, tmp_path):
    run_dir = tmp_path / "resumed"
    processes, cp, extra = LAYOUTS["cp2-pp2"]
    _train(run_dir, code_dir, config, processes, cp, "--max-steps", 2, *extra)
    _train(run_dir, code_dir, config, processes, cp, "--max-steps", STEPS, "--resume", *extra)
    assert_bitwise_equal(_final_state(runs["cp2-pp2"], tmp_path),
                         _final_state(run_dir, tmp_path))


def test_a_mixture_s_loss_by_source_matches_one_process(config, code_dir, data_dir, tmp_path):
    """Each token's loss lives on one rank of a ``cp`` group and is counted once."""
    sources = [f"code={code_dir}:0.7", f"docs={data_dir}:0.3"]
    one, ours = tmp_path / "one", tmp_path / "cp2"
    _train(one, sources, config, 1, 1, "--max-steps", 2)
    _train(ours, sources, config, 2, 2, "--max-steps", 2)
    for a, b in zip(_events(ours, "train"), _events(one, "train"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["loss_by_source"].keys() == b["loss_by_source"].keys() == {"code", "docs"}
        assert a["loss_by_source"] == pytest.approx(b["loss_by_source"], rel=1e-6)


@pytest.mark.parametrize(("flags", "message"), [
    (["--parallel", "ddp", "--cp", 2], "--context-parallel 2 needs --parallel fsdp"),
    (["--parallel", "fsdp", "--cp", 5], f"--seq-len {SEQ} is not divisible by "
                                         "--context-parallel 5"),
    (["--parallel", "fsdp", "--cp", 2, "--pipeline-parallel", 2],
     "the world size 1 is not dp·cp·pp = 1·2·2"),
    (["--parallel", "fsdp", "--context-parallel", 4], "less than one KDA chunk (16)"),
    (["--parallel", "fsdp", "--cp", 2], "the world size 1 is not dp·cp·pp"),
    # Said by the --nproc launcher before torchrun starts (not once per rank under its report).
    (["--parallel", "fsdp", "--nproc", 2, "--cp", 2, "--pp", 2],
     "the world size 2 is not dp·cp·pp = 1·2·2 = 4"),
])
def test_layouts_that_cannot_run_are_refused_in_one_line(flags, message, config, code_dir,
                                                         tmp_path):
    refused = k3_train("train", "--data", code_dir, "--config", config, "--device", "cpu",
                       "--run-dir", tmp_path / "refused", "--max-steps", 1, *flags)
    assert_one_line_error(refused, message, code=2)
    assert not (tmp_path / "refused").exists()
