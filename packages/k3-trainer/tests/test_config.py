from __future__ import annotations

import dataclasses

import pytest

from k3_trainer import ConfigError, TrainConfig, TrainState

BAD_VALUES = {
    "batch_size": [0, -1, 2.0, True, "8"],
    "seq_len": [0, 1.5],
    "gradient_accumulation_steps": [0],
    "expert_parallel": [0, -2, 1.5, True],
    "pipeline_parallel": [0, -2, 1.5, True],
    "pp_schedule": ["zero-bubble", 1],
    "pp_microbatches": [0, 1.5, "8"],
    "pp_stages_per_rank": [0, 1.5, True],
    "context_parallel": [0, -2, 1.5, True],
    "peak_lr": [0.0, -1e-3, float("nan"), float("inf"), "1e-3"],
    "weight_decay": [-0.1, float("nan")],
    "adam_beta1": [1.0, -0.1],
    "adam_beta2": [1.5],
    "adam_eps": [-1e-8],
    "muon_momentum": [1.0, -0.5],
    "muon_nesterov": ["yes", 1],
    "muon_ns_steps": [0],
    "muon_ns_dtype": ["fp16", "float8"],
    "muon_ns_coefficients": ["cubic"],
    "muon_update_scale": ["rms"],
    "muon_normuon": ["yes", 1, None],
    "cautious_weight_decay": ["true", 0, None],
    "max_grad_norm": [-1.0, float("inf")],
    "lr_schedule": ["linear"],
    "warmup_steps": [-1, 0.5],
    "decay_steps": [0],
    "min_lr_ratio": [-0.1, 1.5],
    "decay_fraction": [0.0, 1.5, float("nan"), "0.2"],
    "decay_shape": ["exp", None],
    "max_steps": [0],
    "log_interval": [0],
    "eval_interval": [0],
    "checkpoint_interval": [-5],
    "async_checkpoint": ["true", 1, None],
    "document_masking": ["yes", 0, None],
    "keep_last": [0, -1, 1.5, True, "2", None],
    "keep_every": [0, -3, 1.5, True, "10"],
    "downstream": ["", "arc_easy,", ",piqa", 3, ["arc_easy"]],
    "downstream_interval": [0, -2, 1.5, True],
    "downstream_limit": [0, -1, None, 2.5],
    "eval_batches": [0, 1.5, "8"],
    "eval_tokens": [0, -1, 1.5, None],
    "precision": ["fp8", "FP32"],
    "qk_clip_enabled": ["true"],
    "qk_clip_tau": [0.0, -1.0, float("inf")],
    "qk_clip_gqa": ["per_head"],
    "seed": [-1, 1.5],
    "overfit_batch": [None],
    "compile": ["true", 1, None],
    "activation_checkpointing": ["layer", True, None],
}


def test_every_field_has_a_rejection_case():
    assert set(BAD_VALUES) == {f.name for f in dataclasses.fields(TrainConfig)}


@pytest.mark.parametrize(("field", "value"),
                         [(f, v) for f, values in BAD_VALUES.items() for v in values])
def test_invalid_values_raise_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**{field: value})


def test_cross_field_rule_and_unknown_keys():
    with pytest.raises(ConfigError, match="warmup_steps"):
        TrainConfig(warmup_steps=50, decay_steps=50)
    TrainConfig(warmup_steps=50, decay_steps=50, lr_schedule="constant")  # fine without decay
    with pytest.raises(ConfigError, match="learning_rate"):
        TrainConfig.from_dict({"learning_rate": 1e-3})


def test_round_trip_and_defaults():
    cfg = TrainConfig(batch_size=4, max_grad_norm=0.0, muon_ns_dtype="fp64")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.tokens_per_update == 4 * 128
    state = TrainState()
    assert (state.step, state.tokens_seen, state.skipped_updates) == (0, 0, 0)
    assert state.fixed_batch_offset is None


def test_muon_variants_reach_the_optimizer_and_older_runs_keep_their_meaning():
    import warnings

    from torch import nn

    from k3_trainer import build_optimizer

    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the name/shape guess of the groups
        variant = build_optimizer(model, TrainConfig(muon_normuon=True,
                                                     cautious_weight_decay=True))
        plain = build_optimizer(model, TrainConfig())
    assert any(g["use_muon"] for g in variant.param_groups)
    assert all(g["normuon"] for g in variant.param_groups if g["use_muon"])
    assert all(g["cautious_weight_decay"] for g in variant.param_groups)  # both halves
    assert not any(g["normuon"] or g["cautious_weight_decay"] for g in plain.param_groups)
    # Left out of a recorded config at their defaults (a run recorded before them matches),
    # recorded when on.
    assert not {"muon_normuon", "cautious_weight_decay"} & set(TrainConfig().to_dict())
    on = TrainConfig(muon_normuon=True).to_dict()
    assert on["muon_normuon"] is True and TrainConfig.from_dict(on).muon_normuon
