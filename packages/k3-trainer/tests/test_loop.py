"""The update loop against the spec: resume exactness, overfit mode, events, skips, failures."""

from __future__ import annotations

import math
import random

import pytest
import torch
from trainer_helpers import InjectAt, assert_same_state, build_parts, fit, train_config

from k3_checkpoint import read_payload
from k3_trainer import (
    Callback,
    ConfigError,
    FP16SkipHarness,
    MetricsLog,
    PrepareOptions,
    Trainer,
    learning_rate_at_step,
)


def _run(config, data_dir, *, checkpoint=None, seed=None, resume_from=None):
    model, opt, tl, vl = build_parts(config, data_dir, seed=seed)
    log = MetricsLog(None)
    trainer = Trainer(model, opt, (tl, vl), config, checkpoint_path=checkpoint, callbacks=[log])
    if resume_from is not None:
        trainer.resume(resume_from)
    state = trainer.fit()
    return model, opt, tl, vl, state, log


@pytest.mark.parametrize("variant", [
    {},  # fp32, cosine with warmup crossing the interruption, MoE + MLA + QK-Clip observing
    {"gradient_accumulation_steps": 2, "qk_clip_tau": 0.01},  # accumulation; clipping active
])
def test_resumed_session_equals_continuous_training(data_dir, tmp_path, variant):
    config = train_config(warmup_steps=4, **variant)
    model_a, opt_a, tl_a, vl_a, state_a, _ = _run(config, data_dir)

    first = config.replace(max_steps=3)
    _run(first, data_dir, checkpoint=tmp_path / "ck.pt")
    # A fresh process would build everything from a different RNG state; the load
    # must overwrite all of it.
    model_b, opt_b, tl_b, vl_b, state_b, log_b = _run(
        config, data_dir, seed=999, resume_from=tmp_path / "ck.pt")

    assert_same_state(model_a, opt_a, model_b, opt_b)
    assert (state_a.step, state_a.tokens_seen) == (state_b.step, state_b.tokens_seen) == (
        6, 6 * config.tokens_per_update)
    assert tl_a.state_dict() == tl_b.state_dict()
    assert log_b.events[0]["step"] == 3


def test_rng_streams_continue_exactly_after_resume(data_dir, tmp_path):
    config = train_config()
    _run(config, data_dir)
    continuous = (random.random(), torch.rand(4))
    _run(config.replace(max_steps=3), data_dir, checkpoint=tmp_path / "ck.pt")
    _run(config, data_dir, seed=5, resume_from=tmp_path / "ck.pt")
    resumed = (random.random(), torch.rand(4))
    assert continuous[0] == resumed[0] and torch.equal(continuous[1], resumed[1])


def test_overfit_batch_is_reused_and_loss_falls(data_dir):
    config = train_config(overfit_batch=True, max_steps=30, log_interval=5, eval_interval=30,
                          peak_lr=1e-2, warmup_steps=3)
    model, opt, tl, vl, state, log = _run(config, data_dir)
    assert tl.offset == 0, "overfit mode must not move the loader cursor"
    assert state.fixed_batch_offset == 0
    losses = [e["loss"] for e in log.events if e["event"] == "train"]
    assert losses[-1] < 0.5 * losses[0], losses
    assert state.tokens_seen == 30 * config.tokens_per_update


def test_events_and_all_three_boundaries_on_the_final_step(data_dir, tmp_path):
    config = train_config(max_steps=5, log_interval=2, eval_interval=2, checkpoint_interval=2)
    *_, log = _run(config, data_dir, checkpoint=tmp_path / "ck.pt")
    kinds = [(e["event"], e.get("step")) for e in log.events]
    assert kinds[0] == ("session_start", 0) and kinds[-1] == ("session_end", 5)
    for step in (2, 4, 5):
        for event in ("train", "eval", "checkpoint"):
            assert (event, step) in kinds, (event, step)
    assert ("train", 3) not in kinds
    train_event = next(e for e in log.events if e["event"] == "train")
    for field in ("loss", "lr", "tokens_seen", "grad_norm", "tokens_per_s", "qk_max_logit",
                  "moe_load_cv"):
        assert isinstance(train_event[field], float | int), field
    assert train_event["lr"] == pytest.approx(learning_rate_at_step(config, 2))
    assert (tmp_path / "ck.pt").is_file() and not (tmp_path / "ck.pt.tmp").exists()


def test_qk_clip_applies_after_each_real_step(data_dir):
    config = train_config(qk_clip_tau=0.01, max_steps=4, log_interval=1)
    *_, log = _run(config, data_dir)
    trains = [e for e in log.events if e["event"] == "train"]
    assert all(e["qk_heads_clipped"] > 0 for e in trains)
    assert all(e["qk_max_logit"] > 0.01 for e in trains)
    unclipped = train_config(max_steps=4, log_interval=1)
    *_, log2 = _run(unclipped, data_dir)
    assert all(e["qk_heads_clipped"] == 0 for e in log2.events if e["event"] == "train")


def _scaler():
    return FP16SkipHarness(init_scale=2.0**10, growth_interval=1000)


def test_fp16_style_skip_consumes_data_but_not_the_schedule(data_dir):
    """Harness: an enabled GradScaler on CPU and an overflow injected into attempt 3."""
    config = train_config(max_steps=5, log_interval=1)
    model, opt, tl, vl = build_parts(config, data_dir)
    wrapped = InjectAt(model, calls={3})
    real_steps, lrs = [], []
    opt.register_step_pre_hook(lambda o, *_: lrs.append(o.param_groups[0]["lr"]))
    opt.register_step_post_hook(lambda o, *_: real_steps.append(1))
    log = MetricsLog(None)
    trainer = fit(wrapped, opt, (tl, vl), config, callbacks=[log], grad_scaler=_scaler())
    state = trainer.state
    assert state.step == 5 and state.skipped_updates == 1
    assert state.tokens_seen == 6 * config.tokens_per_update  # the skipped attempt counted
    assert len(real_steps) == 5
    assert lrs == pytest.approx([learning_rate_at_step(config, s) for s in range(1, 6)])
    overflow = [e for e in log.events if e["event"] == "overflow"]
    assert len(overflow) == 1 and overflow[0]["step"] == 3 and overflow[0]["scale"] == 512.0
    assert trainer.scaler.state_dict()["scale"] == 512.0
    assert tl.offset == 6 * config.batch_size * config.seq_len  # the retry used new data


def test_a_direct_checkpoint_save_holds_the_live_scaler_state(data_dir, tmp_path):
    """The loss scaler is itself the checkpoint component: a save at any moment (here a
    callback's, mid-run, after a skip and a growth step) holds its state as it is now."""
    config = train_config(max_steps=4)
    model, opt, tl, vl = build_parts(config, data_dir)
    seen: dict[str, object] = {}

    class SaveAt3(Callback):
        def on_step_end(self, trainer, stats):
            if trainer.state.step == 3:
                seen["live"] = trainer.scaler.state_dict()
                trainer.checkpointer.save(tmp_path / "direct.pt", step=3)

    scaler = _scaler()
    trainer = fit(InjectAt(model, calls={2}), opt, (tl, vl), config, grad_scaler=scaler,
                  callbacks=[SaveAt3()])
    saved = read_payload(tmp_path / "direct.pt")["grad_scaler"]
    assert saved == seen["live"] and saved["_growth_tracker"] == 2  # two growth steps since
    assert trainer.state.skipped_updates == 1


def test_31_skips_a_success_and_31_more_do_not_raise(data_dir):
    """The consecutive-skip count starts again after every successful update."""
    config = train_config(max_steps=3)
    model, opt, tl, vl = build_parts(config, data_dir)
    skips = set(range(1, 32)) | set(range(33, 64))  # attempt 32 succeeds
    state = fit(InjectAt(model, calls=skips), opt, (tl, vl), config,
                grad_scaler=FP16SkipHarness(init_scale=2.0**80, growth_interval=1000)).state
    assert (state.step, state.skipped_updates) == (3, 62)


def test_32_consecutive_skips_raise(data_dir):
    # tau so small that a clip applied after a skipped attempt would change the weights.
    config = train_config(max_steps=5, qk_clip_tau=1e-4)
    model, opt, tl, vl = build_parts(config, data_dir)
    weights = [p.detach().clone() for p in model.parameters()]
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("balancer.bias")}
    assert biases
    trainer = Trainer(InjectAt(model, calls=set(range(1, 100))), opt, (tl, vl), config,
                      grad_scaler=_scaler())
    state = trainer.state
    with pytest.raises(FloatingPointError, match="32 consecutive"):
        trainer.fit()
    assert state.step == 0 and state.skipped_updates == 32
    assert len(opt.state) == 0, "a skipped attempt must not create or change optimizer state"
    # Parameters are untouched (no optimizer step, no QK-Clip); the MoE balancer's buffers
    # did move: they update in every training forward and a skip does not roll them back.
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    buffers = dict(model.named_buffers())
    assert all(not torch.equal(biases[n], buffers[n]) for n in biases)


def test_nonfinite_loss_raises_before_backward_and_counting(data_dir):
    config = train_config(max_steps=3)
    model, opt, tl, vl = build_parts(config, data_dir)
    trainer = Trainer(InjectAt(model, calls={2}, kind="nan_loss"), opt, (tl, vl), config)
    state = trainer.state
    with pytest.raises(FloatingPointError, match="Non-finite training loss at step 2"):
        trainer.fit()
    assert state.step == 1 and state.tokens_seen == config.tokens_per_update
    assert all(p.grad is None for p in model.parameters())


def test_precision_contracts(data_dir):
    config = train_config(precision="fp16")
    model, opt, tl, vl = build_parts(config, data_dir)
    with pytest.raises(ConfigError, match="fp16"):
        Trainer(model, opt, (tl, vl), config)
    # A scaler does not bypass the checks: fp16 stays refused on CPU, even with a harness.
    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):
        Trainer(model, opt, (tl, vl), config, grad_scaler=_scaler())
    for precision in ("fp32", "bf16"):
        plain = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        with pytest.raises(ConfigError, match="loss scaling is for fp16 only"):
            Trainer(model, opt, (tl, vl), train_config(precision=precision), grad_scaler=plain)
    with pytest.raises(ConfigError, match="loss scaling is for fp16 only"):
        Trainer(model, opt, (tl, vl), train_config(precision="bf16"), grad_scaler=_scaler())
    assert len(opt.state) == 0 and tl.offset == 0
    bf16 = train_config(precision="bf16")
    model, opt, tl, vl = build_parts(bf16, data_dir)
    model.to(torch.bfloat16)
    with pytest.raises(ConfigError, match="fp32 master"):
        Trainer(model, opt, (tl, vl), bf16)


def test_bf16_autocast_training_keeps_fp32_masters(data_dir):
    config = train_config(precision="bf16", max_steps=2, eval_interval=2)
    model, opt, tl, vl, state, log = _run(config, data_dir)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(math.isfinite(e["loss"]) for e in log.events if e["event"] == "train")
    assert not Trainer(model, opt, (tl, vl), config).scaler.is_enabled()  # none for bf16


def test_data_with_a_larger_vocabulary_than_the_model_is_refused(data_dir):
    from trainer_helpers import MLA_MOE_MODEL

    from k3_trainer import DataError

    config = train_config(max_steps=1)
    model, opt, tl, vl = build_parts(config, data_dir, MLA_MOE_MODEL.replace(vocab_size=128))
    with pytest.raises(DataError, match=r"vocabulary \(256\) exceeds the model's vocab_size"):
        Trainer(model, opt, (tl, vl), config)
    assert len(opt.state) == 0


def test_cuda_bf16_without_hardware_support_is_refused(monkeypatch):
    from k3_trainer import validate_precision

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    with pytest.raises(ConfigError, match="bf16 needs native bf16 support"):
        validate_precision("bf16", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    validate_precision("bf16", torch.device("cuda"))  # supported: accepted


def test_nonfinite_gradient_with_finite_loss_ends_the_run(data_dir):
    """fp32 has no scaler to skip an overflow: clip_grad_norm_ refuses it, before any step."""
    config = train_config(max_steps=3)
    model, opt, tl, vl = build_parts(config, data_dir)
    trainer = Trainer(InjectAt(model, calls={2}), opt, (tl, vl), config)
    with pytest.raises(FloatingPointError, match="Non-finite gradient norm at step 2"):
        trainer.fit()
    assert trainer.state.step == 1


def test_max_grad_norm_zero_disables_clipping(data_dir):
    """0 means "no clipping", not "clip to zero": one update equals one with a huge limit."""
    results = []
    for limit in (0.0, 1e12):
        config = train_config(max_steps=1, max_grad_norm=limit)
        model, opt, tl, vl, *_ = _run(config, data_dir)
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    model0, *_ = build_parts(train_config(), data_dir)
    assert any(not torch.equal(a, b) for a, b in zip(results[0], model0.parameters()))


def test_an_exhausted_training_loader_restarts_from_offset_zero(tmp_path):
    """The loop resets an exhausted loader (dropping the tail); the loader never wraps."""
    from k3_trainer import prepare_dataset

    text = tmp_path / "small.txt"
    text.write_text("".join(f"line {i}: the quick brown fox\n" for i in range(60)))
    prepare_dataset([str(text)], tmp_path / "data", PrepareOptions(val_fraction=0.2))
    config = train_config(batch_size=4, seq_len=32, max_steps=1)
    model, opt, tl, vl = build_parts(config, tmp_path / "data")
    batches = (tl.num_tokens - 1) // tl.tokens_per_batch
    assert 2 <= batches <= 20
    config = config.replace(max_steps=batches + 2, eval_interval=10_000, log_interval=10_000)
    state = fit(model, opt, (tl, vl), config).state
    assert state.step == batches + 2
    assert tl.offset == 2 * tl.tokens_per_batch  # two batches read after the reset
