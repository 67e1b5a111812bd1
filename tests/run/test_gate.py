"""The CI gate: threshold parsing (at argument-parse time), evaluation, and the CLI's exit codes.

Parsing and evaluation are checked on hand-written cases (no torch); the CLI tests run the real
audit on a one-case suite, where K-SEQ's acceptance ratio on the seed example is known:
alpha*(K=2) = 0.94 and K-SEQ accepts 0.62 + 0.4 sqrt(0.34), a ratio of 0.9077.
"""

from __future__ import annotations

import dataclasses
import json
import math
import xml.etree.ElementTree as ET

import pytest

from spectr_audit.cli import main
from spectr_audit.errors import InvalidArgument
from spectr_audit.run.gate import (
    GATE_OPTIONS,
    KNOWN_METRICS,
    Threshold,
    evaluate_gate,
    metric_value,
    parse_threshold,
    threshold_from_option,
)
from spectr_audit.results import AuditResult, Check

KSEQ_SEED_RATIO = (0.62 + 0.4 * math.sqrt(0.34)) / 0.94  # 0.90770...

# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------

GOOD_EXPRESSIONS = [
    ("tv_distance<=1e-9", Threshold("tv_distance", "<=", 1e-9)),
    ("  acceptance_ratio >= 0.95 ", Threshold("acceptance_ratio", ">=", 0.95)),
    ("acceptance_ratio>=95%", Threshold("acceptance_ratio", ">=", 0.95)),
    ("pvalue>0.001", Threshold("pvalue", ">", 0.001)),
    ("max_abs_error<1E-12", Threshold("max_abs_error", "<", 1e-12)),
    ("block_efficiency_ratio>=0.5", Threshold("block_efficiency_ratio", ">=", 0.5)),
]


@pytest.mark.parametrize("text,expected", GOOD_EXPRESSIONS, ids=[t for t, _ in GOOD_EXPRESSIONS])
def test_parse_threshold(text, expected):
    parsed = parse_threshold(text, "--gate")
    assert (parsed.metric, parsed.op) == (expected.metric, expected.op)
    assert parsed.limit == pytest.approx(expected.limit, rel=1e-12)
    assert parsed.source == f"--gate {text.strip()}"


BAD_EXPRESSIONS = [
    ("tv<=1", "unknown metric 'tv'"),
    ("tv_distanc<=0.1", "did you mean 'tv_distance'"),
    ("acceptance_ratio=>0.9", "expected 'METRIC OP NUMBER'"),
    ("acceptance_ratio==0.9", "expected 'METRIC OP NUMBER'"),
    ("tv_distance<=abc", "expected a number, got 'abc'"),
    ("tv_distance<=nan", "expected a finite number"),
    ("tv_distance<=inf", "expected a finite number"),
    ("tv_distance <= 1 2", "expected 'METRIC OP NUMBER'"),
    ("", "expected 'METRIC OP NUMBER'"),
    ("<=0.1", "expected 'METRIC OP NUMBER'"),
]


@pytest.mark.parametrize("text,message", BAD_EXPRESSIONS, ids=[t or "empty" for t, _ in BAD_EXPRESSIONS])
def test_parse_threshold_rejects(text, message):
    with pytest.raises(InvalidArgument, match="^--gate: ") as info:
        parse_threshold(text, "--gate")
    assert message in str(info.value)


def test_parse_threshold_rejects_a_non_string():
    with pytest.raises(InvalidArgument, match="expected a string"):
        parse_threshold(0.5)  # type: ignore[arg-type]


def test_every_dedicated_option_names_a_known_metric():
    for option in GATE_OPTIONS:
        assert option.metric in KNOWN_METRICS
        assert option.op in ("<=", ">=")


@pytest.mark.parametrize("name,text,message", [
    ("max-tv", "-0.1", "in [0, 1]"),
    ("max-tv", "1.5", "in [0, 1]"),
    ("min-pvalue", "2", "in [0, 1]"),
    ("fail-under-acceptance-ratio", "150%", "in [0, 1]"),
    ("fail-under-acceptance-ratio", "x", "expected a number"),
])
def test_dedicated_options_validate_their_range(name, text, message):
    option = next(o for o in GATE_OPTIONS if o.name == name)
    with pytest.raises(InvalidArgument, match=f"^--{name}: ") as info:
        threshold_from_option(option, text)
    assert message in str(info.value)


def test_fail_under_accepts_a_percentage():
    option = next(o for o in GATE_OPTIONS if o.name == "fail-under-acceptance-ratio")
    threshold = threshold_from_option(option, "95%")
    assert (threshold.metric, threshold.op, threshold.limit) == ("acceptance_ratio", ">=", pytest.approx(0.95))


@pytest.mark.parametrize("op,value,holds", [
    ("<=", 1.0, True), ("<", 1.0, False), (">=", 1.0, True), (">", 1.0, False),
    ("<=", 1.0 + 1e-12, False), (">=", 1.0 - 1e-12, False),
])
def test_threshold_boundaries(op, value, holds):
    assert Threshold("tv_distance", op, 1.0).holds(value) is holds


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


def _result(verifier="v", case="c", expected=None, error=None, **metrics):
    return AuditResult(verifier, case, checks=(Check("exact", True),), metrics=metrics, expected=expected, error=error)


def test_gate_lists_each_violation_with_its_value():
    results = [
        _result("a", "c1", tv_distance=1e-17, acceptance_ratio=0.99),
        _result("b", "c1", tv_distance=0.02, acceptance_ratio=0.80),
        _result("b", "c2", tv_distance=1e-17, acceptance_ratio=0.96),
    ]
    thresholds = [parse_threshold("tv_distance<=1e-9"), threshold_from_option(GATE_OPTIONS[4], "0.95")]
    outcome = evaluate_gate(results, thresholds)
    assert not outcome.passed and outcome.num_gated == 3
    assert [(v.verifier, v.case, v.threshold.metric, v.value) for v in outcome.violations] == [
        ("b", "c1", "tv_distance", 0.02), ("b", "c1", "acceptance_ratio", 0.80)]
    message = outcome.message()
    assert "gate failed: 2 violation(s)" in message
    assert "b on c1: acceptance_ratio = 0.8 breaks acceptance_ratio >= 0.95" in message
    assert "[--fail-under-acceptance-ratio 0.95]" in message
    assert outcome.to_dict()["violations"][0]["value"] == 0.02


def test_gate_passes_when_every_threshold_holds():
    outcome = evaluate_gate([_result(tv_distance=0.0)], [parse_threshold("tv_distance<=0")])
    assert outcome.passed and "gate passed" in outcome.message()


def test_gate_without_thresholds_passes():
    assert evaluate_gate([_result(tv_distance=1.0)], None).passed
    assert evaluate_gate([_result(tv_distance=1.0)], []).passed


def test_a_threshold_no_result_measured_fails_the_gate():
    outcome = evaluate_gate([_result(tv_distance=0.0)], [parse_threshold("pvalue>=0.01")])
    assert not outcome.passed and not outcome.violations
    assert [t.metric for t in outcome.unmeasured] == ["pvalue"]
    assert "no gated result measured 'pvalue'" in outcome.message()


def test_errors_and_declared_inexact_results_are_left_out():
    results = [
        _result("lossy", "c", expected=False, tv_distance=0.3),
        _result("broken", "c", error="VerifierError: boom", tv_distance=0.5),
        _result("good", "c", tv_distance=0.0),
    ]
    outcome = evaluate_gate(results, [parse_threshold("tv_distance<=1e-9")])
    assert outcome.passed and outcome.num_gated == 1
    assert outcome.skipped == ("lossy on c: declared inexact", "broken on c: audit error")


@pytest.mark.parametrize("metrics,expected", [
    ({"tv_distance": None}, None),
    ({"tv_distance": float("nan")}, None),
    ({"tv_distance": True}, None),
    ({"tv_distance": "0.1"}, None),
    ({"tv_distance": 1}, 1.0),
    ({"block_efficiency": 1.5, "block_lp_optimum": 2.0}, 0.75),
    ({"block_efficiency": 1.5, "block_lp_optimum": 0.0}, None),
    ({"block_efficiency": 1.5}, None),
])
def test_metric_value(metrics, expected):
    metric = "block_efficiency_ratio" if "block_efficiency" in metrics else "tv_distance"
    assert metric_value(metrics, metric) == expected


# ---------------------------------------------------------------------------------------------
# The CLI
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_suite(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text('[suite]\nname = "tiny"\n'
                    '[[case]]\nname = "seed"\ndraft = [0.6, 0.4]\ntarget = [0.3, 0.7]\nnum_drafts = 2\n'
                    'checks = ["exact", "optimality"]\n')
    return path


@pytest.mark.parametrize("argv,message", [
    (["--max-tv", "abc"], "argument --max-tv: expected a number, got 'abc'"),
    (["--fail-under-acceptance-ratio", "1.2"], "argument --fail-under-acceptance-ratio: expected a number in [0, 1]"),
    (["--gate", "tv<=1"], "argument --gate: unknown metric 'tv'"),
    (["--gate", "acceptance_ratio=>0.9"], "argument --gate: expected 'METRIC OP NUMBER'"),
])
def test_bad_thresholds_are_usage_errors_at_parse_time(capsys, argv, message):
    # The suite does not exist: a parse-time error must come first, before anything is loaded.
    with pytest.raises(SystemExit) as info:
        main(["run", "--suite", "no-such-suite.toml", *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_gate_thresholds_are_collected_in_order():
    from spectr_audit.cli import build_parser

    args = build_parser().parse_args(["run", "--max-tv", "1e-9", "--gate", "pvalue>=0.01",
                                      "--fail-under-acceptance-ratio", "90%"])
    assert [str(t) for t in args.gate] == ["tv_distance <= 1e-09", "pvalue >= 0.01", "acceptance_ratio >= 0.9"]
    assert build_parser().parse_args(["run"]).gate is None


def test_gate_failure_exits_1_with_the_violation(capsys, tiny_suite, tmp_path):
    junit = tmp_path / "junit.xml"
    code = main(["run", "--suite", str(tiny_suite), "--verifier", "kseq", "--out", str(tmp_path / "out"),
                 "--fail-under-acceptance-ratio", "0.95", "--max-tv", "1e-9", "--junit", str(junit),
                 "--progress", "none"])
    captured = capsys.readouterr()
    assert code == 1
    assert "gate FAILED -> FAIL" in captured.out
    assert "spectr-audit run: gate failed: 1 violation(s)" in captured.err
    assert f"kseq on seed: acceptance_ratio = {KSEQ_SEED_RATIO:.6g}" in captured.err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["passed"] is True  # the verdicts themselves are fine; the gate is reported apart
    gate = report["meta"]["gate"]
    assert gate["passed"] is False and gate["violations"][0]["value"] == pytest.approx(KSEQ_SEED_RATIO, abs=1e-9)
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("failures") == "1" and suite.get("tests") == "1"
    failure = suite.find("testcase/failure")
    assert failure.get("type") == "GateViolation" and "acceptance_ratio" in failure.text


def test_gate_that_holds_exits_0(capsys, tiny_suite, tmp_path):
    code = main(["run", "--suite", str(tiny_suite), "--verifier", "kseq", "--out", str(tmp_path / "out"),
                 "--fail-under-acceptance-ratio", "0.9", "--max-tv", "1e-9", "--progress", "none"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "gate held -> PASS" in out


def test_unmeasured_threshold_fails_the_cli_gate(capsys, tiny_suite, tmp_path):
    # "seconds" is measured by every audit that runs; "block_lp_optimum" never at L = 1 with these checks.
    code = main(["run", "--suite", str(tiny_suite), "--verifier", "kseq", "--out", str(tmp_path / "out"),
                 "--gate", "block_lp_optimum>=0", "--progress", "none"])
    assert code == 1
    assert "no gated result measured 'block_lp_optimum'" in capsys.readouterr().err


def test_progress_bar_and_html(capsys, tiny_suite, tmp_path):
    # --progress bar forces rich's bar even without a terminal; the run must still finish cleanly.
    code = main(["run", "--suite", str(tiny_suite), "--verifier", "kseq", "--out", str(tmp_path / "out"),
                 "--progress", "bar", "--html"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert (tmp_path / "out" / "report.html").read_text().startswith("<!DOCTYPE html>")
    assert "report.html" in out


def test_dataclass_thresholds_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse_threshold("tv_distance<=0").limit = 1.0  # type: ignore[misc]
