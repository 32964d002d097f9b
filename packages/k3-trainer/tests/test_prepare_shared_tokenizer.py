"""``prepare --out-each``: one tokenizer for several inputs, each written as its own dataset
(trained on all of them, or given), all or nothing, and the datasets train as a mixture."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from k3_trainer import DataError, PrepareOptions, prepare_dataset, read_manifest
from k3_trainer.cli import main
from k3_trainer.data import MixtureLoader, Source
from k3_trainer.data import prepare as prepare_module
from k3_trainer.data.prepare import prepare_each

PROSE = [f"Chapter {i}. The river ran quietly past the old mill, and the miller's daughter "
         f"watched the boats drift by in the evening light. " * (2 + i % 3) for i in range(40)]
CODE = [f"def handler_{i}(request):\n    zyxqvark_payload = request.zyxqvark_payload\n"
        f"    return zyxqvark_payload.get('key_{i}', None)\n" * (2 + i % 3) for i in range(40)]


@pytest.fixture
def sources(tmp_path):
    """A folder of prose (.txt) and a folder of code (.py, read with --include)."""
    web, code = tmp_path / "web", tmp_path / "code"
    web.mkdir()
    code.mkdir()
    for i, (prose, source) in enumerate(zip(PROSE, CODE)):
        (web / f"{i:02d}.txt").write_text(prose)
        (code / f"{i:02d}.py").write_text(source)
    return web, code


def _cli(argv, capsys):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, [line for line in captured.err.splitlines() if line.strip()]


def _tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _mixture(*sources):
    """A MixtureLoader over ``(name, path)`` sources, equal weights, batches of 2 × 16."""
    return MixtureLoader([Source(name, path, 0.5) for name, path in sources], "train", 2, 16)


def _vocab(data_dir):
    return json.loads((data_dir / "tokenizer.json").read_text())["model"]["vocab"]


def test_out_each_writes_every_input_with_one_tokenizer_trained_on_all(sources, tmp_path,
                                                                       capsys):
    web, code = sources
    out = tmp_path / "data"
    status, printed, err = _cli(["prepare", web, code, "--include", "*.py",
                                 "--train-tokenizer", 400, "--out-each", out], capsys)
    assert status == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["code", "web"]
    a, b = read_manifest(out / "web"), read_manifest(out / "code")
    # one tokenizer, exactly: the same file, sha256 and end-of-document id
    assert (out / "web" / "tokenizer.json").read_bytes() == \
        (out / "code" / "tokenizer.json").read_bytes()
    digest = hashlib.sha256((out / "code" / "tokenizer.json").read_bytes()).hexdigest()
    assert a["tokenizer"] == b["tokenizer"] and a["tokenizer"]["sha256"] == digest
    assert (out / "web" / "token_bytes.npy").read_bytes() == \
        (out / "code" / "token_bytes.npy").read_bytes()
    # trained on both inputs, all of their text, and the manifest says so
    trained = a["tokenizer"]["trained"]
    assert trained["on"] == [
        {"input": str(web), "bytes": sum(len(t.encode()) for t in PROSE)},
        {"input": str(code), "bytes": sum(len(t.encode()) for t in CODE)}]
    assert trained["vocab_size"] == 400 and trained["sample"] == "all"
    # a word only the second input holds became a token: the first input alone never
    # teaches it (what the old recipe, train on web and reuse, gave the code)
    assert "zyxqvark" in "".join(_vocab(out / "web"))
    first_only = prepare_dataset([web], tmp_path / "first", PrepareOptions(train_tokenizer=400))
    assert "zyxqvark" not in "".join(_vocab(tmp_path / "first"))
    assert first_only["tokenizer"]["trained"]["on"] == [
        {"input": str(web), "bytes": sum(len(t.encode()) for t in PROSE)}]
    # each dataset holds its own input only, and the summary names every folder
    assert a["records"]["documents"] == len(PROSE) and b["records"]["documents"] == len(CODE)
    assert {f["path"].rsplit("/", 2)[-2] for f in a["source"]["files"]} == {"web"}
    lines = printed.splitlines()
    assert lines[0].startswith(f"prepared {out / 'web'}: ") and "bytes/token" in lines[0]
    assert lines[1].startswith(f"prepared {out / 'code'}: ")
    assert f"--data web={out / 'web'}:WEIGHT --data code={out / 'code'}:WEIGHT" in lines[2]


def test_the_datasets_of_one_call_load_together_as_a_mixture(sources, tmp_path):
    web, code = sources
    prepare_each([web, code], tmp_path / "shared",
                 PrepareOptions(train_tokenizer=400, include=("*.py",)))
    mixture = _mixture(("web", tmp_path / "shared" / "web"),
                       ("code", tmp_path / "shared" / "code"))
    assert mixture.vocab_size == 400
    for _ in range(6):
        x, y = mixture.next_batch()
        assert x.shape == (2, 16) and int(x.max()) < 400 and int(y.max()) < 400
    # two tokenizers trained apart are refused: the test above is not vacuous
    prepare_dataset([web], tmp_path / "own" / "web", PrepareOptions(train_tokenizer=400))
    prepare_dataset([code], tmp_path / "own" / "code",
                    PrepareOptions(train_tokenizer=400, include=("*.py",)))
    with pytest.raises(DataError, match="another tokenizer"):
        _mixture(("web", tmp_path / "own" / "web"), ("code", tmp_path / "own" / "code"))


def test_the_tokenizer_sample_is_drawn_from_every_input_by_its_size(tmp_path):
    big, small = tmp_path / "big.jsonl", tmp_path / "small.jsonl"
    big.write_text("".join(json.dumps({"text": f"prose line {i} " * 3}) + "\n"
                           for i in range(3000)))
    small.write_text("".join(json.dumps({"text": f"code_{i}() " * 3}) + "\n"
                             for i in range(1000)))
    limit_mb = 0.02
    manifests = prepare_each([big, small], tmp_path / "out", PrepareOptions(
        train_tokenizer=300, tokenizer_sample_mb=limit_mb))
    assert sorted(p.name for p in manifests) == ["big", "small"]
    trained = manifests[tmp_path / "out" / "big"]["tokenizer"]["trained"]
    assert trained["sample"] == "proportional" and trained["sample_mb"] == limit_mb
    on = {e["input"]: e["bytes"] for e in trained["on"]}
    total = big.stat().st_size + small.stat().st_size
    for path in (big, small):  # each input's share of the sample is its share of the bytes
        share = limit_mb * 1e6 * path.stat().st_size / total
        assert share <= on[str(path)] < share + 50, (path, on)
    # a single --out keeps its rule: the first MB of the stream, here all from the first input
    single = prepare_dataset([big, small], tmp_path / "one", PrepareOptions(
        train_tokenizer=300, tokenizer_sample_mb=limit_mb))
    assert single["tokenizer"]["trained"]["sample"] == "first"
    assert [e["bytes"] for e in single["tokenizer"]["trained"]["on"]][1] == 0


def test_an_existing_tokenizer_is_shared_as_given(sources, tmp_path, capsys):
    web, code = sources
    prepare_dataset([web], tmp_path / "trained", PrepareOptions(train_tokenizer=350))
    given = tmp_path / "tok.json"
    given.write_bytes((tmp_path / "trained" / "tokenizer.json").read_bytes())
    status, _, err = _cli(["prepare", web, code, "--include", "*.py", "--tokenizer", given,
                           "--out-each", tmp_path / "out"], capsys)
    assert status == 0, err
    for name in ("web", "code"):
        manifest = read_manifest(tmp_path / "out" / name)
        assert (tmp_path / "out" / name / "tokenizer.json").read_bytes() == given.read_bytes()
        assert manifest["tokenizer"]["source"] == str(given) and manifest["vocab_size"] == 350
    # the same tokens as a single --out with that tokenizer
    prepare_dataset([code], tmp_path / "alone",
                    PrepareOptions(tokenizer=given, include=("*.py",)))
    for shard in ("train_00000.npy", "val_00000.npy"):
        assert (tmp_path / "alone" / shard).read_bytes() == \
            (tmp_path / "out" / "code" / shard).read_bytes()


def test_out_each_shards_are_the_same_bytes_for_1_and_3_workers(sources, tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_module, "TASK_CHARS", 300)  # many small tasks
    web, code = sources
    for workers in (1, 3):
        prepare_each([web, code], tmp_path / f"w{workers}", PrepareOptions(
            train_tokenizer=300, shard_tokens=500, workers=workers, include=("*.py",)))
    one, three = _tree(tmp_path / "w1"), _tree(tmp_path / "w3")
    assert len([n for n in one if n.startswith("code/train_")]) > 2
    assert one == three


# -- refusals: nothing is written --------------------------------------------------------------


def test_two_inputs_with_one_name_are_refused_naming_both(sources, tmp_path, capsys):
    web, _ = sources
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "web.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    status, _, err = _cli(["prepare", web, other / "web.jsonl", "--out-each",
                           tmp_path / "out"], capsys)
    assert status == 2 and len(err) == 1, err
    assert str(web) in err[0] and str(other / "web.jsonl") in err[0] and "'web'" in err[0]
    assert not (tmp_path / "out").exists()


def test_an_existing_output_is_refused_unless_overwrite(sources, tmp_path, capsys):
    web, code = sources
    out = tmp_path / "out"
    prepare_dataset([code], out / "code", PrepareOptions(include=("*.py",)))
    before = _tree(out)
    argv = ["prepare", web, code, "--include", "*.py", "--train-tokenizer", 300,
            "--out-each", out]
    status, _, err = _cli(argv, capsys)
    assert status == 2 and len(err) == 1 and f"{out / 'code'} already exists" in err[0], err
    assert "--overwrite" in err[0]
    assert _tree(out) == before  # web was not written either
    status, _, err = _cli([*argv, "--overwrite"], capsys)
    assert status == 0, err
    assert read_manifest(out / "code")["vocab_size"] == 300
    assert sorted(p.name for p in out.iterdir()) == ["code", "web"]  # no staging left behind


def test_a_bad_later_input_leaves_no_dataset_and_replaces_none(sources, tmp_path, capsys):
    web, _ = sources
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + '{"text": "broken\n')
    out = tmp_path / "new" / "data"
    for tokenizer in (["--train-tokenizer", 300], ["--tokenizer", "bytes"]):
        status, _, err = _cli(["prepare", web, bad, *tokenizer, "--out-each", out], capsys)
        assert status == 2 and len(err) == 1 and f"{bad}: line 2: not valid JSON" in err[0]
        assert not (tmp_path / "new").exists()  # not even the folders made for it
    prepare_each([web], out)
    before = _tree(out)
    status, _, err = _cli(["prepare", web, bad, "--out-each", out, "--overwrite"], capsys)
    assert status == 2, err
    assert _tree(out) == before and [p.name for p in out.iterdir()] == ["web"]


def test_out_and_out_each_are_one_choice(sources, tmp_path, capsys):
    web, _ = sources
    with pytest.raises(SystemExit) as exit:
        main(["prepare", str(web), "--out", str(tmp_path / "a"), "--out-each",
              str(tmp_path / "b")])
    assert exit.value.code == 2 and "not allowed with" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        main(["prepare", str(web)])
    assert exit.value.code == 2 and "--out --out-each is required" in capsys.readouterr().err
    status, _, err = _cli(["prepare", "--out-each", tmp_path / "b"], capsys)
    assert status == 2 and len(err) == 1 and "name the input files or folders" in err[0]
    assert list(tmp_path.iterdir()) == [web, tmp_path / "code"]


def test_dataset_names_drop_known_suffixes(tmp_path):
    folder = tmp_path / "corpus.v2"
    folder.mkdir()
    names = prepare_module.dataset_names([tmp_path / "web.jsonl.gz", tmp_path / "code.parquet",
                                          tmp_path / "notes.md", tmp_path / "Makefile",
                                          folder, tmp_path / "x.tar"])
    assert names == ["web", "code", "notes", "Makefile", "corpus.v2", "x"]
    with pytest.raises(DataError, match=r"inputs .*a\.txt and .*a\.jsonl .*'a'"):
        prepare_module.dataset_names([tmp_path / "a.txt", tmp_path / "b" / "a.jsonl"])


def test_each_dataset_alone_is_a_normal_dataset(sources, tmp_path):
    """An --out-each dataset equals a single --out of its input with the same tokenizer."""
    web, code = sources
    manifests = prepare_each([web, code], tmp_path / "each", PrepareOptions(include=("*.py",)))
    alone = prepare_dataset([web], tmp_path / "alone")
    each = manifests[tmp_path / "each" / "web"]
    assert each["splits"] == alone["splits"] and each["records"] == alone["records"]
    assert each["source"]["files"] == alone["source"]["files"]
    assert each["source"]["include"] == ["*.py"] and "include" not in alone["source"]
    ids = np.load(tmp_path / "each" / "web" / "train_00000.npy")
    assert ids.max() <= 255 and manifests[tmp_path / "each" / "code"]["vocab_size"] == 256
