"""The generation audit's results are exactly the recorded ones (``tests/generation/golden``).

The records are the JSON reports of the ``generation`` suite and of a fixed set of toy audits (the correct loop
under several options, every planted slip, a store resumed) made by ``scripts/record_generation_golden.py``, wall
times removed.  A change of the generation audit's code that moves any verdict, test, p-value or detail, in the
last bit of a float, fails here; an intended change re-records them and says so in its commit.  Bit-identical
floats hold for one torch version on one CPU kernel family and one thread count: on another the comparison is
skipped, saying what differs.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "record_generation_golden.py"
_spec = importlib.util.spec_from_file_location("record_generation_golden", _SCRIPT)
record_generation_golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record_generation_golden)


@pytest.mark.parametrize("run", list(record_generation_golden.RUNS))
def test_generation_results_are_the_recorded_ones(run):
    path = record_generation_golden.record_path(run)
    if not path.exists():
        pytest.skip(f"no record for this machine's CPU kernels ({path.parent.name})")
    recorded = json.loads(path.read_text())
    if recorded["platform"] != record_generation_golden.platform():
        pytest.skip(f"recorded on {recorded['platform']}, this machine is {record_generation_golden.platform()}")
    found = record_generation_golden.differences(recorded["report"], record_generation_golden.results(run))
    assert not found, f"{len(found)} differences from the recorded {run} results:\n" + "\n".join(found[:30])


def test_a_difference_is_found():
    """The comparison sees a float's last bit, a missing key and a changed list length."""
    differences = record_generation_golden.differences
    assert differences({"a": 0.1}, {"a": 0.1}) == []
    assert differences({"a": 0.1}, {"a": 0.10000000000000002})
    assert differences({"a": 1, "b": 2}, {"a": 1})
    assert differences({"a": [1, 2]}, {"a": [1]})
    assert differences({"a": 1}, {"a": 1.0})
