"""The trainer's Muon variants (``muon_normuon``, ``cautious_weight_decay``): a run with
both checkpoints NorMuon's per-row state and resumes bitwise."""

from __future__ import annotations

from trainer_helpers import build_parts, fit, resume, state_fingerprint, train_config


def test_a_normuon_run_with_cautious_decay_resumes_bitwise(data_dir, tmp_path):
    config = train_config(muon_normuon=True, cautious_weight_decay=True, max_steps=4,
                          checkpoint_interval=2, eval_interval=2)
    model, optimizer, train, val = build_parts(config, data_dir)
    whole = fit(model, optimizer, (train, val), config, checkpoint_path=tmp_path / "a.ckpt")
    assert any("row_second_moment" in s for s in whole.optimizer.state.values())
    expected = state_fingerprint(whole.model, whole.optimizer, whole.loaders)
    half = config.replace(max_steps=2)
    parts = build_parts(half, data_dir)
    fit(parts[0], parts[1], parts[2:], half, checkpoint_path=tmp_path / "b.ckpt")
    model, optimizer, train, val = build_parts(config, data_dir)
    run = resume(tmp_path / "b.ckpt", model, optimizer, (train, val), config)
    run.fit()
    assert state_fingerprint(run.model, run.optimizer, run.loaders) == expected
