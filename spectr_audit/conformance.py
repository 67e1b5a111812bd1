"""Deprecated alias of :mod:`spectr_audit.run.conformance` (``check_verifier``); goes in 0.2.

``ConformanceReport`` is the old name of :class:`~spectr_audit.run.conformance_checks.ConformanceResult`.
"""

from spectr_audit.deprecation import moved_module

moved_module(__name__, "spectr_audit.run.conformance", globals(), renamed={"ConformanceReport": "ConformanceResult"})
