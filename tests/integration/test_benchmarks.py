"""The benchmark command keeps working: one run, every part in its JSON (slow: about 30 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_benchmark_writes_every_part(tmp_path):
    out = tmp_path / "results.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_verifiers.py"), "--quick", "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert {"machine", "verifiers", "bounds", "exact_audit", "montecarlo"} <= set(result)
    names = {row["verifier"] for row in result["verifiers"]}
    assert {"speculative", "kseq", "spectr-tree", "block"} <= names
    # every ratio is a positive, finite measurement against a memory pass from the same run
    assert all(0 < row["ratio"] < float("inf") and row["memory_pass_ms"] > 0 for row in result["verifiers"])
    solvers = {row["what"] for row in result["bounds"]}
    assert any("bisection" in w for w in solvers) and any("sort-free" in w for w in solvers)
    assert any(row["vocab_size"] == 8 and row["num_drafts"] == 6 for row in result["exact_audit"])
    assert result["montecarlo"]["kseq"]["verifications_per_second"] > 0
    assert "| verifier | V | K | L |" in run.stdout  # the Markdown table
