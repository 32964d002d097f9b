"""``prepare`` reads any text file: ``--include``/``--exclude`` patterns on file names inside
input folders, explicit files whatever their suffix, files that are not UTF-8 text skipped
and counted (never silently), and one-line refusals that write nothing."""

from __future__ import annotations

import pytest

from k3_trainer import DataError, PrepareOptions, prepare_dataset, read_manifest
from k3_trainer.cli import main
from k3_trainer.data import readers
from k3_trainer.data.prepare import describe_prepared


@pytest.fixture
def project(tmp_path):
    """A source tree: C files, a README and a copyright file without suffix, markdown, a
    binary, and hidden entries."""
    root = tmp_path / "project"
    (root / "src").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "README").write_text("The project reads its configuration at start-up.\n")
    (root / "copyright").write_text("Copyright the authors; all rights reserved.\n")
    (root / "notes.md").write_text("# notes\n")
    (root / "src" / "main.c").write_text('#include "util.h"\nint main(void) { return 0; }\n')
    (root / "src" / "util.h").write_text("int util(int x);\n")
    (root / "src" / "util.c").write_text("int util(int x) { return x + 1; }\n")
    (root / "src" / "main.o").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    (root / ".git" / "config").write_text("[core]\n")
    (root / "src" / ".cache.c").write_text("int hidden;\n")
    return root


def _read(root, **options):
    """The files a prepare of ``root`` read, relative to it, and the manifest."""
    manifest = prepare_dataset([root], root.parent / "out", PrepareOptions(
        shuffle_seed=None, val_fraction=0.5, **options), overwrite=True)
    files = [f["path"][len(str(root)) + 1:] for f in manifest["source"]["files"]]
    return files, manifest


def _cli(argv, capsys):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, [line for line in captured.err.splitlines() if line.strip()]


def test_folders_read_known_suffixes_and_what_include_adds(project):
    assert _read(project)[0] == ["notes.md"]
    files, manifest = _read(project, include=("*.h", "*.c"))
    assert files == ["notes.md", "src/main.c", "src/util.c", "src/util.h"]
    assert manifest["source"]["include"] == ["*.h", "*.c"]
    assert manifest["records"]["documents"] == 4
    # suffix-less files by name, or everything with '*' (hidden entries never)
    assert _read(project, include=("README", "copyright"))[0] == ["README", "copyright",
                                                                  "notes.md"]
    files, manifest = _read(project, include=("*",))
    assert files == ["README", "copyright", "notes.md", "src/main.c", "src/main.o",
                     "src/util.c", "src/util.h"]
    assert manifest["records"]["documents"] == 6 and manifest["records"]["not_utf8"] == 1


def test_exclude_applies_after_include_and_to_known_suffixes(project):
    files, manifest = _read(project, include=("*",), exclude=("*.o", "*.md", "util.*"))
    assert files == ["README", "copyright", "src/main.c"]
    assert manifest["source"]["exclude"] == ["*.o", "*.md", "util.*"]
    assert manifest["records"]["not_utf8"] == 0


def test_an_explicit_file_is_read_whatever_its_suffix_or_the_patterns(project, tmp_path):
    manifest = prepare_dataset([project / "README", project / "src" / "main.c"],
                               tmp_path / "d", PrepareOptions(exclude=("*.c",)))
    assert [f["kind"] for f in manifest["source"]["files"]] == ["text", "text"]
    assert manifest["records"]["documents"] == 2


def test_a_file_that_is_not_utf8_text_is_skipped_counted_and_named(project, tmp_path, capsys):
    (project / "src" / "latin1.c").write_bytes(b"/* caf\xe9 */\nint x;\n")
    code, out, err = _cli(["prepare", project, "--include", "*.c", "--include", "*.o",
                           "--out", tmp_path / "d"], capsys)
    assert code == 0, err
    manifest = read_manifest(tmp_path / "d")
    assert manifest["records"]["not_utf8"] == 2 and manifest["records"]["documents"] == 3
    by_name = {f["path"].rsplit("/", 1)[1]: f for f in manifest["source"]["files"]}
    assert by_name["latin1.c"]["skipped"].startswith("not UTF-8 at line 1: invalid")
    assert by_name["main.o"]["skipped"] == "a NUL byte at line 1"  # before its first 0x80
    assert "skipped" not in by_name["main.c"] and by_name["main.c"]["documents"] == 1
    assert ("(skipped 2 files that are not UTF-8 text, the first "
            f"{project / 'src' / 'latin1.c'}: not UTF-8 at line 1") in out
    assert out == describe_prepared(tmp_path / "d", manifest) + "\n"
    # none of the skipped files' bytes reached the shards
    assert manifest["split_stats"]["train"]["bytes"] + manifest["split_stats"]["val"]["bytes"] \
        == sum(len((project / n).read_bytes()) for n in ("notes.md", "src/main.c",
                                                         "src/util.c")) + 2  # separators


def test_a_nul_byte_makes_a_file_binary(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.txt").write_text("plain text\n")
    (folder / "zeros.txt").write_bytes(b"valid so far\n\x00\x00\x00\n")
    manifest = prepare_dataset([folder], tmp_path / "d")
    assert manifest["records"]["not_utf8"] == 1
    assert manifest["source"]["files"][1]["skipped"] == "a NUL byte at line 2"


def test_a_large_file_is_skipped_whole_when_its_bad_byte_comes_late(tmp_path, monkeypatch):
    """A file read in several pieces is checked before its first piece is tokenized."""
    monkeypatch.setattr(readers, "PIECE_BYTES", 64)
    folder = tmp_path / "in"
    folder.mkdir()
    good = "".join(f"good line {i}\n" for i in range(50))
    (folder / "a.txt").write_text(good)
    (folder / "b.txt").write_bytes(("".join(f"fine line {i}\n" for i in range(40))).encode()
                                   + b"caf\xe9\n")
    manifest = prepare_dataset([folder], tmp_path / "d", PrepareOptions(val_fraction=0.5))
    assert manifest["records"]["not_utf8"] == 1 and manifest["records"]["documents"] == 1
    assert manifest["source"]["files"][1]["skipped"].startswith("not UTF-8 at line 41")
    stats = manifest["split_stats"]
    assert stats["train"]["bytes"] + stats["val"]["bytes"] == len(good)  # nothing of b.txt


def test_only_binary_files_is_an_empty_corpus_that_says_why(tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "x.bin").write_bytes(b"\xff\xfe\x00")
    code, _, err = _cli(["prepare", folder, "--include", "*.bin", "--out", tmp_path / "d"],
                        capsys)
    assert code == 2 and len(err) == 1
    assert "the corpus is empty" in err[0]
    assert f"1 file that is not UTF-8 text, the first {folder / 'x.bin'}" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


# -- refusals ----------------------------------------------------------------------------------


def test_an_include_that_matches_nothing_is_one_line_and_writes_nothing(project, tmp_path,
                                                                        capsys):
    code, _, err = _cli(["prepare", project, "--include", "*.c", "--include", "*.rs",
                         "--out", tmp_path / "d"], capsys)
    assert code == 2 and len(err) == 1, err
    assert "--include '*.rs' matches no file in the input folders" in err[0]
    assert str(project) in err[0]
    assert not (tmp_path / "d").exists()
    code, _, err = _cli(["prepare", project / "README", "--include", "*.c", "--out-each",
                         tmp_path / "e"], capsys)
    assert code == 2 and len(err) == 1 and "no input is a folder" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]


def test_a_pattern_with_a_path_is_refused(project, tmp_path):
    with pytest.raises(DataError, match=r"--exclude 'src/\*': a pattern matches file names"):
        prepare_dataset([project], tmp_path / "d", PrepareOptions(exclude=("src/*",)))
    assert not (tmp_path / "d").exists()


def test_an_input_folder_with_nothing_to_read_is_named(project, tmp_path):
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "sub" / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=rf"no input files found in {empty}: .*--include"):
        prepare_dataset([project, empty], tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_an_output_inside_an_input_is_refused(project):
    with pytest.raises(DataError, match=r"is inside the input .*write the dataset outside"):
        prepare_dataset([project], project / "tokens")
    assert not (project / "tokens").exists()


def test_overwrite_replaces_a_dataset_but_never_another_folder(project, tmp_path, capsys):
    out = tmp_path / "d"
    assert _cli(["prepare", project, "--out", out], capsys)[0] == 0
    code, _, err = _cli(["prepare", project, "--out", out], capsys)
    assert code == 2 and "already exists" in err[0] and "--overwrite" in err[0]
    code, _, err = _cli(["prepare", project, "--include", "*.c", "--out", out, "--overwrite"],
                        capsys)
    assert code == 0, err
    assert read_manifest(out)["records"]["documents"] == 3
    other = tmp_path / "mine"
    other.mkdir()
    (other / "keep.txt").write_text("precious\n")
    code, _, err = _cli(["prepare", project, "--out", other, "--overwrite"], capsys)
    assert code == 2 and len(err) == 1 and "not a prepared dataset" in err[0], err
    assert (other / "keep.txt").read_text() == "precious\n"
