"""Reading what the figures draw from result objects and the real-LM suite's table rows.

Only what is present is read: a missing or non-finite value is ``None``, never an error,
so a figure draws what a result carries and leaves the rest out.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Optional

__all__ = ["acceptance_interval", "case_shape", "deviation_points", "law_with_ci"]

#: z for the two-sided 95% intervals drawn on sampled laws.
_Z95 = 1.959963984540054
_K_RE = re.compile(r"/K=(\d+)")
_L_RE = re.compile(r"/L=(\d+)")


def _int_field(result: Any, key: str) -> Optional[int]:
    for source in (result.metrics, result.details):
        value = source.get(key) if isinstance(source, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def case_shape(result: Any) -> tuple[str, Optional[int], Optional[int]]:
    """``(base name, K, L)`` of a result's case.

    K and L come from ``num_drafts`` / ``draft_len`` in the metrics or details when the
    runner records them, else from the ``/K=`` and ``/L=`` suffixes that suites give to
    expanded cases; the base name drops those suffixes.
    """
    name = result.case
    num_drafts = _int_field(result, "num_drafts")
    draft_len = _int_field(result, "draft_len")
    k_match, l_match = _K_RE.search(name), _L_RE.search(name)
    if num_drafts is None and k_match:
        num_drafts = int(k_match.group(1))
    if draft_len is None and l_match:
        draft_len = int(l_match.group(1))
    base = _L_RE.sub("", _K_RE.sub("", name))
    return base, num_drafts, draft_len


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _vector(value: Any) -> Optional[list[float]]:
    if isinstance(value, (list, tuple)) and value and all(_number(v) is not None for v in value):
        return [float(v) for v in value]
    return None


def _wilson(phat: float, total: float) -> tuple[float, float]:
    """The 95% Wilson interval of a frequency ``phat`` observed over ``total`` samples (unclipped)."""
    denom = 1 + _Z95**2 / total
    centre = (phat + _Z95**2 / (2 * total)) / denom
    half = _Z95 * math.sqrt(phat * (1 - phat) / total + _Z95**2 / (4 * total**2)) / denom
    return centre - half, centre + half


def law_with_ci(result: Any) -> Optional[dict]:
    """The first-token law a result implies, with a confidence interval per token.

    Returns ``None`` when the result carries no law.  Otherwise a dict with ``law``,
    ``low``, ``high`` (lists over the vocabulary), ``target`` (or ``None``) and ``kind``:
    ``"exact"`` (an enumerated law: zero-width interval) or ``"sampled"`` (observed
    frequencies with 95% Wilson intervals, or the intervals the audit recorded).

    Recognised details: ``first_token_law`` (exact); ``first_token_counts`` or
    ``observed_first_token_counts`` (sampled counts); ``observed_first_token_law`` with
    ``first_token_law_ci_low`` / ``first_token_law_ci_high``; ``target_first_token_law``.
    """
    details = result.details if isinstance(result.details, dict) else {}
    target = _vector(details.get("target_first_token_law"))
    counts = _vector(details.get("first_token_counts")) or _vector(details.get("observed_first_token_counts"))
    if counts is not None and sum(counts) > 0:
        total = sum(counts)
        law, low, high = [], [], []
        for count in counts:
            phat = count / total
            lower, upper = _wilson(phat, total)
            law.append(phat)
            low.append(max(0.0, lower))
            high.append(min(1.0, upper))
        return {"law": law, "low": low, "high": high, "target": target, "kind": "sampled"}
    observed = _vector(details.get("observed_first_token_law"))
    if observed is not None:
        low = _vector(details.get("first_token_law_ci_low")) or observed
        high = _vector(details.get("first_token_law_ci_high")) or observed
        return {"law": observed, "low": low, "high": high, "target": target, "kind": "sampled"}
    exact = _vector(details.get("first_token_law"))
    if exact is not None:
        return {"law": exact, "low": exact, "high": exact, "target": target, "kind": "exact"}
    return None


def deviation_points(result: Any) -> list[dict]:
    """Where a result's law differs from the target: ``{"string", "deviation", "low", "high", "kind"}`` per string.

    From an exact audit's ``worst_strings`` (``implied - target`` over strings of L + 1 tokens,
    no interval), or a statistical audit's ``worst_cells`` with ``worst_cells_num_samples``
    (observed frequency minus the cell's target probability, with a 95% Wilson interval).
    Strings are written as their tokens separated by spaces.

    Examples
    --------
    >>> from types import SimpleNamespace as R
    >>> [p["string"] for p in deviation_points(R(details={"worst_strings": [
    ...     {"string": [1, 0, 2], "implied": 0.2, "target": 0.1}]}))]
    ['1 0 2']
    """
    details = result.details if isinstance(result.details, dict) else {}
    out = []
    for w in details.get("worst_strings") or ():
        implied, target = (_number(w.get("implied")), _number(w.get("target"))) if isinstance(w, dict) else (None, None)
        if implied is not None and target is not None:
            string = " ".join(str(t) for t in w.get("string") or ())
            out.append({"string": string, "deviation": implied - target, "low": implied - target,
                        "high": implied - target, "kind": "exact"})
    total = _number(details.get("worst_cells_num_samples"))
    if not out and total:
        for c in details.get("worst_cells") or ():
            observed, expected = (_number(c.get("observed")), _number(c.get("expected"))) if isinstance(c, dict) else (
                None, None)
            if observed is None or expected is None:
                continue
            phat, target = observed / total, expected / total
            lower, upper = _wilson(phat, total)
            out.append({"string": str(c.get("cell")), "deviation": phat - target, "low": lower - target,
                        "high": upper - target, "kind": "sampled"})
    return out


def _interval(value: Any) -> Optional[tuple[float, float]]:
    """A two-number interval from a metric (``acceptance_ci``), or None."""
    pair = _vector(value)
    if pair is None or len(pair) != 2 or any(not math.isfinite(v) for v in pair):
        return None
    return (min(pair), max(pair))


def acceptance_interval(metrics: dict) -> Optional[tuple[float, float]]:
    """The interval of a sampled acceptance: ``acceptance_ci``, or ``acceptance_ci_low`` / ``_high``
    (the real-LM suite's); None for an acceptance computed exactly.

    Examples
    --------
    >>> acceptance_interval({"acceptance": 0.5, "acceptance_ci_low": 0.45, "acceptance_ci_high": 0.55})
    (0.45, 0.55)
    >>> acceptance_interval({"acceptance": 0.5}) is None
    True
    """
    return _interval(metrics.get("acceptance_ci")) or _interval(
        [metrics.get("acceptance_ci_low"), metrics.get("acceptance_ci_high")])


def _row(row: Any) -> dict:
    """A table row as a dict (rows come as dicts from ``to_dict``; dataclass rows are accepted too)."""
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
        return dataclasses.asdict(row)
    return row if isinstance(row, dict) else {}


def _count(value: Any) -> Optional[int]:
    number = _number(value)
    return int(number) if number is not None and number == int(number) else None
