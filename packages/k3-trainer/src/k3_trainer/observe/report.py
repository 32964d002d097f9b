"""``k3-train report``: PNG plots of a run's ``metrics.jsonl`` and a one-page HTML index.

Needs matplotlib (``pip install 'k3-trainer[report]'``; the workspace's default
environment has it). Events from every session are combined, except those a resume
marked superseded (work after the checkpoint it resumed from, redone or, on a branch,
abandoned); of a step logged twice anyway, the later record wins.

A mixture's loss plot draws each source's training loss (``loss_by_source``) and its
validation plots each source's validation (``val_by_source``) beside the mixture, and
every plot marks where each phase started (the ``phase_start`` events): a phase that
changes the weights moves the mixture's line even where no source changed.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ConfigError
from ..record import METRICS, RunRecord
from .metrics import current, read_events

REPORT_DIR = "report"


def _series(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    by_step: dict[int, dict[str, Any]] = {}
    for event in events:
        if event.get("event") == kind and isinstance(event.get("step"), int):
            by_step[event["step"]] = event
    return [by_step[step] for step in sorted(by_step)]


def _prefixed(rows: list[dict[str, Any]], prefix: str) -> list[str]:
    return sorted({k for row in rows for k in row if k.startswith(prefix)})


def _sources(events: list[dict[str, Any]], field: str = "val_by_source") -> list[str]:
    """The sources of a mixture's evaluations (``field``: ``val_by_source``) or training
    windows (``loss_by_source``), in the order they first appear; none for a run on one
    dataset (or a mixture of one, whose line is the mixture's)."""
    names: dict[str, None] = {}
    for event in events:
        by_source = event.get(field)
        if isinstance(by_source, dict):
            names.update(dict.fromkeys(by_source))
    return list(names) if len(names) > 1 else []


def _by_source(evals: list[dict[str, Any]], source: str, key: str) -> list[Any]:
    """``key`` (``val_loss``, ``val_bpb``) of one source at every evaluation (None where
    the source was not evaluated: not in that phase's mixture)."""
    values = []
    for event in evals:
        part = (event.get("val_by_source") or {}).get(source)
        values.append(part.get(key) if isinstance(part, dict) else None)
    return values


def _train_by_source(train: list[dict[str, Any]], source: str) -> list[Any]:
    """One source's training loss in every log window (None where it had no rows)."""
    return [(event.get("loss_by_source") or {}).get(source) for event in train]


def _phases(events: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """``(name, step)`` of each phase the run started (its ``phase_start`` events), by
    step; of two started at one step, the later."""
    by_step = {event["step"]: str(event.get("name")) for event in events
               if event.get("event") == "phase_start" and isinstance(event.get("step"), int)}
    return sorted(((name, step) for step, name in by_step.items()), key=lambda p: p[1])


def short_count(value: float) -> str:
    """A count as a short label: ``550k``, ``5.5M``, ``1.2B`` (4 significant digits at
    most), never a long integer."""
    value = float(f"{value:.4g}")
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.4g}{suffix}"
    return f"{value:.4g}"


def _tokens_of_steps(steps: list[int], tokens: list[Any]) -> tuple[Any, Any] | None:
    """Steps → tokens seen and back, piecewise linear through the run's own counts (from
    step 0, no tokens), straight on past either end (the plot's margins); None without
    two steps of strictly growing counts."""
    xs = np.array([0, *steps] if steps and steps[0] > 0 else steps, dtype=float)
    ys = np.array([0, *tokens] if steps and steps[0] > 0 else tokens, dtype=float)
    if len(xs) < 2 or not (np.all(np.diff(xs) > 0) and np.all(np.diff(ys) > 0)):
        return None

    def along(x: Any, xp: Any, fp: Any) -> Any:
        x = np.asarray(x, dtype=float)
        low = fp[0] + (x - xp[0]) * (fp[1] - fp[0]) / (xp[1] - xp[0])
        high = fp[-1] + (x - xp[-1]) * (fp[-1] - fp[-2]) / (xp[-1] - xp[-2])
        return np.where(x < xp[0], low, np.where(x > xp[-1], high, np.interp(x, xp, fp)))

    return (lambda s: along(s, xs, ys)), (lambda t: along(t, ys, xs))


PHASE_STYLES = ("--", "-.", ":")
"""The line styles of successive phases' marks (grey vertical lines)."""


def require_matplotlib() -> None:
    """Raise ``ConfigError`` now if matplotlib (the ``report`` extra) is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("the report needs matplotlib: pip install 'k3-trainer[report]'") from None


def write_report(run_dir: str | Path) -> Path:
    """Render the plots into ``run_dir/report/`` and return the path of ``index.html``."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator
    run_dir = Path(run_dir)
    metrics = run_dir / METRICS
    if not metrics.is_file():
        raise ConfigError(f"{metrics} not found: {run_dir} is not a k3-train run directory")
    events = current(read_events(metrics))
    train = _series(events, "train")
    evals = _series([e for e in events if "val_loss" in e], "eval")
    downstream = _series([e for e in events if isinstance(e.get("downstream"), dict)], "eval")
    if not train:
        raise ConfigError(f"{metrics} has no train events yet: nothing to plot")
    out = run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)

    steps = [e["step"] for e in train]
    tokens = [e["tokens_seen"] for e in train]
    to_tokens = _tokens_of_steps(steps, tokens)
    phases = _phases(events)
    sources = _sources(evals)
    trained = _sources(train, "loss_by_source")
    named = sources + [source for source in trained if source not in sources]
    # One colour per line across the plots: the mixture's validation C1, the sources C2 on.
    styles: dict[str, dict[str, Any]] = {"validation": {"color": "C1"}}
    styles.update({f"validation: {source}": {"color": f"C{2 + i % 8}", "linewidth": 1,
                                             "linestyle": "--"}
                   for i, source in enumerate(named)})
    styles.update({source: {"color": f"C{2 + i % 8}", "linewidth": 1.2}
                   for i, source in enumerate(named)})
    styles.update({f"train: {source}": {"color": f"C{2 + i % 8}", "linewidth": 1,
                                        "linestyle": ":"}
                   for i, source in enumerate(named)})
    if sources:
        styles["mixture (by weight)"] = {"color": "C1", "linewidth": 2}

    def plot(name: str, title: str, ylabel: str,
             lines: list[tuple[str, list[float], list[Any]]], log_y: bool = False,
             threshold: tuple[str, float] | None = None, from_zero: bool = False,
             tokens_axis: bool = False) -> str:
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        values: list[float] = []
        for label, xs, ys in lines:
            points = [(x, y) for x, y in zip(xs, ys) if isinstance(y, int | float)]
            if points:
                ax.plot(*zip(*points), label=label, **{
                    "marker": "." if len(points) < 40 else None, **styles.get(label, {})})
                values += [y for _, y in points]
        for i, (phase, start) in enumerate(phases if values else []):  # marks on data
            ax.axvline(start, color="0.45", linewidth=1.2,
                       linestyle=PHASE_STYLES[i % len(PHASE_STYLES)],
                       label=f"phase {phase} (from step {start})")
        if threshold is not None:
            label, tau = threshold
            if values and tau > 2 * max(values):  # a line there would flatten the values
                ax.set_title(f"{title}\n({label}: above this range)", fontsize=10)
            else:
                ax.axhline(tau, color="tab:red", linestyle="--", linewidth=1, label=label)
        if log_y:
            ax.set_yscale("log")
        if from_zero:
            ax.set_ylim(bottom=0)
        if tokens_axis and to_tokens is not None:  # tokens, read off the steps' own counts
            top = ax.secondary_xaxis("top", functions=to_tokens)
            top.set_xlabel("tokens seen")
            # Few round counts, each short (5.5M, not 5500000): labels that never collide.
            top.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
            top.xaxis.set_major_formatter(FuncFormatter(lambda x, _: short_count(x)))
        ax.grid(alpha=0.3)
        drawn = len(ax.get_legend_handles_labels()[0])
        if drawn > 1 or (drawn and threshold is not None):
            ax.legend(fontsize=8, ncol=2 if drawn > 6 else 1)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png")
        plt.close(fig)
        return f"{name}.png"

    eval_steps = [e["step"] for e in evals]
    mixture = (" A mixture's validation weighs its sources by the weights of the phase it "
               "was measured in, so a phase that changes the weights moves it "
               "even where no source changed: compare each source's line across a phase."
               if sources else "")
    marked = (" Grey vertical lines: where each phase started." if phases else "")
    images = [
        (plot("loss", "Loss", "mean token loss (nats)",
              [("train", steps, [e.get("loss") for e in train]),
               *((f"train: {source}", steps, _train_by_source(train, source))
                 for source in trained),
               ("validation", eval_steps, [e.get("val_loss") for e in evals]),
               *((f"validation: {source}", eval_steps, _by_source(evals, source, "val_loss"))
                 for source in sources)],
              tokens_axis=True),
         "Training loss (the mean of each log window) and validation loss, in nats per "
         f"token{' (the mixture and each source)' if named else ''}.{mixture}{marked}"),
        (plot("val_bpb", "Validation bits per byte (comparable across tokenizers)",
              "bits per UTF-8 byte",
              [("mixture (by weight)" if sources else "validation", eval_steps,
                [e.get("val_bpb") for e in evals]),
               *((source, eval_steps, _by_source(evals, source, "val_bpb"))
                 for source in sources)],
              tokens_axis=True),
         "Validation loss in bits per UTF-8 byte of the evaluated text: the number to compare "
         f"between runs, whatever their tokenizer.{mixture}{marked}"),
        (plot("lr", "Learning rate", "LR", [("lr", steps, [e.get("lr") for e in train])]),
         "The learning rate of the last update of each log window."),
        (plot("grad_norm", "Gradient norm (pre-clip)", "L2 norm",
              [("window mean", steps, [e.get("grad_norm") for e in train]),
               ("window max", steps, [e.get("grad_norm_max") for e in train])], log_y=True),
         "The global gradient norm before clipping: each window's mean and maximum."),
        (plot("qk_max_logit", "QK-Clip: max pre-softmax logit per attention layer",
              "max logit", [(k.split("/", 1)[1], steps, [e.get(k) for e in train])
                            for k in _prefixed(train, "qk_max_logit/")]
              or [("all layers", steps, [e.get("qk_max_logit") for e in train])],
              threshold=_qk_clip_threshold(run_dir)),
         "The largest attention logit of each layer in the window; QK-Clip rescales a head "
         "whose logit passes τ."),
        (plot("moe_load_cv", "MoE: expert-load coefficient of variation per layer",
              "load CV (0 = even)", [(k.split("/", 1)[1], steps, [e.get(k) for e in train])
                                     for k in _prefixed(train, "moe_load_cv/")]),
         "How unevenly the routed tokens spread over each MoE layer's experts (0: evenly)."),
        (plot("throughput", "Throughput (active training)", "tokens/s",
              [("tokens/s", steps, [e.get("tokens_per_s") for e in train])], from_zero=True),
         "Training tokens per second of each log window, attempts only (no evaluation or "
         "checkpoint time)."),
    ]
    images += _downstream_plots(plot, downstream)
    last = train[-1]
    facts = [("steps", last["step"]), ("tokens seen", f"{last['tokens_seen']:,}"),
             ("last train loss", f"{last.get('loss', float('nan')):.4f}")]
    if evals:
        facts.append(("last validation loss", f"{evals[-1].get('val_loss', float('nan')):.4f}"))
        if isinstance(evals[-1].get("val_bpb"), float):
            facts.append(("last validation bits per byte", f"{evals[-1]['val_bpb']:.4f}"))
        for source in sources:  # of the last evaluation that measured it
            bpb = next((v for v in reversed(_by_source(evals, source, "val_bpb"))
                        if isinstance(v, float)), None)
            if bpb is not None:
                facts.append((f"last validation bits per byte: {source}", f"{bpb:.4f}"))
    if downstream:
        facts.append(("last downstream core", f"{downstream[-1]['downstream']['core']:+.4f}"))
    if phases:
        facts.append(("phases", ", ".join(f"{name} from step {step}"
                                          for name, step in phases)))
    if last.get("mfu") is not None:
        facts.append(("MFU (last window)", f"{last['mfu']:.1%}"))
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
                   for k, v in facts)
    figures = "".join(f'<figure><img src="{name}" alt="{name[:-4]}">'
                      f"<figcaption>{html.escape(caption)}</figcaption></figure>"
                      for name, caption in images)
    index = out / "index.html"
    index.write_text(
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>k3-train report: {html.escape(run_dir.name)}</title>"
        "<style>body{font-family:sans-serif;max-width:1500px;margin:1em auto}"
        "figure{display:inline-block;margin:.5em;width:680px;vertical-align:top}"
        "img{width:680px}figcaption{font-size:90%;color:#444}"
        "th{text-align:left;padding-right:1em}td,th{vertical-align:top}"
        "details{margin:1em 0}</style></head><body>"
        f"<h1>{html.escape(run_dir.name)}</h1><table>{rows}</table>"
        f"{_configuration(run_dir)}{figures}</body></html>\n"
    )
    return index


def _downstream_plots(plot: Any, events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """One plot per downstream task (acc and acc_norm), one of every task's bpb, and one of
    ``core``; nothing for a run without downstream events."""
    if not events:
        return []
    steps = [e["step"] for e in events]
    tasks = sorted({name for e in events for name in e["downstream"]["tasks"]})

    def series(task: str, key: str) -> list[Any]:
        return [e["downstream"]["tasks"].get(task, {}).get(key) for e in events]

    images = [(plot(f"downstream_{_file_name(task)}", f"Downstream: {task}", "accuracy",
                    [("acc", steps, series(task, "acc")),
                     ("acc_norm", steps, series(task, "acc_norm"))]),
               f"{task}: accuracy of the ranked choices on the same "
               f"{series(task, 'docs')[-1]} documents at every evaluation (acc: the largest "
               "summed log-likelihood; acc_norm: per character of the continuation).")
              for task in tasks]
    images.append((plot("downstream_bpb", "Downstream: bits per byte of the gold answers",
                        "bits per UTF-8 byte",
                        [(task, steps, series(task, "bpb")) for task in tasks]),
                   "Bits per UTF-8 byte of each task's gold continuations: moves smoothly "
                   "long before accuracy leaves chance."))
    images.append((plot("downstream_core", "Downstream: core (mean centered accuracy)",
                        "centered accuracy (0 = chance)",
                        [("core", steps, [e["downstream"]["core"] for e in events])]),
                   "The mean over the tasks of (acc − chance) / (1 − chance): 0 at chance, 1 "
                   "when perfect (nanochat's CORE construction over these tasks only)."))
    return images


def _file_name(task: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in task)


def _configuration(run_dir: Path) -> str:
    """The run's model, data and recipe from run.json, as HTML tables (empty without it)."""
    try:
        record = RunRecord.read(run_dir, partial=True)
    except (FileNotFoundError, ValueError):
        return ""
    sources = record.data.sources
    summary = [("model", record.model), ("preset", record.preset),
               *((f"data: {s.name}", f"{s.dir} (weight {s.weight})") for s in sources),
               *([("data", record.data.dir)] if not sources else []),
               ("sessions", len(record.sessions))]
    parts = ["<h2>Configuration</h2>", _table(summary)]
    for config, title in ((record.train_config, "Training recipe"),
                          (record.model_config, "Model")):
        if config:
            parts.append(f"<details open><summary>{title}</summary>"
                         f"{_table(sorted(config.items()))}</details>")
    return "".join(parts)


def _table(items: Any) -> str:
    return "<table>" + "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
        for k, v in items) + "</table>"


def _qk_clip_threshold(run_dir: Path) -> tuple[str, float] | None:
    """``("QK-Clip τ = …", τ)`` from the run's record, when QK-Clip is on; None when the
    record is missing or says it is off."""
    try:
        config = RunRecord.read(run_dir, partial=True).train_config
    except (FileNotFoundError, ValueError):
        return None
    tau = config.get("qk_clip_tau")
    if not config.get("qk_clip_enabled", True) or not isinstance(tau, int | float):
        return None
    return f"QK-Clip τ = {tau:g} (heads above it are rescaled)", float(tau)
