"""Deprecated alias of :mod:`spectr_audit.drafting.models` (the draft and target models); goes in 0.2."""

from spectr_audit.deprecation import moved_module

moved_module(__name__, "spectr_audit.drafting.models", globals())
