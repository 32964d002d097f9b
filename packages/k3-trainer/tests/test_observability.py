"""Profiling, training windows, diagnostics, sinks and the report."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from trainer_helpers import build_parts, fit, train_config

from k3_trainer import MetricsLog, ProfilerWindow, Trainer, TrainingProfiler, TrainingWindow
from k3_trainer.cli import main
from k3_trainer.observe.metrics import read_events

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_phase_times_add_up_to_the_session_wall_time(data_dir, tmp_path):
    # 12 steps, not fewer: the session's fixed setup outside any phase (QK-Clip's discovery,
    # the session events) must stay well under 5% of it on a busy machine too (6 steps,
    # ~80 ms, once came out at 91% in CI).
    config = train_config(max_steps=12, eval_interval=6, checkpoint_interval=6)
    model, opt, tl, vl = build_parts(config, data_dir)
    log = MetricsLog(None)
    fit(model, opt, (tl, vl), config, callbacks=[log], checkpoint_path=tmp_path / "ck.pt")
    end = log.events[-1]
    phases = end["phase_s"]
    top_level = sum(v for k, v in phases.items() if k != "train/qk_clip")  # nested in optimizer
    # Stated tolerance: the named phases cover at least 95% of the session's wall time.
    assert top_level <= end["wall_s"] and top_level >= 0.95 * end["wall_s"], end
    auxiliary = phases["eval"] + phases["checkpoint"] + phases["log"]
    assert end["active_training_s"] + auxiliary == pytest.approx(end["wall_s"], rel=0.05)
    assert end["attempts"] == 12


def test_bounded_profiler_window_traces_exactly_the_requested_attempts(data_dir, tmp_path):
    config = train_config(max_steps=6)
    model, opt, tl, vl = build_parts(config, data_dir)
    fit(model, opt, (tl, vl), config,
        callbacks=[ProfilerWindow(tmp_path / "profile", start=3, steps=2)])
    trace = json.loads((tmp_path / "profile" / "trace.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith(
        "train/attempt#")}
    assert steps == {"train/attempt#3", "train/attempt#4"}
    assert {"train/forward", "train/optimizer"} <= {e.get("name") for e in trace["traceEvents"]}
    assert "aten::" in (tmp_path / "profile" / "top_ops.txt").read_text()
    with pytest.raises(ValueError, match="steps"):
        ProfilerWindow(tmp_path, start=1, steps=1000)


def test_window_loss_is_token_weighted():
    window = TrainingWindow()
    window.add(loss=1.0, tokens=100, grad_norm=2.0, lr=0.1)
    window.add(loss=3.0, tokens=300, grad_norm=4.0, lr=0.2)
    summary = window.summary(TrainingProfiler())
    assert summary["loss"] == pytest.approx(2.5)  # not the plain mean 2.0
    assert summary["grad_norm"] == 3.0 and summary["grad_norm_max"] == 4.0
    assert summary["lr"] == 0.2 and summary["updates_in_window"] == 2
    assert summary["mfu"] is None  # CPU: not in the peak table, never guessed


def test_diagnostics_are_logged_and_do_not_change_training(data_dir):
    config = train_config(max_steps=4, log_interval=2)
    runs = {}
    for diagnostics in (True, False):
        model, opt, tl, vl = build_parts(config, data_dir)
        log = MetricsLog(None)
        trainer = Trainer(model, opt, (tl, vl), config, callbacks=[log])
        trainer.diagnostics = diagnostics
        trainer.fit()
        runs[diagnostics] = (model, [e for e in log.events if e["event"] == "train"])
    on, off = runs[True][1], runs[False][1]
    assert "moe_load_cv/layers.1.mlp" in on[0] and "qk_max_logit/layers.0.attn" in on[0]
    assert on[0]["model_flops_per_token"] > 0 and "max_rss_bytes" in on[0]
    assert not any(k.startswith(("moe_", "qk_")) for k in off[0])
    for a, b in zip(runs[True][0].parameters(), runs[False][0].parameters()):
        assert torch.equal(a, b)


def test_tiny_preset_cli_logs_moe_and_qk_fields_and_writes_a_report(data_dir, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), "--data", str(data_dir), "--max-steps", "2",
                 "--log-interval", "1", "--eval-batches", "1", "--report"]) == 0
    train_event = next(e for e in read_events(run / "metrics.jsonl") if e["event"] == "train")
    for layer in (1, 2, 3):
        assert math.isfinite(train_event[f"moe_load_cv/layers.{layer}.mlp"])
    # tiny is hybrid: layers 0-2 are KDA (no QK-Clip), layer 3 is the Gated MLA
    assert math.isfinite(train_event["qk_max_logit/layers.3.attn"])
    assert not any(f"qk_max_logit/layers.{layer}.attn" in train_event for layer in (0, 1, 2))
    index = (run / "report" / "index.html").read_text()
    pngs = sorted((run / "report").glob("*.png"))
    assert len(pngs) == 7  # loss, val_bpb, lr, grad_norm, qk_max_logit, moe_load_cv, throughput
    for png in pngs:
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000
        assert f'src="{png.name}"' in index
    assert main(["report", "--run-dir", str(tmp_path / "missing")]) == 2


def _tensorboard_run(run, data_dir):
    return main(["train", "--run-dir", str(run), "--data", str(data_dir), "--max-steps", "2",
                 "--log-interval", "1", "--batch-size", "2", "--seq-len", "16",
                 "--eval-batches", "1", "--tensorboard"])


def test_tensorboard_sink_mirrors_the_metrics(data_dir, tmp_path):
    """The test environments install tensorboard, so the sink really runs here."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert _tensorboard_run(run, data_dir) == 0
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    expected = {e["step"]: e["loss"] for e in read_events(run / "metrics.jsonl")
                if e["event"] == "train"}
    assert set(losses) == set(expected) == {1, 2}
    assert all(abs(losses[s] - expected[s]) < 1e-5 for s in expected)
    assert "eval/val_loss" in events.Tags()["scalars"]


def test_tensorboard_missing_is_a_clear_error_before_anything_is_written(
        data_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard → ImportError
    run = tmp_path / "run"
    assert _tensorboard_run(run, data_dir) == 2
    assert "pip install 'k3-trainer[tensorboard]'" in capsys.readouterr().err
    assert not run.exists()


def test_metrics_log_recovers_from_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "train", "step": 1}\n{"event": "tra')  # cut by a crash
    assert [e["event"] for e in read_events(path)] == ["train"]  # the torn end: ignored
    with MetricsLog(path) as log:
        log.write("session_start", step=1)
    events = read_events(path)
    assert [e["event"] for e in events] == ["train", "session_start"]
    lines = path.read_text().splitlines()  # the torn line is gone: one event per line
    assert len(lines) == 2 and all(json.loads(line)["event"] for line in lines)


@pytest.mark.parametrize("bad", ['{"event": "tra', "[1, 2]"])
def test_a_damaged_line_inside_the_event_log_is_an_error_naming_it(tmp_path, bad):
    from k3_trainer.config import ConfigError
    from k3_trainer.observe.metrics import mark_superseded

    path = tmp_path / "metrics.jsonl"
    path.write_text(f'{{"event": "train", "step": 1}}\n{bad}\n{{"event": "train", "step": 2}}\n')
    with pytest.raises(ConfigError, match=rf"{path}:2 is not a JSON (event|object)"):
        read_events(path)
    with pytest.raises(ConfigError, match=rf"{path}:2 "):
        mark_superseded(path, 0)
    path.write_text(f'{{"event": "train", "step": 1}}\n{bad}\n')  # complete, yet not JSON
    with pytest.raises(ConfigError, match=rf"{path}:2 "):
        read_events(path)


def test_the_qk_plot_has_a_legend_and_the_tau_line(tmp_path, monkeypatch):
    """The report's QK-Clip plot draws τ (from the run's record) as a labelled line."""
    import matplotlib.axes

    from k3_trainer.observe.report import write_report

    run = tmp_path / "run"
    run.mkdir()
    events = [{"event": "train", "step": s, "tokens_seen": 64 * s, "loss": 3.0, "lr": 1e-3,
               "qk_max_logit/layers.3.attn": 20.0 + s} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "run.json").write_text(json.dumps({"train_config": {"qk_clip_tau": 30.0,
                                                               "qk_clip_enabled": True}}))
    drawn: list[tuple[str, float, str]] = []
    legends: list[str] = []
    real_axhline, real_legend = matplotlib.axes.Axes.axhline, matplotlib.axes.Axes.legend

    def axhline(ax, y=0, *args, **kwargs):
        drawn.append((ax.get_title(), y, kwargs.get("label")))
        return real_axhline(ax, y, *args, **kwargs)

    def legend(ax, *args, **kwargs):
        legends.append(ax.get_title())
        return real_legend(ax, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "axhline", axhline)
    monkeypatch.setattr(matplotlib.axes.Axes, "legend", legend)
    write_report(run)
    qk_title = "QK-Clip: max pre-softmax logit per attention layer"
    assert drawn == [(qk_title, 30.0, "QK-Clip τ = 30 (heads above it are rescaled)")]
    assert qk_title in legends  # one layer, still a legend: its name and τ

    (run / "run.json").write_text(json.dumps({"train_config": {"qk_clip_tau": 30.0,
                                                               "qk_clip_enabled": False}}))
    drawn.clear()
    write_report(run)
    assert drawn == []  # QK-Clip off: no threshold to draw


def test_a_tau_far_above_the_logits_is_named_not_drawn(tmp_path, monkeypatch):
    """A τ line at 100 over logits near 20 would flatten them: the values keep their
    scale, and the title says where τ is."""
    import matplotlib.figure

    from k3_trainer.observe.report import write_report

    run = tmp_path / "run"
    run.mkdir()
    events = [{"event": "train", "step": s, "tokens_seen": 64 * s, "loss": 3.0, "lr": 1e-3,
               "tokens_per_s": 900.0 + s, "qk_max_logit/layers.3.attn": 20.0 + s}
              for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "run.json").write_text(json.dumps({"train_config": {"qk_clip_tau": 100.0,
                                                               "qk_clip_enabled": True}}))
    titles, lines, limits = [], [], {}
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        ax = fig.axes[0]
        titles.append(ax.get_title())
        lines.append([line.get_ydata()[0] for line in ax.get_lines()
                      if line.get_linestyle() == "--"])
        limits[Path(path).stem] = ax.get_ylim()
        return real_savefig(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    write_report(run)
    qk = next(i for i, title in enumerate(titles) if title.startswith("QK-Clip"))
    assert "QK-Clip τ = 100 (heads above it are rescaled): above this range" in titles[qk]
    assert lines[qk] == []
    assert limits["throughput"][0] == 0  # throughput from zero


def test_every_training_session_keeps_the_report_current(data_dir, tmp_path, capsys):
    """A run with a report rewrites it at the end of each session, resumes included, and
    the page shows the run's configuration and a caption per plot."""
    run = tmp_path / "run"
    flags = ["--data", str(data_dir), "--batch-size", "2", "--seq-len", "16",
             "--eval-batches", "1", "--log-interval", "1", "--decay-steps", "3"]
    assert main(["train", "--run-dir", str(run), *flags, "--max-steps", "2", "--report"]) == 0
    assert "<tr><th>steps</th><td>2</td></tr>" in (run / "report" / "index.html").read_text()
    assert main(["train", "--run-dir", str(run), "--resume", "--max-steps", "3"]) == 0
    index = (run / "report" / "index.html").read_text()
    assert "<tr><th>steps</th><td>3</td></tr>" in index
    assert "<h2>Configuration</h2>" in index and "<th>decay_steps</th><td>3</td>" in index
    assert "<tr><th>preset</th><td>tiny</td></tr>" in index  # the default, kept on resume
    assert f"<tr><th>data</th><td>{data_dir.resolve()}</td></tr>" in index
    assert index.count("<figcaption>") == len(list((run / "report").glob("*.png"))) == 7


def test_pipeline_stages_figures_combine_as_one_process_s():
    """Each stage observes its own layers; rank 0 logs every stage's (the per-layer fields
    side by side, each whole-model figure by its rule), and keeps its own of the rest."""
    from k3_trainer.observe.stages import combine_stages, layer_figures

    first = {"loss": 2.0, "moe_load_cv": 0.5, "moe_dead_experts": 1, "moe_max_load_ratio": 2.5,
             "moe_bias_min": -0.1, "moe_bias_max": 0.2, "moe_load_cv/layers.1.mlp": 0.5,
             "moe_expert_load/layers.1.mlp": [1.0, 3.0], "moe_all_to_all_bytes_per_step": 8}
    last = {"loss": 0.0, "qk_max_logit": 31.0, "qk_heads_clipped": 3, "qk_min_gamma": 0.9,
            "qk_max_logit/layers.3.attn": 31.0, "moe_load_cv": 0.7, "moe_dead_experts": 2,
            "moe_max_load_ratio": 1.5, "moe_bias_min": -0.3, "moe_bias_max": 0.1,
            "moe_load_cv/layers.2.mlp": 0.7, "moe_all_to_all_bytes_per_step": 16}
    assert "loss" not in layer_figures(first)
    assert "moe_all_to_all_bytes_per_step" not in layer_figures(first)
    combined = combine_stages([layer_figures(first), layer_figures(last)])
    assert combined == {
        "moe_load_cv/layers.1.mlp": 0.5, "moe_expert_load/layers.1.mlp": [1.0, 3.0],
        "qk_max_logit/layers.3.attn": 31.0, "moe_load_cv/layers.2.mlp": 0.7,
        "qk_max_logit": 31.0, "qk_heads_clipped": 3, "qk_min_gamma": 0.9,
        "moe_load_cv": 0.7, "moe_dead_experts": 3, "moe_max_load_ratio": 2.5,
        "moe_bias_min": -0.3, "moe_bias_max": 0.2}
    assert combine_stages([layer_figures(first)]) == layer_figures(first)
