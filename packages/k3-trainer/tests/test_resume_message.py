"""A resumed session says where it goes on, once, on stderr: ``k3-train: resumed from step
N (T tokens seen)``, for ``--resume`` and ``--resume-from`` alike; a fresh run does not."""

from __future__ import annotations

from k3_trainer.cli import main

# 8 rows of 64 tokens: 512 tokens a step, so the count needs its thousands separator.
RECIPE = ["--batch-size", "8", "--seq-len", "64", "--eval-batches", "1", "--eval-interval",
          "2", "--checkpoint-interval", "2", "--log-interval", "1", "--warmup-steps", "1",
          "--decay-steps", "6", "--d-model", "32", "--n-layers", "2", "--keep-last", "3"]


def _train(capsys, *argv):
    capsys.readouterr()
    code = main(["train", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def _resumed(err: str) -> list[str]:
    return [line for line in err.splitlines() if "resumed from" in line]


def test_a_resume_says_the_step_and_tokens_it_continues_from(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = _train(capsys, "--run-dir", run, "--data", data_dir, *RECIPE,
                          "--max-steps", "4")
    assert code == 0, err
    assert _resumed(err) == []  # a fresh run resumes nothing
    code, out, err = _train(capsys, "--run-dir", run, "--resume", "--max-steps", "6")
    assert code == 0, err
    assert _resumed(err) == ["k3-train: resumed from step 4 (2,048 tokens seen)"]
    assert "resumed from" not in out
    code, _, err = _train(capsys, "--run-dir", run, "--resume-from",
                          run / "checkpoints" / "step-00000002", "--max-steps", "6")
    assert code == 0, err
    assert _resumed(err) == ["k3-train: resumed from step 2 (1,024 tokens seen)"]


def test_a_complete_run_is_not_said_to_resume(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(capsys, "--run-dir", run, "--data", data_dir, *RECIPE,
                  "--max-steps", "2")[0] == 0
    code, out, err = _train(capsys, "--run-dir", run, "--resume", "--max-steps", "2")
    assert code == 0 and "already complete at step 2" in out
    assert _resumed(err) == []
