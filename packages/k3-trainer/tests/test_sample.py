"""``k3-train sample``: a continuation from the strictly loaded checkpoint, seeded."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from trainer_helpers import small_toml

from k3_trainer.cli import main
from k3_trainer.sample import Sampling, sample_tokens

CONFIG = small_toml(model={"max_seq_len": 32}, train=dict(
    batch_size=2, seq_len=16, eval_batches=1, warmup_steps=1, decay_steps=4))


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("sample")
    (root / "c.toml").write_text(CONFIG)
    assert main(["train", "--run-dir", str(root / "run"), "--data", str(data_dir), "--config",
                 str(root / "c.toml"), "--max-steps", "2"]) == 0
    return root / "run"


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
