"""``prepare`` on real corpus formats: readers, record counts, errors, tokenizers, determinism."""

from __future__ import annotations

import gzip
import json
import sys
import zlib

import numpy as np
import pytest
from trainer_helpers import small_toml

from k3_trainer import DataError, PrepareOptions, TokenDataLoader, prepare_dataset, read_manifest
from k3_trainer.cli import main
from k3_trainer.data import BytesCodec, HFCodec, load_codec
from k3_trainer.data import prepare as prepare_module

SMALL_RUN = small_toml(model={"vocab_size": 300}, train=dict(
    batch_size=2, seq_len=16, eval_batches=1, warmup_steps=1, decay_steps=4))
DOCS = [f"Document {i}: " + "naïve café prose, " * (3 + i % 7) + f"the end {i}." for i in range(30)]


def _jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return path


def _documents(data_dir, split="train"):
    """The split's token stream cut at the end-of-document token, decoded."""
    manifest = read_manifest(data_dir)
    codec = load_codec(data_dir, manifest)
    ids = np.concatenate([np.load(data_dir / s["file"]) for s in manifest["splits"][split]])
    cuts = np.flatnonzero(ids == codec.eod_id)
    return [codec.decode(part) for part in np.split(ids, cuts)], manifest


def _cli(argv, capsys):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, [line for line in captured.err.splitlines() if line.strip()]


# -- input kinds -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet"])
def test_each_record_format_yields_its_documents_in_order(kind, tmp_path):
    path = tmp_path / f"corpus.{kind}"
    if kind == "jsonl":
        _jsonl(path, [{"text": d} for d in DOCS])
    elif kind == "jsonl.gz":
        _jsonl(path, [{"text": d} for d in DOCS], gzip.open)
    elif kind == "jsonl.zst":
        zstandard = pytest.importorskip("zstandard")
        lines = "".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode()
        path.write_bytes(zstandard.ZstdCompressor().compress(lines))
    else:
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        pq.write_table(pa.table({"id": list(range(30)), "text": DOCS}), path, row_group_size=7)
    prepare_dataset([path], tmp_path / "data", PrepareOptions(val_fraction=0.1,
                                                              shuffle_seed=None))
    train, manifest = _documents(tmp_path / "data")
    val, _ = _documents(tmp_path / "data", "val")
    # every 10th document (9, 19, 29) is validation; the rest are training, in order
    assert val == [DOCS[9], DOCS[19], DOCS[29]]
    assert train == [d for i, d in enumerate(DOCS) if i % 10 != 9]
    assert manifest["records"] == {"documents": 30, "empty": 0, "missing_field": 0,
                                   "not_text": 0, "not_utf8": 0}
    assert manifest["validation"] == {"rule": "every_nth_document", "n": 10, "order": "input"}
    assert manifest["source"]["files"][0]["sha256"] and manifest["source"]["files"][0]["bytes"]


def test_a_folder_mixing_formats_is_read_recursively_in_sorted_order(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "b").mkdir(parents=True)
    (corpus / "a.txt").write_text("first file\nsecond line\n")
    _jsonl(corpus / "b" / "c.jsonl.gz", [{"text": "from gzip"}, {"text": "gzip two"}], gzip.open)
    _jsonl(corpus / "b" / "d.jsonl", [{"content": "custom field"}])
    (corpus / "notes.md").write_text("# markdown\n")
    (corpus / "ignored.csv").write_text("a,b\n")
    (corpus / ".hidden.txt").write_text("skipped\n")
    if _has("pyarrow"):
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"content": ["parquet row"]}), corpus / "b" / "e.parquet")
    prepare_dataset([corpus], tmp_path / "data",
                    PrepareOptions(text_field="content", val_fraction=0.5, shuffle_seed=None))
    manifest = read_manifest(tmp_path / "data")
    names = [f["path"].split("/corpus/")[1] for f in manifest["source"]["files"]]
    assert names[:3] == ["a.txt", "b/c.jsonl.gz", "b/d.jsonl"] and names[-1] == "notes.md"
    # text files are one document each whatever the field; c.jsonl.gz has no "content"
    assert manifest["records"]["missing_field"] == 2
    train, _ = _documents(tmp_path / "data")
    val, _ = _documents(tmp_path / "data", "val")
    expected = ["first file\nsecond line\n", "custom field"]
    expected += ["parquet row"] if len(names) == 5 else []
    expected += ["# markdown\n"]
    assert [d for pair in zip(train, val) for d in pair] + train[len(val):] == expected


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def test_bad_records_are_counted_and_reported(tmp_path, capsys):
    path = _jsonl(tmp_path / "c.jsonl", [{"text": "kept one"}, {"text": ""}, {"text": "  \n"},
                                         {"body": "no text"}, {"text": None}, {"text": 42},
                                         [1, 2], {"text": "kept two"}, ""])
    code, out, err = _cli(["prepare", path, "--out", tmp_path / "d", "--workers", 1], capsys)
    assert code == 0, err
    records = read_manifest(tmp_path / "d")["records"]
    assert records == {"documents": 2, "empty": 2, "missing_field": 3, "not_text": 1,
                       "not_utf8": 0}
    assert "2 documents (skipped 2 empty, 3 without the text field, 1 with a non-text field)" \
        in out
    assert read_manifest(tmp_path / "d")["source"]["files"][0]["missing_field"] == 3


def test_only_bad_records_is_an_empty_corpus_that_says_why(tmp_path, capsys):
    path = _jsonl(tmp_path / "c.jsonl", [{"body": "x"}, {"text": ""}])
    code, _, err = _cli(["prepare", path, "--out", tmp_path / "d"], capsys)
    assert code == 2 and len(err) == 1
    assert "the corpus is empty" in err[0] and "1 without 'text'" in err[0]
    assert list(tmp_path.iterdir()) == [path]


# -- errors ----------------------------------------------------------------------------------


def test_a_bad_json_line_names_file_and_line(tmp_path, capsys):
    good = _jsonl(tmp_path / "a.jsonl", [{"text": "fine"}] * 3)
    bad = _jsonl(tmp_path / "b.jsonl", [{"text": "fine"}, {"text": "also fine"},
                                        '{"text": "broken'])
    code, _, err = _cli(["prepare", good, bad, "--out", tmp_path / "d"], capsys)
    assert code == 2 and len(err) == 1, err
    assert f"{bad}: line 3: not valid JSON" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl"]  # no dataset


def test_a_corrupt_gzip_names_file_and_line(tmp_path, capsys):
    path = _jsonl(tmp_path / "c.jsonl.gz", [{"text": f"record {i} " * 40} for i in range(400)],
                  gzip.open)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 64] = bytes(64)  # damage the deflate stream
    path.write_bytes(bytes(raw))
    code, _, err = _cli(["prepare", path, "--out", tmp_path / "d"], capsys)
    assert code == 2 and len(err) == 1, err
    assert str(path) in err[0] and ": line " in err[0] and "corrupt or truncated" in err[0]
    truncated = tmp_path / "t.jsonl.gz"
    truncated.write_bytes(path.read_bytes()[:100])
    complete = zlib.decompressobj(wbits=31).decompress(truncated.read_bytes()).count(b"\n")
    code, _, err = _cli(["prepare", truncated, "--out", tmp_path / "d"], capsys)
    assert code == 2 and str(truncated) in err[0] and f": line {complete + 1}: " in err[0]
    assert not (tmp_path / "d").exists()


def test_text_that_is_not_utf8_is_skipped_and_jsonl_that_is_not_names_the_line(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"ok\nstill ok\ncaf\xe9\n")
    with pytest.raises(DataError, match=r"corpus is empty.*1 file that is not UTF-8 text, "
                       r"the first .*latin1.txt: not UTF-8 at line 3"):
        prepare_dataset([path], tmp_path / "d")
    assert not (tmp_path / "d").exists()
    records = tmp_path / "latin1.jsonl"  # the bad line lies past the reader's first block
    records.write_bytes(b'{"text": "fine"}\n' * 700 + b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl: line 701: not UTF-8"):
        prepare_dataset([records], tmp_path / "d")


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "c.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails
    with pytest.raises(DataError, match=r"pip install 'k3-trainer\[parquet\]'"):
        prepare_dataset([path], tmp_path / "d")


def test_parquet_without_the_text_column_says_which_columns_exist(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "c.parquet")
    with pytest.raises(DataError, match=r"no column 'text' \(columns: body\).*--text-field"):
        prepare_dataset([tmp_path / "c.parquet"], tmp_path / "d")


def test_tokenizer_options_are_checked(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("some text " * 50)
    with pytest.raises(DataError, match="at least 258"):
        prepare_dataset([text], tmp_path / "d", PrepareOptions(train_tokenizer=100))
    with pytest.raises(DataError, match="choose one"):
        prepare_dataset([text], tmp_path / "d",
                        PrepareOptions(train_tokenizer=300, tokenizer="x.json"))
    with pytest.raises(DataError, match=r"tokenizer .*missing.json not found"):
        prepare_dataset([text], tmp_path / "d", PrepareOptions(tokenizer=tmp_path / "missing.json"))
    with pytest.raises(DataError, match="val_fraction"):
        prepare_dataset([text], tmp_path / "d", PrepareOptions(val_fraction=0.7))
    assert not (tmp_path / "d").exists()


# -- tokenizers ------------------------------------------------------------------------------


@pytest.fixture
def jsonl_corpus(tmp_path):
    return _jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in DOCS * 3])


def test_tokenizer_training_is_deterministic(jsonl_corpus, tmp_path):
    for name in ("a", "b"):
        prepare_dataset([jsonl_corpus], tmp_path / name, PrepareOptions(train_tokenizer=300))
    a, b = tmp_path / "a", tmp_path / "b"
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "manifest.json").read_bytes() == (b / "manifest.json").read_bytes()
    manifest = read_manifest(a)
    assert manifest["tokenizer"]["eod_token"] == "<|endoftext|>"
    assert manifest["vocab_size"] == 300 and manifest["dtype"] == "uint16"


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_round_trip_decodes_the_first_document(tokenizer, jsonl_corpus, tmp_path):
    options = {"train_tokenizer": 320} if tokenizer == "bpe" else {}
    prepare_dataset([jsonl_corpus], tmp_path / "d", PrepareOptions(**options, shuffle_seed=None))
    train, manifest = _documents(tmp_path / "d")
    assert train[0] == DOCS[0] and train[1] == DOCS[1]
    stats = manifest["split_stats"]
    utf8 = sum(len(d.encode()) for i, d in enumerate(DOCS * 3) if i % 20 != 19)
    # bytes per split: the documents' UTF-8 bytes plus one per separator
    assert stats["train"]["bytes"] == utf8 + stats["train"]["documents"] - 1
    if tokenizer == "bpe":
        assert stats["train"]["tokens"] < stats["train"]["bytes"] / 2


def test_an_existing_tokenizer_file_is_used_and_copied(jsonl_corpus, tmp_path):
    prepare_dataset([jsonl_corpus], tmp_path / "trained", PrepareOptions(train_tokenizer=300))
    source = tmp_path / "tok.json"
    source.write_bytes((tmp_path / "trained" / "tokenizer.json").read_bytes())
    prepare_dataset([jsonl_corpus], tmp_path / "reused", PrepareOptions(tokenizer=source))
    for name in ("train_00000.npy", "val_00000.npy", "tokenizer.json"):
        assert (tmp_path / "reused" / name).read_bytes() == \
            (tmp_path / "trained" / name).read_bytes()
    assert isinstance(load_codec(tmp_path / "reused", read_manifest(tmp_path / "reused")),
                      HFCodec)
    with pytest.raises(DataError, match=r"no end-of-document token.*--eod-token"):
        prepare_dataset([jsonl_corpus], tmp_path / "x",
                        PrepareOptions(tokenizer=source, eod_token="<eos>"))


@pytest.mark.parametrize("workers", [1, 2])
def test_an_end_of_document_token_found_inside_documents_is_refused_or_kept_on_request(
        jsonl_corpus, tmp_path, capsys, workers):
    """An ordinary token named as the end of document would cut documents wherever it
    occurs: refused in one line, or kept with --allow-eod-in-text and recorded."""
    prepare_dataset([jsonl_corpus], tmp_path / "trained", PrepareOptions(train_tokenizer=300))
    tokenizer = tmp_path / "trained" / "tokenizer.json"
    codec = load_codec(tmp_path / "trained", read_manifest(tmp_path / "trained"))
    ids = np.concatenate(codec.encode_batch(DOCS * 3))
    common = int(np.bincount(ids).argmax())  # the corpus's most frequent token
    name = codec.tokenizer.id_to_token(common)
    argv = ["prepare", jsonl_corpus, "--tokenizer", tokenizer, "--eod-token", name,
            "--workers", workers]
    code, _, err = _cli([*argv, "--out", tmp_path / "refused"], capsys)
    assert code == 2 and len(err) == 1, err
    assert f"the end-of-document token {name!r} (id {common}) occurs inside the documents' " \
           f"text (first in {jsonl_corpus}:1;" in err[0]
    assert "--allow-eod-in-text" in err[0]
    assert not (tmp_path / "refused").exists()
    code, out, err = _cli([*argv, "--out", tmp_path / "kept", "--allow-eod-in-text"], capsys)
    assert code == 0, err
    count = int((ids == common).sum())
    assert read_manifest(tmp_path / "kept")["tokenizer"]["eod_in_text"] == count
    assert f"inside the documents' text {count:,} times: --allow-eod-in-text" in out
    assert "eod_in_text" not in read_manifest(tmp_path / "trained")["tokenizer"]


def test_a_special_tokens_text_inside_a_document_is_refused_too(tmp_path):
    """The trained tokenizer's <|endoftext|> written out in a document encodes to the
    end-of-document id (special tokens are matched in text): refused the same way."""
    corpus = _jsonl(tmp_path / "c.jsonl", [{"text": d} for d in DOCS[:5]]
                    + [{"text": "GPT-2 ends texts with <|endoftext|> in its data."}])
    with pytest.raises(DataError, match=r"'<\|endoftext\|>' \(id 0\) occurs inside"):
        prepare_dataset([corpus], tmp_path / "d", PrepareOptions(train_tokenizer=300))


def test_shards_are_the_same_bytes_for_1_and_4_workers(jsonl_corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_module, "TASK_CHARS", 500)  # many small tasks
    folders = []
    for workers in (1, 4):
        out = tmp_path / f"w{workers}"
        prepare_dataset([jsonl_corpus], out,
                        PrepareOptions(train_tokenizer=300, shard_tokens=700, workers=workers))
        folders.append(out)
    files = sorted(p.name for p in folders[0].iterdir())
    assert len([f for f in files if f.startswith("train_")]) > 3
    assert files == sorted(p.name for p in folders[1].iterdir())
    for name in files:
        assert (folders[0] / name).read_bytes() == (folders[1] / name).read_bytes(), name


def test_a_long_text_file_is_read_in_pieces_as_one_document(tmp_path, monkeypatch):
    monkeypatch.setattr("k3_trainer.data.readers.PIECE_BYTES", 64)
    text = "".join(f"line {i} of a long file\n" for i in range(200))
    (tmp_path / "long.txt").write_text(text)
    (tmp_path / "blank.txt").write_text("\n\n  \n" * 40)
    manifest = prepare_dataset([tmp_path / "long.txt", tmp_path / "blank.txt"], tmp_path / "d")
    assert manifest["records"] == {"documents": 1, "empty": 1, "missing_field": 0,
                                   "not_text": 0, "not_utf8": 0}
    assert manifest["validation"]["rule"] == "token_tail"  # fewer documents than 1/fraction
    train, _ = _documents(tmp_path / "d")
    val, _ = _documents(tmp_path / "d", "val")
    assert train[0] + val[0] == text and len(val[0].encode()) == round(len(text) * 0.05)


# -- the dataset's identity covers the tokenizer -----------------------------------------------


def test_a_tampered_tokenizer_is_refused_by_the_loader(jsonl_corpus, tmp_path):
    data = tmp_path / "d"
    prepare_dataset([jsonl_corpus], data, PrepareOptions(train_tokenizer=300))
    TokenDataLoader(data, "train", 2, 16)
    tokenizer = data / "tokenizer.json"
    tokenizer.chmod(0o644)
    content = json.loads(tokenizer.read_text())
    content["added_tokens"][0]["content"] = "<|end|>"
    tokenizer.write_text(json.dumps(content))
    with pytest.raises(DataError, match=r"tokenizer file .*tokenizer.json does not match"):
        TokenDataLoader(data, "train", 2, 16)
    tokenizer.unlink()
    with pytest.raises(DataError, match=r"tokenizer file .* is missing"):
        TokenDataLoader(data, "val", 2, 16)


def _files(root):
    """Every file under ``root`` (its relative path → its bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_a_tampered_tokenizer_refuses_the_resume(jsonl_corpus, tmp_path, capsys):
    data, run = tmp_path / "d", tmp_path / "run"
    prepare_dataset([jsonl_corpus], data, PrepareOptions(train_tokenizer=300))
    config = tmp_path / "c.toml"
    config.write_text(SMALL_RUN)
    code, _, err = _cli(["train", "--run-dir", run, "--data", data, "--config", config,
                         "--max-steps", 2], capsys)
    assert code == 0, err
    tokenizer = data / "tokenizer.json"
    tokenizer.chmod(0o644)
    tokenizer.write_text(tokenizer.read_text().replace("<|endoftext|>", "<|eot|>"))
    before = _files(run)
    assert "checkpoints/step-00000002/k3.ckpt" in before  # the checkpoint is compared too
    code, _, err = _cli(["train", "--run-dir", run, "--resume", "--max-steps", 4], capsys)
    assert code == 2 and len(err) == 1 and "tokenizer.json does not match" in err[0], err
    assert _files(run) == before


def test_an_old_format_dataset_asks_to_prepare_again(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("abc " * 100)
    prepare_dataset([text], tmp_path / "d")
    path = tmp_path / "d" / "manifest.json"
    manifest = json.loads(path.read_text())
    path.chmod(0o644)
    path.write_text(json.dumps({**manifest, "format": "k3-tokens/1"}))
    with pytest.raises(DataError, match="older k3-trainer; prepare the dataset again"):
        read_manifest(tmp_path / "d")


def test_the_byte_tokenizer_keeps_256_ids_with_0xff_between_documents(tmp_path):
    path = _jsonl(tmp_path / "c.jsonl", [{"text": "ab"}, {"text": "ü"}])
    prepare_dataset([path], tmp_path / "d", PrepareOptions(val_fraction=0.5, shuffle_seed=None))
    assert np.load(tmp_path / "d" / "train_00000.npy").tolist() == [97, 98]
    prepare_dataset([path, path], tmp_path / "e",
                    PrepareOptions(val_fraction=0.5, shuffle_seed=None))
    assert np.load(tmp_path / "e" / "train_00000.npy").tolist() == [97, 98, 255, 97, 98]
    assert BytesCodec().decode([97, 255, 195, 188]) == "aü"


def test_the_tokenizer_sample_limits_what_the_tokenizer_learns(jsonl_corpus, tmp_path):
    full = prepare_dataset([jsonl_corpus], tmp_path / "full", PrepareOptions(train_tokenizer=600))
    sampled = prepare_dataset([jsonl_corpus], tmp_path / "sampled", PrepareOptions(
        train_tokenizer=600, tokenizer_sample_mb=len(DOCS[0]) / 1e6))  # the first document
    assert sampled["vocab_size"] < full["vocab_size"]
    assert sampled["tokenizer"]["trained"]["sample_mb"] == len(DOCS[0]) / 1e6
    assert sampled["records"] == full["records"]  # the sample never changes what is prepared
    with pytest.raises(DataError, match="only with --train-tokenizer"):
        prepare_dataset([jsonl_corpus], tmp_path / "x", PrepareOptions(tokenizer_sample_mb=1.0))


def test_a_dataset_folder_follows_the_umask(tmp_path):
    """Others may read a prepared dataset when the umask lets them (it was made 0700)."""
    import os
    import stat

    text = tmp_path / "t.txt"
    text.write_text("hello world\n" * 200)
    old = os.umask(0o022)
    try:
        prepare_dataset([text], tmp_path / "d")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o755
