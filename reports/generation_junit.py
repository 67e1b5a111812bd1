"""The generation audit's JUnit XML report: one ``<testcase>`` per deciding test and decisive check."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from typing import Any, Mapping, Optional

from spectr_audit.reports.generation_reading import (
    _CHECKS,
    _alpha,
    _outcome,
    _rejected,
    _role,
    _subtests,
    _tokens_needed,
    _verdict_text,
    generation_dict,
)
from spectr_audit.reports.markdown import _detectable, _finite, _fixed, _pvalue

__all__ = ["render_generation_junit"]


def _property(parent: ET.Element, name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool):
        text = str(value).lower()
    elif isinstance(value, float):
        if not math.isfinite(value):
            return
        text = repr(value)
    else:
        text = str(value)
    ET.SubElement(parent, "property", name=name, value=text)


def render_generation_junit(result: Any) -> str:
    """The generation audit as JUnit XML: one ``<testcase>`` per deciding test and decisive check.

    A deciding test that rejects (adjusted p at most alpha) or a check that found a violation is a
    ``<failure>``; when the verdict is INCONCLUSIVE, the tests that did not reject are ``<skipped>``
    (nothing rejected, below the planned power), with a ``minimum detectable TV`` test case saying
    how far the power fell short; an ERROR is one ``<error>``.  Tests the verdict does not rest on
    (reported only) are left out.  Every test case carries its numbers as ``<property>`` elements.
    """
    d = generation_dict(result)
    verdict = str(d.get("verdict", "?"))
    alpha = _alpha(d)
    seconds = d.get("seconds") if isinstance(d.get("seconds"), Mapping) else {}
    total = sum(v for v in (_finite(x) for x in seconds.values()) if v is not None)
    classname = f"spectr_audit.generation.{d.get('generator', 'generator')}"
    suite = ET.Element("testsuite", name=f"spectr-audit.generation.{d.get('generator', 'generator')}")
    properties = ET.SubElement(suite, "properties")
    for key in ("verdict", "test", "pvalue", "alpha", "power", "decided_by", "num_tokens", "num_continuations",
                "num_jobs", "min_detectable_tv", "requested_tv", "tv_lower", "greedy", "stop_reason", "incomplete",
                "logit_tolerance", "scorer"):
        _property(properties, key, d.get(key))
    counts = {"failures": 0, "errors": 0, "skipped": 0}
    verdict_text = " ".join(_verdict_text(d, lambda s: f"'{s}'"))
    conditions = [c for c in d.get("conditions") or () if isinstance(c, Mapping)]
    unreached = [str(c.get("name")) for c in conditions if c.get("reached") is not True]
    short = not (_finite(d.get("min_detectable_tv")) is not None and _finite(d.get("requested_tv")) is not None
                 and d["min_detectable_tv"] <= d["requested_tv"] * (1 + 1e-9))
    why_inconclusive = (f"the audit's minimum detectable TV {_detectable(d.get('min_detectable_tv'))} is above the "
                        f"{_fixed(d.get('requested_tv'))} requested" if short or not unreached else
                        f"the engine did not show the serving conditions {', '.join(unreached)} reached")

    def case(name: str, test: Optional[dict] = None):
        element = ET.SubElement(suite, "testcase", classname=classname, name=name, time="0")
        props = ET.SubElement(element, "properties")
        _property(props, "verdict", verdict)
        for key in ("statistic", "pvalue", "pvalue_adjusted", "df", "num_samples", "min_detectable_tv"):
            _property(props, key, (test or {}).get(key))
        _property(props, "alpha", alpha)
        if test is not None:
            _property(props, "role", _role(d, test))
        return element

    if verdict == "ERROR":
        element = case("generation audit")
        error = ET.SubElement(element, "error", message=verdict_text[:500], type="AuditError")
        tracebacks = [f"job {c.get('job')} ({c.get('arm')}):\n{c.get('traceback')}" for c in d.get("failed_calls") or ()
                      if c.get("traceback")]
        error.text = "\n".join(tracebacks or [str(f) for f in d.get("failures") or ()]) or verdict_text
        counts["errors"] += 1
    else:
        deciding = set(d.get("deciding") or ())
        for test in _subtests(d):
            name = test.get("name")
            if name not in deciding and name not in _CHECKS:
                continue  # reported only: the verdict does not rest on it
            element = case(str(name), test)
            outcome = _outcome(d, test)
            what = "; ".join(x for x in (test.get("detail"), test.get("null")) if x)
            if _rejected(d, test):
                failure = ET.SubElement(element, "failure", message=f"FINDING: {name}: {outcome}"[:500],
                                        type="Finding")
                failure.text = f"{outcome}\n{what}\n{verdict_text}"
                counts["failures"] += 1
            elif verdict == "INCONCLUSIVE" and name not in _CHECKS:
                skipped = ET.SubElement(element, "skipped", message=(
                    f"INCONCLUSIVE: {outcome}, but {why_inconclusive}")[:500])
                skipped.text = ("nothing rejected, but below the planned power" if short or not unreached else
                                "nothing rejected, but a serving condition was not shown reached")
                counts["skipped"] += 1
            else:
                ET.SubElement(element, "system-out").text = f"{outcome}. {what}".strip()
        if verdict in ("PASS", "INCONCLUSIVE") and not d.get("greedy"):
            element = case("minimum detectable TV")
            _property(element.find("properties"), "min_detectable_tv", d.get("min_detectable_tv"))
            _property(element.find("properties"), "requested_tv", d.get("requested_tv"))
            reached, requested = _detectable(d.get("min_detectable_tv")), _fixed(d.get("requested_tv"))
            if verdict == "INCONCLUSIVE" and short:
                skipped = ET.SubElement(element, "skipped", message=(
                    f"INCONCLUSIVE: the minimum detectable TV reached, {reached}, is above the {requested} "
                    f"requested ({d.get('num_tokens', 0)} tokens scored)")[:500])
                needed = _tokens_needed(d)
                skipped.text = ("nothing rejected, but below the planned power"
                                + (f"; about {needed} tokens would reach it" if needed else ""))
                counts["skipped"] += 1
            else:
                ET.SubElement(element, "system-out").text = (f"the minimum detectable TV reached, {reached}, is "
                                                            f"within the {requested} requested")
    for condition in conditions if verdict != "ERROR" else ():
        # each serving condition its own test case: a finding in its stratum fails, a state not shown reached is
        # skipped (it was not tested), and the counters it rests on are properties
        element = case(f"condition {condition.get('name')}")
        props = element.find("properties")
        _property(props, "pvalue_adjusted", condition.get("pvalue_adjusted"))
        _property(props, "num_samples", condition.get("tokens"))
        for key, value in (condition.get("stats") or {}).items():
            _property(props, f"engine.{key}", value)
        status, how = str(condition.get("status")), str(condition.get("how"))
        if status == "FINDING":
            failure = ET.SubElement(element, "failure", type="Finding", message=(
                f"FINDING in condition {condition.get('name')}: Holm-adjusted p = "
                f"{_pvalue(condition.get('pvalue_adjusted'))}; {how}")[:500])
            failure.text = ", ".join(condition.get("tests") or ())
            counts["failures"] += 1
        elif status == "ERROR":
            ET.SubElement(element, "error", type="EngineError", message=f"ERROR: {how}"[:500]).text = (
                "every call of the engine under this condition failed; the failed calls are in the report")
            counts["errors"] += 1
        elif status in ("NOT REACHED", "NOT SHOWN", "TOO FEW TOKENS"):
            ET.SubElement(element, "skipped", message=f"{status}: {how}"[:500]).text = (
                "the condition's state was not shown reached: its tokens did not test it" if status != "TOO FEW TOKENS"
                else "its stratum held too few tokens to be tested")
            counts["skipped"] += 1
        else:
            ET.SubElement(element, "system-out").text = f"PASS: {how}"
    det = d.get("determinism")
    if isinstance(det, dict) and verdict != "ERROR":
        # its own test case: the engine promised seeds; apart from the fidelity verdict
        element = case("determinism")
        _property(element.find("properties"), "checked", det.get("checked"))
        _property(element.find("properties"), "differing", det.get("differing"))
        if det.get("differing"):
            failure = ET.SubElement(element, "failure", type="Determinism", message=(
                f"{det.get('differing')} of {det.get('checked')} seeded rows gave other tokens when rerun in "
                "another batch order (not part of the fidelity verdict)")[:500])
            failure.text = "rows: " + ", ".join(f"job {r.get('job')} row {r.get('row')}" for r in det.get("rows") or ())
            counts["failures"] += 1
        else:
            ET.SubElement(element, "system-out").text = (
                f"{det.get('checked')} seeded rows rerun in another batch order gave the same tokens")
    failures = d.get("failures") or []
    if failures and verdict != "ERROR":
        ET.SubElement(suite, "system-err").text = "failed jobs (their arm's other jobs were kept):\n" + "\n".join(
            str(f) for f in failures)
    ET.SubElement(suite, "system-out").text = verdict_text
    suite.set("tests", str(len(suite.findall("testcase"))))
    suite.set("failures", str(counts["failures"]))
    suite.set("errors", str(counts["errors"]))
    suite.set("skipped", str(counts["skipped"]))
    suite.set("time", f"{total:.6f}")
    suites = ET.Element("testsuites", name="spectr-audit")
    suites.append(suite)
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


# Its public home is spectr_audit.reports.generation, which re-exports it: reprs, pickles and help
# name that module.
render_generation_junit.__module__ = "spectr_audit.reports.generation"
