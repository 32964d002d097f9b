"""Trainer-level resume gate: what may change on resume, and zero mutation on rejection."""

from __future__ import annotations

import pytest
import torch
from trainer_helpers import MLA_MOE_MODEL, build_parts, fit, resume, state_fingerprint, train_config

from k3_checkpoint import CheckpointError, read_payload
from k3_checkpoint.payload import write_payload
from k3_trainer import MetricsLog, TokenDataLoader, Trainer, evaluate, prepare_dataset


@pytest.fixture(scope="module")
def saved(data_dir, tmp_path_factory):
    """A checkpoint at step 3 of a 6-step run."""
    path = tmp_path_factory.mktemp("ck") / "checkpoint.pt"
    config = train_config(max_steps=3, checkpoint_interval=3)
    model, opt, tl, vl = build_parts(config, data_dir)
    fit(model, opt, (tl, vl), config, checkpoint_path=path)
    return path


def _moved(config, data_dir, model_config=MLA_MOE_MODEL, data=None):
    """A live run that differs from the checkpoint everywhere (so mutation would show)."""
    model, opt, tl, vl = build_parts(config, data or data_dir, model_config, seed=4242)
    x, y = tl.next_batch()
    model(x, targets=y)[1].backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.rand(5)
    return model, opt, tl, vl


@pytest.mark.parametrize(("change", "match"), [
    ({"max_steps": 2}, "max_steps"),
    ({"decay_steps": 50}, "decay_steps"),
    ({"min_lr_ratio": 0.5}, "min_lr_ratio"),
    ({"lr_schedule": "constant"}, "lr_schedule"),
    ({"peak_lr": 1e-2}, "peak_lr"),
    ({"qk_clip_tau": 30.0}, "tau"),
    ({"muon_ns_dtype": "fp64"}, "muon_ns_dtype"),
])
def test_incompatible_train_config_is_rejected_without_mutation(saved, data_dir, change, match):
    # The checkpoint's run resolved decay_steps to 3 (its max_steps): keep that, change one.
    config = train_config(max_steps=6, decay_steps=3).replace(**change)
    model, opt, tl, vl = _moved(config, data_dir)
    before = state_fingerprint(model, opt, [tl, vl])
    with pytest.raises(CheckpointError, match=match):
        resume(saved, model, opt, (tl, vl), config)
    assert state_fingerprint(model, opt, [tl, vl]) == before


def test_other_model_and_other_data_are_rejected_without_mutation(saved, data_dir, tmp_path):
    config = train_config(decay_steps=3)
    other_model = MLA_MOE_MODEL.replace(moe_top_k=1)
    model, opt, tl, vl = _moved(config, data_dir, other_model)
    before = state_fingerprint(model, opt, [tl, vl])
    with pytest.raises(CheckpointError, match="model_config"):
        resume(saved, model, opt, (tl, vl), config)
    assert state_fingerprint(model, opt, [tl, vl]) == before

    text = tmp_path / "other.txt"
    text.write_text("other data " * 2000)
    prepare_dataset([text], tmp_path / "other")
    model, opt, tl, vl = _moved(config, data_dir, data=tmp_path / "other")
    before = state_fingerprint(model, opt, [tl, vl])
    with pytest.raises(CheckpointError, match=r"manifest|loader"):
        resume(saved, model, opt, (tl, vl), config)
    assert state_fingerprint(model, opt, [tl, vl]) == before


def test_intervals_may_change_and_max_steps_may_grow(saved, data_dir):
    config = train_config(max_steps=8, log_interval=1, eval_interval=7, checkpoint_interval=5,
                          eval_batches=1, decay_steps=3)
    model, opt, tl, vl = build_parts(config, data_dir)
    trainer = resume(saved, model, opt, (tl, vl), config)
    assert trainer.state.step == 3 and tl.offset == 3 * config.batch_size * config.seq_len
    log = MetricsLog(None)
    trainer.callbacks.extend([log])
    assert trainer.fit().step == 8
    assert [e["step"] for e in log.events if e["event"] == "train"] == [4, 5, 6, 7, 8]


def test_max_steps_may_be_lowered_down_to_the_saved_step(saved, data_dir, tmp_path):
    """The spec's rule: a resume's max_steps must be at least the checkpoint's step; it
    may be lower than the saved run's own max_steps (a run planned for 8 stops at 4)."""
    planned = _forged(saved, tmp_path, lambda p: p["train_config"].update(max_steps=8))
    for max_steps in (4, 3):
        config = train_config(max_steps=max_steps, decay_steps=3)
        model, opt, tl, vl = build_parts(config, data_dir)
        assert resume(planned, model, opt, (tl, vl), config).state.step == 3
    config = train_config(max_steps=2, decay_steps=3)
    model, opt, tl, vl = _moved(config, data_dir)
    before = state_fingerprint(model, opt, [tl, vl])
    with pytest.raises(CheckpointError, match=r"max_steps 2 is smaller than .*counters\.step 3"):
        resume(planned, model, opt, (tl, vl), config)
    assert state_fingerprint(model, opt, [tl, vl]) == before


def test_save_refuses_live_gradients(data_dir, tmp_path):
    config = train_config()
    model, opt, tl, vl = build_parts(config, data_dir)
    x, y = tl.next_batch()
    model(x, targets=y)[1].backward()
    with pytest.raises(CheckpointError, match="zero_grad"):
        Trainer(model, opt, (tl, vl), config).checkpointer.save(tmp_path / "ck.pt", step=0)
    assert not (tmp_path / "ck.pt").exists() and not (tmp_path / "ck.pt.tmp").exists()


def test_evaluate_reads_the_fixed_prefix_and_changes_nothing(data_dir):
    """(Token weighting against unequal batches: test_evaluate.py.) Every batch here scores
    the same number of targets, so the token-weighted mean is the mean of batch losses."""
    config = train_config()
    model, _, _, vl = build_parts(config, data_dir)
    model.train()
    vl.next_batch()
    state = torch.get_rng_state()
    loss = evaluate(model, vl, "cpu", max_batches=3)
    assert model.training and torch.equal(torch.get_rng_state(), state)
    manual, loader = [], TokenDataLoader(vl.path, "val", vl.batch_size, vl.seq_len)
    model.eval()
    with torch.no_grad():
        for _ in range(3):
            x, y = loader.next_batch()
            manual.append(float(model(x, targets=y)[1]))
    assert loss == pytest.approx(sum(manual) / 3, rel=1e-6)
    assert vl.offset == 3 * vl.tokens_per_batch  # validation restarts from zero each time


def _forged(saved, tmp_path, change):
    """A copy of ``saved`` whose payload ``change`` edited, behind a valid trailer and checksum."""
    path = tmp_path / "forged.pt"
    payload = read_payload(saved)
    change(payload)
    write_payload(path, payload)
    return path


def test_swapped_loaders_are_refused_without_mutation(saved, data_dir, tmp_path):
    """A loader's identity is its data and its split: the train cursor never moves val."""
    def swap(payload):
        loaders = payload["loaders"]
        loaders["train"], loaders["val"] = loaders["val"], loaders["train"]

    config = train_config(max_steps=6, decay_steps=3)
    model, opt, tl, vl = _moved(config, data_dir)
    before = state_fingerprint(model, opt, [tl, vl])
    with pytest.raises(CheckpointError, match=r"loaders\.train refused.*belongs to split 'val'"):
        resume(_forged(saved, tmp_path, swap), model, opt, (tl, vl), config)
    assert state_fingerprint(model, opt, [tl, vl]) == before


def _scaler_state(**changes):
    state = torch.amp.GradScaler("cpu", enabled=True).state_dict()
    return {**state, **changes}


def _set_counter(**values):
    return lambda payload: payload["counters"].update(values)


@pytest.mark.parametrize(("change", "match"), [
    (lambda p: p.pop("counters"), r"counters\.step in the checkpoint is <missing>"),
    (lambda p: p.update(counters=None), r"counters\.step in the checkpoint is <missing>"),
    (lambda p: p.update(counters=[3, 0, 0]), r"counters\.step in the checkpoint is <missing>"),
    (lambda p: p["counters"].pop("step"), r"counters\.step in the checkpoint is <missing>"),
    (_set_counter(step="3"), r"counters\.step in the checkpoint is '3'"),
    (_set_counter(step=True), r"counters\.step in the checkpoint is True"),
    (lambda p: p["counters"].pop("tokens_seen"), r"counters lack \['tokens_seen'\]"),
    (_set_counter(tokens_seen=-1), r"non-negative integers: tokens_seen=-1"),
    (_set_counter(skipped_updates=1.5), r"non-negative integers: skipped_updates=1\.5"),
    (_set_counter(fixed_batch_offset="0"), r"non-negative integers: fixed_batch_offset='0'"),
    (lambda p: p.update(grad_scaler=[1.0]), r"grad_scaler must be a mapping or None, got list"),
    (lambda p: p.update(grad_scaler={"scale": "x"}), r"grad_scaler must hold exactly"),
    (lambda p: p.update(grad_scaler=_scaler_state(scale="x")), r"malformed: scale='x'"),
    (lambda p: p.update(grad_scaler=_scaler_state(scale=float("inf"))), r"scale=inf"),
    (lambda p: p.update(grad_scaler=_scaler_state(backoff_factor=2.0)), r"backoff_factor=2\.0"),
    (lambda p: p.update(grad_scaler=_scaler_state(_growth_tracker=-1)), r"_growth_tracker=-1"),
], ids=["no-counters", "none", "list", "no-step", "str-step", "bool-step", "no-tokens",
        "negative", "float", "str-offset", "scaler-list", "scaler-keys", "scaler-str-scale",
        "scaler-inf-scale", "scaler-backoff", "scaler-tracker"])
def test_malformed_counters_are_refused_by_name_without_mutation(saved, data_dir, tmp_path,
                                                                 change, match):
    config = train_config(max_steps=6, decay_steps=3)
    model, opt, tl, vl = _moved(config, data_dir)
    before = state_fingerprint(model, opt, [tl, vl])
    with pytest.raises(CheckpointError, match=match) as refused:
        resume(_forged(saved, tmp_path, change), model, opt, (tl, vl), config)
    assert "\n" not in str(refused.value)
    assert state_fingerprint(model, opt, [tl, vl]) == before


@pytest.mark.parametrize("past_last", [0, 1])
def test_fixed_batch_offset_must_name_a_complete_batch(saved, data_dir, tmp_path, past_last):
    """The last complete batch starts at num_tokens - tokens_per_batch - 1 (its targets
    need one token more): that offset is taken, the next one is refused."""
    config = train_config(max_steps=6, decay_steps=3, overfit_batch=True)
    model, opt, tl, vl = _moved(config, data_dir)
    last = tl.num_tokens - tl.tokens_per_batch - 1
    tl.batch_at(last)  # a complete batch
    def at_offset(payload):
        payload["train_config"]["overfit_batch"] = True
        payload["counters"]["fixed_batch_offset"] = last + past_last

    forged = _forged(saved, tmp_path, at_offset)
    if not past_last:
        assert resume(forged, model, opt, (tl, vl), config).state.fixed_batch_offset == last
        return
    before = state_fingerprint(model, opt, [tl, vl])
    with pytest.raises(CheckpointError, match="does not name a complete batch"):
        resume(forged, model, opt, (tl, vl), config)
    assert state_fingerprint(model, opt, [tl, vl]) == before


def test_runtime_change_is_refused_unless_allowed_and_then_reported(saved, data_dir, tmp_path):
    def elsewhere(payload):
        payload["runtime"].update(torch_version="2.0.0", num_threads=97)

    forged = _forged(saved, tmp_path, elsewhere)
    config = train_config(max_steps=6, decay_steps=3)
    model, opt, tl, vl = _moved(config, data_dir)
    before = state_fingerprint(model, opt, [tl, vl])
    with pytest.raises(CheckpointError, match=r"runtime\.num_threads: checkpoint 97"):
        resume(forged, model, opt, (tl, vl), config)
    assert state_fingerprint(model, opt, [tl, vl]) == before

    trainer = Trainer(model, opt, (tl, vl), config)
    resumed = trainer.resume(forged, allow_runtime_change=True)
    assert trainer.state.step == 3
    assert resumed.runtime_changes == {
        "runtime.num_threads": (97, torch.get_num_threads()),
        "runtime.torch_version": ("2.0.0", str(torch.__version__)),
    }
    assert trainer.resume(saved, allow_runtime_change=True).runtime_changes == {}


@pytest.mark.parametrize("setting", ["deterministic_algorithms", "cudnn_deterministic",
                                     "cudnn_benchmark", "float32_matmul_precision"])
def test_allowing_runtime_change_keeps_the_run_settings_strict(saved, data_dir, tmp_path,
                                                               setting):
    """Determinism and dtype are choices of the run, not of the machine."""
    value = "medium" if setting == "float32_matmul_precision" else True
    forged = _forged(saved, tmp_path, lambda p: p["runtime"].update({setting: value}))
    config = train_config(max_steps=6, decay_steps=3)
    model, opt, tl, vl = _moved(config, data_dir)
    with pytest.raises(CheckpointError, match=rf"runtime\.{setting}"):
        resume(forged, model, opt, (tl, vl), config, allow_runtime_change=True)
