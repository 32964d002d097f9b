"""Weighted data mixtures: a seeded schedule that depends only on the batch index, one
cursor per source in the checkpoint, sources that run out start over, one tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from k3_trainer import DataError, prepare_dataset
from k3_trainer.data import MixtureLoader, Source
from k3_trainer.evaluation import evaluate_split


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """A second byte-level dataset, small enough to run out within a test."""
    root = tmp_path_factory.mktemp("small")
    docs = root / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"{i:02d}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i % 7}\n")
    prepare_dataset([str(docs)], root / "data")
    return root / "data"


def _mixture(data_dir, small_dir, split="train", batch=2, **kw):
    sources = [Source("web", data_dir, 0.7), Source("code", small_dir, 0.3)]
    return MixtureLoader(sources, split, batch, 16, seed=kw.pop("seed", 5), **kw)


def _draw(loader, n):
    return [loader.next_batch() for _ in range(n)]


def test_the_schedule_depends_only_on_the_seed_and_the_batch_index(data_dir, small_dir):
    a, b = _mixture(data_dir, small_dir), _mixture(data_dir, small_dir)
    picks = [a.source_at(i) for i in range(4000)]
    assert picks == [b.source_at(i) for i in range(4000)]
    assert 0.67 < picks.count("web") / len(picks) < 0.73
    other = _mixture(data_dir, small_dir, seed=6)
    assert picks != [other.source_at(i) for i in range(4000)]
    for (x1, y1), (x2, y2) in zip(_draw(a, 12), _draw(b, 12)):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_two_ranks_read_the_rows_of_one_process_with_the_whole_batch(data_dir, small_dir):
    whole = _mixture(data_dir, small_dir, batch=4)
    ranks = [_mixture(data_dir, small_dir, batch=2, rank=r, world_size=2) for r in (0, 1)]
    for _ in range(15):
        x, y = whole.next_batch()
        (x0, y0), (x1, y1) = (rank.next_batch() for rank in ranks)
        assert torch.equal(x, torch.cat([x0, x1])) and torch.equal(y, torch.cat([y0, y1]))
    assert whole.state_dict() == ranks[0].state_dict() == ranks[1].state_dict()


def test_a_restored_state_continues_with_the_same_batches(data_dir, small_dir):
    first = _mixture(data_dir, small_dir)
    _draw(first, 7)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps
    assert set(state["sources"]) == {"web", "code"}
    assert sum(s["batches"] for s in state["sources"].values()) == state["batches"] == 7
    second = _mixture(data_dir, small_dir)
    second.load_state_dict(state)
    for (x1, y1), (x2, y2) in zip(_draw(first, 9), _draw(second, 9)):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert first.tokens_by_source() == second.tokens_by_source()
    assert sum(first.tokens_by_source().values()) == 16 * first.tokens_per_batch


def test_another_mixture_is_refused_unless_a_new_phase_adopts_it(data_dir, small_dir):
    saved = _mixture(data_dir, small_dir)
    _draw(saved, 9)
    state = saved.state_dict()
    reweighted = MixtureLoader([Source("web", data_dir, 0.5), Source("code", small_dir, 0.5)],
                               "train", 2, 16, seed=5)
    before = reweighted.state_dict()
    with pytest.raises(DataError, match=r"belongs to different data.*start a new phase"):
        reweighted.load_state_dict(state)
    assert reweighted.state_dict() == before
    anneal = MixtureLoader([Source("code", small_dir, 1.0), Source("math", data_dir, 1.0)],
                           "train", 2, 16, seed=5, adopt=True)
    anneal.load_state_dict(state)
    assert anneal.sources["code"].offset == saved.sources["code"].offset  # shared: kept
    assert anneal.sources["math"].offset == 0  # other data under that name: from zero
    single = MixtureLoader([Source("web", data_dir, 1.0)], "train", 2, 16, seed=5, adopt=True)
    single.load_state_dict({"offset": 320, "manifest_digest":
                            saved.sources["web"].manifest_digest, "split": "train"})
    assert single.sources["web"].offset == 320
    with pytest.raises(DataError, match="split 'val'"):
        single.load_state_dict({**state, "split": "val"})


def test_a_source_that_runs_out_starts_over_and_says_so(data_dir, small_dir):
    loader = MixtureLoader([Source("web", data_dir, 1.0), Source("code", small_dir, 1.0)],
                           "train", 4, 32, seed=1)
    code = loader.sources["code"]
    per_epoch = (code.num_tokens - 1) // code.tokens_per_batch
    first = code.batch_at(0)
    epochs = []
    while not epochs:
        batch = loader.next_batch()
        epochs = loader.pop_epochs()
    assert epochs == [("code", 1)] and loader.drawn["code"] == per_epoch + 1
    assert torch.equal(batch[0], first[0])  # the source's first batch again
    assert loader.pop_epochs() == []
    assert loader.state_dict()["sources"]["code"]["epoch"] == 1


def test_every_source_must_share_one_tokenizer(data_dir, small_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(small_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"]["eod_id"] = 10
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"'code' .* another tokenizer than 'web'"):
        MixtureLoader([Source("web", data_dir, 1), Source("code", other, 1)], "train", 2, 16,
                      seed=0)
    for text, message in [("web", "NAME=PATH:WEIGHT"), ("web=d:x", "not a number")]:
        with pytest.raises(DataError, match=message):
            Source.parse(text)
    with pytest.raises(DataError, match="named twice"):
        MixtureLoader([Source("a", data_dir, 1), Source("a", data_dir, 1)], "train", 2, 16,
                      seed=0)
    with pytest.raises(DataError, match="weight must be a positive number"):
        MixtureLoader([Source("a", data_dir, 0)], "train", 2, 16, seed=0)


def test_validation_of_a_mixture_is_per_source_and_weighted(data_dir, small_dir):
    torch.manual_seed(0)
    model = _Bigram()
    val = _mixture(data_dir, small_dir, split="val")
    result = evaluate_split(model, val, "cpu", 2)
    assert set(result.by_source) == {"web", "code"}
    alone = {name: evaluate_split(model, part, "cpu", 2) for name, part in val.sources.items()}
    assert result.by_source["code"].loss == alone["code"].loss
    assert result.loss == pytest.approx(0.7 * alone["web"].loss + 0.3 * alone["code"].loss)
    per_byte = 0.7 * alone["web"].bytes / alone["web"].tokens + \
        0.3 * alone["code"].bytes / alone["code"].tokens
    assert result.bpb == pytest.approx(result.loss / torch.log(torch.tensor(2.0)).item()
                                       / per_byte, rel=1e-4)


class _Bigram(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(256, 256)

    def forward(self, x, targets=None):
        logits = self.table(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss
