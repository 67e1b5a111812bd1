"""The pytest plugin: audit a verifier inside a test (registered through the ``pytest11`` entry point).

pytest loads this module on every run of every project that has spectr-audit installed, so
it is thin and lazy: it imports pytest, the standard library and :mod:`spectr_audit.run.gate`
only; torch, scipy and cvxpy are imported by the fixture's methods when a test uses them.

Use
---
The ``spectr_audit`` fixture::

    def test_my_verifier_is_lossless(spectr_audit):
        spectr_audit.check(my_verify, num_drafts=[1, 2], draft_len=1)

    def test_my_tree_verifier_is_lossless(spectr_audit):
        spectr_audit.check(my_verify_tree, tree="paths:[[0],[1],[0,0]]", draft_scheme="topk")

runs :func:`spectr_audit.run.conformance.check_verifier` (contract checks, then fidelity on a
standard small suite) with the session's seed, sample budget and alpha, applies the gate
thresholds, records every result, and fails the test with a message naming the case and the
worst cells.  ``spectr_audit.audit(verifier, suite="default")`` runs a whole suite and returns
the :class:`~spectr_audit.results.AuditReport` without asserting; ``spectr_audit.assert_passed``
asserts on it.

The ``spectr_generation`` fixture audits a whole generation engine (:mod:`spectr_audit.generation`)::

    def test_my_engine_generates_from_the_target(spectr_generation):
        spectr_generation(engine.generate, engine.score, prompts, vocab_size=engine.vocab_size,
                          max_new_tokens=32)

runs :func:`spectr_audit.check_generation` with the session's seed, alpha and
``--spectr-max-seconds`` (keyword arguments are the audit's options), records the result for
the terminal summary (and ``--spectr-report``: a ``<name>.generation.json`` beside it) and
fails the test on FINDING or ERROR, and on INCONCLUSIVE with ``--spectr-fail-on-inconclusive``;
``spectr_generation.audit(...)`` records without asserting.  ``spectr_audit.check_generation``
is the same call on the verifier fixture.

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
... and ``--spectr-gate EXPR`` / ``spectr_audit_gate`` (one expression per line).  Budgets and
certification: ``--spectr-max-samples N`` (the same as ``--spectr-samples``),
``--spectr-max-seconds S`` / ``spectr_audit_max_seconds``, ``--spectr-certify-tv EPS`` /
``spectr_audit_certify_tv`` (a check passes only when every case is CERTIFIED), and
``--spectr-fail-on-inconclusive`` / ``spectr_audit_fail_on_inconclusive`` (a check whose results
held without their planned power, INCONCLUSIVE, fails its test).

With pytest-xdist (``pytest -n N``) each worker sends its audits to the controller when it
finishes (``workeroutput``), so the terminal summary, the session gate and ``--spectr-report``
cover every worker's audits.
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

__all__ = ["SpectrAuditFixture", "SpectrGenerationFixture", "spectr_audit", "spectr_generation"]

_MARKER = "spectr_audit"
#: Keyword arguments the marker (and the fixture's ``check``) accept.
_CHECK_KWARGS = ("num_drafts", "draft_len", "suite", "name", "output_probs", "draft_scheme", "tree", "params", "order",
                 "temperature", "top_k", "top_p", "min_p")
#: The sampling fields the marker and ``check`` may give one by one instead of ``params``.
_PARAM_FIELDS = ("temperature", "top_k", "top_p", "min_p")


@dataclasses.dataclass(frozen=True)
class _Settings:
    seed: int = defaults.SEED
    num_samples: int = defaults.CHECK_SAMPLES
    alpha: float = defaults.ALPHA
    report: Optional[Path] = None
    thresholds: tuple = ()
    max_seconds: Optional[float] = None
    certify_tv: Optional[float] = None
    fail_on_inconclusive: bool = False


@dataclasses.dataclass
class _Record:
    nodeid: str
    result: Any
    gate_violations: tuple = ()


@dataclasses.dataclass
class _GenerationRecord:
    nodeid: str
    #: ``GenerationAuditResult.to_dict()`` (plain JSON: it crosses pytest-xdist's channel as it is)
    result: dict
    line: str


_SETTINGS = pytest.StashKey[_Settings]()
_RECORDS = pytest.StashKey[list]()
_GENERATION_RECORDS = pytest.StashKey[list]()
#: The key of a worker's records in pytest-xdist's ``workeroutput``.
_WORKER_KEY = "spectr_audit_records"
_WORKER_GENERATION_KEY = "spectr_audit_generation_records"


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


def _seconds(text: str, argument: str = "--spectr-max-seconds") -> Optional[float]:
    if text in ("", None):
        return None
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{argument}: expected a positive number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{argument}: expected a positive number of seconds, got {text!r}")
    return value


def _tolerance(text: str, argument: str = "--spectr-certify-tv") -> Optional[float]:
    if text in ("", None):
        return None
    return _alpha(text, argument)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("spectr-audit", "spectr-audit: audit speculative-decoding verifiers")
    group.addoption("--spectr-seed", dest="spectr_seed", type=_seed, default=None, metavar="N",
                    help=f"seed of every random draw in audits (ini: spectr_audit_seed; default {defaults.SEED})")
    group.addoption("--spectr-samples", "--spectr-max-samples", dest="spectr_samples", type=_samples, default=None,
                    metavar="N", help="sample budget of each statistical test (ini: spectr_audit_samples; "
                    f"default {defaults.CHECK_SAMPLES})")
    group.addoption("--spectr-max-seconds", dest="spectr_max_seconds", type=_seconds, default=None, metavar="S",
                    help="wall-time budget of each statistical audit's sampling (ini: spectr_audit_max_seconds)")
    group.addoption("--spectr-certify-tv", dest="spectr_certify_tv", type=_tolerance, default=None, metavar="EPS",
                    help="certify TV <= EPS on every case: a check passes only when every case is CERTIFIED "
                    "(ini: spectr_audit_certify_tv)")
    group.addoption("--spectr-fail-on-inconclusive", dest="spectr_fail_on_inconclusive", action="store_true",
                    default=None, help="fail a check whose results held only below their planned power "
                    "(INCONCLUSIVE) (ini: spectr_audit_fail_on_inconclusive)")
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
    parser.addini("spectr_audit_max_seconds", "spectr-audit: wall-time budget of each statistical audit", default="")
    parser.addini("spectr_audit_certify_tv", "spectr-audit: certify TV <= this on every case", default="")
    parser.addini("spectr_audit_fail_on_inconclusive", "spectr-audit: fail checks with INCONCLUSIVE results",
                  type="bool", default=False)


def _from_ini(config: pytest.Config, key: str, convert) -> Any:
    raw = config.getini(key)
    try:
        return convert(str(raw).strip(), key)
    except argparse.ArgumentTypeError as exc:
        raise pytest.UsageError(f"ini option {exc}") from None


def _writable_report(path: Path, source: str) -> Path:
    """The session report's path, or a usage error now (not a traceback after the whole session ran)."""
    import os

    if path.is_dir():
        raise pytest.UsageError(f"{source}: {str(path)!r} is a folder; give the path of the report file "
                                "(.json, .md, .html or .xml)")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise pytest.UsageError(f"{source}: {str(path)!r} lies under {str(parent)!r}, which is a file, "
                                        "not a folder")
            import tempfile

            try:  # a real probe: os.access says yes to root, and knows nothing of read-only file systems
                with tempfile.TemporaryFile(dir=parent):
                    pass
            except OSError as exc:
                raise pytest.UsageError(f"{source}: {str(path)!r} cannot be written: the folder {str(parent)!r} "
                                        f"does not take new files ({exc.strerror or exc})") from None
            break
    if path.exists() and not os.access(path, os.W_OK):
        raise pytest.UsageError(f"{source}: {str(path)!r} exists and is not writable")
    return path


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(verifier=None, *, num_drafts=..., draft_len=..., suite=..., name=..., output_probs=..., "
        "draft_scheme=..., tree=..., params=..., order=..., temperature=..., top_k=..., top_p=..., min_p=...): with a "
        "verifier, audit it after the test body (the test fails if the audit does); without, supply defaults to the "
        "spectr_audit fixture.",
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
        report = _writable_report(Path(option.spectr_report).resolve(), "--spectr-report")
    elif str(config.getini("spectr_audit_report")).strip():
        base = config.inipath.parent if config.inipath is not None else config.rootpath
        report = _writable_report((base / str(config.getini("spectr_audit_report")).strip()).resolve(),
                                  "ini option spectr_audit_report")
    thresholds = list(getattr(option, "spectr_gate", None) or [])
    for line in config.getini("spectr_audit_gate"):
        if line.strip():
            try:
                thresholds.append(parse_threshold(line, "spectr_audit_gate"))
            except ValueError as exc:
                raise pytest.UsageError(f"ini option {exc}") from None
    max_seconds = (option.spectr_max_seconds if getattr(option, "spectr_max_seconds", None) is not None
                   else _from_ini(config, "spectr_audit_max_seconds", _seconds))
    certify_tv = (option.spectr_certify_tv if getattr(option, "spectr_certify_tv", None) is not None
                  else _from_ini(config, "spectr_audit_certify_tv", _tolerance))
    fail_on_inconclusive = (bool(option.spectr_fail_on_inconclusive)
                            if getattr(option, "spectr_fail_on_inconclusive", None) is not None
                            else bool(config.getini("spectr_audit_fail_on_inconclusive")))
    config.stash[_SETTINGS] = _Settings(seed, samples, alpha, report, tuple(thresholds), max_seconds, certify_tv,
                                        fail_on_inconclusive)
    config.stash[_RECORDS] = []
    config.stash[_GENERATION_RECORDS] = []


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
        self.max_seconds = settings.max_seconds
        self.certify_tv = settings.certify_tv
        #: INCONCLUSIVE results fail the test (``--spectr-fail-on-inconclusive``, or certifying)
        self.fail_on_inconclusive = settings.fail_on_inconclusive or settings.certify_tv is not None

    def options(self) -> Any:
        """The :class:`~spectr_audit.run.runner.AuditOptions` of this session."""
        from spectr_audit.run.runner import AuditOptions

        return AuditOptions(seed=self.seed, alpha=self.alpha, max_samples=self.num_samples,
                            max_seconds=self.max_seconds, certify_tv=self.certify_tv)

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
            ``draft_scheme``, ``tree`` (check a tree verifier on that draft tree: a
            ``DraftTree``, a spec such as ``"cartesian:2,2"`` or a path list), ``params`` (a
            ``SamplingParams``: hold the verifier to the engine's sampler with them) or the
            fields ``temperature``, ``top_k``, ``top_p``, ``min_p`` one by one, and ``order``
            (the engine's processing order, default ``"vllm"``; docs/sampling.md); missing ones
            come from the test's ``spectr_audit`` marker.

        Returns
        -------
        ConformanceResult

        Raises
        ------
        ConformanceFailure
            (an ``AssertionError``) naming each failed check, its case and the worst cells,
            and every gate violation.
        """
        # A finding (an AssertionError) is shown from the test's line, not from the plugin's source.
        __tracebackhide__ = _hide_for_findings
        from spectr_audit.run.conformance import ConformanceFailure, check_verifier
        from spectr_audit.errors import InvalidArgument

        unknown = sorted(set(kwargs) - set(_CHECK_KWARGS))
        if unknown:
            raise InvalidArgument(f"{', '.join(unknown)}: unknown argument(s); expected some of {', '.join(_CHECK_KWARGS)}")
        merged = _with_params({**{k: v for k, v in self._defaults.items() if k != "verifier"}, **kwargs})
        verifier = verifier if verifier is not None else self._defaults.get("verifier")
        if verifier is None:
            raise InvalidArgument("verifier: no verifier given to spectr_audit.check and none on the marker")
        report = check_verifier(verifier, seed=self.seed, num_samples=self.num_samples, alpha=self.alpha,
                                max_seconds=self.max_seconds, certify_tv=self.certify_tv, raise_on_failure=False,
                                **merged)
        gate = self._record(report.audit)
        if not report.passed:
            raise ConformanceFailure(report)
        if gate.violations:
            raise AssertionError(f"spectr-audit {_violations_only(gate).message()}")
        if self.fail_on_inconclusive and report.inconclusive:
            raise AssertionError("spectr-audit: INCONCLUSIVE: " + _inconclusive_text(report.inconclusive))
        return report

    def check_generation(self, generate: Any, score: Any, prompts: Any, **kwargs: Any) -> Any:
        """Audit a generation engine and fail unless it passed: :class:`SpectrGenerationFixture` (the
        ``spectr_generation`` fixture) with this session's settings."""
        __tracebackhide__ = _hide_for_findings
        return _generation_fixture_for(self._node)(generate, score, prompts, **kwargs)

    def audit(self, verifier: Any, suite: Any = "default", *, params: Any = None, order: Optional[str] = None) -> Any:
        """Audit ``verifier`` on every case of ``suite`` it supports; record and return the report.

        Parameters
        ----------
        verifier : callable, Verifier, class, str, or a list of them
        suite : str or Suite
            A built-in suite name, a path to a suite ``.toml``, or a :class:`~spectr_audit.run.suite.Suite`.
        params : SamplingParams, optional
            Sampling parameters for every chain case (replacing the suite's own; docs/sampling.md).
        order : str, optional
            The engine's processing order of the parameters (default: each case's, ``"vllm"``).

        Returns
        -------
        AuditReport
            Not asserted on: use :meth:`assert_passed`.
        """
        from spectr_audit.registry import load_verifier
        from spectr_audit.run.runner import run_suite
        from spectr_audit.run.suite import Suite, load_suite, with_sampling

        suite_obj = suite if isinstance(suite, Suite) else load_suite(suite)
        if params is not None or order is not None:
            suite_obj = with_sampling(suite_obj, params, order)
        verifiers = verifier if isinstance(verifier, (list, tuple)) else [verifier]
        report = run_suite(suite_obj, [load_verifier(v) for v in verifiers], self.options())
        self._record(report)
        return report

    def assert_passed(self, report: Any) -> None:
        """Fail with a readable message unless every result went as declared and the gate held."""
        __tracebackhide__ = _hide_for_findings
        from spectr_audit.run.conformance import describe_result

        gate = evaluate_gate(report.results, self.thresholds)
        lines = []
        for result in report.results:
            if not result.as_expected:
                lines.extend(describe_result(result).splitlines())
        if gate.violations:
            lines.append(_violations_only(gate).message())
        if self.fail_on_inconclusive and report.inconclusive:
            lines.append("INCONCLUSIVE: " + _inconclusive_text(report.inconclusive))
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


class SpectrGenerationFixture:
    """What the ``spectr_generation`` fixture returns: generation audits with the session's settings, recorded.

    Call it as :func:`spectr_audit.check_generation`:
    ``spectr_generation(generate, score, prompts, vocab_size=..., **options)`` runs
    :func:`~spectr_audit.generation.audit_generation` (the session's ``seed``, ``alpha`` and
    ``--spectr-max-seconds`` unless given), records the result and fails the test on FINDING or
    ERROR, and on INCONCLUSIVE with ``--spectr-fail-on-inconclusive`` (or
    ``fail_on_inconclusive=True``).  Returns the :class:`~spectr_audit.generation.GenerationAuditResult`.

    Attributes
    ----------
    seed : int
    alpha : float
    max_seconds : float or None
    fail_on_inconclusive : bool
    """

    def __init__(self, node: Any, settings: _Settings, records: list):
        self._node = node
        self._records = records
        self.seed = settings.seed
        self.alpha = settings.alpha
        self.max_seconds = settings.max_seconds
        self.fail_on_inconclusive = settings.fail_on_inconclusive

    def _options(self, kwargs: dict) -> dict:
        options = dict(kwargs)
        options.setdefault("seed", self.seed)
        options.setdefault("alpha", self.alpha)
        if self.max_seconds is not None:
            options.setdefault("max_seconds", self.max_seconds)
        options.setdefault("progress", False)
        return options

    def audit(self, generate: Any, score: Any, prompts: Any, **kwargs: Any) -> Any:
        """Run the audit and record its result, without asserting (Ctrl-C records the finished jobs' result)."""
        from spectr_audit.generation import GenerationInterrupted, audit_generation

        try:
            result = audit_generation(generate, score, prompts, **self._options(kwargs))
        except GenerationInterrupted as exc:
            if exc.result is not None:
                self._record(exc.result)
            raise
        self._record(result)
        return result

    def __call__(self, generate: Any, score: Any, prompts: Any, *, fail_on_inconclusive: Optional[bool] = None,
                 **kwargs: Any) -> Any:
        __tracebackhide__ = _hide_for_findings
        from spectr_audit.run.generation import failure_text

        result = self.audit(generate, score, prompts, **kwargs)
        strict = self.fail_on_inconclusive if fail_on_inconclusive is None else bool(fail_on_inconclusive)
        message = failure_text(result, strict)
        if message is not None:
            raise AssertionError(message)
        return result

    def _record(self, result: Any) -> None:
        from spectr_audit.run.generation import verdict_line

        self._records.append(_GenerationRecord(self._node.nodeid, result.to_dict(), verdict_line(result)))
        prefix = f"spectr_generation.{result.generator}"
        self._node.user_properties.append((f"{prefix}.verdict", result.verdict))
        for key in ("pvalue", "num_tokens", "min_detectable_tv", "tv_lower"):
            value = getattr(result, key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self._node.user_properties.append((f"{prefix}.{key}", value))


def _generation_fixture_for(node: Any) -> SpectrGenerationFixture:
    config = node.config
    return SpectrGenerationFixture(node, config.stash[_SETTINGS], config.stash.setdefault(_GENERATION_RECORDS, []))


def _with_params(kwargs: dict) -> dict:
    """``check``'s arguments with the sampling fields (``temperature=...``) folded into ``params``."""
    fields = {key: kwargs.pop(key) for key in _PARAM_FIELDS if key in kwargs}
    if not fields:
        return kwargs
    from spectr_audit.contract.sampling import SamplingParams
    from spectr_audit.errors import InvalidArgument

    if kwargs.get("params") is not None:
        raise InvalidArgument(f"params, {', '.join(fields)}: give the sampling parameters one way, not both")
    return {**kwargs, "params": SamplingParams(**fields)}


def _hide_for_findings(excinfo: Any) -> bool:
    """``__tracebackhide__`` filter of the plugin's frames: hidden for an audit's finding (an
    ``AssertionError``, whose message says everything), shown for anything else (a bug to debug)."""
    return excinfo.errisinstance(AssertionError)


def _inconclusive_text(results: Any) -> str:
    """Which results were inconclusive, and why (their inconclusive checks' details)."""
    return "; ".join(f"{r.verifier} on {r.case}: " + " / ".join(c.detail for c in r.checks if c.inconclusive)
                     for r in results)


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


@pytest.fixture
def spectr_generation(request: pytest.FixtureRequest) -> SpectrGenerationFixture:
    """Audit a generation engine inside a test: ``spectr_generation(generate, score, prompts, vocab_size=...)``.

    See :class:`SpectrGenerationFixture`; results are listed in the terminal summary and recorded
    as JUnit properties.
    """
    return _generation_fixture_for(request.node)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    __tracebackhide__ = _hide_for_findings
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


def _numbers(m: dict) -> str:
    """A result's numbers: the exact TV, or the sampled TV estimate with its interval and the power reached."""
    if m.get("tv_estimate") is not None or m.get("tv_upper") is not None:
        tv = (f"tv>={_fmt(m.get('tv_lower'))} (est {_fmt(m.get('tv_estimate'))}, <={_fmt(m.get('tv_upper'))}) "
              f"mdtv={_fmt(m.get('min_detectable_tv'))}/{_fmt(m.get('requested_tv'))}")
    else:
        tv = f"tv={_fmt(m.get('tv_distance'))}"
    acceptance = _fmt(m.get("acceptance"))
    ratio = _fmt(m.get("acceptance_ratio"))
    ci = m.get("acceptance_ci")
    if not (isinstance(ci, (list, tuple)) and len(ci) == 2) and "acceptance_ci_low" in m:
        ci = (m.get("acceptance_ci_low"), m.get("acceptance_ci_high"))
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(_fmt(v) != "-" for v in ci):
        # a sampled acceptance: its interval, and the ratio's (a sampled ratio above 1 may be noise)
        acceptance += f" [{_fmt(ci[0])}, {_fmt(ci[1])}]"
        optimum = m.get("optimal_acceptance")
        if ratio != "-" and _fmt(optimum) != "-" and optimum > 0:
            ratio += f" [{_fmt(ci[0] / optimum)}, {_fmt(ci[1] / optimum)}]"
    pvalue = f"p={_fmt(m.get('pvalue'))}"
    if _fmt(m.get("pvalue")) != "-" and _fmt(m.get("alpha")) != "-":
        pvalue += f" (alpha {_fmt(m.get('alpha'))})"
    drawn = f" n={m['num_samples']}" if _fmt(m.get("num_samples")) != "-" else ""
    return (f"{tv} {pvalue}{drawn} acc={acceptance} acc/alpha*={ratio} "
            f"block_eff={_fmt(m.get('block_efficiency'))}")


def _session_header(settings: _Settings, results: list) -> list:
    """The summary's first lines: the settings, with the samples the audits drew and the levels they ran at."""
    gate = ", ".join(str(t) for t in settings.thresholds) or "none"
    budget = "" if settings.max_seconds is None else f", max {settings.max_seconds:g} s of sampling per audit"
    certify = "" if settings.certify_tv is None else f", certify TV <= {settings.certify_tv:g}"
    drawn = sorted({int(r.metrics["num_samples"]) for r in results if _fmt(r.metrics.get("num_samples")) != "-"})
    drawn_text = "" if not drawn else (
        f"; drawn: {drawn[0]}" if len(drawn) == 1 else f"; drawn: {drawn[0]} to {drawn[-1]}") + " per audit (n= below)"
    levels = sorted({float(r.metrics["alpha"]) for r in results if _fmt(r.metrics.get("alpha")) != "-"})
    alpha_text = f"alpha {settings.alpha:g} per check"
    if levels and any(not math.isclose(level, settings.alpha) for level in levels):
        alpha_text += (", split over the check's statistical tests (Bonferroni): each audit ran at "
                       + " or ".join(f"{level:g} = {settings.alpha:g} / {round(settings.alpha / level)}"
                                     for level in levels))
    return [f"seed {settings.seed}{certify}, gate: {gate}",
            f"samples: at most {settings.num_samples} per statistical audit's main design, each drawing what its "
            f"power plan needs up to that (a stratified design adds as many){budget}{drawn_text}",
            alpha_text]


def _markup(verdict: str, settings: _Settings) -> dict:
    if verdict in ("ERROR", "FINDING", "GATE"):
        return {"red": True}
    if verdict == "INCONCLUSIVE":
        return {"red": True} if settings.fail_on_inconclusive or settings.certify_tv is not None else {"yellow": True}
    return {"green": True}


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.3g}"


def _generation_summary(terminalreporter: Any, settings: _Settings, records: list) -> None:
    """The generation audits' lines: verdict, engine, deciding test, p-value, tokens, power, TV bound."""
    terminalreporter.write_line(f"generation audits (seed {settings.seed} unless a test set its own):")
    counts: dict = {}
    for record in records:
        r = record.result
        verdict = r["verdict"] + ("/INCOMPLETE" if r.get("incomplete") else "")
        counts[verdict] = counts.get(verdict, 0) + 1
        terminalreporter.write_line(
            f"{verdict:<12} {r['generator']} against {r['scorer']}: test {r['test']!r} p={_fmt(r.get('pvalue'))} "
            f"(alpha {_fmt(r.get('alpha'))}) n={r.get('num_tokens')} tokens mdtv={_fmt(r.get('min_detectable_tv'))}/"
            f"{_fmt(r.get('requested_tv'))} tv>={_fmt(r.get('tv_lower'))}  [{record.nodeid}]",
            **_markup("ERROR" if r.get("incomplete") else r["verdict"], settings))
    terminalreporter.write_line("generation verdicts: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    records = config.stash.get(_RECORDS, [])
    generation = config.stash.get(_GENERATION_RECORDS, [])
    if not records and not generation:
        return
    settings = config.stash[_SETTINGS]
    terminalreporter.section("spectr-audit")
    if not records:
        _generation_summary(terminalreporter, settings, generation)
        if settings.report is not None:
            terminalreporter.write_line(f"spectr-audit generation report: {_generation_report_path(settings.report)}")
        return
    for line in _session_header(settings, [r.result for r in records]):
        terminalreporter.write_line(line)
    counts: dict = {}
    for record in records:
        result = record.result
        if result.error is not None:
            verdict = "ERROR"
        elif not result.as_expected:
            verdict = "FINDING"
        elif record.gate_violations:
            verdict = "GATE"
        elif result.inconclusive:
            verdict = "INCONCLUSIVE"
        elif result.verdict == "CERTIFIED":
            verdict = "CERTIFIED"
        else:
            verdict = "exact" if result.passed else "inexact (declared)"
        counts[verdict] = counts.get(verdict, 0) + 1
        terminalreporter.write_line(
            f"{verdict:<12} {result.verifier} on {result.case}: {_numbers(result.metrics)}  [{record.nodeid}]",
            **_markup(verdict, settings))
    terminalreporter.write_line("verdicts: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
    gate = _session_gate(config)
    if gate is not None and gate.unmeasured:
        for threshold in gate.unmeasured:
            terminalreporter.write_line(
                f"GATE     {threshold.source or threshold}: no audit of this session measured {threshold.metric!r}, "
                "so the threshold checked nothing (the session fails)", red=True)
    if generation:
        _generation_summary(terminalreporter, settings, generation)
    if settings.report is not None:
        terminalreporter.write_line(f"spectr-audit report: {settings.report}")
        if generation:
            terminalreporter.write_line(f"spectr-audit generation report: {_generation_report_path(settings.report)}")


def _generation_report_path(report: Path) -> Path:
    """Where the session's generation audits go: ``<report stem>.generation.json`` beside ``--spectr-report``."""
    return report.with_name(f"{report.stem}.generation.json")


def _session_gate(config: pytest.Config) -> Any:
    settings = config.stash.get(_SETTINGS, None)
    records = config.stash.get(_RECORDS, [])
    if settings is None or not settings.thresholds or not records:
        return None
    return evaluate_gate([r.result for r in records], settings.thresholds)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist, on the controller: collect a finished worker's audits."""
    config = node.config
    settings = config.stash.get(_SETTINGS, None)
    output = getattr(node, "workeroutput", None) or {}
    sent = output.get(_WORKER_KEY)
    if settings is not None:
        config.stash.setdefault(_GENERATION_RECORDS, []).extend(
            _GenerationRecord(item["nodeid"], item["result"], item["line"]) for item in output.get(_WORKER_GENERATION_KEY)
            or [])
    if settings is None or not sent:
        return
    from spectr_audit.results import AuditResult

    records = config.stash.setdefault(_RECORDS, [])
    for item in sent:
        result = AuditResult.from_dict(item["result"])
        violations = tuple(evaluate_gate([result], settings.thresholds).violations) if settings.thresholds else ()
        records.append(_Record(item["nodeid"], result, violations))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    settings = config.stash.get(_SETTINGS, None)
    records = config.stash.get(_RECORDS, [])
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        # An xdist worker: the controller prints the summary, runs the session gate and writes the report.
        workeroutput[_WORKER_KEY] = [{"nodeid": r.nodeid, "result": r.result.to_dict()} for r in records]
        workeroutput[_WORKER_GENERATION_KEY] = [dataclasses.asdict(r) for r in config.stash.get(_GENERATION_RECORDS, [])]
        return
    generation = config.stash.get(_GENERATION_RECORDS, [])
    if settings is not None and settings.report is not None and generation:
        import json

        from spectr_audit import __version__
        from spectr_audit._files import write_text_atomic

        data = {"spectr_audit_version": __version__, "kind": "generation-audits", "seed": settings.seed,
                "results": [{"nodeid": r.nodeid, "line": r.line, **r.result} for r in generation]}
        write_text_atomic(_generation_report_path(settings.report), json.dumps(data, indent=2) + "\n")
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
