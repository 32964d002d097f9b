"""Bits per byte: the validation loss divided by the UTF-8 bytes its targets stand for."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from trainer_helpers import MLA_MOE_MODEL

from k3_model import K3Model
from k3_trainer import PrepareOptions, TokenDataLoader, evaluate, prepare_dataset
from k3_trainer.cli import main
from k3_trainer.data import load_codec
from k3_trainer.evaluation import evaluate_split
from k3_trainer.observe.metrics import read_events

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota",
         "kappa", "lambda", "mu"]


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    """ASCII documents (so any window of tokens decodes to exactly its bytes) and a BPE."""
    root = tmp_path_factory.mktemp("bpb")
    lines = [json.dumps({"text": " ".join(WORDS[(i * 7 + j) % 12] for j in range(5 + i % 30))})
             for i in range(200)]
    (root / "c.jsonl").write_text("\n".join(lines) + "\n")
    prepare_dataset([root / "c.jsonl"], root / "data",
                    PrepareOptions(train_tokenizer=300, val_fraction=0.25))
    return root / "data"


def _model(vocab: int) -> K3Model:
    torch.manual_seed(0)
    return K3Model(dataclasses.replace(MLA_MOE_MODEL, vocab_size=vocab))


def test_val_bpb_is_loss_over_ln2_times_tokens_per_byte(bpe_data):
    loader = TokenDataLoader(bpe_data, "val", 2, 16)
    model = _model(loader.vocab_size)
    result = evaluate_split(model, loader, "cpu", max_batches=3)
    assert result.loss == evaluate(model, loader, "cpu", max_batches=3)

    # independently: decode exactly the evaluated targets and count their UTF-8 bytes
    codec = load_codec(bpe_data, loader.manifest)
    loader.reset()
    tokens = nbytes = 0
    for _ in range(3):
        _, y = loader.next_batch()
        for row in y.tolist():
            tokens += len(row)
            nbytes += len(codec.decode(row).encode()) + row.count(codec.eod_id)  # 1 per separator
    assert result.tokens == tokens == 3 * 2 * 16
    assert result.bytes == nbytes and nbytes > 2 * tokens  # BPE: several bytes per token
    assert result.bpb == pytest.approx(result.loss / math.log(2) * tokens / nbytes, rel=1e-12)


def test_with_the_byte_tokenizer_bpb_is_bits_per_token(data_dir):
    loader = TokenDataLoader(data_dir, "val", 2, 16)
    result = evaluate_split(_model(256), loader, "cpu", max_batches=2)
    assert result.bytes == result.tokens == 64
    assert result.bpb == pytest.approx(result.loss / math.log(2), rel=1e-12)


def test_eval_events_the_eval_command_and_the_report_show_val_bpb(bpe_data, tmp_path, capsys):
    config = tmp_path / "c.toml"
    config.write_text('preset = "tiny"\n[model]\nvocab_size = 300\nd_model = 32\nn_layers = 2\n'
                      'n_heads = 2\nkv_lora_rank = 16\nqk_nope_head_dim = 8\n'
                      'qk_rope_head_dim = 8\nv_head_dim = 8\nn_experts = 4\nmoe_d_ff = 32\n'
                      'd_ff = 64\n[train]\nbatch_size = 2\nseq_len = 16\neval_batches = 2\n'
                      'warmup_steps = 1\ndecay_steps = 4\n')
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), "--data", str(bpe_data), "--config",
                 str(config), "--max-steps", "2", "--report"]) == 0
    evals = [e for e in read_events(run / "metrics.jsonl") if e["event"] == "eval"]
    assert evals and all(e["val_bpb"] > 0 for e in evals)
    assert "val_bpb" in (run / "report" / "index.html").read_text().replace(
        "validation bits per byte", "val_bpb")
    assert (run / "report" / "val_bpb.png").is_file()
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(run), "--batches", "2"]) == 0
    out = capsys.readouterr().out
    measured = out.strip().split(": ", 1)[1].split(" (")[0]
    loss, bpb = (float(part.split()[-1]) for part in measured.split(", "))
    assert bpb == pytest.approx(evals[-1]["val_bpb"], abs=1e-4)
    assert loss == pytest.approx(evals[-1]["val_loss"], abs=1e-4)
