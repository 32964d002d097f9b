"""The benchmark suite: every comparison in its own process, one summary, one JSON file.

Run: ``hatch run bench:all`` (``--quick`` for the smoke run CI uses, under 5 minutes on 2
cores). Each script interleaves its baseline and candidates itself and prints its own
tables; this runner passes ``--quick``/``--json``, collects the JSON files into
``--out`` (default ``benchmarks/results/all.json``) and exits non-zero if a script fails.
No thresholds are asserted: the targets and what the numbers mean are in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUITE = [  # (name, script, extra arguments for --quick)
    ("optim", "bench_optim.py", []),
    ("qkclip", "bench_qkclip.py", []),
    ("checkpoint", "bench_checkpoint.py", []),
    ("hub", "bench_hub.py", []),
    ("generate", "bench_generate.py", []),
    ("trainer", "bench_trainer.py", ["--stall-presets", "tiny"]),
    ("presets", "bench_presets.py", []),
    ("data", "bench_data.py", []),
    ("model", "bench_model.py", []),
    ("compile", "bench_compile.py", ["--presets", "tiny"]),
    ("distributed", "bench_distributed.py", []),
    ("pipeline", "bench_pipeline.py", []),
    ("context_parallel", "bench_context_parallel.py", []),
    ("cli", "bench_cli.py", []),
    ("threads", "bench_threads.py", []),
    ("quality", "bench_quality.py", []),
    ("gpu_check", "gpu_check.py", None),  # CUDA checks, or a CPU smoke run without CUDA
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the CI smoke run")
    parser.add_argument("--only", nargs="*", help="names to run (default: all)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "all.json")
    args = parser.parse_args()
    results: dict[str, object] = {}
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, script, quick_args in SUITE:
            if args.only and name not in args.only:
                continue
            out = Path(tmp) / f"{name}.json"
            command = [sys.executable, str(HERE / script), "--json", str(out)]
            if args.quick and quick_args is not None:
                command += ["--quick", *quick_args]
            print(f"\n# {name}: {' '.join(command[1:])}", flush=True)
            start = time.perf_counter()
            code = subprocess.call(command, cwd=HERE)
            seconds = time.perf_counter() - start
            print(f"# {name}: exit {code} in {seconds:.0f} s", flush=True)
            if code != 0:
                failed.append(name)
            results[name] = {"exit": code, "seconds": round(seconds, 1),
                             "results": json.loads(out.read_text()) if out.exists() else None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"quick": args.quick, "suite": results}, indent=2))
    print(f"\nwrote {args.out}; " + (f"FAILED: {', '.join(failed)}" if failed else "all ran"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
