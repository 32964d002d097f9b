"""Every benchmark runs end to end in --quick mode (a smoke test: no thresholds).

Keeps benchmarks/ from rotting: a renamed API, a broken import or a script that no longer
writes its JSON fails here. The numbers themselves are judged in BENCHMARKS.md, never in
tests. One test per benchmark, through the suite's own runner, so a parallel test run
spreads them over the cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from run_all import SUITE  # noqa: E402  (benchmarks/ is scripts, not a package)

NAMES = [name for name, _, _ in SUITE]


def test_the_suite_runs_every_benchmark_script():
    scripts = {script for _, script, _ in SUITE}
    on_disk = {p.name for p in BENCHMARKS.glob("bench_*.py")} | {"gpu_check.py"}
    assert scripts == on_disk
    assert len(NAMES) == len(set(NAMES))


@pytest.mark.parametrize("name", NAMES)
def test_each_benchmark_runs_in_quick_mode(name, tmp_path):
    out = tmp_path / "all.json"
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run_all.py"), "--quick", "--only", name,
         "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    suite = json.loads(out.read_text())["suite"]
    assert set(suite) == {name}
    assert suite[name]["exit"] == 0 and suite[name]["results"]
