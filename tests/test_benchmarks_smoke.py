"""The benchmark suite runs end to end in --quick mode (a smoke test: no thresholds).

Keeps benchmarks/ from rotting: a renamed API, a broken import or a script that no longer
writes its JSON fails here. The numbers themselves are judged in BENCHMARKS.md, never in
tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_suite_runs_every_benchmark(tmp_path):
    out = tmp_path / "all.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    suite = json.loads(out.read_text())["suite"]
    assert set(suite) == {"optim", "qkclip", "checkpoint", "hub", "generate", "trainer",
                          "presets", "model",
                          "data", "compile", "distributed", "cli", "threads", "quality",
                          "gpu_check"}
    for name, entry in suite.items():
        assert entry["exit"] == 0 and entry["results"], name
