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
    # each ratio with the spread of its per-round ratios
    assert all(row["ratio_spread"][0] <= row["ratio_median"] <= row["ratio_spread"][1] for row in result["verifiers"])
    assert set(result["machine"]) >= {"clock", "threads", "device_name"}
    solvers = {row["what"] for row in result["bounds"]}
    assert any("bisection" in w for w in solvers) and any("sort-free" in w for w in solvers)
    assert any(row["vocab_size"] == 8 and row["num_drafts"] == 6 for row in result["exact_audit"])
    for processes in ("1_processes", "2_processes"):
        assert result["montecarlo"]["kseq"][processes]["verifications_per_second"] > 0
    # the sharded audit's counts do not depend on the number of processes
    assert all(row["bit_identical"] for row in result["montecarlo"].values())
    assert "| verifier | V | K | L |" in run.stdout  # the Markdown table


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_verifiers_under_test", ROOT / "benchmarks" / "bench_verifiers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_verifier_table_interleaves_its_calls(monkeypatch):
    import torch

    bench = _bench()
    calls = []
    items = {key: (lambda key=key: calls.append(key)) for key in ("memory", "verify", "validated")}
    monkeypatch.setattr(bench, "_calls_per_sample", lambda fn, device: 1)  # no warm-up calls
    times = bench.interleaved(items, torch.device("cpu"), 3)
    # every round times every item, the order reversed on odd rounds: no item always follows the same one
    assert calls == ["memory", "verify", "validated", "validated", "verify", "memory", "memory", "verify", "validated"]
    assert all(len(times[key][0]) == 3 and times[key][1] == 1 for key in items)


def test_ratios_are_fastest_over_fastest_with_the_paired_spread():
    bench = _bench()
    # rounds: verify 2, 9, 3 s against memory passes of 1, 3, 1 s measured next to them
    summary = bench._summary([2.0, 9.0, 3.0], [1.0, 3.0, 1.0])
    assert summary["ratio"] == 2.0  # min 2 over min 1
    assert summary["ratio_median"] == 3.0  # per-round ratios 2, 3, 3
    assert summary["ratio_spread"] == [2.5, 3.0]  # their 25th and 75th percentiles (inclusive method)
    assert summary["ms"] == 2000.0 and summary["ms_median"] == 3000.0


def test_unknown_parts_are_refused():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_verifiers.py"), "--parts", "verifiers,nope"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and "--parts: unknown part(s) nope" in run.stderr


@pytest.mark.slow
def test_the_exact_audit_benchmark_compares_two_codes_in_one_run(tmp_path):
    # against this very commit's code: both sides must give the same bits, and each ratio is a measurement
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: the benchmark reads the other code with git archive")
    out = tmp_path / "exact.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_exact.py"), "--quick", "--rounds", "1",
                          "--against", "HEAD", "--json", str(out)], capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [case["case"].split()[0] for case in result["cases"]] == ["kseq", "rrs-wor"]
    for case in result["cases"]:
        assert case["results_identical"] and 0 < case["ratio"] < float("inf")
        # the other side ran the archived copy, this side this checkout
        assert case["runs"]["other"][0]["package"] != case["runs"]["now"][0]["package"]
    assert "RESULTS DIFFER" not in run.stdout


def test_the_exact_audit_benchmark_refuses_an_unknown_case(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_exact_under_test", ROOT / "benchmarks" / "bench_exact.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit, match="--case: no case starts with"):
        module.main(["--case", "nope"])
