"""``k3-train eval --model DIR`` on a mixture: ``--data NAME=DIR[:WEIGHT]`` repeated (weight
default 1), each source evaluated and printed as a run's mixture is, the mixture's loss
their weighted mean; bad ``--data`` is one line."""

from __future__ import annotations

import pytest
from trainer_helpers import cli_run, small_toml

from k3_trainer.cli import main
from k3_trainer.data import prepare_dataset

# eval --model reads 16 rows of min(128, max_seq_len) = 32 tokens: 512 tokens a batch.
CONFIG = small_toml(model={"max_seq_len": 32}, train=dict(
    batch_size=16, seq_len=32, eval_batches=1, warmup_steps=1, decay_steps=4))


@pytest.fixture(scope="module")
def model(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("evalmix")
    run = cli_run(root, data_dir, CONFIG, 2)
    assert main(["export", "--run-dir", str(run), "--out", str(root / "model")]) == 0
    return root / "model"


@pytest.fixture(scope="module")
def code_dir(tmp_path_factory):
    """A second byte-level dataset whose validation split holds a few 512-token batches."""
    root = tmp_path_factory.mktemp("code")
    docs = root / "docs"
    docs.mkdir()
    for i in range(400):
        (docs / f"{i:03d}.txt").write_text(
            f"def f{i}(x, y):\n    # the {i}th function\n    return x * {i} + y % {i % 7 + 1}\n")
    prepare_dataset([str(docs)], root / "data")
    return root / "data"


def _eval(capsys, *argv):
    capsys.readouterr()
    code = main(["eval", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def _loss(line: str) -> float:
    return float(line.split("val_loss ")[1].split(",")[0].split(" ")[0])


def test_each_source_and_the_weighted_mixture_are_printed(model, data_dir, code_dir, capsys):
    code, out, err = _eval(capsys, "--model", model, "--data", f"web={data_dir}:3",
                           "--data", f"code={code_dir}", "--batches", "2")
    assert code == 0, err
    head, web, code_line = out.splitlines()
    assert head.startswith(f"{model}: val_loss ") and "mixture by weight" in head
    assert "in 2 of " in head and "val_bpb" in head
    assert web.startswith("  web: val_loss ") and code_line.startswith("  code: val_loss ")
    # code's weight defaults to 1: the mixture is (3·web + 1·code) / 4
    assert _loss(head) == pytest.approx((3 * _loss(web) + _loss(code_line)) / 4, abs=2e-4)
    for line, folder in ((web, data_dir), (code_line, code_dir)):  # each as if alone
        alone = _eval(capsys, "--model", model, "--data", folder, "--batches", "2")[1]
        body = alone.split(": ", 1)[1]  # val_loss …, val_bpb … (N tokens in 2 of M batches)
        assert line.split(": ", 1)[1] == body.split(" in ")[0] + ")"


def test_by_default_each_source_is_read_whole(model, data_dir, code_dir, capsys):
    code, out, err = _eval(capsys, "--model", model, "--data", f"web={data_dir}",
                           "--data", f"code={code_dir}:1")
    assert code == 0, err
    head = out.splitlines()[0]
    batches = head.split(" batches")[0].rsplit("(", 1)[1]  # "… tokens in N of M"
    wanted, available = batches.split(" in ")[1].split(" of ")
    assert wanted == available  # the whole split of the larger source, the other to its end


@pytest.mark.parametrize(("data", "says"), [
    (["{data}", "code={code}"], "give one dataset folder, or every source of a mixture"),
    (["web=", "code={code}"], "a mixture source is NAME=DIR or NAME=DIR:WEIGHT"),
    (["web={data}:0", "code={code}"], "weight must be a positive number"),
    (["web={data}:x1", "code={code}"], "not found"),  # a colon inside DIR: no such folder
    (["web={data}", "web={code}"], "'web' is named twice"),
    (["w b={data}"], "use letters, digits"),
])
def test_bad_mixture_data_is_one_line(model, data_dir, code_dir, capsys, data, says):
    argv = []
    for value in data:
        argv += ["--data", value.format(data=data_dir, code=code_dir)]
    code, out, err = _eval(capsys, "--model", model, *argv)
    assert code == 2 and not out
    assert says in err and len(err.strip().splitlines()) == 1


def test_a_mixture_goes_with_model_and_the_validation_loss(model, data_dir, code_dir,
                                                          tmp_path, capsys):
    mix = ["--data", f"web={data_dir}", "--data", f"code={code_dir}"]
    code, _, err = _eval(capsys, "--run-dir", tmp_path, *mix)
    assert code == 2 and "goes with --model" in err and "the run's own data" in err
    code, _, err = _eval(capsys, "--model", model, "--tasks", "arc_easy", *mix)
    assert code == 2 and "--tasks" in err and len(err.strip().splitlines()) == 1
