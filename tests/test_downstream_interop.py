"""Downstream scores proven against transformers: on a Kimi-Linear export, every choice's
log-likelihood from our forked decoding states equals transformers'
``KimiLinearForCausalLM`` running the same token ids in one full forward (1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3_model import K3Model, preset
from k3_model.hub import save_pretrained
from k3_trainer.data import BytesCodec
from k3_trainer.tasks import load_task, score_documents
from k3_trainer.tasks.scoring import encode_documents

transformers = pytest.importorskip("transformers")  # what the integration environment pins


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    ours = K3Model(preset("kimi-linear-tiny", max_seq_len=512, kda_backend="torch")).eval()
    with torch.no_grad():  # a router bias, as a trained model has
        for layer in ours.moe_layers().values():
            layer.balancer.bias.normal_(0.0, 0.02)
    folder = tmp_path_factory.mktemp("hub") / "kimi-linear"
    save_pretrained(ours, folder)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return ours, theirs.eval()


@torch.no_grad()
def _theirs(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([(context + continuation)[:-1]])
    logprobs = F.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    rows = logprobs[len(context) - 1:]
    return float(rows.gather(-1, torch.tensor(continuation)[:, None]).sum())


@pytest.mark.parametrize("name", ["arc_easy", "winogrande", "hellaswag"])
def test_choice_log_likelihoods_equal_transformers_kimi_linear(models, name):
    ours, theirs = models
    codec, task = BytesCodec(), load_task(name, limit=4)
    kwargs = dict(vocab_size=256, bos=codec.eod_id)
    scored, skipped = score_documents(ours, codec, task, task.documents, max_len=512,
                                      batch_size=3, **kwargs)
    assert skipped == 0
    encoded = encode_documents(codec, task, task.documents, **kwargs)
    for doc, document in zip(scored, encoded):
        expected = [_theirs(theirs, context, continuation)
                    for context, continuation in document.pairs]
        assert list(doc.logliks) == pytest.approx(expected, rel=1e-5, abs=1e-5)
