"""The pytest plugin: audit a verifier inside a test (registered through the ``pytest11`` entry point).

pytest loads this module on every run of every project that has spectr-audit installed, so
it is thin and lazy: it imports pytest, the standard library, :mod:`spectr_audit.run.gate` and
its own parts, as light (``spectr_audit.plugin_options``: the options and the session's settings;
``spectr_audit.plugin_report``: the terminal summary and the report files) only; torch, scipy and
cvxpy are imported by the fixture's methods when a test uses them.

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
held without their planned power, INCONCLUSIVE, fails its test).  Cases: ``--spectr-num-drafts K`` /
``spectr_audit_num_drafts`` and ``--spectr-draft-len L`` / ``spectr_audit_draft_len`` (``2``, ``1,2``,
``1-3``) narrow the checks that name no K / L and the suite audits to those values.

With pytest-xdist (``pytest -n N``) each worker sends its audits to the controller when it
finishes (``workeroutput``), so the terminal summary, the session gate and ``--spectr-report``
cover every worker's audits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import pytest

# pytest finds the plugin's hooks as attributes of this module (the entry point's), wherever they are defined.
from spectr_audit.plugin_options import GENERATION_RECORDS as _GENERATION_RECORDS
from spectr_audit.plugin_options import MARKER as _MARKER
from spectr_audit.plugin_options import RECORDS as _RECORDS
from spectr_audit.plugin_options import SETTINGS as _SETTINGS
from spectr_audit.plugin_options import GenerationRecord as _GenerationRecord
from spectr_audit.plugin_options import Record as _Record
from spectr_audit.plugin_options import Settings as _Settings
from spectr_audit.plugin_options import pytest_addoption, pytest_configure  # noqa: F401 (hooks)
from spectr_audit.plugin_report import pytest_sessionfinish, pytest_terminal_summary, pytest_testnodedown  # noqa: F401
from spectr_audit.run.gate import evaluate_gate

__all__ = ["SpectrAuditFixture", "SpectrGenerationFixture", "spectr_audit", "spectr_generation"]

#: Keyword arguments the marker (and the fixture's ``check``) accept.
_CHECK_KWARGS = ("num_drafts", "draft_len", "suite", "name", "output_probs", "draft_scheme", "tree", "params", "order",
                 "temperature", "top_k", "top_p", "min_p")
#: The sampling fields the marker and ``check`` may give one by one instead of ``params``.
_PARAM_FIELDS = ("temperature", "top_k", "top_p", "min_p")


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
        #: The K and L of the session (``--spectr-num-drafts`` / ``--spectr-draft-len``; ``None``: not narrowed)
        self.num_drafts = settings.num_drafts
        self.draft_len = settings.draft_len

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
        if merged.get("tree") is None:  # the session's K and L, where the test names none
            for key in ("num_drafts", "draft_len"):
                if merged.get(key) is None and getattr(self, key) is not None:
                    merged[key] = list(getattr(self, key))
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

    def audit(self, verifier: Any, suite: Any = "default", *, params: Any = None, order: Optional[str] = None,
              num_drafts: Any = None, draft_len: Any = None) -> Any:
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
        num_drafts, draft_len : int, list or str (``"1-3"``), optional
            Only the suite's cases of these K and L (default: the session's ``--spectr-num-drafts`` /
            ``--spectr-draft-len``, else every case; a plain function that declares none runs at K = 1,
            L = 1 where nothing is selected).

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
        num_drafts = num_drafts if num_drafts is not None else self.num_drafts
        draft_len = draft_len if draft_len is not None else self.draft_len
        report = run_suite(suite_obj, [load_verifier(v) for v in verifiers], self.options(), num_drafts=num_drafts,
                           draft_len=draft_len)
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
        from spectr_audit.generation.checks import failure_text

        result = self.audit(generate, score, prompts, **kwargs)
        strict = self.fail_on_inconclusive if fail_on_inconclusive is None else bool(fail_on_inconclusive)
        message = failure_text(result, strict)
        if message is not None:
            raise AssertionError(message)
        return result

    def _record(self, result: Any) -> None:
        from spectr_audit.generation.checks import verdict_line

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
