"""The default validation budget: the split's first 32,768 tokens, whatever the batch shape
or the evaluation interval (an evaluation of a 145k-token split took a third of a 50-step
interval), so runs of other shapes measure the same prefix; ``--eval-tokens`` and
``--eval-batches`` still set it, and the run, its summary and ``eval --run-dir`` measure the
same tokens."""

from __future__ import annotations

import pytest
from trainer_helpers import small_toml

from k3_trainer import read_events
from k3_trainer.cli import main
from k3_trainer.cli.flags import field_docs
from k3_trainer.config import LATER_FIELDS, TrainConfig
from k3_trainer.data import prepare_dataset, read_manifest
from k3_trainer.data.options import PrepareOptions

DEFAULT = 32_768


@pytest.mark.parametrize("fields", [
    {}, {"eval_interval": 10}, {"eval_interval": 5000}, {"gradient_accumulation_steps": 8},
    {"batch_size": 64, "seq_len": 512},
])
@pytest.mark.parametrize("tokens_per_batch", [512, 2048, 4096, 4 * 2048])
def test_the_default_budget_is_the_same_tokens_whatever_the_shape(fields, tokens_per_batch):
    config = TrainConfig(**fields)
    assert config.eval_tokens == DEFAULT
    assert config.validation_batches(tokens_per_batch) * tokens_per_batch == DEFAULT


def test_eval_batches_wins_and_a_budget_under_a_batch_reads_one():
    assert TrainConfig(eval_batches=3).validation_batches(2048) == 3
    assert TrainConfig(eval_tokens=10**6).validation_batches(2048) == 488
    assert TrainConfig(eval_tokens=100).validation_batches(2048) == 1


def test_the_rule_is_the_help_line_and_records_keep_their_meaning():
    doc = field_docs(TrainConfig)["eval_tokens"]
    assert "first 32,768 by default" in doc and "whatever the batch shape or interval" in doc
    assert "%" not in doc  # argparse would read it as a format
    # The default is left out of a recorded config (LATER_FIELDS) and read back as itself;
    # a budget a run set, the former default's 1,000,000 included, is recorded and kept.
    assert LATER_FIELDS["eval_tokens"] == TrainConfig().eval_tokens == DEFAULT
    assert "eval_tokens" not in TrainConfig().to_dict()
    kept = TrainConfig.from_dict(TrainConfig(eval_tokens=1_000_000).to_dict())
    assert kept.validation_batches(2048) == 1_000_000 // 2048
    # 0.1.0 recorded eval_batches = 8, which still reads 8 batches.
    assert TrainConfig.from_dict({"eval_batches": 8}).validation_batches(2048) == 8


@pytest.fixture(scope="module")
def large_val(tmp_path_factory):
    """The built-in corpus with a tenth of it for validation: a split above the budget."""
    out = tmp_path_factory.mktemp("val") / "data"
    prepare_dataset([], out, PrepareOptions(val_fraction=0.1))
    assert read_manifest(out)["split_stats"]["val"]["tokens"] > DEFAULT + 4096
    return out


CONFIG = small_toml(model={"max_seq_len": 64}, train=dict(warmup_steps=0, decay_steps=2))


@pytest.mark.parametrize(("flags", "rows"), [
    (["--batch-size", "16", "--seq-len", "32"], 16 * 32),
    (["--batch-size", "8", "--seq-len", "64", "--eval-interval", "500"], 8 * 64),
    (["--batch-size", "16", "--seq-len", "32", "--eval-tokens", "1000000"], 16 * 32),
])
def test_a_run_and_eval_measure_the_budgets_tokens(large_val, tmp_path, capsys, flags, rows):
    (tmp_path / "c.toml").write_text(CONFIG)
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), "--data", str(large_val), "--config",
                 str(tmp_path / "c.toml"), "--max-steps", "1", *flags]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    whole = (read_manifest(large_val)["split_stats"]["val"]["tokens"] - 1) // rows * rows
    expected = whole if "--eval-tokens" in flags else DEFAULT
    logged = [e for e in read_events(run / "metrics.jsonl") if e["event"] == "eval"][-1]
    assert logged["val_tokens"] == expected
    assert f"({expected:,} validation tokens)" in summary
    assert main(["eval", "--run-dir", str(run)]) == 0
    shown = capsys.readouterr().out
    assert f"val_loss {logged['val_loss']:.4f}" in shown
    assert f"({expected:,} tokens in {expected // rows} of {whole // rows} batches)" in shown
