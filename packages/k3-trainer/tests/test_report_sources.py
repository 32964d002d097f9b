"""A mixture's report and log lines: each source beside the mixture, each phase marked,
and a tokens axis whose labels stay short."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from k3_trainer.callbacks.progress import LogLines
from k3_trainer.observe.report import short_count, write_report

TOKENS_PER_STEP = 5_632 * 100  # millions of tokens by the end: the labels a user misread


def _eval(step, web, code, weights=(0.7, 0.3)):
    return {"event": "eval", "step": step, "tokens_seen": TOKENS_PER_STEP * step,
            "val_loss": weights[0] * web + weights[1] * code, "val_tokens": 64,
            "val_bpb": (weights[0] * web + weights[1] * code) / 0.7,
            "val_by_source": {"web": {"val_loss": web, "val_bpb": web / 0.7, "val_tokens": 32},
                              "code": {"val_loss": code, "val_bpb": code / 0.7,
                                       "val_tokens": 32}}}


def _mixture_run(run: Path) -> None:
    """Steps 1-12 on web 0.7 / code 0.3, an ``anneal`` phase from step 8 (code 0.7), and a
    phase a later resume superseded (not part of the run any more)."""
    run.mkdir()
    events = [{"event": "train", "step": s, "tokens_seen": TOKENS_PER_STEP * s,
               "loss": 3.0 - 0.05 * s, "lr": 1e-3, "tokens_per_s": 1e5,
               "grad_norm": 1.0, "grad_norm_max": 2.0,
               "loss_by_source": {"web": 3.1 - 0.05 * s, "code": 2.7 - 0.05 * s}}
              for s in range(1, 13)]
    events += [_eval(s, 2.0 - 0.01 * s, 1.8 - 0.02 * s) for s in (2, 4, 6, 8)]
    events.append({"event": "phase_start", "name": "anneal", "step": 8, "changes": {}})
    events.append({"event": "phase_start", "name": "gone", "step": 10, "changes": {},
                   "superseded": True})
    events += [_eval(s, 2.0 - 0.01 * s, 1.8 - 0.02 * s, weights=(0.3, 0.7)) for s in (10, 12)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


@pytest.fixture
def drawn(monkeypatch):
    """Each saved figure, by file stem: its legend's names, its lines by label, its
    vertical lines' x and the tokens axis's tick labels (as drawn)."""
    import matplotlib.figure

    figures: dict[str, dict] = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        result = real_savefig(fig, path, *args, **kwargs)  # draws: the tick labels are set
        ax = fig.axes[0]
        legend = ax.get_legend()
        figures[Path(path).stem] = {
            "legend": [] if legend is None else [t.get_text() for t in legend.get_texts()],
            "lines": {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()},
            "vertical": [line.get_xdata()[0] for line in ax.get_lines()
                         if len(set(line.get_xdata())) == 1 and len(line.get_xdata()) == 2],
            "tokens": [label.get_text() for top in ax.child_axes
                       for label in top.get_xticklabels() if label.get_text()],
        }
        return result

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    return figures


def test_the_validation_plots_draw_each_source_beside_the_mixture(tmp_path, drawn):
    run = tmp_path / "run"
    _mixture_run(run)
    write_report(run)
    bpb = drawn["val_bpb"]
    assert bpb["legend"][:3] == ["mixture (by weight)", "web", "code"]
    assert bpb["lines"]["code"] == pytest.approx([(1.8 - 0.02 * s) / 0.7
                                                  for s in (2, 4, 6, 8, 10, 12)])
    loss = drawn["loss"]
    assert loss["legend"][:6] == ["train", "train: web", "train: code", "validation",
                                  "validation: web", "validation: code"]
    assert loss["lines"]["train: code"] == pytest.approx([2.7 - 0.05 * s for s in range(1, 13)])
    assert loss["lines"]["validation: web"] == pytest.approx([2.0 - 0.01 * s
                                                              for s in (2, 4, 6, 8, 10, 12)])
    index = (run / "report" / "index.html").read_text()
    assert "<th>last validation bits per byte: code</th>" in index
    assert "<th>phases</th><td>anneal from step 8</td>" in index
    assert "a phase that changes the weights moves it" in index


def test_every_plot_marks_where_each_phase_started(tmp_path, drawn):
    run = tmp_path / "run"
    _mixture_run(run)
    write_report(run)
    assert {"loss", "val_bpb", "lr", "grad_norm", "throughput"} <= set(drawn)
    for name, figure in drawn.items():
        if figure["lines"]:  # a plot with no data of this run draws nothing at all
            assert "phase anneal (from step 8)" in figure["legend"], name
            assert figure["vertical"] == [8], name  # the superseded phase is not drawn


def test_the_tokens_axis_labels_are_short_round_counts(tmp_path, drawn):
    run = tmp_path / "run"
    _mixture_run(run)
    write_report(run)
    for name in ("loss", "val_bpb"):
        labels = drawn[name]["tokens"]
        assert 3 <= len(labels) <= 8, labels
        assert all(re.fullmatch(r"\d+(\.\d+)?[kMBT]?", label) for label in labels), labels
        assert any(label.endswith("M") for label in labels), labels  # 6.8M tokens by step 12
        assert all(len(label) <= 6 for label in labels), labels


@pytest.mark.parametrize(("count", "label"), [
    (0, "0"), (64, "64"), (550_000, "550k"), (5_500_000, "5.5M"), (999_999, "1M"),
    (1_200_000_000, "1.2B"), (1_025_000, "1.025M"), (3e12, "3T")])
def test_short_count(count, label):
    assert short_count(count) == label


def test_a_run_on_one_dataset_draws_no_sources_and_no_phases(tmp_path, drawn):
    run = tmp_path / "run"
    run.mkdir()
    events = [{"event": "train", "step": s, "tokens_seen": 64 * s, "loss": 3.0, "lr": 1e-3}
              for s in (1, 2)]
    events.append({"event": "eval", "step": 2, "val_loss": 3.0, "val_bpb": 4.0,
                   "val_tokens": 64, "tokens_seen": 128,
                   "val_by_source": {"data": {"val_loss": 3.0, "val_bpb": 4.0,
                                              "val_tokens": 64}}})  # a mixture of one
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    write_report(run)
    assert list(drawn["val_bpb"]["lines"]) == ["validation"]
    assert list(drawn["loss"]["lines"]) == ["train", "validation"]
    assert all(figure["vertical"] == [] for figure in drawn.values())


def _eval_line(record) -> str:
    out = io.StringIO()
    LogLines(out).on_eval_end(SimpleNamespace(config=SimpleNamespace(max_steps=6)), record)
    return out.getvalue()


def test_the_train_log_line_gives_each_sources_loss_of_a_mixture():
    out = io.StringIO()
    lines = LogLines(out)
    run = SimpleNamespace(config=SimpleNamespace(max_steps=6), state=SimpleNamespace(step=0))
    lines.on_session_start(run, {})
    lines.on_log(run, {"step": 2, "loss": 3.05, "lr": 1e-3, "tokens_per_s": 100.0,
                       "loss_by_source": {"web": 3.1, "code": 2.9}})
    lines.on_log(run, {"step": 4, "loss": 3.0, "lr": 1e-3, "tokens_per_s": 100.0})
    first, second = out.getvalue().splitlines()
    assert first.startswith("step 2/6 | loss 3.0500 (web 3.1000, code 2.9000) | lr 1.00e-03")
    assert second.startswith("step 4/6 | loss 3.0000 | lr 1.00e-03")


def test_the_eval_log_line_lists_each_source_of_a_mixture():
    line = _eval_line(_eval(6, 2.25, 2.01))
    assert line == ("step 6/6 | val_loss 2.1780 | val_bpb 3.1114 | 64 tokens | "
                    "web 3.2143, code 2.8714 bpb\n")
    record = _eval(6, 2.25, 2.01)
    record["val_bpb"] = None
    for part in record["val_by_source"].values():
        part["val_bpb"] = None  # a tokenizer without byte counts: the sources' losses
    assert _eval_line(record).endswith(" | 64 tokens | web 2.2500, code 2.0100 val_loss\n")
    alone = {"event": "eval", "step": 6, "val_loss": 2.0, "val_bpb": 3.0, "val_tokens": 64,
             "val_by_source": {"data": {"val_loss": 2.0, "val_bpb": 3.0, "val_tokens": 64}}}
    assert _eval_line(alone) == "step 6/6 | val_loss 2.0000 | val_bpb 3.0000 | 64 tokens\n"
