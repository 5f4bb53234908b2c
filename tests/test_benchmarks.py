"""Every benchmark script starts: its imports resolve and its options parse.

The benchmarks are not run by CI (they take minutes, or a GPU), so nothing else would notice a
script that no longer imports; ``bench_goodput.py`` once imported a helper that a refactor of
``bench_estimators.py`` had renamed. ``--help`` imports the whole script (and the scripts it
imports) and builds its parser, then exits before any work.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("bench_*.py"))


def test_there_are_benchmarks() -> None:
    assert len(SCRIPTS) >= 5


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_benchmark_script_starts(script: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(script), "--help"],
        cwd=BENCHMARKS.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage:"), run.stdout[:500]
