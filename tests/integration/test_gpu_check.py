"""scripts/gpu_check.sh on a machine without a GPU, and the table scripts/gpu_summary.py makes of a GPU run.

Without a GPU the script must say so and exit non-zero before it installs or runs anything; its
later gate (a torch that sees no CUDA) is reached with ``GPU_CHECK_ASSUME_GPU=1``.  The table is
checked on hand-written JUnit reports and benchmark rows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
HAS_GPU = torch.cuda.is_available() or shutil.which("nvidia-smi") is not None or any(Path("/dev").glob("nvidia[0-9]*"))
no_gpu_here = pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU: scripts/gpu_check.sh would run for real")


def _run(*args, env=None, timeout=60):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


@no_gpu_here
@pytest.mark.parametrize("flag", ["--no-install", "--detect-only"])
def test_without_a_gpu_it_says_so_and_exits_2(flag, tmp_path):
    run = _run(flag, "--out", str(tmp_path / "out"))
    assert run.returncode == 2, run.stdout + run.stderr
    assert "no GPU found" in run.stderr
    assert not (tmp_path / "out").exists()  # nothing installed, run or written


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees CUDA")
def test_a_torch_without_cuda_is_named_and_exits_3(tmp_path):
    run = _run("--no-install", "--out", str(tmp_path), env={"GPU_CHECK_ASSUME_GPU": "1", "PYTHON": sys.executable})
    assert run.returncode == 3, run.stdout + run.stderr
    assert f"torch ({torch.__version__}) sees no CUDA device" in run.stderr


def test_bad_usage_exits_64():
    run = _run("--frobnicate")
    assert run.returncode == 64 and "unknown argument: --frobnicate" in run.stderr
    assert "Usage: scripts/gpu_check.sh" in run.stderr


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


# -- the summary table ------------------------------------------------------------------------------------------

def _junit(path: Path, cases: dict) -> str:
    """A pytest-style JUnit report: ``{test id: "ok" | "fail" | "xfail" | "skip"}``."""
    body = {"ok": "", "fail": '<failure message="assert False">boom</failure>',
            "xfail": '<skipped type="pytest.xfail" message="known sync" />',
            "skip": '<skipped type="pytest.skip" message="no CUDA" />'}
    rows = "".join(f'<testcase classname="t" name="{name}" time="0.1">{body[kind]}</testcase>'
                   for name, kind in cases.items())
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>')
    return str(path)


def _summary(tmp_path, device_cases, triton_cases, rows):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"machine": {"device_name": "Test GPU", "torch": "9.9"}, "verifiers": rows}))
    out = tmp_path / "summary.md"
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_summary.py"),
         "--device-junit", _junit(tmp_path / "device.xml", device_cases),
         "--triton-junit", _junit(tmp_path / "triton.xml", triton_cases), "--bench", str(bench), "--out", str(out)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert out.read_text().strip() == run.stdout.strip()
    return run


def _all_ok(names):
    cases = {}
    for name in names:
        for test in ("test_sampler_follows_its_exact_law", "test_contract_checks_and_exact_audit",
                     "test_statistical_audit"):
            cases[f"{test}[cuda-{name}]"] = "ok"
        for vocab_size in (50, 1000):
            cases[f"test_no_host_sync_in_the_sampler_on_cuda[{name}-{vocab_size}]"] = "ok"
    return cases


def _line(text: str, name: str) -> list:
    return [line for line in text.splitlines() if line.startswith(f"| {name} |")]


def test_the_summary_table(tmp_path):
    from spectr_audit.registry import BUILTIN_VERIFIERS

    names = list(BUILTIN_VERIFIERS)
    row = {"verifier": "block", "num_drafts": 1, "draft_len": 4, "vocab_size": 32768, "verify_ms": 0.5,
           "ratio": 2.0, "ratio_median": 2.5, "ratio_spread": [2.25, 2.75], "ratio_eager": 6.0}
    run = _summary(tmp_path, _all_ok(names), {"test_a": "ok", "test_b": "ok"}, [row])
    assert run.returncode == 0, run.stdout
    for name in names:  # every built-in has its line
        assert len(_line(run.stdout, name)) == 1, name
    # block: four verdicts, its time, its ratio, the spread, Triton off, and the speed-up 6 / 2
    assert _line(run.stdout, "block")[0] == ("| block | 1 | 4 | 32768 | ok | ok | ok | ok | 0.500 | 2.00 | "
                                             "2.50 [2.25, 2.75] | 6.00 | 3.00x |")
    assert "Test GPU (torch 9.9)" in run.stdout and "2 passed, 0 failed, 0 skipped" in run.stdout


def test_the_summary_table_flags_failures_and_names_known_syncs(tmp_path):
    from spectr_audit.registry import BUILTIN_VERIFIERS

    names = list(BUILTIN_VERIFIERS)
    cases = _all_ok(names)
    cases["test_no_host_sync_in_the_sampler_on_cuda[kseq-50]"] = "xfail"
    cases["test_no_host_sync_in_the_sampler_on_cuda[kseq-1000]"] = "xfail"
    run = _summary(tmp_path, cases, {"test_a": "ok"}, [])
    assert run.returncode == 0  # a documented (strict xfail) sync holds the check
    assert _line(run.stdout, "kseq")[0].split(" | ")[7] == "known"
    # greedy-block's cells must not pick up greedy-block-repaired's cases
    cases["test_statistical_audit[cuda-greedy-block-repaired]"] = "fail"
    run = _summary(tmp_path, cases, {"test_a": "ok"}, [])
    assert run.returncode == 1
    assert _line(run.stdout, "greedy-block-repaired")[0].split(" | ")[6] == "FAIL"
    assert _line(run.stdout, "greedy-block")[0].split(" | ")[6] == "ok"
    run = _summary(tmp_path, _all_ok(names), {"test_a": "fail"}, [])
    assert run.returncode == 1 and "0 passed, 1 failed" in run.stdout
