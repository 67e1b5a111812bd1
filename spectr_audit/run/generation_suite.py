"""A suite's ``[[generation]]`` cases run from its name or file: the suite read here, its cases run by
:mod:`spectr_audit.generation.suite`.

Suites hold verifier cases and generation cases alike, so reading one belongs to the runner
(:mod:`spectr_audit.run.suite`); :func:`run_generation_suite` reads it and hands its generation cases to
:func:`spectr_audit.generation.suite.run_generation_cases`.  The other names of this module moved to
:mod:`spectr_audit.generation.suite`; reading them here warns with ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from spectr_audit.generation import cases as _cases
from spectr_audit.generation import suite as _suite
from spectr_audit.run.suite import Suite, load_suite

__all__ = ["run_generation_suite"]


def run_generation_suite(suite: Union[str, Path, Suite], *, store_dir: Optional[Union[str, Path]] = None,
                         resume: bool = False, on_result: Optional[Callable[[_suite.GenerationCaseResult], None]] = None,
                         on_start: Optional[Callable[[_cases.GenerationCase], None]] = None,
                         select: Optional[Sequence[str]] = None, **overrides: Any) -> _suite.GenerationSuiteReport:
    """Run every ``[[generation]]`` case of ``suite`` (a name, a path or a :class:`~spectr_audit.run.suite.Suite`).

    The options are :func:`~spectr_audit.generation.suite.run_generation_cases`'s.

    Raises
    ------
    InvalidArgument
        A suite without ``[[generation]]`` cases, or a case whose engine cannot be resolved.
    GenerationSuiteInterrupted
        On Ctrl-C, carrying the finished cases.
    """
    suite_obj = suite if isinstance(suite, Suite) else load_suite(suite)
    return _suite.run_generation_cases(suite_obj.generation, suite=suite_obj.name, store_dir=store_dir, resume=resume,
                                on_result=on_result, on_start=on_start, select=select, **overrides)


def __getattr__(name: str) -> Any:
    # the names that moved to spectr_audit.generation.suite
    if not hasattr(_suite, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} is deprecated: import it from spectr_audit.generation.suite",
                  DeprecationWarning, stacklevel=2)
    return getattr(_suite, name)
