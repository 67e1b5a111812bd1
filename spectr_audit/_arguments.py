"""The checks of scalar arguments every boundary shares: integers, probabilities, numbers in an interval.

A torch-free leaf (it imports only :mod:`spectr_audit.errors`), so that the faces and the suite readers that
load without torch use the same checks, and the same words, as the audits.  Every error is an
:class:`~spectr_audit.errors.InvalidArgument` whose message starts with the argument's name.
:mod:`spectr_audit._validation` re-exports them beside the checks of probability rows.

Examples
--------
>>> check_number("alpha", 1.5, 0, 1, low_open=True)
Traceback (most recent call last):
...
spectr_audit.errors.InvalidArgument: alpha: expected a number in (0, 1), got 1.5
>>> check_int_at_least("rounds", 2, 1)
2
"""

from __future__ import annotations

import math
from typing import Any, Optional

from spectr_audit.errors import InvalidArgument

__all__ = ["check_int_at_least", "check_number", "check_positive_int", "check_prob"]


def _bound(value: float) -> str:
    return "inf" if value == math.inf else f"{value:g}"


def check_number(name: str, value: Any, low: float, high: float, *, low_open: bool = False,
                 high_open: bool = True) -> float:
    """A finite real number (not a bool) in the interval from ``low`` to ``high``, each end open or closed as
    asked (by default ``[low, high)``); returns it as a float.  ``high`` may be ``math.inf`` (then open)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        where = f"{'(' if low_open else '['}{_bound(low)}, {_bound(high)}{')' if high_open else ']'}"
        raise InvalidArgument(f"{name}: expected a number in {where}, got {value!r}")
    return float(value)


def check_prob(name: str, value: Any) -> float:
    """A number in the open interval (0, 1) (a false-alarm rate, a power); returns it as float."""
    return check_number(name, value, 0, 1, low_open=True)


def check_positive_int(name: str, value: Any, allow_none: bool = True) -> Optional[int]:
    """An integer >= 1 (or None when allowed)."""
    if value is None and allow_none:
        return None
    return check_int_at_least(name, value, 1)


def check_int_at_least(name: str, value: Any, minimum: int) -> int:
    """An integer (not a bool) >= ``minimum``; returns it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return int(value)
