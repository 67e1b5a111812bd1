"""The ``[[generation]]`` cases of suites run against what they expect.

The format is in :mod:`spectr_audit.generation.checks`, the tables are validated by
:mod:`spectr_audit.generation.cases`; :func:`run_generation_cases` runs a suite's cases
(``spectr-audit generation --suite NAME`` and :func:`spectr_audit.run.generation_suite.run_generation_suite`
read the suite first).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from spectr_audit import __version__
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.engine_specs import _prune, _suggest, audit_engine, load_generation_engine
from spectr_audit.generation.cases import (  # noqa: F401 (re-exported)
    AUDIT_KEYS,
    CASE_KEYS,
    EXPECTED,
    TOY_KEYS,
    GenerationCase,
    parse_generation_cases,
)
from spectr_audit.generation.verdict import verdict_line
from spectr_audit.results import EXIT_ERROR

__all__ = [
    "AUDIT_KEYS",
    "CASE_KEYS",
    "EXPECTED",
    "GenerationCase",
    "GenerationCaseResult",
    "GenerationSuiteInterrupted",
    "GenerationSuiteReport",
    "TOY_KEYS",
    "parse_generation_cases",
    "run_generation_case",
    "run_generation_cases",
    "select_cases",
]


@dataclasses.dataclass(frozen=True)
class GenerationCaseResult:
    """A case's result against what it expected."""

    case: str
    engine: str
    expected: str
    result: Any
    #: The generator's ``repro_spec`` (engines that can write a standalone reproduction), and the prompts audited.
    repro_spec: Optional[dict] = None
    prompts: Optional[tuple] = None

    @property
    def as_expected(self) -> bool:
        """A ``finding`` case gave FINDING; a ``pass`` case PASS or INCONCLUSIVE; neither when incomplete."""
        if getattr(self.result, "incomplete", False):
            return False
        if self.expected == "finding":
            return self.result.verdict == "FINDING"
        return self.result.verdict in ("PASS", "INCONCLUSIVE")

    @property
    def inconclusive(self) -> bool:
        return self.expected == "pass" and self.result.verdict == "INCONCLUSIVE"

    def line(self) -> str:
        mark = "as expected" if self.as_expected else "NOT as expected"
        return f"{self.case}: {verdict_line(self.result)} (expected {self.expected}: {mark})"

    def to_dict(self) -> dict:
        return {"case": self.case, "engine": self.engine, "expected": self.expected, "as_expected": self.as_expected,
                "result": self.result.to_dict()}


@dataclasses.dataclass(frozen=True)
class GenerationSuiteReport:
    """The results of a suite's ``[[generation]]`` cases, in order; ``incomplete`` says why a run stopped early;
    ``skipped`` holds ``(case, reason)`` for the cases not run (a module they require is missing)."""

    suite: str
    results: tuple
    planned: int
    incomplete: Optional[str] = None
    skipped: tuple = ()

    @property
    def unexpected(self) -> list:
        return [r for r in self.results if not r.as_expected]

    @property
    def inconclusive(self) -> list:
        return [r for r in self.results if r.inconclusive]

    @property
    def passed(self) -> bool:
        return self.incomplete is None and not self.unexpected

    def exit_status(self, fail_on_inconclusive: bool = False) -> int:
        """130 incomplete, 1 a case not as expected (4 when every such case is an ERROR: its engine calls failed),
        3 only inconclusive ones with the flag, else 0."""
        if self.incomplete is not None:
            return 130
        if self.unexpected:
            return EXIT_ERROR if all(r.result.verdict == "ERROR" for r in self.unexpected) else 1
        return 3 if fail_on_inconclusive and self.inconclusive else 0

    def to_dict(self) -> dict:
        return {"spectr_audit_version": __version__, "kind": "generation-suite", "suite": self.suite,
                "passed": self.passed, "planned": self.planned, "completed": len(self.results),
                "incomplete": self.incomplete, "results": [r.to_dict() for r in self.results],
                "skipped": [{"case": case, "reason": reason} for case, reason in self.skipped]}


class GenerationSuiteInterrupted(KeyboardInterrupt):
    """Ctrl-C during a generation suite; ``report`` holds the finished cases (and the interrupted one's partial
    result), marked incomplete."""

    def __init__(self, report: GenerationSuiteReport):
        super().__init__(f"generation suite interrupted after {len(report.results)} of {report.planned} cases")
        self.report = report


def run_generation_case(case: GenerationCase, *, store: Optional[Union[str, Path]] = None, resume: bool = False,
                        with_engine: bool = False, **overrides: Any) -> Any:
    """Audit one case: its engine resolved, its options with ``overrides`` (None keeps the case's) on top.

    Returns the result, or ``(result, engine, prompts)`` with ``with_engine=True``.
    """
    where = f"generation case {case.name!r}"
    options = dict(case.engine_options)
    factory_options = options.pop("options", None)
    engine = load_generation_engine(case.engine, argument=f"{where}: engine", options=factory_options,
                                    base=case.base or None, **options)
    audit_options = {**case.audit_options, **_prune(overrides)}
    prompts = None if case.prompts is None else [list(p) for p in case.prompts]
    if prompts is None and engine.prompts is None:
        raise InvalidArgument(f"{where}: prompts: the engine {case.engine!r} gives none; add prompts = [[...], ...]")
    result = audit_engine(engine, prompts, reference=case.reference, store=None if store is None else str(store),
                          resume=resume, requests=None if case.requests is None else list(case.requests),
                          **audit_options)
    return (result, engine, prompts if prompts is not None else engine.prompts) if with_engine else result


def select_cases(cases: Sequence[GenerationCase], patterns: Optional[Sequence[str]]) -> tuple:
    """The cases whose name matches one of the shell-style ``patterns`` (all of them when None), in suite order.

    Raises
    ------
    InvalidArgument
        A pattern that matches no case.
    """
    import fnmatch

    if patterns is None:
        return tuple(cases)
    names = [c.name for c in cases]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise InvalidArgument(f"case: {pattern!r} matches no case{_suggest(pattern, names)}; the cases: "
                                  f"{', '.join(names)}")
    return tuple(c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in patterns))


def run_generation_cases(cases: Sequence[GenerationCase], *, suite: str = "suite",
                         store_dir: Optional[Union[str, Path]] = None, resume: bool = False,
                         on_result: Optional[Callable[[GenerationCaseResult], None]] = None,
                         on_start: Optional[Callable[[GenerationCase], None]] = None,
                         select: Optional[Sequence[str]] = None,
                         **overrides: Any) -> GenerationSuiteReport:
    """Run the ``[[generation]]`` cases of the suite named ``suite`` (read from its file by
    :func:`spectr_audit.run.generation_suite.run_generation_suite`, which takes a suite's name or path).

    ``store_dir``: a folder with one SQLite store per case (``<case>.sqlite``; ``resume=True``
    continues those that exist and starts the others).  ``overrides`` (``seed``, ``alpha``, ``max_tokens``, ``max_seconds``,
    ``timeout``, ``allow_failed_calls``, ``progress``) replace every case's own.  ``on_start(case)`` and
    ``on_result(case_result)`` are called around each case.  ``select``: shell-style patterns of
    the case names to run (default all).  A case whose ``requires`` lists a module that is not
    installed is skipped (the report's ``skipped``).

    Raises
    ------
    InvalidArgument
        No cases, or a case whose engine cannot be resolved.
    GenerationSuiteInterrupted
        On Ctrl-C, carrying the finished cases.
    """
    # here, not at the top: the generation audit imports torch, and importing the faces stays torch-free
    from spectr_audit.generation.audit import GenerationInterrupted

    cases = tuple(cases)
    if not cases:
        raise InvalidArgument(f"suite: {suite!r} has no [[generation]] cases (its [[case]] tables are "
                              "verifier cases: spectr-audit run --suite)")
    cases = select_cases(cases, select)
    skipped = tuple((c.name, f"needs {', '.join(c.missing())}: not installed") for c in cases if c.missing())
    cases = tuple(c for c in cases if not c.missing())
    if store_dir is not None:
        Path(store_dir).mkdir(parents=True, exist_ok=True)
    results: list = []
    for case in cases:
        if on_start is not None:
            on_start(case)
        store = None if store_dir is None else Path(store_dir) / f"{case.name}.sqlite"
        try:
            # resuming a suite: the cases it had not reached start afresh
            result, engine, prompts = run_generation_case(
                case, store=store, resume=resume and store is not None and store.exists(), with_engine=True,
                **overrides)
        except GenerationInterrupted as exc:
            if exc.result is not None:
                results.append(GenerationCaseResult(case.name, case.engine, case.expected, exc.result))
            raise GenerationSuiteInterrupted(GenerationSuiteReport(suite, tuple(results), len(cases),
                                                                   "interrupted (SIGINT)", skipped)) from None
        except KeyboardInterrupt:
            raise GenerationSuiteInterrupted(GenerationSuiteReport(suite, tuple(results), len(cases),
                                                                   "interrupted (SIGINT)", skipped)) from None
        entry = GenerationCaseResult(case.name, case.engine, case.expected, result,
                                     getattr(engine.generate, "repro_spec", None),
                                     None if prompts is None else tuple(tuple(p) for p in prompts))
        results.append(entry)
        if on_result is not None:
            on_result(entry)
    return GenerationSuiteReport(suite, tuple(results), len(cases), skipped=skipped)
