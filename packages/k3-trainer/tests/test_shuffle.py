"""``prepare`` shuffles documents (seeded, bounded memory) before the validation split, so
the training stream and the validation prefix both sample the whole corpus."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from k3_trainer import PrepareOptions, prepare_dataset, read_manifest
from k3_trainer.cli import main
from k3_trainer.data import load_codec
from k3_trainer.data.options import DEFAULT_SHUFFLE_SEED

# Two halves that differ sharply, as a corpus of concatenated sources does.
DOCS = [f"alpha document {i}: licenses and notices" for i in range(200)] + \
       [f"omega document {i}: manual pages and flags" for i in range(200)]


def _corpus(tmp_path):
    path = tmp_path / "halves.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return path


def _stream(data_dir, split):
    manifest = read_manifest(data_dir)
    ids = np.concatenate([np.load(data_dir / s["file"]) for s in manifest["splits"][split]])
    return ids, load_codec(data_dir, manifest)


def _documents(ids, codec):
    return [codec.decode(part) for part in np.split(ids, np.flatnonzero(ids == codec.eod_id))]


def _halves(texts):
    return {text.strip("\xff").split()[0] for text in texts if text.strip("\xff")}


def test_the_training_start_and_the_validation_prefix_sample_both_halves(tmp_path):
    prepare_dataset([_corpus(tmp_path)], tmp_path / "d")
    train, codec = _stream(tmp_path / "d", "train")
    first = _documents(train[: len(train) // 20], codec)  # the first 5% of the stream
    assert _halves(first) == {"alpha", "omega"}
    val, _ = _stream(tmp_path / "d", "val")
    prefix = 8 * 4 * 16  # a short validation prefix: eight batches of a small run
    assert prefix < len(val)
    assert _halves(_documents(val[:prefix], codec)) == {"alpha", "omega"}
    # Every document is kept exactly once, whatever the order.
    every = _documents(train, codec) + _documents(val, codec)
    assert Counter(d.strip("\xff") for d in every) == Counter(DOCS)
    validation = read_manifest(tmp_path / "d")["validation"]
    assert validation["order"] == "shuffled"
    assert validation["seed"] == DEFAULT_SHUFFLE_SEED


def test_no_shuffle_keeps_the_input_order_and_seeds_decide_the_order(tmp_path):
    corpus = _corpus(tmp_path)
    prepare_dataset([corpus], tmp_path / "input", PrepareOptions(shuffle_seed=None))
    train, codec = _stream(tmp_path / "input", "train")
    assert _halves(_documents(train[: len(train) // 20], codec)) == {"alpha"}
    assert read_manifest(tmp_path / "input")["validation"]["order"] == "input"
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        prepare_dataset([corpus], tmp_path / name, PrepareOptions(shuffle_seed=seed))
    same = [(tmp_path / n / "train_00000.npy").read_bytes() for n in ("a", "b", "c")]
    assert same[0] == same[1] != same[2]


def test_many_buckets_keep_every_document_once(tmp_path, monkeypatch):
    """A corpus larger than one bucket (forced small here) goes through several bucket
    files, one in memory at a time; none is left behind."""
    monkeypatch.setattr("k3_trainer.data.prepare.BUCKET_BYTES", 1000)
    prepare_dataset([_corpus(tmp_path)], tmp_path / "d")
    validation = read_manifest(tmp_path / "d")["validation"]
    assert validation["buckets"] > 10
    train, codec = _stream(tmp_path / "d", "train")
    val, _ = _stream(tmp_path / "d", "val")
    every = _documents(train, codec) + _documents(val, codec)
    assert Counter(d.strip("\xff") for d in every) == Counter(DOCS)
    assert not list(tmp_path.glob("**/.shuffle-*"))


@pytest.mark.parametrize("flags", [["--no-shuffle"], ["--shuffle-seed", "7"]])
def test_the_command_line_names_the_order(tmp_path, capsys, flags):
    assert main(["prepare", str(_corpus(tmp_path)), "--out", str(tmp_path / "d"), *flags]) == 0
    validation = read_manifest(tmp_path / "d")["validation"]
    assert validation["order"] == ("input" if flags == ["--no-shuffle"] else "shuffled")
    assert validation.get("seed") == (None if flags == ["--no-shuffle"] else 7)
