"""``save_pretrained(..., overwrite=True)`` replaces a previous export and nothing else: a
folder holding anything an export does not write is refused naming it, and the old export
is removed only once the new one is complete (a failure at any point leaves it as it was).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
import torch

from k3_model import K3Model, preset
from k3_model.hub import files, save_pretrained
from k3_model.hub.files import EXPORT_FILES, FolderInUse, export_refusal

TOKENIZER = {"tokenizer.json": '{"model": {}}\n', "tokenizer_config.json": "{}\n"}


def _model(name: str = "tiny", seed: int = 0) -> K3Model:
    torch.manual_seed(seed)
    return K3Model(preset(name, kda_backend="torch"))


def _snapshot(root: Path) -> dict[str, bytes | str]:
    """Every path under ``root`` (links not followed) with its bytes or link target."""
    found: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            found[key] = f"-> {os.readlink(path)}"
        elif path.is_file():
            found[key] = path.read_bytes()
        else:
            found[key] = "dir"
    return found


@pytest.fixture
def export(tmp_path) -> Path:
    """A previous export of the Kimi K3 form (it ships its modeling code) with the
    tokenizer files k3-train export adds."""
    return save_pretrained(_model(seed=1), tmp_path / "out", eos_token_id=255,
                           extra_files=TOKENIZER)


@pytest.mark.parametrize(("first", "second"), [
    (dict(name="tiny"), dict(name="tiny", seed=2)),
    (dict(name="tiny"), dict(name="kimi-linear-tiny", max_shard_bytes=400_000)),
    (dict(name="kimi-linear-tiny", max_shard_bytes=400_000), dict(name="tiny")),
])
def test_overwrite_replaces_a_previous_export_of_either_form_and_layout(tmp_path, first,
                                                                        second):
    def save(name, seed=0, overwrite=False, **options):
        return save_pretrained(_model(name, seed), tmp_path / "out", eos_token_id=255,
                               extra_files=TOKENIZER, overwrite=overwrite, **options)

    save(**first)
    save(**second, overwrite=True)
    fresh = tmp_path / "fresh"
    save_pretrained(_model(second["name"], second.get("seed", 0)), fresh, eos_token_id=255,
                    extra_files=TOKENIZER, **{k: v for k, v in second.items()
                                              if k not in ("name", "seed")})
    assert _snapshot(tmp_path / "out") == _snapshot(fresh)  # the new export, nothing old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "out"]  # nothing left over


def test_every_file_an_export_writes_is_one_the_rule_recognises(export, tmp_path):
    sharded = save_pretrained(_model("kimi-linear-tiny"), tmp_path / "sharded",
                              max_shard_bytes=400_000, eos_token_id=255, extra_files=TOKENIZER)
    for folder in (export, sharded):
        names, reason = export_refusal(folder)
        assert reason is None and len(names) >= 5
        assert all(n in EXPORT_FILES or files.SHARD.fullmatch(n) for n in names)


@pytest.mark.parametrize(("arrange", "named"), [
    (lambda out: (out / "notes.txt").write_text("mine"), "notes.txt"),
    # named like a shard, but more: a shard's whole name, or not an export's file
    (lambda out: (out / "model-00001-of-00002.safetensors.orig").write_bytes(b"1"),
     "model-00001-of-00002.safetensors.orig"),
    (lambda out: (out / "drafts").mkdir(), "drafts/"),
    (lambda out: (out / "README.md").write_text("# my model card"), "README.md"),
    # the export's own card, edited by hand: the edit is someone's, never replaced
    (lambda out: (out / "README.md").write_text((out / "README.md").read_text()
                                                + "\nEvaluated on my data: 61%.\n"),
     "README.md"),
    (lambda out: (out / "model.safetensors").unlink() or (out / "data.bin").write_bytes(b"1"),
     "data.bin"),
])
def test_overwrite_refuses_an_export_holding_anything_else(export, tmp_path, arrange, named):
    arrange(export)
    before = _snapshot(tmp_path)
    with pytest.raises(FolderInUse) as refused:
        save_pretrained(_model(seed=2), export, extra_files=TOKENIZER, overwrite=True)
    message = str(refused.value)
    assert f"{export} already exists and holds {named}" in message
    assert "which no export writes" in message and "overwrite replaces only" in message
    assert "\n" not in message
    assert refused.value.reason is not None and named in refused.value.entries
    assert _snapshot(tmp_path) == before  # the folder and its parent exactly as they were


def test_overwrite_refuses_a_folder_that_is_no_export(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (mine / "a.txt").write_text("a")
    tokenizer_only = tmp_path / "tok"
    tokenizer_only.mkdir()
    (tokenizer_only / "tokenizer.json").write_text("{}")
    no_weights = tmp_path / "cfg"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    before = _snapshot(tmp_path)
    for folder, says in ((mine, "holds a.txt, notes.txt, which no export writes"),
                         (tokenizer_only, "holds no config.json"),
                         (no_weights, "holds neither model.safetensors nor")):
        for overwrite in (False, True):
            with pytest.raises(FolderInUse, match=re.escape(says)):
                save_pretrained(_model(), folder, overwrite=overwrite)
    assert _snapshot(tmp_path) == before


def test_a_link_inside_or_as_the_folder_is_refused_and_not_followed(export, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep")
    (export / "tokenizer.json").unlink()
    (export / "tokenizer.json").symlink_to(outside / "precious.txt")
    link = tmp_path / "link"
    link.symlink_to(outside, target_is_directory=True)
    before = _snapshot(tmp_path)
    with pytest.raises(FolderInUse, match=r"holds tokenizer\.json@"):
        save_pretrained(_model(), export, overwrite=True)
    with pytest.raises(FolderInUse, match="is a symbolic link"):
        save_pretrained(_model(), link, overwrite=True)
    assert _snapshot(tmp_path) == before


def test_a_file_in_the_way_is_refused(tmp_path):
    (tmp_path / "out").write_text("a file")
    with pytest.raises(FolderInUse, match="already exists and is not a folder"):
        save_pretrained(_model(), tmp_path / "out", overwrite=True)
    assert (tmp_path / "out").read_text() == "a file"


def test_without_overwrite_a_previous_export_is_refused_saying_what_overwrite_replaces(
        export):
    before = _snapshot(export)
    with pytest.raises(FolderInUse) as refused:
        save_pretrained(_model(seed=2), export)
    message = str(refused.value)
    assert "already exists: a previous export (8 files: README.md, config.json" in message
    assert "overwrite=True replaces it" in message
    assert refused.value.reason is None
    assert _snapshot(export) == before


def test_an_empty_folder_is_filled_and_gets_the_usual_permissions(tmp_path):
    (tmp_path / "out").mkdir()
    save_pretrained(_model(), tmp_path / "out")
    assert (tmp_path / "out" / "config.json").is_file()
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~mask


def test_a_failure_mid_write_leaves_the_previous_export_intact(export, tmp_path, monkeypatch):
    before = _snapshot(tmp_path)
    real = files.write_json

    def config_fails(path, data):
        if path.name == "config.json":  # the weights are written by now
            assert any(p.name == "model.safetensors" for p in path.parent.iterdir())
            path.write_text('{"half": ')
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(files, "write_json", config_fails)
    monkeypatch.setattr("k3_model.hub.write_json", config_fails)
    with pytest.raises(OSError, match="No space left"):
        save_pretrained(_model(seed=2), export, extra_files=TOKENIZER, overwrite=True)
    assert _snapshot(tmp_path) == before  # the old export, no staging folder left


def test_a_failed_rename_puts_the_previous_export_back(export, tmp_path, monkeypatch):
    before = _snapshot(tmp_path)
    rename = Path.rename

    def staging_fails(self, target):
        if self.name.startswith(".out.tmp-"):
            raise OSError(5, "Input/output error")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", staging_fails)
    with pytest.raises(OSError, match="Input/output error"):
        save_pretrained(_model(seed=2), export, extra_files=TOKENIZER, overwrite=True)
    assert _snapshot(tmp_path) == before


def test_a_file_added_while_the_export_is_written_is_kept(export, tmp_path, monkeypatch):
    """The folder is checked again once the new one is complete: what a user put there
    meanwhile is not removed with the old export."""
    real = files.write_json

    def user_writes_meanwhile(path, data):
        real(path, data)
        (export / "notes.txt").write_text("written during the export")

    monkeypatch.setattr("k3_model.hub.write_json", user_writes_meanwhile)
    before = _snapshot(tmp_path)
    with pytest.raises(FolderInUse, match=r"holds notes\.txt"):
        save_pretrained(_model(seed=2), export, extra_files=TOKENIZER, overwrite=True)
    after = _snapshot(tmp_path)
    assert after.pop("out/notes.txt") == b"written during the export"
    assert after == before
