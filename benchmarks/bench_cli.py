"""How fast ``k3-train`` answers before it does any work: ``--help``, a subcommand's
``--help`` and an argument error, each in a fresh process, against the interpreter alone
and against ``import torch`` (what every answer cost when the CLI imported torch first).

Run: ``hatch run bench:cli`` (``--quick``: fewer repeats). Medians of interleaved runs;
the target (under 1 s, BENCHMARKS.md) is judged there, never in tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = {
    "python -c pass": ["-c", "pass"],
    "python -c 'import torch'": ["-c", "import torch"],
    "k3-train --help": ["-m", "k3_trainer.cli", "--help"],
    "k3-train train --help": ["-m", "k3_trainer.cli", "train", "--help"],
    "k3-train train --bogus (error)": ["-m", "k3_trainer.cli", "train", "--bogus"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(repeats):
        for name, argv in CASES.items():  # interleaved: load drifts hit every case alike
            start = time.perf_counter()
            subprocess.run([sys.executable, *argv], capture_output=True, check=False)
            times[name].append(time.perf_counter() - start)
    torch_s = statistics.median(times["python -c 'import torch'"])
    print(f"{'command':34} {'median s':>9} {'vs import torch':>16}")
    results = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        results[name] = {"median_s": round(median, 4), "vs_import_torch": median / torch_s}
        print(f"{name:34} {median:9.3f} {median / torch_s:15.2f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
