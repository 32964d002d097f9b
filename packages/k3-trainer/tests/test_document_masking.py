"""``document_masking``: the trainer derives ``document_ids`` from the end-of-document
token (which begins the next document), trains and evaluates with them, resumes bitwise,
and refuses a model that cannot take them."""

from __future__ import annotations

import pytest
import torch
from test_mixture import small_dir  # noqa: F401  (the module-scoped fixture: short documents)
from trainer_helpers import build_parts, fit, resume, state_fingerprint, train_config

from k3_model import K3Config
from k3_trainer import Callback, ConfigError, Trainer
from k3_trainer.data import document_ids

# KDA (chunks of 16, rows of 32 holding several short documents) and Gated MLA.
HYBRID = K3Config(vocab_size=256, d_model=32, n_layers=2, n_heads=2, max_seq_len=64,
                  attention="hybrid", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                  v_head_dim=8, mlp="dense", d_ff=64, kda_chunk_size=16)


def test_ids_count_end_of_document_tokens_along_each_row():
    x = torch.tensor([[3, 4, 0, 5, 6, 0, 0, 7], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert document_ids(x, 0).tolist() == [[0, 0, 1, 1, 1, 2, 3, 3],
                                            [1, 1, 1, 1, 1, 1, 1, 1]]


def _losses(config, data_dir) -> tuple[list[float], float, float]:
    """The logged training losses of a run, and its first batch's loss at init with and
    without the documents kept apart."""
    losses: list[float] = []

    class Record(Callback):
        def on_step_end(self, trainer, stats):
            losses.append(stats["loss"])

    model, optimizer, train, val = build_parts(config, data_dir, HYBRID)
    x, y = train.batch_at(0)
    with torch.no_grad():
        masked = model(x, y, document_ids=document_ids(x, train.tokenizer["eod_id"]))[1]
        plain = model(x, y)[1]
    fit(model, optimizer, (train, val), config, callbacks=[Record()])
    return losses, float(masked), float(plain)


def test_the_trainer_keeps_documents_apart_when_asked(small_dir):  # noqa: F811
    config = train_config(document_masking=True, batch_size=2, eval_batches=1, seq_len=32,
                          max_steps=2, eval_interval=2, checkpoint_interval=100)
    losses, masked, plain = _losses(config, small_dir)
    assert abs(masked - plain) > 1e-4  # the rows do hold several documents
    assert losses[0] == pytest.approx(masked, rel=1e-6)
    losses, _, _ = _losses(config.replace(document_masking=False), small_dir)
    assert losses[0] == pytest.approx(plain, rel=1e-6)


def test_a_masked_run_resumes_bitwise(small_dir, tmp_path):  # noqa: F811
    config = train_config(document_masking=True, batch_size=2, eval_batches=1, seq_len=32,
                          max_steps=4, checkpoint_interval=2, eval_interval=2)
    model, optimizer, train, val = build_parts(config, small_dir, HYBRID)
    whole = fit(model, optimizer, (train, val), config, checkpoint_path=tmp_path / "a.ckpt")
    expected = state_fingerprint(whole.model, whole.optimizer, whole.loaders)
    half = config.replace(max_steps=2)
    parts = build_parts(half, small_dir, HYBRID)
    fit(parts[0], parts[1], parts[2:], half, checkpoint_path=tmp_path / "b.ckpt")
    model, optimizer, train, val = build_parts(config, small_dir, HYBRID)
    run = resume(tmp_path / "b.ckpt", model, optimizer, (train, val), config)
    run.fit()
    assert state_fingerprint(run.model, run.optimizer, run.loaders) == expected


def test_a_model_without_document_ids_is_refused(small_dir):  # noqa: F811
    config = train_config(document_masking=True)
    _, optimizer, train, val = build_parts(config, small_dir, HYBRID)

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(256, 256)

        def forward(self, x, targets=None):
            return self.table(x), None

    plain = Plain()
    with pytest.raises(ConfigError, match="takes no document_ids"):
        Trainer(plain, torch.optim.SGD(plain.parameters(), lr=0.1), (train, val), config)
