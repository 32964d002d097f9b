"""Weighted data mixtures: every row drawn by a schedule exact at every prefix, the same
stream under any world size and across resumes, one cursor per source in the checkpoint,
sources that run out start over, one tokenizer."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from k3_trainer import DataError, prepare_dataset
from k3_trainer.data import MixtureLoader, Source
from k3_trainer.data.mixture import RowSchedule
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
    return MixtureLoader(sources, split, batch, 16, **kw)


def _draw(loader, n):
    return [loader.next_batch() for _ in range(n)]


def _check_exact(schedule, weights, rows):
    """After every prefix of the stream, each source within one row of its share."""
    counts = [0] * len(weights)
    for n in range(1, rows + 1):
        counts[schedule.next()] += 1
        assert all(abs(c - w * n) < 1 for c, w in zip(counts, weights)), (n, counts)
    return counts


@pytest.mark.parametrize("weights", [[0.75, 0.25], [0.7, 0.2, 0.1], [0.03, 0.97],
                                     [5, 1, 1, 1, 0.2, 0.01], [1.0]])
def test_the_row_schedule_is_within_one_row_of_every_share_at_every_prefix(weights):
    total = sum(weights)
    shares = [w / total for w in weights]
    counts = _check_exact(RowSchedule(weights), shares, 3000)
    assert sum(counts) == 3000
    rng = random.Random(7)
    for _ in range(40):  # random mixtures of up to 8 sources, some tiny
        drawn = [rng.random() ** 3 + 1e-3 for _ in range(rng.randint(2, 8))]
        _check_exact(RowSchedule(drawn), [w / sum(drawn) for w in drawn], 400)


def _rows_by_source(loader, batches):
    """Which source each row of the next ``batches`` global batches came from, read off
    the per-source row counts."""
    picks = []
    for _ in range(batches):
        before = dict(loader.drawn)
        loader.next_batch()
        picks.append({name: loader.drawn[name] - before[name] for name in before})
    return picks


def test_every_global_batch_mixes_the_sources_by_weight_under_one_and_two_ranks(
        data_dir, small_dir):
    whole = _mixture(data_dir, small_dir, batch=10)
    seen = {"web": 0, "code": 0}
    for n, batch in enumerate(_rows_by_source(whole, 25), start=1):
        assert sorted(batch.values()) == [3, 7]  # 0.7/0.3 of every 10 rows
        seen = {name: seen[name] + batch[name] for name in seen}
        assert abs(seen["web"] - 0.7 * 10 * n) < 1 and abs(seen["code"] - 0.3 * 10 * n) < 1
    ranks = [_mixture(data_dir, small_dir, batch=5, rank=r, world_size=2) for r in (0, 1)]
    for loader in ranks:
        assert [sorted(b.values()) for b in _rows_by_source(loader, 25)] == [[3, 7]] * 25
        assert loader.tokens_by_source() == whole.tokens_by_source()
        assert loader.state_dict() == whole.state_dict()


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
    assert state["batches"] == 7
    assert sum(s["rows"] for s in state["sources"].values()) == 7 * 2
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
                               "train", 2, 16)
    before = reweighted.state_dict()
    with pytest.raises(DataError, match=r"belongs to different data.*start a new phase"):
        reweighted.load_state_dict(state)
    assert reweighted.state_dict() == before
    anneal = MixtureLoader([Source("code", small_dir, 1.0), Source("math", data_dir, 1.0)],
                           "train", 2, 16, adopt=True)
    anneal.load_state_dict(state)
    assert anneal.sources["code"].offset == saved.sources["code"].offset  # shared: kept
    assert anneal.sources["math"].offset == 0  # other data under that name: from zero
    single = MixtureLoader([Source("web", data_dir, 1.0)], "train", 2, 16, adopt=True)
    single.load_state_dict({"offset": 320, "manifest_digest":
                            saved.sources["web"].manifest_digest, "split": "train"})
    assert single.sources["web"].offset == 320
    with pytest.raises(DataError, match="split 'val'"):
        single.load_state_dict({**state, "split": "val"})


def test_a_source_that_runs_out_starts_over_and_says_so(data_dir, small_dir):
    loader = MixtureLoader([Source("web", data_dir, 1.0), Source("code", small_dir, 1.0)],
                           "train", 4, 32)
    code = loader.sources["code"]
    per_epoch = (code.num_tokens - 1) // 32  # complete rows of 32 (+1) tokens
    first_row = torch.from_numpy(code.window(0, 32).astype("int64"))
    epochs = []
    while not epochs:
        x, _ = loader.next_batch()
        epochs = loader.pop_epochs()
    assert epochs == [("code", 1)]
    since = loader.drawn["code"] - per_epoch  # rows read in the new epoch
    assert since >= 1 and code.offset == since * 32
    assert any(torch.equal(row, first_row) for row in x)  # the source's first row again
    assert loader.pop_epochs() == []
    assert loader.state_dict()["sources"]["code"]["epoch"] == 1


def test_a_batch_level_state_of_the_previous_release_is_converted(data_dir, small_dir):
    loader = _mixture(data_dir, small_dir)
    web, code = loader.sources["web"], loader.sources["code"]
    old = {"kind": "mixture", "split": "train", "batches": 5, "mixture": loader.identity,
           "sources": {"web": {**web.state_dict(), "offset": 3 * 32, "epoch": 0,
                               "batches": 3},
                       "code": {**code.state_dict(), "offset": 2 * 32, "epoch": 0,
                                "batches": 2}}}
    loader.load_state_dict(old)
    assert (web.offset, code.offset, loader.batches) == (96, 64, 5)
    assert loader.drawn == {"web": 6, "code": 4}  # batches of 2 rows each
    web_rows = 0
    for n, batch in enumerate(_rows_by_source(loader, 20), start=1):  # exact from here on
        web_rows += batch["web"]
        assert abs(web_rows - 0.7 * 2 * n) < 1


def test_a_saved_schedule_is_restored_and_a_forged_one_refused(data_dir, small_dir):
    first = _mixture(data_dir, small_dir)
    _draw(first, 3)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["schedule"]["rows"] == 6 and sum(state["schedule"]["counts"].values()) == 6
    phase = _mixture(data_dir, small_dir, adopt=True)  # same mixture, a new decay
    phase.load_state_dict(state)
    assert phase.schedule.counts == first.schedule.counts
    for counts in ({"web": 6, "code": 0}, {"web": 4}, {"web": 4.0, "code": 2}):
        forged = {**state, "schedule": {"rows": 6, "counts": counts}}
        fresh = _mixture(data_dir, small_dir)
        before = fresh.state_dict()
        with pytest.raises(DataError, match="not a state of this mixture's schedule"):
            fresh.load_state_dict(forged)
        assert fresh.state_dict() == before


def test_a_source_weight_is_optional_only_where_a_default_is_given():
    assert Source.parse("web=d/web:0.7") == Source("web", Path("d/web"), 0.7)
    assert Source.parse("web=d/web:0.7", 1.0) == Source("web", Path("d/web"), 0.7)
    assert Source.parse("web=d/web", 1.0) == Source("web", Path("d/web"), 1.0)
    # a colon followed by no number belongs to the folder's name
    assert Source.parse("web=C:/web", 1.0) == Source("web", Path("C:/web"), 1.0)
    for text, default, message in [
        ("web=d/web", None, "NAME=DIR:WEIGHT"),
        ("web=", 1.0, "NAME=DIR or NAME=DIR:WEIGHT"),
        ("=d/web", 1.0, "NAME=DIR or NAME=DIR:WEIGHT"),
        ("web=d/web:", 1.0, "weight '' is not a number"),
    ]:
        with pytest.raises(DataError, match=message):
            Source.parse(text, default)


def test_every_source_must_share_one_tokenizer(data_dir, small_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(small_dir, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"]["eod_id"] = 10
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"'code' .* another tokenizer than 'web'"):
        MixtureLoader([Source("web", data_dir, 1), Source("code", other, 1)], "train", 2, 16)
    for text, message in [("web", "NAME=DIR:WEIGHT"), ("web=d:x", "not a number")]:
        with pytest.raises(DataError, match=message):
            Source.parse(text)
    with pytest.raises(DataError, match="named twice"):
        MixtureLoader([Source("a", data_dir, 1), Source("a", data_dir, 1)], "train", 2, 16)
    with pytest.raises(DataError, match="weight must be a positive number"):
        MixtureLoader([Source("a", data_dir, 0)], "train", 2, 16)


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
