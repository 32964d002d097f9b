"""Shared timing and table helpers for the side-by-side benchmarks.

Every comparison runs its candidates interleaved in one process (A, B, A, B, …), so a
slow spell of the machine hits both sides alike, and reports medians with min–max.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass
class Timing:
    name: str
    seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def spread(self) -> str:
        return f"{min(self.seconds) * 1e3:.2f}–{max(self.seconds) * 1e3:.2f}"


def interleaved(cases: dict[str, Callable[[], object]], *, repeats: int, warmup: int = 1,
                sync: Callable[[], None] | None = None) -> dict[str, Timing]:
    """Time each callable ``repeats`` times, round-robin, after ``warmup`` untimed rounds."""
    timings = {name: Timing(name) for name in cases}
    for round_index in range(warmup + repeats):
        for name, fn in cases.items():
            if sync:
                sync()
            start = time.perf_counter()
            fn()
            if sync:
                sync()
            if round_index >= warmup:
                timings[name].seconds.append(time.perf_counter() - start)
    return timings


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n## {title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |")


def machine() -> dict[str, object]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def write_json(path: str | None, results: dict[str, object]) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), "results": results}
    Path(path).write_text(json.dumps(payload, indent=2, default=lambda o: asdict(o)))
    print(f"\nwrote {path}")
