"""The pytest plugin: audit a verifier inside a test (registered through the ``pytest11`` entry point).

pytest loads this module on every run of every project that has spectr-audit installed, so
it is thin and lazy: it imports pytest, the standard library and :mod:`spectr_audit.run.gate`
only; torch, scipy and cvxpy are imported by the fixture's methods when a test uses them.

Use
---
The ``spectr_audit`` fixture::

    def test_my_verifier_is_lossless(spectr_audit):
        spectr_audit.check(my_verify, num_drafts=[1, 2], draft_len=1)

runs :func:`spectr_audit.run.conformance.check_verifier` (contract checks, then fidelity on a
standard small suite) with the session's seed, sample budget and alpha, applies the gate
thresholds, records every result, and fails the test with a message naming the case and the
worst cells.  ``spectr_audit.audit(verifier, suite="default")`` runs a whole suite and returns
the :class:`~spectr_audit.results.AuditReport` without asserting; ``spectr_audit.assert_passed``
asserts on it.

The ``spectr_audit`` marker either supplies defaults to the fixture
(``@pytest.mark.spectr_audit(num_drafts=2)``) or, given a verifier, audits it after the test
body (``@pytest.mark.spectr_audit(verifier=my_verify, num_drafts=2)``): the test fails if the
check does.  Pass the verifier by keyword: pytest takes a lone positional function or class for
the decorated object.

Options (command line, then ini key, then default): ``--spectr-seed`` /
``spectr_audit_seed`` (0), ``--spectr-samples`` / ``spectr_audit_samples`` (20000),
``--spectr-alpha`` / ``spectr_audit_alpha`` (0.001), ``--spectr-report PATH`` /
``spectr_audit_report`` (``.json``, ``.md``, ``.html`` or ``.xml`` by suffix), and the gate:
``--spectr-max-tv X``, ``--spectr-min-pvalue X``, ``--spectr-fail-under-acceptance-ratio X``,
... and ``--spectr-gate EXPR`` / ``spectr_audit_gate`` (one expression per line).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any, Optional

import pytest

from spectr_audit import defaults
from spectr_audit.run.gate import add_gate_arguments, evaluate_gate, parse_threshold

__all__ = ["SpectrAuditFixture", "spectr_audit"]

_MARKER = "spectr_audit"
#: Keyword arguments the marker (and the fixture's ``check``) accept.
_CHECK_KWARGS = ("num_drafts", "draft_len", "suite", "name", "output_probs", "draft_scheme")


@dataclasses.dataclass(frozen=True)
class _Settings:
    seed: int = defaults.SEED
    num_samples: int = defaults.CHECK_SAMPLES
    alpha: float = defaults.ALPHA
    report: Optional[Path] = None
    thresholds: tuple = ()


@dataclasses.dataclass
class _Record:
    nodeid: str
    result: Any
    gate_violations: tuple = ()


_SETTINGS = pytest.StashKey[_Settings]()
_RECORDS = pytest.StashKey[list]()


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------


def _int(text: str, argument: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{argument}: expected an integer, got {text!r}") from None


def _seed(text: str, argument: str = "--spectr-seed") -> int:
    value = _int(text, argument)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{argument}: expected an integer >= 0, got {text!r}")
    return value


def _samples(text: str, argument: str = "--spectr-samples") -> int:
    value = _int(text, argument)
    if value < 100:
        raise argparse.ArgumentTypeError(f"{argument}: expected an integer >= 100, got {text!r}")
    return value


def _alpha(text: str, argument: str = "--spectr-alpha") -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{argument}: expected a number in (0, 1), got {text!r}") from None
    if not (math.isfinite(value) and 0 < value < 1):
        raise argparse.ArgumentTypeError(f"{argument}: expected a number in (0, 1), got {text!r}")
    return value


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("spectr-audit", "spectr-audit: audit speculative-decoding verifiers")
    group.addoption("--spectr-seed", dest="spectr_seed", type=_seed, default=None, metavar="N",
                    help=f"seed of every random draw in audits (ini: spectr_audit_seed; default {defaults.SEED})")
    group.addoption("--spectr-samples", dest="spectr_samples", type=_samples, default=None, metavar="N",
                    help="sample budget of each statistical test (ini: spectr_audit_samples; "
                    f"default {defaults.CHECK_SAMPLES})")
    group.addoption("--spectr-alpha", dest="spectr_alpha", type=_alpha, default=None, metavar="ALPHA",
                    help=f"false-alarm rate of each check (ini: spectr_audit_alpha; default {defaults.ALPHA:g})")
    group.addoption("--spectr-report", dest="spectr_report", default=None, metavar="PATH",
                    help="write every audit of the session to PATH: .json, .md, .html or .xml (JUnit) "
                    "(ini: spectr_audit_report)")
    add_gate_arguments(group.addoption, prefix="--spectr-", dest="spectr_gate")
    parser.addini("spectr_audit_seed", f"spectr-audit: seed of every random draw (default {defaults.SEED})",
                  default=str(defaults.SEED))
    parser.addini("spectr_audit_samples", "spectr-audit: sample budget of each statistical test",
                  default=str(defaults.CHECK_SAMPLES))
    parser.addini("spectr_audit_alpha", "spectr-audit: false-alarm rate of each check", default=repr(defaults.ALPHA))
    parser.addini("spectr_audit_report", "spectr-audit: path of the session report (.json/.md/.html/.xml)",
                  default="")
    parser.addini("spectr_audit_gate", "spectr-audit: gate thresholds 'METRIC OP NUMBER', one per line",
                  type="linelist", default=[])


def _from_ini(config: pytest.Config, key: str, convert) -> Any:
    raw = config.getini(key)
    try:
        return convert(str(raw).strip(), key)
    except argparse.ArgumentTypeError as exc:
        raise pytest.UsageError(f"ini option {exc}") from None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(verifier=None, *, num_drafts=..., draft_len=..., suite=..., name=..., output_probs=..., "
        "draft_scheme=...): with a verifier, audit it after the test body (the test fails if the audit does); "
        "without, supply defaults to the spectr_audit fixture.",
    )
    option = config.option
    seed = option.spectr_seed if getattr(option, "spectr_seed", None) is not None else _from_ini(
        config, "spectr_audit_seed", _seed)
    samples = option.spectr_samples if getattr(option, "spectr_samples", None) is not None else _from_ini(
        config, "spectr_audit_samples", _samples)
    alpha = option.spectr_alpha if getattr(option, "spectr_alpha", None) is not None else _from_ini(
        config, "spectr_audit_alpha", _alpha)
    report: Optional[Path] = None
    if getattr(option, "spectr_report", None):
        report = Path(option.spectr_report).resolve()
    elif str(config.getini("spectr_audit_report")).strip():
        base = config.inipath.parent if config.inipath is not None else config.rootpath
        report = (base / str(config.getini("spectr_audit_report")).strip()).resolve()
    thresholds = list(getattr(option, "spectr_gate", None) or [])
    for line in config.getini("spectr_audit_gate"):
        if line.strip():
            try:
                thresholds.append(parse_threshold(line, "spectr_audit_gate"))
            except ValueError as exc:
                raise pytest.UsageError(f"ini option {exc}") from None
    config.stash[_SETTINGS] = _Settings(seed, samples, alpha, report, tuple(thresholds))
    config.stash[_RECORDS] = []


# ---------------------------------------------------------------------------------------------
# The fixture
# ---------------------------------------------------------------------------------------------


class SpectrAuditFixture:
    """What the ``spectr_audit`` fixture returns: audits with the session's settings, recorded.

    Attributes
    ----------
    seed : int
    num_samples : int
    alpha : float
    thresholds : tuple of Threshold
        The gate; every audit's results must satisfy it.
    """

    def __init__(self, node: Any, settings: _Settings, records: list, defaults: dict):
        self._node = node
        self._records = records
        self._defaults = defaults
        self.seed = settings.seed
        self.num_samples = settings.num_samples
        self.alpha = settings.alpha
        self.thresholds: tuple = settings.thresholds

    def options(self) -> Any:
        """The :class:`~spectr_audit.run.runner.AuditOptions` of this session."""
        from spectr_audit.run.runner import AuditOptions

        return AuditOptions(seed=self.seed, alpha=self.alpha, max_samples=self.num_samples)

    def generator(self) -> Any:
        """A ``torch.Generator`` seeded with the session's seed (for the test's own draws)."""
        import torch

        return torch.Generator().manual_seed(self.seed)

    def check(self, verifier: Any = None, **kwargs: Any) -> Any:
        """Run :func:`~spectr_audit.run.conformance.check_verifier` and the gate; fail on any finding.

        Parameters
        ----------
        verifier : callable, Verifier, class or str
            Defaults to the marker's verifier.
        **kwargs
            ``num_drafts``, ``draft_len``, ``suite``, ``name``, ``output_probs``,
            ``draft_scheme``; missing ones come from the test's ``spectr_audit`` marker.

        Returns
        -------
        ConformanceResult

        Raises
        ------
        ConformanceFailure
            (an ``AssertionError``) naming each failed check, its case and the worst cells,
            and every gate violation.
        """
        from spectr_audit.run.conformance import ConformanceFailure, check_verifier
        from spectr_audit.errors import InvalidArgument

        unknown = sorted(set(kwargs) - set(_CHECK_KWARGS))
        if unknown:
            raise InvalidArgument(f"{', '.join(unknown)}: unknown argument(s); expected some of {', '.join(_CHECK_KWARGS)}")
        merged = {**{k: v for k, v in self._defaults.items() if k != "verifier"}, **kwargs}
        verifier = verifier if verifier is not None else self._defaults.get("verifier")
        if verifier is None:
            raise InvalidArgument("verifier: no verifier given to spectr_audit.check and none on the marker")
        report = check_verifier(verifier, seed=self.seed, num_samples=self.num_samples, alpha=self.alpha,
                                raise_on_failure=False, **merged)
        gate = self._record(report.audit)
        if not report.passed:
            raise ConformanceFailure(report)
        if gate.violations:
            raise AssertionError(f"spectr-audit {_violations_only(gate).message()}")
        return report

    def audit(self, verifier: Any, suite: Any = "default") -> Any:
        """Audit ``verifier`` on every case of ``suite`` it supports; record and return the report.

        Parameters
        ----------
        verifier : callable, Verifier, class, str, or a list of them
        suite : str or Suite
            A built-in suite name, a path to a suite ``.toml``, or a :class:`~spectr_audit.run.suite.Suite`.

        Returns
        -------
        AuditReport
            Not asserted on: use :meth:`assert_passed`.
        """
        from spectr_audit.registry import load_verifier
        from spectr_audit.run.runner import run_suite
        from spectr_audit.run.suite import Suite, load_suite

        suite_obj = suite if isinstance(suite, Suite) else load_suite(suite)
        verifiers = verifier if isinstance(verifier, (list, tuple)) else [verifier]
        report = run_suite(suite_obj, [load_verifier(v) for v in verifiers], self.options())
        self._record(report)
        return report

    def assert_passed(self, report: Any) -> None:
        """Fail with a readable message unless every result went as declared and the gate held."""
        from spectr_audit.run.conformance import describe_result

        gate = evaluate_gate(report.results, self.thresholds)
        lines = []
        for result in report.results:
            if not result.as_expected:
                lines.extend(describe_result(result).splitlines())
        if gate.violations:
            lines.append(_violations_only(gate).message())
        if lines:
            raise AssertionError(f"spectr-audit: {report.suite}: " + "\n".join(lines))

    def _record(self, report: Any) -> Any:
        gate = evaluate_gate(report.results, self.thresholds)
        for result in report.results:
            violations = tuple(v for v in gate.violations if (v.verifier, v.case) == (result.verifier, result.case))
            self._records.append(_Record(self._node.nodeid, result, violations))
            prefix = f"spectr_audit.{result.verifier}.{result.case}"
            self._node.user_properties.append((f"{prefix}.passed", result.passed))
            for key, value in result.metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._node.user_properties.append((f"{prefix}.{key}", value))
        return gate


def _violations_only(gate: Any) -> Any:
    """The gate as one test sees it: a threshold one audit did not measure is judged per session."""
    return dataclasses.replace(gate, unmeasured=())


def _marker_defaults(node: Any) -> dict:
    from spectr_audit.errors import InvalidArgument

    marker = node.get_closest_marker(_MARKER)
    if marker is None:
        return {}
    where = f"@pytest.mark.{_MARKER} on {node.nodeid}"
    if len(marker.args) > 1:
        raise InvalidArgument(f"{where}: takes at most one positional argument (the verifier), got {len(marker.args)}")
    defaults = dict(marker.kwargs)
    if marker.args:
        if "verifier" in defaults:
            raise InvalidArgument(f"{where}: verifier given twice")
        defaults["verifier"] = marker.args[0]
    unknown = sorted(set(defaults) - set(_CHECK_KWARGS) - {"verifier"})
    if unknown:
        raise InvalidArgument(f"{where}: unknown argument(s) {', '.join(unknown)}; "
                              f"expected verifier, {', '.join(_CHECK_KWARGS)}")
    return defaults


def _fixture_for(node: Any) -> SpectrAuditFixture:
    config = node.config
    return SpectrAuditFixture(node, config.stash[_SETTINGS], config.stash[_RECORDS], _marker_defaults(node))


@pytest.fixture
def spectr_audit(request: pytest.FixtureRequest) -> SpectrAuditFixture:
    """Audit verifiers inside a test with the session's seed, sample budget, alpha and gate.

    See :class:`SpectrAuditFixture`; results are listed in the terminal summary, recorded as
    JUnit properties and written to ``--spectr-report``.
    """
    return _fixture_for(request.node)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    outcome = yield
    if outcome.excinfo is not None or item.get_closest_marker(_MARKER) is None:
        return
    try:
        if _marker_defaults(item).get("verifier") is not None:
            _fixture_for(item).check()
    except Exception as exc:  # the audit's failure is the test's failure
        outcome.force_exception(exc)


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.3g}"


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    records = config.stash.get(_RECORDS, [])
    if not records:
        return
    settings = config.stash[_SETTINGS]
    terminalreporter.section("spectr-audit")
    gate = ", ".join(str(t) for t in settings.thresholds) or "none"
    terminalreporter.write_line(
        f"seed {settings.seed}, samples {settings.num_samples}, alpha {settings.alpha:g}, gate: {gate}")
    for record in records:
        result = record.result
        if result.error is not None:
            verdict = "ERROR"
        elif not result.as_expected:
            verdict = "FINDING"
        elif record.gate_violations:
            verdict = "GATE"
        else:
            verdict = "exact" if result.passed else "inexact (declared)"
        m = result.metrics
        numbers = (f"tv={_fmt(m.get('tv_distance'))} p={_fmt(m.get('pvalue'))} "
                   f"acc/alpha*={_fmt(m.get('acceptance_ratio'))} block_eff={_fmt(m.get('block_efficiency'))}")
        markup = {"red": True} if verdict in ("ERROR", "FINDING", "GATE") else {"green": True}
        terminalreporter.write_line(
            f"{verdict:<8} {result.verifier} on {result.case}: {numbers}  [{record.nodeid}]", **markup)
    gate = _session_gate(config)
    if gate is not None and gate.unmeasured:
        for threshold in gate.unmeasured:
            terminalreporter.write_line(
                f"GATE     {threshold.source or threshold}: no audit of this session measured {threshold.metric!r}, "
                "so the threshold checked nothing (the session fails)", red=True)
    if settings.report is not None:
        terminalreporter.write_line(f"spectr-audit report: {settings.report}")


def _session_gate(config: pytest.Config) -> Any:
    settings = config.stash.get(_SETTINGS, None)
    records = config.stash.get(_RECORDS, [])
    if settings is None or not settings.thresholds or not records:
        return None
    return evaluate_gate([r.result for r in records], settings.thresholds)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    settings = config.stash.get(_SETTINGS, None)
    records = config.stash.get(_RECORDS, [])
    gate = _session_gate(config)
    if gate is not None and gate.unmeasured and session.exitstatus == pytest.ExitCode.OK:
        # Like coverage's --fail-under: a gate that checked nothing must not pass silently.
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if settings is None or settings.report is None or not records:
        return
    from spectr_audit.results import AuditReport

    report = AuditReport(results=tuple(r.result for r in records), suite="pytest",
                         meta={"seed": settings.seed, "num_audits": len(records),
                               **({"gate": gate.to_dict()} if gate is not None else {})})
    path = settings.report
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix.lower()
    if suffix in (".html", ".htm"):
        from spectr_audit.reports.html import write_html

        write_html(report, path, gate)
    elif suffix == ".md":
        from spectr_audit.reports.markdown import write_markdown

        write_markdown(report, path)
    elif suffix == ".xml":
        from spectr_audit.reports.junit import write_junit

        write_junit(report, path, gate)
    else:
        from spectr_audit.reports.json_report import write_json

        write_json(report, path)
