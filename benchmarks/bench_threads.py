"""CPU threads: ``k3-train train``'s default thread count against every other count, on an
idle machine and on one where another process keeps a core busy.

Each cell is a fresh ``k3-train train`` of the tiny preset on the built-in corpus with
``OMP_NUM_THREADS`` set (the default: unset, which ``k3_trainer.cli.threads`` turns into one
thread fewer than the cores), reporting the run's own active-training tokens/s from
``metrics.jsonl``. The load is a pure-Python busy loop, started before and stopped after
the loaded cells. Cells are interleaved by repeat, so drifts hit every cell alike.

Run: ``hatch run bench:threads`` (``--quick``: fewer steps, one repeat, the default count
only, the corpus prepared inside the first cell). The target (the default within 1.5x of
the best count under load) is judged in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from k3_trainer.cli.threads import THREADS_ENV, default_threads, usable_cores
from k3_trainer.record import METRICS


@contextlib.contextmanager
def one_core_busy() -> Iterator[None]:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def tokens_per_s(threads: int | None, steps: int, root: Path) -> float:
    """Active-training tokens/s of one fresh tiny run (``threads`` None: the default)."""
    env = {k: v for k, v in os.environ.items() if k not in (THREADS_ENV, "MKL_NUM_THREADS")}
    if threads is not None:
        env[THREADS_ENV] = str(threads)
    run = Path(tempfile.mkdtemp(dir=root))
    subprocess.run(
        [sys.executable, "-m", "k3_trainer.cli", "train", "--run-dir", str(run / "r"),
         "--max-steps", str(steps), "--log-interval", str(max(1, steps // 3)),
         "--eval-interval", str(steps), "--checkpoint-interval", str(steps),
         "--eval-batches", "1"],
        env=env, check=True, capture_output=True, text=True)
    events = [json.loads(line) for line in (run / "r" / METRICS).read_text().splitlines()]
    rates = [e["tokens_per_s"] for e in events if e["event"] == "train" and e.get("tokens_per_s")]
    return statistics.median(rates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    steps, repeats = (4, 1) if args.quick else (args.steps, args.repeats)
    cores = usable_cores()
    # --quick (the CI smoke run): the default count only, idle and loaded.
    counts: list[int | None] = [None] if args.quick else [None, *range(1, cores + 1)]
    samples: dict[tuple[str, int | None], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.quick:  # prepares the built-in corpus once, outside the cells
            tokens_per_s(1, 2, Path(tmp))
        for _ in range(repeats):
            for condition in ("idle", "one core busy"):
                busy = one_core_busy() if condition != "idle" else contextlib.nullcontext()
                with busy:
                    for threads in counts:
                        rate = tokens_per_s(threads, steps, Path(tmp))
                        samples.setdefault((condition, threads), []).append(rate)
    default = default_threads(cores)
    print(f"{cores} usable cores; the default is {default} thread(s)")
    print(f"{'condition':14} {'threads':>14} {'tokens/s':>9} {'best / this':>12}")
    results: dict[str, dict[str, float]] = {}
    for condition in ("idle", "one core busy"):
        rates = {t: statistics.median(samples[(condition, t)]) for t in counts}
        best = max(rates.values())
        for threads, rate in rates.items():
            label = f"default ({default})" if threads is None else str(threads)
            print(f"{condition:14} {label:>14} {rate:9,.0f} {best / rate:11.2f}x")
            results[f"{condition}, {label}"] = {"tokens_per_s": round(rate, 1),
                                                "best_over_this": round(best / rate, 3)}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
