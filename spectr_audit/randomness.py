"""Deprecated alias of :mod:`spectr_audit.contract.randomness` (random sources, injected uniforms); goes in 0.2."""

from spectr_audit.deprecation import moved_module

moved_module(__name__, "spectr_audit.contract.randomness", globals())
