"""Deprecated alias of :mod:`spectr_audit.generation.checks`, where the module moved; goes in 0.2.

``run_generation_suite`` stays in :mod:`spectr_audit.run.generation_suite`, the runner that reads suite files.
"""

from spectr_audit.deprecation import moved_module
from spectr_audit.run.generation_suite import run_generation_suite

moved_module(__name__, "spectr_audit.generation.checks", globals())
__all__ = [*__all__, "run_generation_suite"]  # noqa: F821 (bound by moved_module)
