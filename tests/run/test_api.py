"""The one-call API: spectr_audit.audit and spectr_audit.assert_passed."""

from __future__ import annotations

import pytest

import spectr_audit
from spectr_audit.errors import InvalidArgument
from spectr_audit.run.gate import parse_threshold


def test_audit_returns_a_report_of_every_supported_case():
    report = spectr_audit.audit("speculative", suite="default", max_samples=2000)
    assert report.results, "the default suite has cases a single-draft verifier supports"
    assert {r.verifier for r in report.results} == {"speculative"}
    assert report.passed
    spectr_audit.assert_passed(report)


def test_assert_passed_names_the_failing_result():
    report = spectr_audit.audit("spectr-gbv-published", suite="default", max_samples=2000)
    # Declared inexact and found inexact: as declared, so the report passes.
    assert report.passed
    from spectr_audit.registry import load_broken

    undeclared = load_broken("always-accept")
    undeclared.expected = None  # as a third party would ship it: claiming nothing, so held to exactness
    broken = spectr_audit.audit(undeclared, suite="default", max_samples=4000)
    assert not broken.passed
    with pytest.raises(AssertionError, match="always-accept"):
        spectr_audit.assert_passed(broken)


def test_assert_passed_applies_gate_thresholds():
    report = spectr_audit.audit("speculative", suite="default", max_samples=2000)
    with pytest.raises(AssertionError, match="gate failed"):
        spectr_audit.assert_passed(report, [parse_threshold("acceptance>=1.01")])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: spectr_audit.audit("speculative", no_such_option=1), "no_such_option: unknown option"),
        (lambda: spectr_audit.audit("speculative", options=3), "options: expected an AuditOptions"),
        (lambda: spectr_audit.assert_passed("report"), "report: expected an AuditReport"),
    ],
)
def test_bad_arguments_are_named(call, message):
    with pytest.raises(InvalidArgument, match=message):
        call()
