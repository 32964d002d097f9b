"""Guarantee 1: a run interrupted and resumed (``--resume`` in a new process) ends bitwise
equal to the same run done in one go — weights, optimizer state, counters, loader cursors,
RNG, GradScaler state and every per-step loss and LR — in every training mode.

The CLI rows run every resumed session as ``python -m k3_trainer.cli train --resume`` in a
fresh interpreter, exactly as a user would after a crash; the continuous run and the first
session run the same ``main`` in the test process (so the comparison is also across
processes). The two rows the CLI cannot express on a CPU (an FP16-style skipped update, a
model that draws from every global RNG) run ``Trainer.fit()`` in process with the same
checkpoint files in between.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from harness import (
    Inject,
    assert_bitwise_equal,
    build_run,
    k3_train,
    latest_checkpoint,
    seed_all,
    toml_text,
    train_config,
)

from k3_checkpoint import capture_rng, read_payload
from k3_trainer import FP16SkipHarness, Trainer, TrainState, read_events
from k3_trainer.cli import main

# name: (extra flags for every run, total steps, interruption points, config-file options)
ROWS = {
    "fp32": ([], 6, [2, 3, 5], {}),
    "bf16-autocast": (["--precision", "bf16"], 4, [2], {}),
    "gradient-accumulation-3": (["--gradient-accumulation-steps", "3"], 4, [1], {}),
    "overfit-batch": (["--overfit-batch"], 5, [2], {}),
    "qk-clip-clipping": (["--qk-clip-tau", "0.01"], 5, [2], {}),
    "moe-preset-tiny": ([], 4, [2], {"model": None}),
    "cosine-across-warmup": (["--warmup-steps", "4", "--decay-steps", "8"], 8, [3, 6], {}),
}


def _session_flags(flags: list[str], steps: int) -> list[str]:
    """Explicit schedule flags, so that a session's --max-steps never becomes the horizon."""
    schedule = [] if "--warmup-steps" in flags else ["--warmup-steps", "1"]
    schedule += [] if "--decay-steps" in flags else ["--decay-steps", str(steps)]
    return [*flags, *schedule]


def _main(*argv) -> int:
    """``k3-train`` in this process."""
    return main([str(a) for a in argv])


def _train_events(run_dir) -> dict[int, dict]:
    events = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "train"]
    by_step = {e["step"]: e for e in events}
    assert len(by_step) == len(events), "a step was trained twice"
    return by_step


def _assert_same_trajectory(continuous, interrupted) -> None:
    a, b = _train_events(continuous), _train_events(interrupted)
    assert sorted(a) == sorted(b)
    for step in a:
        for field in ("loss", "lr", "tokens_seen"):
            assert a[step][field] == b[step][field], (step, field, a[step][field],
                                                      b[step][field])


@pytest.mark.parametrize("row", list(ROWS))
def test_cli_resume_is_bitwise_equal_to_a_continuous_run(row, tmp_path, data_dir):
    flags, steps, cuts, options = ROWS[row]
    config = tmp_path / "config.toml"
    config.write_text(toml_text(**options))
    common = ["--data", data_dir, "--config", config, *_session_flags(flags, steps)]

    continuous, interrupted = tmp_path / "continuous", tmp_path / "interrupted"
    assert _main("train", "--run-dir", continuous, *common, "--max-steps", steps) == 0
    assert _main("train", "--run-dir", interrupted, *common, "--max-steps", cuts[0]) == 0
    for cut in [*cuts[1:], steps]:
        assert read_payload(latest_checkpoint(interrupted))["counters"]["step"] < cut
        # A resumed session names nothing but the run: config, model and data come from it.
        resumed = k3_train("train", "--run-dir", interrupted, "--resume", "--max-steps", cut)
        assert resumed.returncode == 0, resumed.stderr

    a = read_payload(latest_checkpoint(continuous))
    b = read_payload(latest_checkpoint(interrupted))
    assert a["counters"]["step"] == steps
    assert_bitwise_equal(a, b)  # model, optimizer, counters, loaders, RNG, configs, runtime
    _assert_same_trajectory(continuous, interrupted)
    starts = [e["step"] for e in read_events(interrupted / "metrics.jsonl")
              if e["event"] == "session_start"]
    assert starts == [0, *cuts]

    _check_row(row, a, interrupted, steps)


def _check_row(row: str, payload: dict, run_dir, steps: int) -> None:
    """Each row's mode really was in effect (a no-op mode would make the row vacuous)."""
    config = payload["train_config"]
    tokens = config["batch_size"] * config["seq_len"] * config["gradient_accumulation_steps"]
    assert payload["counters"]["tokens_seen"] == steps * tokens
    if row == "bf16-autocast":
        assert config["precision"] == "bf16"
        assert all(t.dtype == torch.float32 for t in payload["model"].values()
                   if t.is_floating_point())
    if row == "gradient-accumulation-3":
        assert payload["loaders"]["train"]["offset"] == steps * tokens
    if row == "overfit-batch":
        assert payload["counters"]["fixed_batch_offset"] == 0
        assert payload["loaders"]["train"]["offset"] == 0  # the cursor never moved
    if row == "qk-clip-clipping":
        events = [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "train"]
        clipped = {e["step"] for e in events if e["qk_heads_clipped"] > 0}
        # Every session clipped. Not every step: right after a clip the logits sit at τ,
        # and the next batch may stay under it in every head (the hybrid model has one
        # softmax layer of two heads).
        assert 1 in clipped and clipped & set(range(3, steps + 1)), clipped
    if row == "moe-preset-tiny":
        assert payload["model_config"]["d_model"] == 128 and payload["model_config"]["mlp"] == "moe"
        assert payload["model_config"]["moe_balance"] is True
        biases = [t for k, t in payload["model"].items() if k.endswith("balancer.bias")]
        updates = [int(t) for k, t in payload["model"].items() if k.endswith("balancer.updates")]
        assert biases and all(bool(b.abs().sum() > 0) for b in biases)
        assert updates and all(u == steps for u in updates)
    if row == "cosine-across-warmup":
        lrs = {s: e["lr"] for s, e in _train_events(run_dir).items()}
        peak = config["peak_lr"]
        assert lrs[3] < peak and lrs[4] == pytest.approx(peak) and lrs[5] < peak
        assert lrs[8] == pytest.approx(peak * config["min_lr_ratio"])


def test_cli_max_steps_raised_on_resume_keeps_the_schedule(tmp_path, data_dir, small_toml,
                                                           capsys):
    """A finished run extended with a larger --max-steps continues the recorded schedule
    (warmup and decay resolved from the first max_steps and stored), bitwise equal to a
    continuous run with that schedule. Both decisions are said, in one line each: the
    first session names the horizon it fixed, the extension says the LR stays at its
    floor; resuming the complete run is a success with nothing to do."""
    common = ["--data", data_dir, "--config", small_toml]
    short, continuous = tmp_path / "short", tmp_path / "continuous"
    capsys.readouterr()
    assert _main("train", "--run-dir", short, *common, "--max-steps", 4) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert len(notes) == 1 and "decay_steps=4" in notes[0] and "--decay-steps" in notes[0]
    record = json.loads((short / "run.json").read_text())
    assert (record["train_config"]["warmup_steps"], record["train_config"]["decay_steps"]) == (
        0, 4)
    assert _main("train", "--run-dir", short, "--resume") == 0
    out = capsys.readouterr()
    assert out.out.strip() == ("k3-train: run already complete at step 4; nothing to do "
                               "(raise --max-steps to extend it)")
    extended = k3_train("train", "--run-dir", short, "--resume", "--max-steps", 7)
    assert extended.returncode == 0, extended.stderr
    notes = [line for line in extended.stderr.splitlines() if "note:" in line]
    assert len(notes) == 1, extended.stderr
    floor = 3e-3 * 0.1  # the toml's peak_lr times the default min_lr_ratio
    assert "decay_steps=4" in notes[0] and f"{floor:.4g}" in notes[0] and "step 4" in notes[0]
    assert _main("train", "--run-dir", continuous, *common, "--max-steps", 7,
                 "--warmup-steps", 0, "--decay-steps", 4) == 0

    a, b = read_payload(latest_checkpoint(continuous)), read_payload(latest_checkpoint(short))
    assert a["counters"]["step"] == 7
    assert_bitwise_equal(a, b)
    _assert_same_trajectory(continuous, short)
    assert json.loads((short / "run.json").read_text())["train_config"]["decay_steps"] == 4


# -- library level: what the CLI cannot drive on a CPU --------------------------------------


def _scaler(init_scale: float = 2.0**10) -> torch.amp.GradScaler:
    # growth_interval=2: the scale also grows, so the growth tracker must survive the resume
    return FP16SkipHarness(init_scale=init_scale, growth_interval=2)


def test_fp16_style_skip_in_the_middle_resumes_bitwise(tmp_path, data_dir):
    """An enabled GradScaler (the FP16 path) with overflows injected at attempts 3 and 7 of
    8; the split run stops at step 4, between the two skips, and resumes in a fresh model,
    optimizer and scaler restored from the checkpoint."""
    config = train_config(max_steps=6, checkpoint_interval=100, warmup_steps=2, decay_steps=6)
    model, opt, tl, vl = build_run(config, data_dir)
    wrapped = Inject(model, calls={3, 7})
    trainer_a = Trainer(wrapped, opt, (tl, vl), config, grad_scaler=_scaler(),
                        checkpoint_path=tmp_path / "a.pt")
    state_a = trainer_a.fit()
    assert (state_a.step, state_a.skipped_updates) == (6, 2)
    assert state_a.tokens_seen == 8 * config.tokens_per_update

    first = config.replace(max_steps=4)
    model, opt, tl, vl = build_run(first, data_dir)
    state = Trainer(Inject(model, calls={3}), opt, (tl, vl), first, grad_scaler=_scaler(),
                    checkpoint_path=tmp_path / "b.pt").fit()
    assert (state.step, state.skipped_updates) == (4, 1)
    saved_scale = read_payload(tmp_path / "b.pt")["grad_scaler"]["scale"]

    model, opt, tl, vl = build_run(config, data_dir, seed=77)
    wrapped_b = Inject(model, calls={2})  # the continuous run's attempt 7
    fresh = _scaler(init_scale=2.0**16)  # fit() must overwrite it from the checkpoint
    trainer = Trainer(wrapped_b, opt, (tl, vl), config, grad_scaler=fresh,
                      checkpoint_path=tmp_path / "b.pt")
    trainer.resume(tmp_path / "b.pt")
    assert fresh.state_dict()["scale"] == saved_scale  # restored into the live scaler
    state_b = trainer.fit()

    assert (state_b.step, state_b.skipped_updates, state_b.tokens_seen) == (
        state_a.step, state_a.skipped_updates, state_a.tokens_seen)
    assert fresh.state_dict() == trainer_a.scaler.state_dict()
    assert_bitwise_equal(read_payload(tmp_path / "a.pt"), read_payload(tmp_path / "b.pt"))


def test_rng_drawing_model_resumes_bitwise(tmp_path, data_dir):
    """A model whose every training forward draws from Python's, NumPy's and torch's global
    generators: only an exact RNG restore continues the same trajectory."""
    config = train_config(max_steps=6, checkpoint_interval=100, warmup_steps=1, decay_steps=6)
    model, opt, tl, vl = build_run(config, data_dir)
    Trainer(Inject(model, noise=True), opt, (tl, vl), config,
            checkpoint_path=tmp_path / "a.pt").fit()
    rng_a = capture_rng()

    first = config.replace(max_steps=3)
    model, opt, tl, vl = build_run(first, data_dir)
    Trainer(Inject(model, noise=True), opt, (tl, vl), first,
            checkpoint_path=tmp_path / "b.pt").fit()
    shutil.copy(tmp_path / "b.pt", tmp_path / "step3.pt")
    model, opt, tl, vl = build_run(config, data_dir, seed=31337)  # a different process's RNG
    torch.rand(7)
    wrapped = Inject(model, noise=True)
    trainer = Trainer(wrapped, opt, (tl, vl), config, checkpoint_path=tmp_path / "b.pt")
    trainer.resume(tmp_path / "b.pt")
    state = trainer.state
    assert isinstance(state, TrainState) and state.step == 3
    trainer.fit()

    assert_bitwise_equal(read_payload(tmp_path / "a.pt"), read_payload(tmp_path / "b.pt"))
    assert_bitwise_equal(rng_a, capture_rng(), "rng after training")

    # Control: the same resume with the restored RNG clobbered ends elsewhere, so the
    # comparison above can fail.
    model, opt, tl, vl = build_run(config, data_dir, seed=31337)
    wrapped = Inject(model, noise=True)
    trainer = Trainer(wrapped, opt, (tl, vl), config, checkpoint_path=tmp_path / "c.pt")
    trainer.resume(tmp_path / "step3.pt")
    seed_all(5)
    trainer.fit()
    with pytest.raises(AssertionError):
        assert_bitwise_equal(read_payload(tmp_path / "a.pt")["model"],
                             read_payload(tmp_path / "c.pt")["model"])
