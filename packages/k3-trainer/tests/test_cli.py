"""``k3-train`` end to end, in process: resume exactness, run files, one-line user errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from trainer_helpers import latest_checkpoint, small_toml

from k3_checkpoint import read_payload
from k3_trainer import read_manifest
from k3_trainer.cli import main
from k3_trainer.observe.metrics import read_events

CONFIG = small_toml(train=dict(batch_size=4, seq_len=16, log_interval=2, eval_interval=3,
                                eval_batches=2, warmup_steps=1, decay_steps=6))


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "small.toml"
    path.write_text(CONFIG)
    return path


def _train(run_dir, data_dir, config_file, *extra):
    return main(["train", "--run-dir", str(run_dir), "--data", str(data_dir),
                 "--config", str(config_file), *extra])


def test_split_run_with_resume_equals_continuous_run(tmp_path, data_dir, config_file):
    a, b = tmp_path / "a", tmp_path / "b"
    assert _train(a, data_dir, config_file, "--max-steps", "6", "--checkpoint-interval", "2") == 0
    assert _train(b, data_dir, config_file, "--max-steps", "3") == 0
    assert main(["train", "--run-dir", str(b), "--resume", "--max-steps", "6"]) == 0
    pa, pb = read_payload(latest_checkpoint(a)), read_payload(latest_checkpoint(b))
    assert pa["counters"] == pb["counters"] and pa["counters"]["step"] == 6
    for key, tensor in pa["model"].items():
        assert torch.equal(tensor, pb["model"][key]), key
    for index, state in pa["optimizer"]["state"].items():
        for field, value in state.items():
            assert torch.equal(value, pb["optimizer"]["state"][index][field]), (index, field)
    assert pa["loaders"] == pb["loaders"]

    events = read_events(b / "metrics.jsonl")
    assert [e["event"] for e in events].count("session_start") == 2
    assert {"session_start", "train", "eval", "checkpoint", "session_end"} <= {
        e["event"] for e in events}
    record = json.loads((b / "run.json").read_text())
    assert [s["resumed_from_step"] for s in record["sessions"]] == [None, 3]
    assert record["data"]["manifest_digest"] == pa["loaders"]["train"]["manifest_digest"]
    assert record["sessions"][0]["versions"]["torch"]


def _error(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def test_user_errors_are_one_line_without_traceback(tmp_path, data_dir, config_file, capsys):
    run = tmp_path / "run"
    assert _train(run, data_dir, config_file, "--max-steps", "2") == 0
    capsys.readouterr()
    cases = [
        (["train", "--run-dir", str(run), "--data", str(data_dir)], "already holds a run"),
        (["train", "--run-dir", str(tmp_path / "x"), "--data", str(data_dir), "--batch-size",
          "0"], "batch_size"),
        (["train", "--run-dir", str(tmp_path / "x"), "--data", str(data_dir), "--precision",
          "fp16"], "fp16"),
        (["train", "--run-dir", str(tmp_path / "x"), "--data", str(tmp_path / "nodata")],
         "manifest.json not found"),
        (["train", "--run-dir", str(run), "--resume", "--max-steps", "1"], "max_steps"),
        (["train", "--run-dir", str(run), "--resume", "--preset", "small"],
         "incompatible vocab_size"),
    ]
    for argv, match in cases:
        code, err = _error(capsys, argv)
        assert code == 2, (argv, err)
        assert len(err) == 1 and match in err[0] and err[0].startswith("k3-train: error:"), err
    assert not (tmp_path / "x").exists(), "a refused run must write nothing"

    checkpoint = latest_checkpoint(run)
    data = bytearray(checkpoint.read_bytes())
    data[len(data) // 2] ^= 0x01
    checkpoint.write_bytes(bytes(data))
    before = (run / "metrics.jsonl").read_text()
    code, err = _error(capsys, ["train", "--run-dir", str(run), "--resume", "--max-steps", "4"])
    assert code == 2 and len(err) == 1 and "corrupt" in err[0]
    assert "checkpoints/step-00000002/k3.ckpt" in err[0], err
    assert (run / "metrics.jsonl").read_text() == before


def test_prepare_inspect_and_eval(tmp_path, data_dir, config_file, capsys):
    text = tmp_path / "t.txt"
    text.write_text("hello world\n" * 500)
    assert main(["prepare", str(text), "--out", str(tmp_path / "d")]) == 0
    assert "train 5,700 tokens" in capsys.readouterr().out
    run = tmp_path / "run"
    assert _train(run, data_dir, config_file, "--max-steps", "2") == 0
    capsys.readouterr()
    assert main(["inspect", str(latest_checkpoint(run))]) == 0
    assert "step" in capsys.readouterr().out
    assert main(["eval", "--run-dir", str(run)]) == 0
    assert "val_loss" in capsys.readouterr().out


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "k3_trainer.cli", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for command in ("prepare", "train", "eval", "inspect"):
        assert command in out


def test_eval_reports_what_it_measured_and_clamps_to_the_split(tmp_path, data_dir,
                                                               config_file, capsys):
    run = tmp_path / "run"
    assert _train(run, data_dir, config_file, "--max-steps", "2", "--eval-batches", "2") == 0
    logged = [e for e in read_events(run / "metrics.jsonl") if e["event"] == "eval"][-1]
    assert logged["val_tokens"] == 2 * 4 * 16  # eval_batches × batch_size × seq_len
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(run)]) == 0
    default = capsys.readouterr()
    assert default.out.startswith(f"step 2: val_loss {logged['val_loss']:.4f}")
    assert "(128 tokens in 2 of " in default.out

    assert main(["eval", "--run-dir", str(run), "--batches", "all"]) == 0
    whole = capsys.readouterr()
    available = int(whole.out.split(" of ")[1].split()[0])
    assert f"in {available} of {available} batches" in whole.out and whole.err == ""
    assert main(["eval", "--run-dir", str(run), "--batches", str(available + 5)]) == 0
    clamped = capsys.readouterr()
    assert clamped.out == whole.out
    assert clamped.err.strip() == (f"k3-train: note: --batches {available + 5} is more than "
                                   f"the validation split holds ({available} full batches); "
                                   f"evaluating all {available}")
    with pytest.raises(SystemExit):
        main(["eval", "--run-dir", str(run), "--batches", "some"])


def test_the_default_validation_is_the_whole_split_up_to_a_token_budget(
        tmp_path, data_dir, config_file, capsys):
    """What a run, its summary and plain ``eval`` show is measured on the same tokens: the
    whole validation split (or eval_tokens of it), with no note about an unasked --batches."""
    run, budget = tmp_path / "run", tmp_path / "budget"
    toml = tmp_path / "whole.toml"
    toml.write_text(small_toml(train=dict(batch_size=4, seq_len=16, warmup_steps=1,
                                          decay_steps=2)))
    assert main(["train", "--run-dir", str(run), "--data", str(data_dir), "--config",
                 str(toml), "--max-steps", "2"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    logged = [e for e in read_events(run / "metrics.jsonl") if e["event"] == "eval"][-1]
    val_tokens = read_manifest(data_dir)["split_stats"]["val"]["tokens"]
    assert logged["val_tokens"] == (val_tokens - 1) // 64 * 64  # every full batch
    assert f"val_bpb {logged['val_bpb']:.3f} ({logged['val_tokens']:,} validation tokens)" \
        in summary
    assert main(["eval", "--run-dir", str(run)]) == 0
    shown = capsys.readouterr()
    assert shown.out.startswith(f"step 2: val_loss {logged['val_loss']:.4f}") and not shown.err
    assert main(["train", "--run-dir", str(budget), "--data", str(data_dir), "--config",
                 str(toml), "--max-steps", "1", "--eval-tokens", "200"]) == 0
    capsys.readouterr()
    logged = [e for e in read_events(budget / "metrics.jsonl") if e["event"] == "eval"][-1]
    assert logged["val_tokens"] == 3 * 64  # the budget's whole batches


@pytest.mark.parametrize("argv", [
    ["--help"], ["train", "--help"], ["eval", "--help"], ["sample", "--help"],
    ["prepare", "--help"], ["inspect", "--help"], ["report", "--help"],
    ["train", "--run-dir", "r", "--bogus", "1"], ["train"], ["eval", "--batches", "x"],
])
def test_help_and_argument_errors_answer_without_importing_torch(argv):
    """What makes them answer in well under a second: torch is imported only once a
    command runs (time it with benchmarks/bench_cli.py)."""
    code = ("import sys\nfrom k3_trainer.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit as exit:\n    status = exit.code\n"
            "print(status, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    status, imported = done.stdout.split()[-2:]
    assert status == ("0" if argv[-1] == "--help" else "2"), done.stderr
    assert imported == "False"


def test_train_flags_are_generated_from_the_documented_config_fields(capsys):
    """Every TrainConfig and K3Config field is a flag whose help line is the field's
    docstring with its default; Literal fields list their values; booleans are flags."""
    from k3_model import K3Config
    from k3_trainer.cli.flags import field_docs
    from k3_trainer.config import TrainConfig

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for cls in (TrainConfig, K3Config):
        docs = field_docs(cls)
        for field in dataclasses.fields(cls):
            assert docs.get(field.name), f"{cls.__name__}.{field.name} has no docstring"
            flag = "--" + field.name.replace("_", "-")
            assert f"{flag} " in text, flag
            first_words = " ".join(docs[field.name].rstrip(".").split()[:4])
            assert first_words in text.split(flag, 2)[-1], (flag, first_words)
    assert "--compile, --no-compile torch.compile each decoder block" in text
    assert "(default: off)" in text and "(default: cosine)" in text
    assert "--precision {fp32,bf16,fp16}" in text
    assert "--preset {tiny,small,base,kimi-linear-tiny,kimi-linear-48b-a3b,kimi-k3}" in text
    unwrapped = text.replace("- ", "-")  # argparse may wrap a line after a hyphen
    assert ("(default: the preset's; tiny 256, small 32768, base 65536, kimi-linear-tiny 256, "
            "kimi-linear-48b-a3b 163840, kimi-k3 163840)") in unwrapped


@pytest.mark.parametrize("argv, field, value", [
    (["--compile"], "train:compile", True),
    (["--no-compile"], "train:compile", False),
    (["--no-qk-clip-enabled"], "train:qk_clip_enabled", False),
    (["--peak-lr", "1e-3"], "train:peak_lr", 1e-3),
    (["--vocab-size", "512"], "model:vocab_size", 512),
    (["--no-mla-gate"], "model:mla_gate", False),
    ([], "train:compile", None),  # not given: the config file's or the run's value applies
])
def test_flags_parse_to_config_values(argv, field, value):
    from k3_trainer.cli import build_parser

    args = build_parser().parse_args(["train", "--run-dir", "r", *argv])
    assert getattr(args, field) == value


@pytest.mark.parametrize("argv, message", [
    (["--compile", "true"], "unrecognized arguments: true"),
    (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    (["--vocab-size", "many"], "argument --vocab-size: expected an integer, got 'many'"),
])
def test_bad_flag_values_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["train", "--run-dir", "r", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 1 and message in err[0], err


def test_config_literals_are_the_packages_own_names():
    """TrainConfig spells k3-optim's and k3-qkclip's names so that --help imports no torch;
    they must stay the names those packages accept."""
    from typing import get_args

    from k3_optim import COEFFICIENT_SETS, UPDATE_SCALES
    from k3_qkclip import GQA_MODES
    from k3_trainer.config import GQAMode, NSCoefficients, UpdateScale

    assert get_args(NSCoefficients) == tuple(COEFFICIENT_SETS)
    assert get_args(UpdateScale) == tuple(UPDATE_SCALES)
    assert get_args(GQAMode) == tuple(GQA_MODES)


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    """A dataset whose trained BPE (300 tokens) is larger than the tiny preset's 256."""
    root = tmp_path_factory.mktemp("bpe")
    text = root / "corpus.txt"
    text.write_text("".join(f"document {i}: the quick brown fox jumps over the lazy dog "
                            f"{i * 7 % 13} times.\n\n" for i in range(400)))
    assert main(["prepare", str(text), "--out", str(root / "data"), "--train-tokenizer", "300",
                 "--val-fraction", "0.1"]) == 0
    return root / "data"


def _vocab_of(run):
    return json.loads((run / "run.json").read_text())["model_config"]["vocab_size"]


def test_vocab_size_follows_a_larger_tokenizer_and_says_so(tmp_path, bpe_data, config_file,
                                                           capsys):
    run = tmp_path / "follows"
    capsys.readouterr()
    assert _train(run, bpe_data, config_file, "--max-steps", "1") == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "vocab_size" in line]
    assert notes == ["k3-train: note: vocab_size 256 → 384 to cover the data's 300-token "
                     "tokenizer (--vocab-size sets it)"]
    assert _vocab_of(run) == 384
    # --resume keeps the run's model and says nothing more about it.
    assert main(["train", "--run-dir", str(run), "--resume", "--max-steps", "2"]) == 0
    assert "vocab_size" not in capsys.readouterr().err and _vocab_of(run) == 384


def test_a_vocab_size_given_is_kept(tmp_path, bpe_data, config_file, capsys):
    run = tmp_path / "given"
    assert _train(run, bpe_data, config_file, "--max-steps", "1", "--vocab-size", "320") == 0
    assert _vocab_of(run) == 320 and "vocab_size" not in capsys.readouterr().err
    code, err = _error(capsys, ["train", "--run-dir", str(tmp_path / "small"), "--data",
                                str(bpe_data), "--config", str(config_file), "--vocab-size",
                                "256"])
    assert code == 2 and len(err) == 1 and "exceeds the model's vocab_size (256)" in err[0]


@pytest.mark.parametrize("command", ["prepare", "train", "eval", "sample", "inspect", "report"])
def test_every_option_of_every_command_has_a_help_line(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    lines = capsys.readouterr().out.splitlines()
    positional = lines.index("positional arguments:") if "positional arguments:" in lines else 0
    options = [i for i, line in enumerate(lines)
               if (line.startswith("  -") and not line.startswith("  -h"))
               or (positional and i == positional + 1)]
    assert options
    for i in options:
        described = "  " in lines[i].strip() or lines[i + 1].startswith(" " * 8)
        assert described, lines[i]



def test_a_log_redirected_from_a_terminal_gets_the_plain_lines(tmp_path, data_dir):
    """``k3-train train ... > train.log`` typed at a terminal: stderr stays on the terminal
    (the bar), and the file gets every log and evaluation line."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    toml = tmp_path / "c.toml"
    toml.write_text(small_toml(train=dict(batch_size=2, seq_len=16, eval_batches=1,
                                          warmup_steps=1, decay_steps=2, log_interval=1,
                                          eval_interval=2)))
    main_fd, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    log = tmp_path / "train.log"
    with open(log, "w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "k3_trainer.cli", "train", "--run-dir", str(tmp_path / "r"),
             "--data", str(data_dir), "--config", str(toml), "--max-steps", "2"],
            stdout=out, stderr=terminal, timeout=300)
    os.close(terminal)
    shown = b""
    while True:
        try:
            chunk = os.read(main_fd, 65536)
        except OSError:  # the terminal's other end is closed: all is read
            break
        if not chunk:
            break
        shown += chunk
    os.close(main_fd)
    assert done.returncode == 0, shown.decode(errors="replace")
    lines = log.read_text().splitlines()
    assert [line.split(" | ")[0] for line in lines if " | loss " in line] == ["step 1/2",
                                                                             "step 2/2"]
    assert any(line.startswith("step 2/2 | val_loss ") for line in lines)
    assert lines[-1].startswith("k3-train: step 2, loss ")
    assert b"val_bpb=" in shown  # the bar on the terminal shows the latest validation
