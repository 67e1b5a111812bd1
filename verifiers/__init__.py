"""Reference verifiers (torch, any device), installed as ``spectr_audit.verifiers``.

Each verifier implements the contract of :mod:`spectr_audit.contract.verifier`; find them by
short name with :func:`spectr_audit.registry.load_verifier` (``spectr-audit list``).
"""
