"""Gate thresholds in the style of coverage.py's ``--fail-under``, shared by the CLI and the pytest plugin.

A threshold is one metric compared with one number: ``tv_distance <= 1e-9``,
``acceptance_ratio >= 0.95``.  It is written either as a dedicated option
(``--max-tv 1e-9``, ``--fail-under-acceptance-ratio 0.95``) or as an expression
(``--gate "tv_distance<=1e-9"``).  Both are parsed and validated when the
arguments are parsed, so a typo is a usage error (exit 2) before any audit runs.

This module imports only the standard library: the pytest plugin loads it on
every pytest run.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import operator
import re
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from spectr_audit.errors import InvalidArgument

__all__ = [
    "KNOWN_METRICS",
    "GATE_OPTIONS",
    "GateOption",
    "Threshold",
    "Violation",
    "GateOutcome",
    "parse_threshold",
    "threshold_from_option",
    "add_gate_arguments",
    "metric_value",
    "evaluate_gate",
]

#: Metrics a threshold may name.  Results carry a subset of them: a threshold is applied to
#: every result that measured its metric (see :func:`evaluate_gate`).
KNOWN_METRICS: tuple[str, ...] = (
    # exact audit
    "tv_distance",
    "max_abs_error",
    "token_tv_distance",
    "prefix_cap_excess",
    # optimality
    "acceptance",
    "optimal_acceptance",
    "optimal_acceptance_lp",
    "spectr_bound",
    "acceptance_ratio",
    "block_efficiency",
    "block_lp_optimum",
    "block_lp_repair_optimum",
    "block_efficiency_ratio",
    # statistical audit
    "pvalue",
    "statistic",
    "num_samples",
    "min_detectable_tv",
    "tv_estimate",
    "tv_lower",
    "tv_upper",
    "power_at_requested_tv",
    "planned_samples",
    # bookkeeping
    "num_draft_tuples",
    "seconds",
)

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    "<": operator.lt,
    ">=": operator.ge,
    ">": operator.gt,
}

_EXPRESSION = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(<=|>=|<|>)\s*(\S+)\s*$")


@dataclasses.dataclass(frozen=True)
class Threshold:
    """One gate threshold: a result passes when ``metric op limit`` holds.

    Attributes
    ----------
    metric : str
        A name from :data:`KNOWN_METRICS`.
    op : {"<=", "<", ">=", ">"}
        The comparison that must hold.
    limit : float
        The number compared with.
    source : str
        How the user wrote it (``--max-tv 1e-09``), for messages.
    """

    metric: str
    op: str
    limit: float
    source: str = ""

    def holds(self, value: float) -> bool:
        """Whether ``value`` satisfies the threshold."""
        return _OPS[self.op](value, self.limit)

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.limit:g}"

    def to_dict(self) -> dict:
        return {"metric": self.metric, "op": self.op, "limit": self.limit, "source": self.source or str(self)}


@dataclasses.dataclass(frozen=True)
class GateOption:
    """A dedicated option: ``--<name> X`` means ``metric op X``, with X in ``[low, high]``."""

    name: str
    metric: str
    op: str
    low: float
    high: float
    help: str


#: The dedicated gate options (the CLI spells them ``--max-tv``; the plugin ``--spectr-max-tv``).
GATE_OPTIONS: tuple[GateOption, ...] = (
    GateOption("max-tv", "tv_distance", "<=", 0.0, 1.0,
               "fail when a result's TV distance to the target law exceeds X"),
    GateOption("max-abs-error", "max_abs_error", "<=", 0.0, 1.0,
               "fail when a result's max |implied - target| over strings exceeds X"),
    GateOption("max-prefix-cap-excess", "prefix_cap_excess", "<=", 0.0, 1.0,
               "fail when a prefix's emitted mass exceeds its target mass by more than X"),
    GateOption("min-pvalue", "pvalue", ">=", 0.0, 1.0,
               "fail when a statistical audit's p-value is below X"),
    GateOption("fail-under-acceptance-ratio", "acceptance_ratio", ">=", 0.0, 1.0,
               "fail when acceptance / alpha* is below X (a ratio in [0, 1], or a percentage like 95%%)"),
    GateOption("fail-under-block-efficiency-ratio", "block_efficiency_ratio", ">=", 0.0, 1.0,
               "fail when block efficiency / block LP optimum is below X"),
)


def _parse_number(text: str, argument: str) -> float:
    raw = text.strip()
    scale = 1.0
    if raw.endswith("%"):
        raw, scale = raw[:-1], 0.01
    try:
        value = float(raw) * scale
    except ValueError:
        raise InvalidArgument(f"{argument}: expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise InvalidArgument(f"{argument}: expected a finite number, got {text!r}")
    return value


def _check_metric(metric: str, argument: str) -> None:
    if metric not in KNOWN_METRICS:
        close = difflib.get_close_matches(metric, KNOWN_METRICS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InvalidArgument(
            f"{argument}: unknown metric {metric!r}{hint}; known metrics: {', '.join(KNOWN_METRICS)}"
        )


def parse_threshold(text: str, argument: str = "--gate") -> Threshold:
    """Parse a gate expression ``METRIC OP NUMBER``.

    Parameters
    ----------
    text : str
        For example ``"tv_distance<=1e-9"``, ``"acceptance_ratio >= 0.95"`` or
        ``"acceptance_ratio>=95%"``.  ``OP`` is one of ``<=``, ``<``, ``>=``, ``>``.
    argument : str
        The option's name, used in error messages.

    Returns
    -------
    Threshold

    Raises
    ------
    InvalidArgument
        When the expression is malformed, names an unknown metric (with a
        suggestion), or its number is not finite.

    Examples
    --------
    >>> str(parse_threshold("acceptance_ratio >= 95%"))
    'acceptance_ratio >= 0.95'
    """
    if not isinstance(text, str):
        raise InvalidArgument(f"{argument}: expected a string 'METRIC OP NUMBER', got {type(text).__name__}")
    match = _EXPRESSION.match(text)
    if match is None:
        raise InvalidArgument(
            f"{argument}: expected 'METRIC OP NUMBER' with OP one of <=, <, >=, > "
            f"(e.g. 'tv_distance<=1e-9'), got {text!r}"
        )
    metric, op, number = match.groups()
    _check_metric(metric, argument)
    return Threshold(metric, op, _parse_number(number, argument), source=f"{argument} {text.strip()}")


def threshold_from_option(option: GateOption, text: str, flag: Optional[str] = None) -> Threshold:
    """Parse the value of a dedicated option (``--max-tv 1e-9``) into a :class:`Threshold`."""
    flag = flag or f"--{option.name}"
    value = _parse_number(text, flag)
    if not option.low <= value <= option.high:
        raise InvalidArgument(f"{flag}: expected a number in [{option.low:g}, {option.high:g}], got {text!r}")
    return Threshold(option.metric, option.op, value, source=f"{flag} {text.strip()}")


def _argparse_type(fn: Callable[[str], Threshold], flag: str) -> Callable[[str], Threshold]:
    def convert(text: str) -> Threshold:
        try:
            return fn(text)
        except InvalidArgument as exc:
            # argparse reports ArgumentTypeError as a usage error (exit 2) at parse time, and
            # names the option itself.
            message = str(exc)
            raise argparse.ArgumentTypeError(message.removeprefix(f"{flag}: ")) from None

    convert.__name__ = "threshold"
    return convert


def add_gate_arguments(add_argument: Callable[..., Any], prefix: str = "--", dest: str = "gate") -> None:
    """Register the gate options with an ``argparse`` parser or a pytest option group.

    Every option appends a parsed :class:`Threshold` to ``dest``, so the thresholds are
    validated when the command line is parsed.

    Parameters
    ----------
    add_argument : callable
        ``parser.add_argument`` (argparse) or ``group.addoption`` (pytest).
    prefix : str
        Prepended to each option name: ``"--"`` gives ``--max-tv``, ``"--spectr-"``
        gives ``--spectr-max-tv``.
    dest : str
        Attribute that collects the thresholds (a list, or ``None`` when none was given).
    """
    for option in GATE_OPTIONS:
        flag = f"{prefix}{option.name}"
        add_argument(
            flag,
            dest=dest,
            action="append",
            metavar="X",
            type=_argparse_type(lambda text, option=option, flag=flag: threshold_from_option(option, text, flag), flag),
            help=f"{option.help} ({option.metric} {option.op} X)",
        )
    flag = f"{prefix}gate"
    add_argument(
        flag,
        dest=dest,
        action="append",
        metavar="EXPR",
        type=_argparse_type(lambda text: parse_threshold(text, flag), flag),
        help="a threshold 'METRIC OP NUMBER', e.g. 'acceptance_ratio>=0.9' (repeatable); METRIC is one of "
        + ", ".join(KNOWN_METRICS),
    )


def metric_value(metrics: Mapping[str, Any], metric: str) -> Optional[float]:
    """The value of ``metric`` in a result's metrics (derived ratios included), or ``None``."""
    if metric == "block_efficiency_ratio" and metric not in metrics:
        eff, opt = metrics.get("block_efficiency"), metrics.get("block_lp_optimum")
        if isinstance(eff, (int, float)) and isinstance(opt, (int, float)) and opt > 0:
            return float(eff) / float(opt)
        return None
    value = metrics.get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@dataclasses.dataclass(frozen=True)
class Violation:
    """A result whose metric broke a threshold."""

    verifier: str
    case: str
    threshold: Threshold
    value: float

    def __str__(self) -> str:
        return f"{self.verifier} on {self.case}: {self.threshold.metric} = {self.value:.6g} breaks {self.threshold}"

    def to_dict(self) -> dict:
        return {"verifier": self.verifier, "case": self.case, "threshold": self.threshold.to_dict(), "value": self.value}


@dataclasses.dataclass(frozen=True)
class GateOutcome:
    """What the gate found; only :attr:`passed` decides.

    Attributes
    ----------
    thresholds : tuple of Threshold
    violations : tuple of Violation
        Every (result, threshold) pair that failed.
    unmeasured : tuple of Threshold
        Thresholds that no gated result measured.  They fail the gate: a gate that
        checks nothing must not pass silently (e.g. ``--min-pvalue`` on a run that
        made only exact audits).
    num_gated : int
        Results the thresholds were applied to.
    skipped : tuple of str
        Results left out of the gate, with the reason (an error, a declared-inexact verifier).
    """

    thresholds: tuple = ()
    violations: tuple = ()
    unmeasured: tuple = ()
    num_gated: int = 0
    skipped: tuple = ()

    @property
    def passed(self) -> bool:
        return not self.violations and not self.unmeasured

    def message(self, max_lines: int = 20) -> str:
        """A readable account: one line per violation (up to ``max_lines``)."""
        if not self.thresholds:
            return "gate: no thresholds"
        if self.passed:
            return f"gate passed: {', '.join(map(str, self.thresholds))} held on {self.num_gated} results"
        if self.violations:
            lines = [f"gate failed: {len(self.violations)} violation(s) of {', '.join(map(str, self.thresholds))}"]
        elif self.num_gated == 0:
            # nothing was measured at all: say so, not "0 violations"
            left_out = f" ({len(self.skipped)} left out: {'; '.join(self.skipped[:3])}{' ...' if len(self.skipped) > 3 else ''})"
            lines = [f"gate failed: nothing was measured: no result was gated{left_out if self.skipped else ''}, "
                     f"so {', '.join(map(str, self.thresholds))} checked nothing"]
        else:
            lines = [f"gate failed: nothing was measured for {', '.join(map(str, self.unmeasured))}: none of the "
                     f"{self.num_gated} gated results has the metric, so the threshold checked nothing"]
        for violation in self.violations[:max_lines]:
            lines.append(f"  {violation}  [{violation.threshold.source or violation.threshold}]")
        if len(self.violations) > max_lines:
            lines.append(f"  ... and {len(self.violations) - max_lines} more")
        for threshold in self.unmeasured:
            lines.append(
                f"  {threshold.source or threshold}: no gated result measured {threshold.metric!r}, "
                f"so the threshold checked nothing"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "thresholds": [t.to_dict() for t in self.thresholds],
            "violations": [v.to_dict() for v in self.violations],
            "unmeasured": [t.to_dict() for t in self.unmeasured],
            "num_gated": self.num_gated,
            "skipped": list(self.skipped),
        }


def evaluate_gate(results: Iterable[Any], thresholds: Optional[Sequence[Threshold]]) -> GateOutcome:
    """Apply ``thresholds`` to every result that measured their metrics.

    Parameters
    ----------
    results : iterable of AuditResult
        Anything with ``verifier``, ``case``, ``metrics``, ``error`` and ``expected``.
    thresholds : sequence of Threshold, optional
        ``None`` or empty: the gate passes trivially.

    Returns
    -------
    GateOutcome

    Notes
    -----
    Results with an ``error`` already fail the run, and results of a verifier that
    declared itself inexact (``expected`` false: a lossy-by-design mode, a published
    rule under audit) are judged by their declaration; both are left out of the gate
    and listed in :attr:`GateOutcome.skipped`.  A threshold that no remaining result
    measured fails the gate.

    Examples
    --------
    >>> from spectr_audit.results import AuditResult
    >>> r = AuditResult("kseq", "seed", metrics={"acceptance_ratio": 0.91})
    >>> evaluate_gate([r], [parse_threshold("acceptance_ratio>=0.95")]).passed
    False
    """
    thresholds = tuple(thresholds or ())
    violations: list[Violation] = []
    measured: set[int] = set()
    skipped: list[str] = []
    num_gated = 0
    for result in results:
        if getattr(result, "error", None) is not None:
            skipped.append(f"{result.verifier} on {result.case}: audit error")
            continue
        if getattr(result, "expected", None) is False:
            skipped.append(f"{result.verifier} on {result.case}: declared inexact")
            continue
        num_gated += 1
        for index, threshold in enumerate(thresholds):
            value = metric_value(result.metrics, threshold.metric)
            if value is None:
                continue
            measured.add(index)
            if not threshold.holds(value):
                violations.append(Violation(result.verifier, result.case, threshold, value))
    unmeasured = tuple(t for i, t in enumerate(thresholds) if i not in measured)
    return GateOutcome(thresholds, tuple(violations), unmeasured, num_gated, tuple(skipped))
