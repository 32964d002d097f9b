"""Downstream tasks: OLMo's bundled request files read offline, the metrics' definitions,
scoring by forked states equal to one forward per choice, ``eval --tasks``, and the same
numbers in the loop (``train --downstream``)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from trainer_helpers import MLA_MOE_MODEL, cli_run, small_toml

from k3_model import K3Model
from k3_trainer.cli import main
from k3_trainer.data import BytesCodec
from k3_trainer.tasks import DownstreamTasks, Scored, TaskError, core, load_task, metrics
from k3_trainer.tasks.catalog import task_names
from k3_trainer.tasks.scoring import SUMS, encode_choice, score_documents

# --- the catalog ---------------------------------------------------------------------------


def test_a_bare_name_is_its_ranked_zero_shot_set_in_the_files_order():
    task = load_task("arc_easy")
    assert len(task.documents) == 570  # OLMo's config: num_instances 570
    first = task.documents[0]
    assert first.id == "MCAS_2000_4_6" and first.gold == 0
    assert first.contexts == ("Question: Which technology was developed most recently?\n"
                              "Answer:",) * 4
    assert first.continuations == (" cellular telephone", " television", " refrigerator",
                                   " airplane")
    assert [d.id for d in load_task("arc_easy", limit=3).documents] == \
        [d.id for d in task.documents[:3]]


def test_other_formats_by_name_and_choices_with_their_own_contexts():
    five = load_task("arc_easy:rc_5shot", limit=2).documents[0]
    assert five.contexts[0].count("Answer:") == 6  # five examples, then the question
    assert load_task("arc_easy:mc_5shot", limit=1).documents[0].continuations[0] == " A"
    wino = load_task("winogrande", limit=1).documents[0]  # the option is in the context
    assert len(set(wino.contexts)) == 2 and len(set(wino.continuations)) == 1
    assert "arc_easy" in task_names() and "rc_0shot" in task_names()["piqa"]


@pytest.mark.parametrize(("name", "message"), [
    ("arc_easi", "unknown task 'arc_easi': did you mean arc_easy"),
    ("nonsense_task_x", "known tasks: arc_challenge, arc_easy"),
    ("arc_easy:rc_9shot", "task arc_easy has no format 'rc_9shot'; its formats:"),
    ("basic_skills_arithmetic", "has no format 'rc_0shot'"),
    # sets that are not choices to rank are refused by name, with why
    ("lambada", r"task lambada is not scored here: its sets \(lambada:bpb_0shot\) hold one "
                r"reference continuation per document"),
    ("lambada:bpb_0shot", "task lambada:bpb_0shot is not scored here: it holds one reference "
                          "continuation per document"),
    ("codex_humaneval:gold_bpb_0shot", r"it holds generation requests "
                                       r"\(generate_until_and_loglikelihood\)"),
])
def test_unknown_names_are_refused_with_what_exists(name, message):
    with pytest.raises(TaskError, match=message):
        load_task(name)


def test_only_scorable_tasks_are_offered_and_the_rest_named_once_apart():
    """The list, the did-you-mean and the format hints name what can be scored; the sets
    that cannot are named once each, apart, with why."""
    from k3_trainer.tasks import unscorable_tasks

    known, other = task_names(), unscorable_tasks()
    assert "lambada" not in known and "codex_humaneval" not in known and "gsm8k" not in known
    assert "lambada:bpb_0shot" in other and "arc_easy" in known
    for task, formats in known.items():  # every format offered is one that scores
        assert not any(f"{task}:{form}" in other for form in formats), task
    with pytest.raises(TaskError) as refused:
        load_task("lambda")
    message = str(refused.value)
    listed, _, apart = message.partition("; not scored here, no choices to rank: ")
    assert "did you mean" not in listed and "lambada" not in listed  # never offered
    assert apart.count("lambada") == 1 and apart.count("codex_humaneval") == 1
    assert "one reference continuation per document" in apart and "generation" in apart


def test_a_user_task_file_and_its_malformed_lines(tmp_path):
    good = tmp_path / "mine.jsonl"
    good.write_text('{"id": "q1", "context": "2 + 2 =", "continuations": [" 4", " 5"], '
                    '"gold": 0}\n\n{"id": 7, "context": "Sky:", "continuations": [" blue", '
                    '" green", " red"], "gold": 0}\n')
    task = load_task(str(good))
    assert [d.id for d in task.documents] == ["q1", 7]
    assert task.documents[1].contexts == ("Sky:",) * 3
    bad_lines = {
        '{"id": 1, "context": "x", "continuations": [" a"], "gold": 0}': "at least 2",
        '{"id": 1, "context": "x", "continuations": [" a", " b"], "gold": 2}': "gold must",
        '{"id": 1, "continuations": [" a", " b"], "gold": 0}': "missing context",
        'not json': "not JSON",
        '[1, 2]': "expected an object",
    }
    for line, message in bad_lines.items():
        path = tmp_path / "bad.jsonl"
        path.write_text(good.read_text() + line + "\n")
        with pytest.raises(TaskError, match=rf"bad.jsonl:4: .*{message}"):
            load_task(str(path))
    with pytest.raises(TaskError, match="does not exist"):
        load_task(str(tmp_path / "missing.jsonl"))


# --- the metrics ---------------------------------------------------------------------------


def _doc(logliks, gold, lengths, gold_bytes=4):
    return Scored("d", gold, tuple(logliks), tuple(lengths), gold_bytes, 0)


def test_the_metrics_on_hand_made_documents():
    docs = [
        _doc([-1.0, -2.0], 0, [1, 1]),           # right, by either rule
        _doc([-4.0, -6.0], 1, [2, 6]),           # wrong; per character -2 vs -1: right
        _doc([-3.0, -1.0, -2.0, -9.0], 0, [1, 1, 1, 1], gold_bytes=2),  # wrong (4 choices)
    ]
    sums = [sum(column) for column in zip(*(d.sums() for d in docs))]
    found = metrics(sums)
    assert found["acc"] == pytest.approx(1 / 3) and found["acc_norm"] == pytest.approx(2 / 3)
    # bits per byte of the gold continuations: (1 + 6 + 3) nats over 4 + 4 + 2 bytes
    assert found["bpb"] == pytest.approx(10 / (math.log(2) * 10))
    chance = (1 / 2 + 1 / 2 + 1 / 4) / 3
    assert found["centered_acc"] == pytest.approx((1 / 3 - chance) / (1 - chance))
    assert found["docs"] == 3 and "skipped" not in found
    assert core({"a": {"centered_acc": 0.5}, "b": {"centered_acc": -0.1}}) == pytest.approx(0.2)
    perfect = metrics([sum(c) for c in zip(*(_doc([-1.0, -5.0], 0, [1, 1]).sums(),) * 4)])
    assert perfect["acc"] == 1.0 and perfect["centered_acc"] == 1.0
    assert len(SUMS) == len(docs[0].sums())


def test_contexts_and_continuations_are_split_as_lm_eval_does():
    codec = BytesCodec()
    context, continuation = encode_choice(codec, "Q: hi\nA:", " yes", bos=codec.eod_id)
    assert context == [codec.eod_id, *b"Q: hi\nA:"] and continuation == list(b" yes")
    assert encode_choice(codec, "x", " y", bos=None)[0] == list(b"x")


# --- scoring -------------------------------------------------------------------------------


def _model() -> K3Model:
    torch.manual_seed(0)
    return K3Model(MLA_MOE_MODEL.replace(max_seq_len=512)).eval()


class _NoCache(torch.nn.Module):
    """The same model seen without ``forward_cached``: one full forward per choice."""

    def __init__(self, model: K3Model) -> None:
        super().__init__()
        self.inner = model

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("name", ["arc_easy", "winogrande"])
def test_forked_scores_equal_one_forward_per_choice(name):
    model, codec = _model(), BytesCodec()
    task = load_task(name, limit=6)
    kwargs = dict(vocab_size=256, max_len=512, bos=codec.eod_id)
    forked, skipped = score_documents(model, codec, task, task.documents, batch_size=4,
                                      **kwargs)
    full, _ = score_documents(_NoCache(model), codec, task, task.documents, **kwargs)
    assert skipped == 0 and len(forked) == len(full) == 6
    for a, b in zip(forked, full):
        assert a.logliks == pytest.approx(b.logliks, rel=1e-5)
        assert (a.id, a.gold, a.pred) == (b.id, b.gold, b.pred)


def test_a_vocabulary_that_cannot_encode_the_task_is_refused():
    tasks = DownstreamTasks(["arc_easy"], BytesCodec(), limit=3, bos=None)
    with pytest.raises(TaskError, match=r"task arc_easy: document 'MCAS_2000_4_6': the model's "
                       r"vocabulary \(100 tokens\) cannot encode token id 117"):
        tasks.check(100)


def test_choices_longer_than_the_window_are_skipped_and_counted(tmp_path):
    path = tmp_path / "lengths.jsonl"
    path.write_text('{"id": 1, "context": "Q:", "continuations": [" a", " b"], "gold": 0}\n'
                    '{"id": 2, "context": "Q:", "continuations": [" a", "' + "x" * 30
                    + '"], "gold": 0}\n')
    tasks = DownstreamTasks([str(path)], BytesCodec(), limit=4, bos=0)
    found = tasks.evaluate(_model(), vocab_size=256, max_len=20)[str(path)].metrics
    assert found["docs"] == 1 and found["skipped"] == 1
    with pytest.raises(TaskError, match="no document could be scored"):
        tasks.evaluate(_model(), vocab_size=256, max_len=1)


# --- the command line ----------------------------------------------------------------------

CONFIG = small_toml(train=dict(batch_size=2, seq_len=16, eval_batches=1, warmup_steps=1,
                               decay_steps=6, eval_interval=3, checkpoint_interval=3))


@pytest.fixture(scope="module")
def run(tmp_path_factory, data_dir):
    """A run that scored two tasks in the loop at steps 3 and 6."""
    toml = CONFIG + 'downstream = "arc_easy,piqa"\ndownstream_limit = 6\n'
    return cli_run(tmp_path_factory.mktemp("downstream"), data_dir, toml, 6)


def _downstream_events(run_dir):
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [e for e in events if e["event"] == "eval" and "downstream" in e]


def test_the_loop_scores_the_tasks_and_eval_gives_the_same_numbers(run, tmp_path, capsys):
    events = _downstream_events(run)
    assert [e["step"] for e in events] == [3, 6]
    last = events[-1]["downstream"]
    assert set(last["tasks"]) == {"arc_easy", "piqa"} and last["tasks"]["piqa"]["docs"] == 6
    capsys.readouterr()
    out = tmp_path / "scores.json"
    assert main(["eval", "--run-dir", str(run), "--tasks", "arc_easy,piqa", "--limit", "6",
                 "--output", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("step 6: arc_easy: acc ") and "(6 docs)" in printed[0]
    assert last["core_tasks"] == ["arc_easy", "piqa"]
    assert printed[-1] == f"step 6: core {last['core']:+.4f} (mean centered_acc of arc_easy, piqa)"
    written = json.loads(out.read_text())
    # what it measured: the run, its step, the documents per task, the tasks behind core
    assert (written["run_dir"], written["step"], written["limit"]) == (str(run), 6, 6)
    assert written["core_tasks"] == ["arc_easy", "piqa"]
    for name, found in last["tasks"].items():
        assert written["tasks"][name]["metrics"] == pytest.approx(found, rel=1e-12)
    assert written["core"] == pytest.approx(last["core"], rel=1e-12)
    doc = written["tasks"]["arc_easy"]["docs"][0]
    assert doc["id"] == "MCAS_2000_4_6" and doc["gold"] == 0 and len(doc["logliks"]) == 4
    assert doc["pred"] == max(range(4), key=lambda i: doc["logliks"][i])
    session = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
               if '"session_end"' in line][-1]
    assert session["phase_s"]["downstream"] > 0  # its own phase in the timings


def test_the_loops_log_line_names_the_tasks_core_averages():
    import io
    from types import SimpleNamespace

    from k3_trainer.callbacks.progress import LogLines

    out = io.StringIO()
    metric = {"acc": 0.5, "acc_norm": 0.25, "bpb": 1.5, "centered_acc": 0.1, "docs": 4}
    LogLines(out).on_eval_end(SimpleNamespace(config=SimpleNamespace(max_steps=6)), {
        "step": 3, "downstream": {"tasks": {"arc_easy": metric, "piqa": metric},
                                  "core": 0.1, "core_tasks": ["arc_easy", "piqa"]}})
    assert out.getvalue().rstrip().endswith("| core +0.1000 (mean centered_acc of arc_easy, "
                                            "piqa)")


def test_the_report_plots_each_task_and_core(run):
    assert main(["report", "--run-dir", str(run)]) == 0
    report = run / "report"
    for name in ("downstream_arc_easy.png", "downstream_piqa.png", "downstream_bpb.png",
                 "downstream_core.png"):
        assert (report / name).is_file(), name
    assert "last downstream core" in (report / "index.html").read_text()


@pytest.mark.parametrize(("tasks", "message"), [
    ("arc_esay", "did you mean arc_easy"),
    ("arc_easy,,piqa", "comma-separated task names"),
    ("BAD_FILE", r"bad.jsonl:1: not JSON"),
])
def test_eval_refuses_bad_tasks_in_one_line_and_writes_nothing(run, tmp_path, capsys, tasks,
                                                               message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    out = tmp_path / "scores.json"
    capsys.readouterr()
    code = main(["eval", "--run-dir", str(run), "--tasks", tasks.replace("BAD_FILE", str(bad)),
                 "--output", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("k3-train: error:")
    assert __import__("re").search(message, err[0]), err[0]
    assert not out.exists()


def test_a_resumed_run_may_start_scoring_tasks(tmp_path, data_dir):
    run_dir = cli_run(tmp_path, data_dir, CONFIG, 3)
    assert main(["train", "--run-dir", str(run_dir), "--resume", "--max-steps", "6",
                 "--downstream", "arc_easy", "--downstream-limit", "4",
                 "--downstream-interval", "2"]) == 0
    assert [e["step"] for e in _downstream_events(run_dir)] == [4, 6]
