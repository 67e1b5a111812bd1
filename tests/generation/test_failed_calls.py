"""Failed engine calls fail the generation audit's gate unless allowed, and an ERROR's headline names what failed.

The engine is the toy's correct loop wrapped so that its ``generate`` raises on every third call: by
default (no failed call allowed) the verdict is ERROR and ``spectr-audit generation`` exits 4; with the
allowance raised to the failures' count the verdict is the tests' (the correct loop: PASS or
INCONCLUSIVE) and the failed calls are counted on their own line.  Budgets are tiny (8 tokens a row).
"""

from __future__ import annotations

import json
import textwrap

import pytest

from spectr_audit.cli import main
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation import audit_generation
from spectr_audit.generation.cases import parse_generation_cases
from spectr_audit.generation.library import ToyPair, correct_engine
from spectr_audit.generation.verdict import detail_lines, status_of, verdict_line
from spectr_audit.results import EXIT_ERROR

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 8
PAIR = ToyPair(vocab_size=VOCAB, seed=3)
PROMPTS = [[1, 2, 3], [4, 5]]
#: 2 prompts, every arm: 6 jobs (one generate call each), so every third call failing fails 2 of them.
SMALL = dict(vocab_size=VOCAB, max_new_tokens=8, batch_size=2, progress=False, seed=5)


def every_third_call_fails(engine):
    """``engine.generate``, raising on its 3rd, 6th, ... call."""
    calls = []

    def generate(prompts, max_new_tokens, seed):
        calls.append(1)
        if len(calls) % 3 == 0:
            raise RuntimeError(f"engine crashed\non call {len(calls)}")
        return engine.generate(prompts, max_new_tokens, seed)

    generate.per_row_max_new_tokens = True
    return generate


def test_one_call_in_three_failing_is_an_error_by_default():
    result = audit_generation(every_third_call_fails(correct_engine(PAIR)), PAIR.scorer(), PROMPTS, **SMALL)
    assert result.verdict == "ERROR" and result.allowed_failed_calls == 0
    assert result.num_failed_calls == 2 and result.num_jobs == 4 and result.num_tokens > 0
    assert [c["job"] for c in result.failed_calls] == [2, 5]
    assert result.failed_calls[0]["error"] == "RuntimeError: on call 3"
    assert "Traceback" in result.failed_calls[0]["traceback"]
    assert "RuntimeError: engine crashed" in result.failed_calls[0]["traceback"]
    assert status_of(result) == EXIT_ERROR == 4
    line = verdict_line(result)
    assert line.startswith("ERROR: ") and "2 of 6 engine calls failed (allowed 0" in line, line
    assert "first: job 2 (equal): RuntimeError: on call 3" in line, line
    assert "failed_calls[].traceback" in line and "test 'none'" not in line and "p = " not in line, line
    assert any(d.startswith("failed calls: 2 of 6 (allowed 0): more than allowed") for d in detail_lines(result))


def test_within_the_allowance_the_verdict_is_the_tests_and_the_failures_are_counted_apart():
    result = audit_generation(every_third_call_fails(correct_engine(PAIR)), PAIR.scorer(), PROMPTS,
                              allow_failed_calls=2, **SMALL)
    # the correct loop: nothing rejected, so PASS at the planned power, else INCONCLUSIVE
    assert result.pvalue > result.alpha
    assert result.verdict == ("PASS" if result.min_detectable_tv <= result.requested_tv else "INCONCLUSIVE")
    assert status_of(result) == 0 and result.num_failed_calls == 2
    assert any(d.startswith("failed calls: 2 of 6 (allowed 2): within the allowance") for d in detail_lines(result))
    # one fewer allowed than failed: ERROR again
    tight = audit_generation(every_third_call_fails(correct_engine(PAIR)), PAIR.scorer(), PROMPTS,
                             allow_failed_calls=1, **SMALL)
    assert tight.verdict == "ERROR" and tight.num_tokens == result.num_tokens


def test_a_finding_stands_over_failed_calls():
    from spectr_audit.generation.library import slip_engine

    result = audit_generation(every_third_call_fails(slip_engine("positions-by-block", PAIR)), PAIR.scorer(),
                              PROMPTS, **{**SMALL, "max_new_tokens": 32})
    assert result.verdict == "FINDING" and result.num_failed_calls == 2 and status_of(result) == 1
    assert any("(the finding stands)" in d for d in detail_lines(result))


def test_every_call_failing_says_so_in_the_headline():
    def generate(prompts, max_new_tokens, seed):
        raise ValueError("no such model\nweights missing")

    result = audit_generation(generate, PAIR.scorer(), PROMPTS, allow_failed_calls=100, **SMALL)
    assert result.verdict == "ERROR" and result.num_jobs == 0 and result.num_failed_calls == 6
    line = verdict_line(result, status_of(result))
    assert line.startswith(f"ERROR: {result.generator} against {result.scorer}: every engine call failed (6 of 6 "
                           "jobs); first: job 0 (single): ValueError: weights missing; tracebacks: "), line
    assert line.endswith(": exit 4") and "test 'none'" not in line and "p = 1" not in line
    assert "min detectable TV" not in line, line
    assert not any(d.startswith("decided by") for d in detail_lines(result))  # nothing was decided


def test_the_json_carries_the_count_the_allowance_and_the_tracebacks():
    result = audit_generation(every_third_call_fails(correct_engine(PAIR)), PAIR.scorer(), PROMPTS,
                              allow_failed_calls=3, **SMALL)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["num_failed_calls"] == 2 and data["allowed_failed_calls"] == 3
    assert [c["arm"] for c in data["failed_calls"]] == ["equal", "repeated"]
    assert all("Traceback" in c["traceback"] for c in data["failed_calls"])


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_bad_allowance_is_named(bad):
    with pytest.raises(InvalidArgument, match="allow_failed_calls: expected an integer >= 0"):
        audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, allow_failed_calls=bad, **SMALL)


def test_a_suite_case_takes_the_allowance():
    (case,) = parse_generation_cases([{"name": "flaky", "engine": "toy", "expected": "pass",
                                       "allow_failed_calls": 3}])
    assert case.audit_options["allow_failed_calls"] == 3
    with pytest.raises(InvalidArgument, match="allow_failed_calls"):
        parse_generation_cases([{"name": "flaky", "engine": "toy", "expected": "pass", "allow_failed_calls": -1}])


FACTORY = textwrap.dedent('''
    from spectr_audit.generation.library import ToyPair, correct_engine

    PAIR = ToyPair(vocab_size=8, seed=3)

    def make_flaky():
        """The toy's correct loop, raising on every third generate call."""
        engine, calls = correct_engine(PAIR), []

        def generate(prompts, max_new_tokens, seed):
            calls.append(1)
            if len(calls) % 3 == 0:
                raise RuntimeError("engine crashed")
            return engine.generate(prompts, max_new_tokens, seed)

        generate.per_row_max_new_tokens = True
        return {"generate": generate, "score": PAIR.scorer(), "vocab_size": 8, "prompts": [[1, 2, 3], [4, 5]]}
''')


def test_the_cli_exits_4_on_failed_calls_and_0_with_them_allowed(capsys, tmp_path):
    path = tmp_path / "flaky.py"
    path.write_text(FACTORY)
    argv = ["generation", "--engine", f"{path}:make_flaky", "--max-new-tokens", "8", "--batch-size", "2",
            "--progress", "none"]
    code = main(argv + ["--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 4, out
    head = out.splitlines()[0]
    assert head.startswith("ERROR: ") and "2 of 6 engine calls failed" in head and head.endswith(": exit 4"), head
    assert "RuntimeError: engine crashed" in head, head
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["verdict"] == "ERROR" and data["num_failed_calls"] == 2 and data["allowed_failed_calls"] == 0
    assert "Traceback" in data["failed_calls"][0]["traceback"]
    code = main(argv + ["--allow-failed-calls", "2"])
    out = capsys.readouterr().out
    assert code == 0 and out.splitlines()[0].split(":")[0] in ("PASS", "INCONCLUSIVE"), out
    assert "failed calls: 2 of 6 (allowed 2): within the allowance" in out, out
    assert "tracebacks: give --out DIR (report.json) or --json to keep them" in out, out


def test_the_reports_name_what_failed(tmp_path):
    from spectr_audit.generation.verdict import write_reports

    result = audit_generation(every_third_call_fails(correct_engine(PAIR)), PAIR.scorer(), PROMPTS, **SMALL)
    names = {path.name for path in write_reports(result, tmp_path)}
    assert {"report.json", "report.md", "junit.xml"} <= names, names
    markdown = (tmp_path / "report.md").read_text()
    assert "ERROR: 2 of 6 engine calls failed, more than the 0 allowed; the first, job 2 (equal): RuntimeError: " \
           "on call 3" in markdown
    junit = (tmp_path / "junit.xml").read_text()
    assert "<error" in junit and "Traceback" in junit and "job 5 (repeated)" in junit


def test_check_generation_fails_with_the_headline_and_passes_with_the_allowance():
    from spectr_audit.generation.checks import check_generation

    with pytest.raises(AssertionError, match=r"audit: ERROR: .*2 of 6 engine calls failed \(allowed 0"):
        check_generation(every_third_call_fails(correct_engine(PAIR)), PAIR.scorer(), PROMPTS, **SMALL)
    result = check_generation(every_third_call_fails(correct_engine(PAIR)), PAIR.scorer(), PROMPTS,
                              allow_failed_calls=2, **{**SMALL, "min_detectable_tv": 0.9})
    assert result.verdict == "PASS" and result.num_failed_calls == 2
