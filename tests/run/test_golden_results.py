"""The built-in suites' results are exactly the recorded ones (``tests/run/golden``).

The records are the JSON reports of ``default``, ``edge-cases``, ``sampling`` and ``historic-bugs`` with
every built-in verifier, the sample budget and seed of ``scripts/record_golden.py``, wall times removed,
one set per CPU kernel family (``tests/run/golden/AVX2``, ``tests/run/golden/AVX512``).
A change of the audit's code that moves any verdict, check text, metric or detail, in the last bit of a
float, fails here; an intended change re-records them (``python scripts/record_golden.py``) and says so in
its commit.  Bit-identical floats hold for one torch version on one CPU kernel family and one thread count (the
script pins the threads and OpenBLAS's kernels): the comparison reads the record of the machine's kernel family,
and is skipped, saying what differs, on a family without a record or another torch version.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "record_golden.py"
_spec = importlib.util.spec_from_file_location("record_golden", _SCRIPT)
record_golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record_golden)


@pytest.mark.parametrize("suite", [pytest.param(s, marks=pytest.mark.slow) if s == "default" else s
                                   for s in record_golden.SUITES])
def test_results_are_the_recorded_ones(suite):
    path = record_golden.record_path(suite)
    if not path.exists():
        pytest.skip(f"no record for this machine's CPU kernels ({path.parent.name}); "
                    f"the records: {sorted(p.name for p in record_golden.GOLDEN.iterdir() if p.is_dir())}")
    recorded = json.loads(path.read_text())["platform"]
    machine = {**record_golden.platform(), "openblas_coretype": record_golden.OPENBLAS_CORE}
    if recorded != machine:
        pytest.skip(f"recorded on {recorded}, this machine is {machine}")
    if record_golden.platform() == machine:
        recorded = json.loads(path.read_text())["report"]
        found = record_golden.differences(recorded, record_golden.results(suite))
        assert not found, f"{len(found)} differences from the recorded {suite} results:\n" + "\n".join(found[:30])
    else:  # OpenBLAS loaded its own choice of kernels in this process: compare in one that pins them
        done = subprocess.run([sys.executable, str(_SCRIPT), "--check", f"--suite={suite}"], capture_output=True,
                              text=True, timeout=900, env=record_golden.pinned_environment())
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        assert ", 0 differences" in done.stdout, done.stdout


@pytest.mark.slow
def test_the_avx2_records_hold_with_avx2_kernels_on_an_avx512_machine():
    """An AVX512 machine checks the AVX2 family too (torch's and numpy's AVX2 kernels; the script's docstring
    gives the measured agreement with a real AVX2 machine), so that neither family's record goes stale."""
    if record_golden.torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip(f"the AVX2 kernels run in place of AVX512 ones; this machine's are "
                    f"{record_golden.torch.backends.cpu.get_cpu_capability()}")
    avx2 = json.loads((record_golden.GOLDEN / "AVX2" / "default.json").read_text())["platform"]
    if avx2["torch"] != record_golden.platform()["torch"]:
        pytest.skip(f"the AVX2 records are of torch {avx2['torch']}, this machine has {record_golden.platform()['torch']}")
    done = subprocess.run([sys.executable, str(_SCRIPT), "--check", "--family", "AVX2"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert done.stdout.count(", 0 differences") == len(record_golden.SUITES), done.stdout


def test_differences_names_each_changed_path():
    recorded = {"results": [{"verdict": "PASS", "metrics": {"tv": 0.0, "n": 3}}]}
    now = {"results": [{"verdict": "FAIL", "metrics": {"tv": 5e-324, "m": 3}}]}
    assert record_golden.differences(recorded, now) == [
        "/results[0]/metrics/m: new", "/results[0]/metrics/n: missing now",
        "/results[0]/metrics/tv: recorded 0.0, now 5e-324", "/results[0]/verdict: recorded 'PASS', now 'FAIL'",
    ]
    assert record_golden.differences(recorded, json.loads(json.dumps(recorded))) == []
    # an int where a float was recorded is a difference too (1 == 1.0 in Python)
    assert record_golden.differences({"x": 1.0}, {"x": 1}) == ["/x: recorded 1.0, now 1"]


def test_wall_times_are_the_only_field_removed():
    assert record_golden._without_times({"seconds": 1.0, "a": [{"seconds": 2, "b": 3}]}) == {"a": [{"b": 3}]}


def test_each_record_is_filed_under_the_kernels_it_was_recorded_on():
    records = sorted(record_golden.GOLDEN.glob("*/*.json"))
    assert records, "no golden records"
    assert {p.stem for p in records} <= set(record_golden.SUITES)
    for path in records:
        platform = json.loads(path.read_text())["platform"]
        assert platform["cpu_capability"] == path.parent.name, (path, platform)
        assert platform["threads"] == record_golden.THREADS, (path, platform)
        assert platform["openblas_coretype"] == record_golden.OPENBLAS_CORE, (path, platform)
