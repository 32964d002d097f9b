"""``k3-train report``: PNG plots of a run's ``metrics.jsonl`` and a one-page HTML index.

Needs matplotlib (``pip install 'k3-trainer[report]'``; the workspace's default
environment has it). Events from every session are combined, except those a resume
marked superseded (work after the checkpoint it resumed from, redone or, on a branch,
abandoned); of a step logged twice anyway, the later record wins.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ConfigError
from .metrics import current, read_events
from .run import read_run_record

REPORT_DIR = "report"


def _series(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    by_step: dict[int, dict[str, Any]] = {}
    for event in events:
        if event.get("event") == kind and isinstance(event.get("step"), int):
            by_step[event["step"]] = event
    return [by_step[step] for step in sorted(by_step)]


def _prefixed(rows: list[dict[str, Any]], prefix: str) -> list[str]:
    return sorted({k for row in rows for k in row if k.startswith(prefix)})


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
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
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
                ax.plot(*zip(*points), label=label, marker="." if len(points) < 40 else None)
                values += [y for _, y in points]
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
        if tokens_axis and len(steps) > 1:  # tokens, read off the steps' own counts
            top = ax.secondary_xaxis("top", functions=(
                lambda s: np.interp(s, steps, tokens),  # type: ignore[arg-type]
                lambda t: np.interp(t, tokens, steps)))  # type: ignore[arg-type]
            top.set_xlabel("tokens seen")
        ax.grid(alpha=0.3)
        drawn = len(ax.get_legend_handles_labels()[0])
        if drawn > 1 or (drawn and threshold is not None):
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png")
        plt.close(fig)
        return f"{name}.png"

    eval_steps = [e["step"] for e in evals]
    images = [
        (plot("loss", "Loss", "mean token loss (nats)",
              [("train", steps, [e.get("loss") for e in train]),
               ("validation", eval_steps, [e.get("val_loss") for e in evals])],
              tokens_axis=True),
         "Training loss (the mean of each log window) and validation loss, in nats per "
         "token."),
        (plot("val_bpb", "Validation bits per byte (comparable across tokenizers)",
              "bits per UTF-8 byte",
              [("validation", eval_steps, [e.get("val_bpb") for e in evals])],
              tokens_axis=True),
         "Validation loss in bits per UTF-8 byte of the evaluated text: the number to compare "
         "between runs, whatever their tokenizer."),
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
    if downstream:
        facts.append(("last downstream core", f"{downstream[-1]['downstream']['core']:+.4f}"))
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
        record = read_run_record(run_dir)
    except (FileNotFoundError, ValueError):
        return ""
    data: dict[str, Any] = record["data"] if isinstance(record.get("data"), dict) else {}
    sources = data.get("sources") or []
    summary = [("model", record.get("model", "k3")), ("preset", record.get("preset")),
               *((f"data: {s.get('name')}", f"{s.get('dir')} (weight {s.get('weight')})")
                 for s in sources if isinstance(s, dict)),
               *([("data", data.get("dir"))] if not sources else []),
               ("sessions", len(record.get("sessions") or []))]
    parts = ["<h2>Configuration</h2>", _table(summary)]
    for key, title in (("train_config", "Training recipe"), ("model_config", "Model")):
        if isinstance(record.get(key), dict):
            parts.append(f"<details open><summary>{title}</summary>"
                         f"{_table(sorted(record[key].items()))}</details>")
    return "".join(parts)


def _table(items: Any) -> str:
    return "<table>" + "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
        for k, v in items) + "</table>"


def _qk_clip_threshold(run_dir: Path) -> tuple[str, float] | None:
    """``("QK-Clip τ = …", τ)`` from the run's record, when QK-Clip is on; None when the
    record is missing or says it is off."""
    try:
        config = read_run_record(run_dir)["train_config"]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    tau = config.get("qk_clip_tau") if isinstance(config, dict) else None
    if not config.get("qk_clip_enabled", True) or not isinstance(tau, int | float):
        return None
    return f"QK-Clip τ = {tau:g} (heads above it are rescaled)", float(tau)
