from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from k3_trainer import (
    DataError,
    DataExhausted,
    PrepareOptions,
    TokenDataLoader,
    builtin_corpus,
    prepare_dataset,
    read_manifest,
)


@pytest.fixture
def corpus(tmp_path):
    text = "".join(chr(ord("a") + i % 26) for i in range(5000))
    src = tmp_path / "text.txt"
    src.write_text(text)
    out = tmp_path / "data"
    prepare_dataset([src], out, PrepareOptions(val_fraction=0.1, shard_tokens=1024))
    return out, np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64)


def test_prepare_writes_shards_and_a_manifest(corpus):
    out, tokens = corpus
    manifest = read_manifest(out)
    assert manifest["vocab_size"] == 256 and manifest["dtype"] == "uint16"
    assert manifest["tokenizer"]["name"] == "bytes-utf8"
    train = manifest["splits"]["train"]
    assert len(train) == 5 and sum(s["tokens"] for s in train) == 4500
    assert sum(s["tokens"] for s in manifest["splits"]["val"]) == 500
    assert not list(out.parent.glob(".data.*")), "staging folder left behind"


def test_batches_are_causal_windows_that_cross_shards(corpus):
    out, tokens = corpus
    loader = TokenDataLoader(out, "train", batch_size=3, seq_len=400)
    x, y = loader.next_batch()
    assert x.dtype == torch.int64 and x.shape == (3, 400)
    for row in range(3):
        start = row * 400
        assert torch.equal(x[row], torch.from_numpy(tokens[start:start + 400]))
        assert torch.equal(y[row], torch.from_numpy(tokens[start + 1:start + 401]))
    assert loader.offset == 1200
    x2, _ = loader.next_batch()  # 1200..2400 spans shards 1 and 2
    assert torch.equal(x2.flatten(), torch.from_numpy(tokens[1200:2400]))


def test_loader_never_wraps_and_reset_starts_over(corpus):
    out, _ = corpus
    loader = TokenDataLoader(out, "train", batch_size=4, seq_len=500)
    loader.next_batch()
    first = loader.batch_at(0)
    loader.next_batch()
    with pytest.raises(DataExhausted):  # 4000 + 2000 + 1 > 4500
        loader.next_batch()
    assert loader.offset == 4000
    loader.reset()
    assert torch.equal(loader.next_batch()[0], first[0])


def test_state_dict_round_trip_and_identity(corpus, tmp_path):
    out, _ = corpus
    a = TokenDataLoader(out, "train", 2, 64)
    a.next_batch()
    b = TokenDataLoader(out, "train", 2, 64)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    assert set(a.state_dict()) == {"offset", "manifest_digest", "split"}
    val = TokenDataLoader(out, "val", 2, 64)
    with pytest.raises(DataError, match=r"belongs to split 'train'.*reads split 'val'"):
        val.load_state_dict(a.state_dict())  # the train cursor never moves the val loader
    assert val.offset == 0
    src = tmp_path / "other.txt"
    src.write_text("something else entirely " * 100)
    other = TokenDataLoader(_prepared(src, tmp_path / "other"), "train", 2, 64)
    with pytest.raises(DataError, match="different data"):
        other.load_state_dict(a.state_dict())
    with pytest.raises(DataError, match="outside"):
        b.load_state_dict({**a.state_dict(), "offset": 10**9})


def _prepared(src, out):
    prepare_dataset([src], out)
    return out


def test_modified_or_missing_shard_is_refused(corpus):
    out, _ = corpus
    shard = out / "train_00002.npy"
    os.chmod(shard, 0o644)
    data = np.load(shard)
    data[10] = (data[10] + 1) % 256
    np.save(shard, data)
    with pytest.raises(DataError, match="modified"):
        TokenDataLoader(out, "train", 2, 64)
    TokenDataLoader(out, "val", 2, 64)  # the other split is still fine
    shard.unlink()
    with pytest.raises(DataError, match="missing"):
        TokenDataLoader(out, "train", 2, 64)


@pytest.mark.parametrize(("change", "match"), [
    (lambda m: m.update(dtype="uint32"), "dtype"),
    (lambda m: m["splits"]["train"][0].update(tokens=999), "manifest says"),
    (lambda m: m.update(format="other/1"), "manifest"),
    (lambda m: m.update(vocab_size="256"), "vocab_size"),
])
def test_inconsistent_manifest_is_refused(corpus, change, match):
    out, _ = corpus
    path = out / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    os.chmod(path, 0o644)
    path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=match):
        TokenDataLoader(out, "train", 2, 64, verify=False)


def test_empty_corpus_tiny_dataset_and_existing_output(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        prepare_dataset([empty], tmp_path / "e")
    assert not (tmp_path / "e").exists()
    small = tmp_path / "small.txt"
    small.write_text("x" * 300)
    prepare_dataset([small], tmp_path / "s")
    with pytest.raises(DataError, match="fewer than one batch"):
        TokenDataLoader(tmp_path / "s", "train", 4, 128)
    with pytest.raises(DataError, match="already exists"):
        prepare_dataset([small], tmp_path / "s")
    with pytest.raises(DataError, match="not found"):
        prepare_dataset([tmp_path / "nope.txt"], tmp_path / "n")
    with pytest.raises(DataError, match="not found"):
        TokenDataLoader(tmp_path / "n", "train", 1, 1)


def test_builtin_corpus_needs_no_download(tmp_path):
    documents, source = builtin_corpus()
    assert sum(map(len, documents)) > 100_000 and source["builtin"] == "pydoc_data.topics"
    assert len(documents) == source["topics"] > 50  # one document per topic
    manifest = prepare_dataset([], tmp_path / "builtin")
    assert manifest["source"]["builtin"] == "pydoc_data.topics"
    assert manifest["validation"]["rule"] == "token_tail"  # the last topics, in name order
    separators = 0  # topics apart, as documents: one end-of-document token between two
    for split in ("train", "val"):
        part = TokenDataLoader(tmp_path / "builtin", split, 1, 16)
        separators += int((part.window(0, part.num_tokens) == part.tokenizer["eod_id"]).sum())
    assert separators == len(documents) - 1
    loader = TokenDataLoader(tmp_path / "builtin", "val", 4, 128)
    assert int(loader.next_batch()[0].max()) < 256
