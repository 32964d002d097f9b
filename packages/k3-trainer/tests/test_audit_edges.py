"""Cases a mutation audit found untested, each where a one-token (or one-line) change went
unnoticed: bits per byte and accuracy per character on text where bytes, characters and
tokens differ, lm-eval's split of a BPE merge across the context's end, a pair exactly at
the window, a mixture's source that fits one row exactly and its reset, the run record
keeping ``init_from``, the checkpoint event's path, and validation under document
masking."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_document_masking import HYBRID
from test_mixture import small_dir  # noqa: F401  (the module-scoped fixture: short documents)
from trainer_helpers import build_parts, fit, train_config

from k3_trainer import MetricsLog
from k3_trainer.checkpoint import CheckpointHistory
from k3_trainer.data import BytesCodec, MixtureLoader, Source
from k3_trainer.data.tokenizer import train_bpe
from k3_trainer.evaluation import evaluate_split
from k3_trainer.record import RecordedData, RunRecord, Session
from k3_trainer.tasks import load_task, metrics
from k3_trainer.tasks.scoring import encode_choice, score_documents, score_pairs


class Uniform(torch.nn.Module):
    """Every token equally likely: a continuation's log-likelihood is −(its tokens)·ln V."""

    def __init__(self, vocab: int = 256) -> None:
        super().__init__()
        self.vocab = vocab
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return torch.zeros(*x.shape, self.vocab) + 0 * self.anchor


def _task(tmp_path, rows) -> str:
    path = tmp_path / "task.jsonl"
    path.write_text("".join(json.dumps({"id": i, "context": c, "continuations": k,
                                        "gold": g}) + "\n" for i, (c, k, g) in enumerate(rows)))
    return str(path)


def _scored(tmp_path, rows, codec=None):
    codec = codec or BytesCodec()
    task = load_task(_task(tmp_path, rows))
    docs, skipped = score_documents(Uniform(), codec, task, task.documents, vocab_size=256,
                                    max_len=64, bos=None)
    assert skipped == 0
    return docs


def test_bpb_counts_the_bytes_scored_wherever_the_space_stands(tmp_path):
    """lm-eval moves a context's trailing space into the continuation: the same text split
    either way scores the same tokens, so it has the same bits per byte."""
    split = _scored(tmp_path, [("Q: 2+2?\nAnswer: ", ["4", "5"], 0),
                               ("Q: 2+2?\nAnswer:", [" 4", " 5"], 0)])
    assert split[0].logliks == split[1].logliks
    assert split[0].gold_bytes == split[1].gold_bytes == 2
    one, other = (metrics(d.sums())["bpb"] for d in split)
    assert one == pytest.approx(other) == pytest.approx(math.log(256) / math.log(2))


def test_bpb_divides_by_utf8_bytes(tmp_path):
    """" é" is 3 bytes in 2 characters."""
    (doc,) = _scored(tmp_path, [("Pick:", [" x", " é"], 1)])
    assert doc.gold_bytes == 3
    nats = -doc.logliks[1]
    assert metrics(doc.sums())["bpb"] == pytest.approx(nats / (math.log(2) * 3))


def test_acc_norm_divides_by_characters_not_tokens(tmp_path):
    """Uniform scores with bytes as tokens: " é" is 3 tokens in 2 characters, " x" 2 in 2.
    Per character " x" loses less; per token the two would tie (and the first be picked)."""
    (doc,) = _scored(tmp_path, [("Pick:", [" é", " x"], 1)])
    assert doc.lengths == (2, 2) and doc.logliks[0] < doc.logliks[1]
    assert doc.pred_norm == 1 and metrics(doc.sums())["acc_norm"] == 1.0


def test_a_merge_across_the_contexts_end_is_the_continuations(tmp_path):
    """lm-eval encodes context + continuation whole and splits at the context's length,
    so a BPE merge across the boundary belongs to the continuation; encoding the
    continuation alone would score other tokens."""
    codec = train_bpe(iter(["ab " * 400 + "xa " * 3]), 300)
    head = codec.encode_batch(["xa"])[0].tolist()
    whole = codec.encode_batch(["xabcd"])[0].tolist()
    alone = codec.encode_batch(["bcd"])[0].tolist()
    assert whole[len(head):] != alone  # the case is a real merge across the boundary
    assert encode_choice(codec, "xa", "bcd", None) == (head, whole[len(head):])


def test_a_pair_that_fills_the_window_exactly_keeps_its_whole_context():
    """A continuation's last token is predicted, never read: context + continuation − 1
    tokens fill the window."""
    model = Uniform()
    context, continuation = list(range(10)), [1, 2, 3]
    (fits,) = score_pairs(model, [(context, continuation)], max_len=12)
    assert fits.dropped == 0
    (over,) = score_pairs(model, [(context, continuation)], max_len=11)
    assert over.dropped == 1


def test_a_source_that_holds_exactly_one_row_serves_it_before_it_starts_over(small_dir):  # noqa: F811
    one = MixtureLoader([Source("only", small_dir, 1.0)], "train", 1, 16)
    tokens = one.sources["only"].num_tokens
    loader = MixtureLoader([Source("only", small_dir, 1.0)], "train", 1, tokens - 1)
    loader.next_batch()  # offset 0 + (tokens − 1) + 1 == tokens: the row fits
    assert loader.pop_epochs() == []
    loader.next_batch()
    assert loader.pop_epochs() == [("only", 1)]


def test_a_reset_mixture_has_drawn_nothing(data_dir, small_dir):  # noqa: F811
    loader = MixtureLoader([Source("web", data_dir, 0.5), Source("code", small_dir, 0.5)],
                           "train", 2, 16)
    loader.next_batch()
    loader.next_batch()
    assert sum(loader.tokens_by_source().values()) == 4 * 16
    loader.reset()
    assert loader.tokens_by_source() == {"web": 0, "code": 0}


def test_a_later_session_keeps_the_runs_init_from():
    data = RecordedData("data")
    first = RunRecord({}, {}, data).with_session(
        Session("t0", ("k3-train",), "cpu", init_from="exported/kl"), train_config={},
        model="k3", model_config={}, preset=None, data=data)
    later = first.with_session(Session("t1", ("k3-train", "--resume"), "cpu"),
                               train_config={}, model="k3", model_config={}, preset=None,
                               data=data)
    assert later.init_from == "exported/kl" and later.to_json()["init_from"] == "exported/kl"


@pytest.mark.parametrize("background", [False, True])
def test_each_checkpoint_event_names_its_own_checkpoint(data_dir, tmp_path, background):
    config = train_config(max_steps=4, checkpoint_interval=2, eval_interval=100,
                          async_checkpoint=background, keep_last=2)
    model, optimizer, train, val = build_parts(config, data_dir)
    log = MetricsLog(None)
    fit(model, optimizer, (train, val), config, callbacks=[log],
        checkpoint_path=CheckpointHistory(tmp_path / "checkpoints", keep_last=2))
    saved = [(e["step"], e["path"]) for e in log.events if e["event"] == "checkpoint"]
    assert saved == [(2, str(tmp_path / "checkpoints" / "step-00000002")),
                     (4, str(tmp_path / "checkpoints" / "step-00000004"))]


def test_validation_keeps_documents_apart_when_training_does(small_dir):  # noqa: F811
    config = train_config(document_masking=True, batch_size=2, eval_batches=1, seq_len=32,
                          max_steps=2, eval_interval=2, checkpoint_interval=100)
    model, optimizer, train, val = build_parts(config, small_dir, HYBRID)
    log = MetricsLog(None)
    fit(model, optimizer, (train, val), config, callbacks=[log])
    (logged,) = [e["val_loss"] for e in log.events if e["event"] == "eval"]
    eod = val.tokenizer["eod_id"]
    masked = evaluate_split(model, val, "cpu", 1, document_boundary=eod).loss
    plain = evaluate_split(model, val, "cpu", 1).loss
    assert abs(masked - plain) > 1e-4  # the validation rows hold several documents
    assert logged == pytest.approx(masked, rel=1e-6)


class _Recording(torch.nn.Module):
    """The model behind the trainer, recording each training forward's rows (their summed
    token losses and sources) and making the gradient of chosen calls overflow."""

    def __init__(self, inner, loader, overflow: set[int]) -> None:
        super().__init__()
        self.inner, self.loader, self.overflow = inner, loader, overflow
        self.config = inner.config
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def forward(self, x, targets=None, reduction="mean"):
        logits, loss = self.inner(x, targets=targets, reduction=reduction)
        if self.training:
            call = len(self.calls) + 1
            self.calls.append((call, loss.detach().double().sum(dim=1),
                               self.loader.row_sources().clone()))
            if call in self.overflow:
                loss.register_hook(lambda g: g * float("inf"))
        return logits, loss


def test_a_skipped_update_leaves_the_sources_losses_out(data_dir, small_dir):  # noqa: F811
    """An FP16 overflow skips an attempt: its rows count in no source's loss, as its loss
    counts in no window's."""
    from k3_trainer import FP16SkipHarness, Trainer

    config = train_config(max_steps=2, log_interval=2, eval_interval=100,
                          checkpoint_interval=100)
    model, optimizer, _, _ = build_parts(config, data_dir)
    sources = [Source("web", data_dir, 0.5), Source("code", small_dir, 0.5)]
    train, val = (MixtureLoader(sources, split, config.batch_size, config.seq_len)
                  for split in ("train", "val"))
    recording = _Recording(model, train, overflow={2})
    log = MetricsLog(None)
    Trainer(recording, optimizer, (train, val), config, callbacks=[log],
            grad_scaler=FP16SkipHarness(init_scale=2.0**8)).fit()
    assert [e["step"] for e in log.events if e["event"] == "overflow"] == [2]
    kept = [c for c in recording.calls if c[0] != 2]  # calls 1 and 3: steps 1 and 2
    expected = {}
    for index, name in enumerate(["web", "code"]):
        total = sum(float(rows[sources == index].sum()) for _, rows, sources in kept)
        count = sum(int((sources == index).sum()) for _, _, sources in kept) * config.seq_len
        expected[name] = total / count
    (event,) = [e for e in log.events if e["event"] == "train"]
    assert event["loss_by_source"] == pytest.approx(expected, rel=1e-9)
