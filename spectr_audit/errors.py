"""The error hierarchy: one root, and an ``InvalidArgument`` that is also a ``ValueError``."""

from __future__ import annotations

__all__ = ["SpectrAuditError", "InvalidArgument", "VerifierError"]


class SpectrAuditError(Exception):
    """Root of every error raised by spectr-audit on purpose."""


class InvalidArgument(SpectrAuditError, ValueError):
    """An argument failed validation at a public boundary.

    The message names the argument, what was expected and what was found.
    """


class VerifierError(SpectrAuditError):
    """A verifier under audit raised or returned something that breaks the contract."""
