"""``k3-train export --overwrite`` replaces a previous export and never a user's files: any
other folder is refused in one line naming what it holds, the refusal without
``--overwrite`` says what it would replace, and a failed export leaves the previous one
intact."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from trainer_helpers import cli_run, small_toml

from k3_trainer.cli import main

CONFIG = small_toml(model={"max_seq_len": 32}, train=dict(
    batch_size=4, seq_len=32, eval_batches=1, warmup_steps=1, decay_steps=4))
EXPORT = ["README.md", "config.json", "configuration_kimi_k3.py", "generation_config.json",
          "model.safetensors", "modeling_kimi_k3.py", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir):
    return cli_run(tmp_path_factory.mktemp("overwrite"), data_dir, CONFIG, 2)


def _export(capsys, run, out, *flags):
    capsys.readouterr()
    code = main(["export", "--run-dir", str(run), "--out", str(out), *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _snapshot(root: Path) -> dict[str, bytes | str]:
    """Every path under ``root`` with its bytes (a folder: "dir", a link: its target)."""
    found: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        found[key] = (f"-> {os.readlink(path)}" if path.is_symlink() else
                      path.read_bytes() if path.is_file() else "dir")
    return found


@pytest.fixture
def exported(run, tmp_path, capsys) -> Path:
    """A previous export in ``tmp_path/out``, beside a user's file."""
    (tmp_path / "beside.txt").write_text("the user's")
    code, _, err = _export(capsys, run, tmp_path / "out")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == EXPORT
    return tmp_path / "out"


def test_overwrite_replaces_a_previous_export_and_says_so(run, exported, capsys):
    (exported / "model.safetensors").write_bytes(b"stale weights")
    code, out, err = _export(capsys, run, exported, "--overwrite")
    assert code == 0, err
    assert "replacing the previous export" in out
    assert sorted(p.name for p in exported.iterdir()) == EXPORT
    assert (exported / "model.safetensors").read_bytes() != b"stale weights"
    parent = exported.parent
    assert sorted(p.name for p in parent.iterdir()) == ["beside.txt", "out"]
    assert (parent / "beside.txt").read_text() == "the user's"


def test_overwrite_refuses_a_folder_with_a_users_file(run, exported, capsys):
    (exported / "notes.txt").write_text("my notes")
    before = _snapshot(exported.parent)
    code, out, err = _export(capsys, run, exported, "--overwrite")
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1
    assert f"--out {exported} already exists and holds notes.txt, which no export " \
           "writes" in err
    assert "--overwrite replaces only a previous export" in err
    assert _snapshot(exported.parent) == before  # notes.txt, the export, its neighbours


def test_overwrite_refuses_a_folder_that_is_no_export(run, tmp_path, capsys):
    mine = tmp_path / "mine"
    (mine / "drafts").mkdir(parents=True)
    for name in ("a.txt", "b.txt", "c.txt", "d.txt", "notes.txt"):
        (mine / name).write_text(name)
    before = _snapshot(tmp_path)
    code, _, err = _export(capsys, run, mine, "--overwrite")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "holds a.txt, b.txt, c.txt, d.txt and 2 more, which no export writes" in err
    assert _snapshot(tmp_path) == before


def test_without_overwrite_the_refusal_says_what_overwrite_would_replace(run, exported,
                                                                        capsys):
    before = _snapshot(exported.parent)
    code, _, err = _export(capsys, run, exported)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"--out {exported} already exists: a previous export (8 files: README.md, " \
           "config.json, configuration_kimi_k3.py, generation_config.json and 4 " \
           "more); --overwrite replaces it" in err
    (exported / "notes.txt").write_text("my notes")
    code, _, err = _export(capsys, run, exported)
    assert code == 2 and "already exists and holds notes.txt" in err
    assert "--overwrite replaces it" not in err  # it would not: the user's file is there
    (exported / "notes.txt").unlink()
    assert _snapshot(exported.parent) == before


def test_a_failed_export_leaves_the_previous_one_intact(run, exported, capsys, monkeypatch):
    import k3_model.hub

    before = _snapshot(exported.parent)

    def disk_full(path, data):
        path.write_text('{"half": ')
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(k3_model.hub, "write_json", disk_full)  # once the weights are written
    code, _, err = _export(capsys, run, exported, "--overwrite")
    assert code == 1 and "No space left on device" in err
    assert len(err.strip().splitlines()) == 1
    assert _snapshot(exported.parent) == before  # the old export, no half-written folder


def test_an_empty_or_new_folder_needs_no_overwrite(run, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new" / "nested"):
        code, out_text, err = _export(capsys, run, out)
        assert code == 0, err
        assert "replacing" not in out_text
        assert sorted(p.name for p in out.iterdir()) == EXPORT
