"""``k3-train sample``: a continuation from the strictly loaded checkpoint, seeded."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from trainer_helpers import cli_run, small_toml

from k3_trainer.cli import main
from k3_trainer.sample import Sampling, sample_tokens

CONFIG = small_toml(model={"max_seq_len": 32}, train=dict(
    batch_size=2, seq_len=16, eval_batches=1, warmup_steps=1, decay_steps=4))


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir):
    return cli_run(tmp_path_factory.mktemp("sample"), data_dir, CONFIG, 2)


def _sample(capsys, run, *extra):
    capsys.readouterr()
    code = main(["sample", "--run-dir", str(run), "--prompt", "def ", "--max-new-tokens", "40",
                 *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_sample_is_deterministic_under_a_seed(run, capsys):
    code, first, err = _sample(capsys, run, "--seed", "7", "--temperature", "1.0")
    assert code == 0, err
    assert first.startswith("def ") and len(first) > len("def \n")
    assert _sample(capsys, run, "--seed", "7", "--temperature", "1.0")[1] == first
    assert _sample(capsys, run, "--seed", "8", "--temperature", "1.0")[1] != first
    greedy = _sample(capsys, run, "--temperature", "0", "--seed", "1")[1]
    assert greedy == _sample(capsys, run, "--temperature", "0", "--seed", "2")[1]
    assert _sample(capsys, run, "--top-k", "1", "--seed", "3")[1] == greedy


def test_sample_refuses_a_run_without_checkpoint(run, tmp_path, capsys):
    for run_dir in (tmp_path / "nothing", tmp_path / "no-checkpoint"):
        if run_dir.name == "no-checkpoint":
            run_dir.mkdir()
            (run_dir / "run.json").write_bytes((run / "run.json").read_bytes())
        code, out, err = _sample(capsys, run_dir)
        lines = err.strip().splitlines()
        assert code == 2 and out == "" and len(lines) == 1, (code, err)
        assert lines[0].startswith("k3-train: error:") and "no checkpoint" in lines[0]


class Counter(nn.Module):
    """Logits that favour (last token + 1) mod 5; records the context lengths it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, x, targets=None):
        self.seen.append(x.shape[1])
        logits = torch.full((*x.shape, 5), -10.0)
        logits[0, -1, (int(x[0, -1]) + 1) % 5] = 10.0
        return logits, None


def test_context_is_truncated_and_sampling_stops_at_the_end_of_document():
    model = Counter()
    ids = sample_tokens(model, [0], Sampling(10, temperature=0), max_seq_len=3,
                        device="cpu", stop_id=4)
    assert ids == [1, 2, 3, 4] and model.seen == [1, 2, 3, 3]
    assert sample_tokens(model, [0], Sampling(3, temperature=0), max_seq_len=3,
                         device="cpu") == [1, 2, 3]


def test_num_samples_and_top_p_from_the_command_line(run, capsys):
    code, out, err = _sample(capsys, run, "--num-samples", "3", "--seed", "2",
                             "--temperature", "1.0")
    assert code == 0, err
    headers = [line for line in out.splitlines() if line.startswith("--- sample ")]
    assert headers == [f"--- sample {i} of 3 ---" for i in (1, 2, 3)]
    texts = out.split("--- sample ")[1:]
    assert len(set(texts)) > 1  # three draws, not one repeated
    greedy = _sample(capsys, run, "--temperature", "0")[1]
    assert _sample(capsys, run, "--top-p", "0.000001", "--seed", "5")[1] == greedy
    with pytest.raises(SystemExit) as exit_:
        _sample(capsys, run, "--top-p", "1.5")
    assert exit_.value.code == 2 and "(0, 1]" in capsys.readouterr().err


def test_a_terminal_sees_the_text_as_it_is_produced(run):
    """stdout on a pseudo-terminal: the same text, written token by token."""
    import os
    import pty
    import subprocess
    import sys

    argv = [sys.executable, "-m", "k3_trainer.cli", "sample", "--run-dir", str(run),
            "--prompt", "def ", "--max-new-tokens", "30", "--temperature", "0"]
    plain = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    leader, follower = pty.openpty()
    with subprocess.Popen(argv, stdout=follower, stderr=subprocess.DEVNULL) as proc:
        os.close(follower)
        chunks = []
        while True:
            try:
                data = os.read(leader, 4096)
            except OSError:  # the terminal closed: the command ended
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=300) == 0
    os.close(leader)
    shown = b"".join(chunks).decode("utf-8").replace("\r\n", "\n")
    assert shown == plain.stdout


def test_the_stream_holds_back_half_a_character():
    from k3_trainer.data import BytesCodec
    from k3_trainer.sample import TextStream

    written: list[str] = []
    stream = TextStream(BytesCodec(), written.append)
    for token in "aé☃".encode():
        stream(0, token)
    assert written == ["a", "é", "☃"] and stream.shown == 3


def test_a_model_without_generate_samples_by_recomputing():
    from k3_trainer.data import BytesCodec
    from k3_trainer.sample import sample_text

    texts = sample_text(Counter(), BytesCodec(), "", Sampling(3, temperature=0, num_samples=2),
                        max_seq_len=8, device="cpu")
    assert texts == ["\x01\x02\x03"] * 2


def test_what_does_not_fit_in_max_seq_len_is_said(run, capsys):
    """The cache holds the whole sequence: the run's max_seq_len is 32. The whole prompt
    is read and the new tokens are capped to what fits after it; only a prompt that would
    leave fewer than half the window (or the tokens asked for) keeps its last tokens."""
    code, _, err = _sample(capsys, run, "--max-new-tokens", "40", "--temperature", "0")
    capped = re.search(r"--max-new-tokens 40 does not fit after the (\d+)-token prompt in "
                       r"the model's max_seq_len 32; generating at most (\d+)", err)
    assert code == 0 and capped and int(capped[1]) + int(capped[2]) == 32, err
    assert len([line for line in err.splitlines() if "note" in line]) == 1
    capsys.readouterr()
    code = main(["sample", "--run-dir", str(run), "--prompt", "y" * 40, "--max-new-tokens",
                 "10", "--temperature", "0"])
    err = capsys.readouterr().err
    assert code == 0 and "the prompt is 41 tokens; its last 22 are read" in err
    code, _, err = _sample(capsys, run, "--max-new-tokens", "8")
    assert code == 0 and "note" not in err


def test_sample_says_its_decoding_speed(run, capsys):
    code, out, err = _sample(capsys, run, "--max-new-tokens", "8", "--temperature", "0")
    speed = re.search(r"k3-train: (\d+) new tokens in [\d.]+ s: [\d,.]+ tokens/s after a "
                      r"[\d.]+ s prefill", err)
    assert code == 0 and speed and 1 <= int(speed[1]) <= 8, err
    assert "tokens/s" not in out


@pytest.mark.parametrize(("prompt", "new", "window", "expected"), [
    (6, 300, 256, (6, 250)),  # the whole prompt, the new tokens capped
    (2, 40, 32, (2, 30)),
    (31, 10, 32, (22, 10)),  # too little room left: the prompt's last tokens
    (41, 10, 32, (22, 10)),
    (41, 40, 32, (16, 16)),  # half the window each
    (300, 5, 256, (251, 5)),
])
def test_context_room_keeps_the_prompt_and_caps_the_new_tokens(prompt, new, window,
                                                                expected):
    from k3_trainer.sample import context_room

    kept, tokens = context_room(prompt, new, window)
    assert (kept, tokens) == expected and kept + tokens <= window
