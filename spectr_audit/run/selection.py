"""The K and L values a run is narrowed to, as the command line and the pytest plugin give them.

A leaf with no third-party import (the pytest plugin reads it when pytest loads it);
:func:`spectr_audit.run.suite.select_cases` applies the values to a suite.
"""

from __future__ import annotations

from typing import Any

from spectr_audit.errors import InvalidArgument

__all__ = ["parse_values"]


def parse_values(text: Any, argument: str) -> tuple:
    """K or L values as the command line gives them: ``"2"``, ``"1,2"``, ``"1-3"``, ``"1,3-4"`` (or ints); sorted.

    Examples
    --------
    >>> parse_values("1,3-4", "--draft-len"), parse_values(2, "num_drafts"), parse_values([3, 1], "draft_len")
    ((1, 3, 4), (2,), (1, 3))
    >>> parse_values("0-2", "--num-drafts")
    Traceback (most recent call last):
    ...
    spectr_audit.errors.InvalidArgument: --num-drafts: expected positive integers or ranges such as 1,2 or 1-3, got '0-2'
    """
    fail = InvalidArgument(f"{argument}: expected positive integers or ranges such as 1,2 or 1-3, got {text!r}")
    if isinstance(text, bool):
        raise fail
    if isinstance(text, int):
        text = [text]
    if isinstance(text, (list, tuple, range)):
        values = list(text)
    elif isinstance(text, str):
        values = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, sep, hi = part.partition("-")
            try:
                low, high = int(lo), int(hi if sep else lo)
            except ValueError:
                raise fail from None
            if high < low:
                raise fail
            values.extend(range(low, high + 1))
    else:
        raise fail
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise fail
    return tuple(sorted(set(values)))
