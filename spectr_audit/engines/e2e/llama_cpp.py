"""Deprecated alias of :mod:`spectr_audit.engine_adapters.llama_cpp`, where the module moved; goes in 0.2."""

from spectr_audit.deprecation import moved_module

moved_module(__name__, "spectr_audit.engine_adapters.llama_cpp", globals())
