"""The ``[[generation]]`` cases of suites: their tables validated, and run against what they expect.

The format is in :mod:`spectr_audit.run.generation`; ``spectr-audit generation --suite NAME``
runs :func:`run_generation_suite`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from spectr_audit.errors import InvalidArgument
from spectr_audit.run.generation_engines import _prune, _suggest, audit_engine, load_generation_engine
from spectr_audit.run.generation_verdict import verdict_line

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
    "run_generation_suite",
    "select_cases",
]


#: The audit's options a case may set.
AUDIT_KEYS = ("max_new_tokens", "batch_size", "rounds", "arms", "seed", "alpha", "power", "min_detectable_tv",
              "max_tokens", "max_seconds", "timeout", "greedy", "logit_tol")
TOY_KEYS = ("vocab_size", "toy_seed", "draft_noise", "temperature", "top_k", "top_p", "eos_token_id")
CASE_KEYS = ("name", "description", "engine", "expected", "options", "prompts", "reference",
             "requires") + TOY_KEYS + AUDIT_KEYS
EXPECTED = ("pass", "finding")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclasses.dataclass(frozen=True)
class GenerationCase:
    """One ``[[generation]]`` table: an engine spec, what its verdict should be, and the audit's options.

    Attributes
    ----------
    name, description, engine : str
    expected : str
        ``"pass"`` (PASS, or INCONCLUSIVE listed as such) or ``"finding"``.
    prompts : tuple of tuple of int, optional
    reference : bool or None
        Audit with the engine's reference generator (None: a factory's if it gives one; not the toy's).
    engine_options : dict
        The toy's keys (``vocab_size``, ``toy_seed``, ...) and a factory's ``options``.
    audit_options : dict
        Keyword arguments of :func:`~spectr_audit.generation.audit_generation`.
    base : str
        The folder of the suite file (a relative factory path is looked up there first).
    requires : tuple of str
        Modules the engine needs (``vllm``, ``transformers``); a case whose module is missing is
        skipped, and the suite report says so.
    """

    name: str
    engine: str
    expected: str = "pass"
    description: str = ""
    prompts: Optional[tuple] = None
    reference: Optional[bool] = None
    engine_options: dict = dataclasses.field(default_factory=dict, hash=False)
    audit_options: dict = dataclasses.field(default_factory=dict, hash=False)
    base: str = ""
    requires: tuple = ()

    def missing(self) -> list:
        """The modules of :attr:`requires` that are not installed."""
        import importlib.util

        out = []
        for module in self.requires:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                out.append(module)
        return out

    def to_dict(self) -> dict:
        return {"name": self.name, "engine": self.engine, "expected": self.expected, "description": self.description,
                "prompts": None if self.prompts is None else [list(p) for p in self.prompts],
                "reference": self.reference, "engine_options": dict(self.engine_options),
                "audit_options": dict(self.audit_options), "requires": list(self.requires)}


def _number(value: Any, where: str, key: str, low: float, high: float, low_open: bool, high_open: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise InvalidArgument(f"{where}: {key}: expected a number in {lo}{low:g}, {_hi_text(high)}{hi}, got {value!r}")
    return float(value)


def _hi_text(high: float) -> str:
    return "inf" if high == math.inf else f"{high:g}"


def _integer(value: Any, where: str, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(f"{where}: {key}: expected an integer >= {minimum}, got {value!r}")
    return value


def _check_case_value(key: str, value: Any, where: str) -> Any:
    from spectr_audit.generation.designs import ARMS

    if key in ("max_new_tokens", "batch_size", "rounds", "max_tokens"):
        return _integer(value, where, key, 1)
    if key in ("seed", "toy_seed", "top_k", "eos_token_id"):
        return _integer(value, where, key, 0)
    if key == "vocab_size":
        return _integer(value, where, key, 2)
    if key in ("alpha", "power", "min_detectable_tv"):
        return _number(value, where, key, 0, 1, True, True)
    if key in ("max_seconds", "timeout"):
        return _number(value, where, key, 0, math.inf, True, True)
    if key == "logit_tol":
        return _number(value, where, key, 0, math.inf, False, True)
    if key == "temperature":
        return _number(value, where, key, 0, math.inf, False, True)
    if key == "top_p":
        return _number(value, where, key, 0, 1, True, False)
    if key == "draft_noise":
        if value == "none":
            return None
        return _number(value, where, key, 0, math.inf, False, True)
    if key in ("greedy", "reference"):
        if not isinstance(value, bool):
            raise InvalidArgument(f"{where}: {key}: expected true or false, got {value!r}")
        return value
    if key == "arms":
        if not isinstance(value, list) or not value or any(a not in ARMS for a in value):
            raise InvalidArgument(f"{where}: arms: expected a non-empty list drawn from {list(ARMS)}, got {value!r}")
        return tuple(value)
    raise AssertionError(key)  # pragma: no cover - every key of CASE_KEYS is handled


def parse_generation_cases(raw: Any, source: str = "suite", base: Optional[Union[str, Path]] = None) -> tuple:
    """Validate the ``[[generation]]`` tables of a suite and build its :class:`GenerationCase` s.

    Errors name the source, the table (``generation[i] ('name')``) and the key.
    """
    from spectr_audit.generation.library import SLIPS

    if not isinstance(raw, list) or not raw or not all(isinstance(t, dict) for t in raw):
        raise InvalidArgument(f"{source}: generation: expected [[generation]] tables")
    cases, seen = [], set()
    for i, table in enumerate(raw):
        where = f"{source} generation[{i}]" + (f" ({table['name']!r})" if "name" in table else "")
        unknown = sorted(set(table) - set(CASE_KEYS))
        if unknown:
            raise InvalidArgument(f"{where}: unknown key(s) {unknown}{_suggest(unknown[0], CASE_KEYS)}; allowed: "
                                  f"{sorted(CASE_KEYS)}")
        name = table.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidArgument(f"{where}: name: expected letters, digits, '.', '_' or '-' (it names the case's "
                                  f"report folder), got {name!r}")
        if name in seen:
            raise InvalidArgument(f"{where}: name: duplicate case name {name!r}")
        seen.add(name)
        engine = table.get("engine")
        if not isinstance(engine, str) or not engine.strip():
            raise InvalidArgument(f"{where}: engine: expected 'toy', 'toy:SLIP', 'package.module:factory' or "
                                  f"'path/file.py:factory', got {engine!r}")
        engine = engine.strip()
        toy = engine == "toy" or engine.startswith("toy:")
        if toy and engine != "toy" and engine[4:] not in SLIPS:
            raise InvalidArgument(f"{where}: engine: no toy slip {engine[4:]!r}{_suggest(engine[4:], SLIPS)}; the "
                                  f"slips: {', '.join(SLIPS)}")
        if not toy and ":" not in engine:
            raise InvalidArgument(f"{where}: engine: {engine!r} is neither 'toy', 'toy:SLIP' nor an import string "
                                  "'package.module:factory' or 'path/file.py:factory'")
        expected = table.get("expected", "finding" if toy and engine != "toy" else "pass")
        if expected not in EXPECTED:
            raise InvalidArgument(f"{where}: expected: expected one of {list(EXPECTED)}, got {expected!r}")
        description = table.get("description", "")
        if not isinstance(description, str):
            raise InvalidArgument(f"{where}: description: expected a string, got {description!r}")
        prompts = table.get("prompts")
        if prompts is not None:
            if not isinstance(prompts, list) or not prompts or not all(
                    isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                      for t in p) for p in prompts):
                raise InvalidArgument(f"{where}: prompts: expected a non-empty list of non-empty token-id lists, got "
                                      f"{prompts!r:.80}")
            prompts = tuple(tuple(p) for p in prompts)
        engine_options = {}
        for key in TOY_KEYS:
            if key in table:
                if not toy and key not in ("vocab_size", "eos_token_id"):
                    raise InvalidArgument(f"{where}: {key}: only for a toy engine; a factory takes options = {{...}}")
                engine_options[key] = _check_case_value(key, table[key], where)
        if "options" in table:
            if toy:
                raise InvalidArgument(f"{where}: options: only for a factory engine; the toy takes "
                                      f"{', '.join(TOY_KEYS)}")
            if not isinstance(table["options"], dict):
                raise InvalidArgument(f"{where}: options: expected a table of the factory's keyword arguments")
            engine_options["options"] = dict(table["options"])
        audit_options = {key: _check_case_value(key, table[key], where) for key in AUDIT_KEYS if key in table}
        reference = _check_case_value("reference", table["reference"], where) if "reference" in table else None
        requires = table.get("requires", [])
        if isinstance(requires, str):
            requires = [requires]
        if not isinstance(requires, list) or not all(isinstance(m, str) and re.match(r"^[A-Za-z_][\w.]*$", m)
                                                     for m in requires):
            raise InvalidArgument(f"{where}: requires: expected a list of module names, e.g. [\"vllm\"], got "
                                  f"{requires!r}")
        cases.append(GenerationCase(name=name, engine=engine, expected=expected, description=description,
                                    prompts=prompts, reference=reference, engine_options=engine_options,
                                    audit_options=audit_options, base="" if base is None else str(base),
                                    requires=tuple(requires)))
    return tuple(cases)


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
        """130 incomplete, 1 a case not as expected, 3 only inconclusive ones with the flag, else 0."""
        if self.incomplete is not None:
            return 130
        if self.unexpected:
            return 1
        return 3 if fail_on_inconclusive and self.inconclusive else 0

    def to_dict(self) -> dict:
        from spectr_audit import __version__

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
                          resume=resume, **audit_options)
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


def run_generation_suite(suite: Any, *, store_dir: Optional[Union[str, Path]] = None, resume: bool = False,
                         on_result: Optional[Callable[[GenerationCaseResult], None]] = None,
                         on_start: Optional[Callable[[GenerationCase], None]] = None,
                         select: Optional[Sequence[str]] = None,
                         **overrides: Any) -> GenerationSuiteReport:
    """Run every ``[[generation]]`` case of ``suite`` (a name, a path or a :class:`~spectr_audit.run.suite.Suite`).

    ``store_dir``: a folder with one SQLite store per case (``<case>.sqlite``; ``resume=True``
    continues those that exist and starts the others).  ``overrides`` (``seed``, ``alpha``, ``max_tokens``, ``max_seconds``,
    ``timeout``, ``progress``) replace every case's own.  ``on_start(case)`` and
    ``on_result(case_result)`` are called around each case.  ``select``: shell-style patterns of
    the case names to run (default all).  A case whose ``requires`` lists a module that is not
    installed is skipped (the report's ``skipped``).

    Raises
    ------
    InvalidArgument
        A suite without ``[[generation]]`` cases, or a case whose engine cannot be resolved.
    GenerationSuiteInterrupted
        On Ctrl-C, carrying the finished cases.
    """
    from spectr_audit.generation import GenerationInterrupted
    from spectr_audit.run.suite import Suite, load_suite

    suite_obj = suite if isinstance(suite, Suite) else load_suite(suite)
    cases = tuple(getattr(suite_obj, "generation", ()))
    if not cases:
        raise InvalidArgument(f"suite: {suite_obj.name!r} has no [[generation]] cases (its [[case]] tables are "
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
            raise GenerationSuiteInterrupted(GenerationSuiteReport(suite_obj.name, tuple(results), len(cases),
                                                                   "interrupted (SIGINT)", skipped)) from None
        except KeyboardInterrupt:
            raise GenerationSuiteInterrupted(GenerationSuiteReport(suite_obj.name, tuple(results), len(cases),
                                                                   "interrupted (SIGINT)", skipped)) from None
        entry = GenerationCaseResult(case.name, case.engine, case.expected, result,
                                     getattr(engine.generate, "repro_spec", None),
                                     None if prompts is None else tuple(tuple(p) for p in prompts))
        results.append(entry)
        if on_result is not None:
            on_result(entry)
    return GenerationSuiteReport(suite_obj.name, tuple(results), len(cases), skipped=skipped)
