"""Result objects: frozen dataclasses that report numbers.  Only the report decides.

JSON contract (stable; CI users parse it)::

    {
      "passed": bool,              # every result's verdict matches its declaration
      "suite": str,
      "spectr_audit_version": str,
      "results": [
        {
          "verifier": str,
          "case": str,
          "passed": bool,          # all of this result's checks hold (false on error)
          "verdict": str,          # "exact", "CERTIFIED", "INCONCLUSIVE", "FINDING" or "ERROR"
          "inconclusive": bool,    # passed, but some check lacked the power asked for
          "sampled": true,         # only when judged from samples (the statistical audit): a verdict
                                   # "exact" then means no deviation detected at the audit's power
          "expected": bool,        # only when the verifier declared a verdict:
                                   # the declared value of "passed"
          "error": str,            # only when the audit could not run
          "checks": [{"name", "passed", "value", "threshold", "inconclusive"?}, ...],
          "metrics": {"tv_distance", "acceptance", "optimal_acceptance", ...},
          "details": {...}         # worst strings, solver statuses, ...
        }
      ]
    }
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from spectr_audit import __version__

__all__ = ["Check", "AuditResult", "AuditReport", "EXIT_ERROR", "EXIT_INCONCLUSIVE", "VERDICTS", "error_origin",
           "power_plan_text",
           "jsonable"]

#: The verdicts of a result, from :attr:`AuditResult.verdict`.
VERDICTS = ("exact", "CERTIFIED", "INCONCLUSIVE", "FINDING", "ERROR")
#: Exit status of a run that failed only because some results were inconclusive
#: (``--fail-on-inconclusive``, or ``--certify-tv`` where a certificate was not reached).
EXIT_INCONCLUSIVE = 3
#: Exit status of a run in which some audits could not run (the verifier raised, broke the call's contract or
#: ran past its time limit) and no finding stood in the way: errors are not findings.
EXIT_ERROR = 4


def error_origin(result: "AuditResult") -> str:
    """Where an error result's exception was raised, from its traceback (``details["traceback"]``): the last
    ``File "...", line N, in f`` of its root cause (the first exception of a chain), as ``file:N in f``; ``""``
    when the result has none.

    Examples
    --------
    >>> tb = ['Traceback (most recent call last):', '  File "/x/my_verifier.py", line 7, in my_verify',
    ...       '    y = x[3]', 'IndexError: index 3 is out of bounds']
    >>> error_origin(AuditResult("v", "c", error="IndexError: ...", details={"traceback": chr(10).join(tb)}))
    '/x/my_verifier.py:7 in my_verify'
    """
    text = str((result.details or {}).get("traceback") or "")
    # a chained traceback lists the root cause first: where the verifier itself raised
    for separator in ("The above exception was the direct cause", "During handling of the above exception"):
        text = text.split(separator)[0]
    frames = [line.strip() for line in text.splitlines() if line.strip().startswith('File "')]
    if not frames:
        return ""
    path, _, rest = frames[-1][len('File "'):].partition('", line ')
    number, _, function = rest.partition(", in ")
    return f"{path}:{number}" + (f" in {function}" if function else "")


def jsonable(value: Any) -> Any:
    """Convert numbers, tensors and containers to plain JSON values (NaN/Inf become None)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "tolist"):
        return jsonable(value.tolist())
    if hasattr(value, "item"):
        return jsonable(value.item())
    return str(value)


@dataclasses.dataclass(frozen=True)
class Check:
    """One named check: ``value`` compared with ``threshold``; ``passed`` says whether it held.

    ``inconclusive``: the check held (nothing was rejected) but without the power it was
    planned for (a statistical test cut short by a budget, a certificate not reached).
    """

    name: str
    passed: bool
    value: Optional[float] = None
    threshold: Optional[float] = None
    detail: str = ""
    inconclusive: bool = False

    def to_dict(self) -> dict:
        out = {"name": self.name, "passed": bool(self.passed), "value": jsonable(self.value), "threshold": jsonable(self.threshold)}
        if self.detail:
            out["detail"] = self.detail
        if self.inconclusive:
            out["inconclusive"] = True
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Check":
        """The inverse of :meth:`to_dict`."""
        return cls(str(data["name"]), bool(data["passed"]), data.get("value"), data.get("threshold"),
                   str(data.get("detail", "")), bool(data.get("inconclusive", False)))


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """The audit of one verifier on one case."""

    verifier: str
    case: str
    checks: tuple = ()
    metrics: dict = dataclasses.field(default_factory=dict)
    #: Declared value of ``passed`` (``True`` for a verifier declared exact, ``False`` for one
    #: declared inexact), or ``None`` when nothing was declared.
    expected: Optional[bool] = None
    error: Optional[str] = None
    details: dict = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """All checks hold (and the audit ran)."""
        return self.error is None and all(c.passed for c in self.checks)

    @property
    def as_expected(self) -> bool:
        """The verdict matches the declaration (or, with none declared, every check passed)."""
        if self.error is not None:
            return False
        return self.passed if self.expected is None else self.passed == self.expected

    @property
    def inconclusive(self) -> bool:
        """Every check held, but some without the power asked for (see :class:`Check`)."""
        return self.passed and any(c.inconclusive for c in self.checks)

    @property
    def verdict(self) -> str:
        """``"ERROR"``, ``"FINDING"`` (a check failed), ``"INCONCLUSIVE"``, ``"CERTIFIED"`` (a TV
        tolerance certified) or ``"exact"`` (every check held at its planned power)."""
        if self.error is not None:
            return "ERROR"
        if not self.passed:
            return "FINDING"
        if self.inconclusive:
            return "INCONCLUSIVE"
        return "CERTIFIED" if any(c.name == "certified-tv" for c in self.checks) else "exact"

    @property
    def sampled(self) -> bool:
        """Judged from samples (the statistical audit), not from an exact law: a pass is then "no deviation
        detected at the audit's power", not "exact"."""
        names = {c.name for c in self.checks}
        return "statistical" in names and not any(name.startswith("exact") for name in names)

    @property
    def verdict_label(self) -> str:
        """The verdict as reports show it: :attr:`verdict`, with a sampled pass as ``"PASS (sampled)"`` (the
        word ``exact`` is the exact audit's)."""
        verdict = self.verdict
        return "PASS (sampled)" if verdict == "exact" and self.sampled else verdict

    @property
    def failed_checks(self) -> list:
        return [c for c in self.checks if not c.passed]

    def to_dict(self) -> dict:
        out: dict = {"verifier": self.verifier, "case": self.case, "passed": self.passed, "verdict": self.verdict,
                     "inconclusive": self.inconclusive}
        if self.sampled:
            out["sampled"] = True
        if self.expected is not None:
            out["expected"] = self.expected
        if self.error is not None:
            out["error"] = self.error
        out["checks"] = [c.to_dict() for c in self.checks]
        out["metrics"] = jsonable(self.metrics)
        if self.details:
            out["details"] = jsonable(self.details)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "AuditResult":
        """The inverse of :meth:`to_dict` (numbers as JSON keeps them).

        Examples
        --------
        >>> r = AuditResult("kseq", "seed", (Check("statistical", True, 0.5, 0.001, inconclusive=True),))
        >>> AuditResult.from_dict(r.to_dict()).verdict
        'INCONCLUSIVE'
        """
        return cls(verifier=str(data["verifier"]), case=str(data["case"]),
                   checks=tuple(Check.from_dict(c) for c in data.get("checks", ())),
                   metrics=dict(data.get("metrics") or {}), expected=data.get("expected"), error=data.get("error"),
                   details=dict(data.get("details") or {}))


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """Every result of a run."""

    results: tuple
    suite: str = ""
    meta: dict = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Every result's verdict matches its declaration, and the run finished (not ``meta["incomplete"]``)."""
        return all(r.as_expected for r in self.results) and not self.meta.get("incomplete")

    @property
    def inconclusive(self) -> list:
        """The results that held only without the power asked for (see :attr:`AuditResult.inconclusive`)."""
        return [r for r in self.results if r.inconclusive]

    @property
    def errors(self) -> list:
        """The results of audits that could not run (``error`` set): not findings."""
        return [r for r in self.results if r.error is not None]

    @property
    def findings(self) -> list:
        """The results that ran and whose verdict is not as declared (a finding of a verifier declared exact or
        undeclared, or none of one declared inexact)."""
        return [r for r in self.results if r.error is None and not r.as_expected]

    def outcome_counts(self) -> dict:
        """The results in disjoint groups, in this order: ``passed`` (as expected, at full power),
        ``expected findings`` (findings of verifiers declared inexact), ``findings`` (not as expected),
        ``held though declared inexact``, ``errors``, ``inconclusive``."""
        groups = {"passed": 0, "expected findings": 0, "findings": 0, "held though declared inexact": 0,
                  "errors": 0, "inconclusive": 0}
        for r in self.results:
            if r.error is not None:
                groups["errors"] += 1
            elif not r.passed:
                groups["expected findings" if r.as_expected else "findings"] += 1
            elif not r.as_expected:
                groups["held though declared inexact"] += 1
            elif r.inconclusive:
                groups["inconclusive"] += 1
            else:
                groups["passed"] += 1
        return groups

    def outcome_text(self) -> str:
        """:meth:`outcome_counts` in words: what each number means, so that a passing run with findings reads as
        one ("41 findings on rules declared inexact, as expected").

        Examples
        --------
        >>> report = AuditReport((AuditResult("a", "c", (Check("exact", False),), expected=False),
        ...                       AuditResult("b", "c", (Check("exact", True),))))
        >>> report.outcome_text()
        '1 passed, 1 finding on a rule declared inexact, as expected, 0 findings not as expected, 0 errors, 0 inconclusive'
        """
        groups = self.outcome_counts()
        expected = groups["expected findings"]
        parts = [f"{groups['passed']} passed"]
        if expected:
            parts.append(f"{expected} finding on a rule declared inexact, as expected" if expected == 1 else
                         f"{expected} findings on rules declared inexact, as expected")
        parts.append(f"{groups['findings']} finding{'' if groups['findings'] == 1 else 's'} not as expected")
        if groups["held though declared inexact"]:
            parts.append(f"{groups['held though declared inexact']} declared inexact but held every check (not as "
                         "expected)")
        parts.append(f"{groups['errors']} error{'' if groups['errors'] == 1 else 's'}")
        parts.append(f"{groups['inconclusive']} inconclusive")
        return ", ".join(parts)

    @property
    def exit_code(self) -> int:
        """0 when every verdict is as expected, 1 otherwise (2 is reserved for usage errors)."""
        return 0 if self.passed else 1

    def exit_status(self, fail_on_inconclusive: bool = False) -> int:
        """The run's exit status: 0 every verdict as expected; 1 a finding (or a run that stopped early);
        :data:`EXIT_ERROR` (4) no finding but some audits errored; :data:`EXIT_INCONCLUSIVE` (3) all as
        expected but inconclusive results fail the run (``fail_on_inconclusive``) and there are some."""
        if self.exit_code == 0:
            return EXIT_INCONCLUSIVE if fail_on_inconclusive and self.inconclusive else 0
        if not self.findings and self.errors and not self.meta.get("incomplete"):
            return EXIT_ERROR
        return self.exit_code

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "suite": self.suite,
            "spectr_audit_version": __version__,
            "meta": jsonable(self.meta),
            "results": [r.to_dict() for r in self.results],
        }


def power_plan_text(plan: dict) -> str:
    """``rounds="auto"``'s plan in one line: the tokens needed and what ran to get them.

    >>> power_plan_text({"requested_tv": 0.05, "power": 0.99, "tokens_needed": 7547, "family_size": 60,
    ...                  "first_rounds": 2, "extension_arm": "ragged", "extension_rounds": 11,
    ...                  "tokens_per_second": {"single": 80.0, "ragged": 144.0}, "reached": True})
    '7547 tokens for TV 0.05 at power 0.99 (family of up to 60): 2 rounds of every arm, then 11 of ragged (the fastest arm, 144 tokens/s of generation); reached'

    With a reference, how far it ran (sized by its own test, ``reference_tv``):

    >>> power_plan_text({"requested_tv": 0.05, "power": 0.99, "tokens_needed": 7463, "family_size": 48,
    ...                  "first_rounds": 2, "extension_arm": "equal", "extension_rounds": 26,
    ...                  "tokens_per_second": {"equal": 9000.0}, "reached": True, "reference_tv": 0.1,
    ...                  "reference_tokens_needed": 1866, "reference_rounds": 0})
    '7463 tokens for TV 0.05 at power 0.99 (family of up to 48): 2 rounds of every arm, then 26 of equal (the fastest arm, 9000 tokens/s of generation), the reference on 0 of them (1866 reference tokens for its own test at TV 0.1); reached'
    """
    arm = plan.get("extension_arm")
    then = (f", then {plan['extension_rounds']} of {arm} (the fastest arm, "
            f"{plan['tokens_per_second'].get(arm, 0):.0f} tokens/s of generation)" if arm else "")
    if arm and "reference_rounds" in plan:
        then += (f", the reference on {plan['reference_rounds']} of them ({plan['reference_tokens_needed']} reference "
                 f"tokens for its own test at TV {plan['reference_tv']:g})")
    return (f"{plan['tokens_needed']} tokens for TV {plan['requested_tv']:g} at power "
            f"{plan['power']:g} (family of up to {plan['family_size']}): {plan['first_rounds']} rounds of every arm"
            f"{then}; {'reached' if plan.get('reached') else 'not reached'}")
