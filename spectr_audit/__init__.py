"""spectr-audit: a formally tested correctness-audit toolkit for speculative decoding.

Public API (imported lazily, so that ``import spectr_audit`` stays cheap; the pytest
plugin must not pull torch, scipy or cvxpy at load time):

* the contract: :class:`Verifier`, :class:`VerifyOutput`, :class:`FunctionVerifier`,
  :func:`as_verifier`, :func:`check_verify_inputs`;
* finding verifiers: :func:`load_verifier`;
* the exact audit: :func:`exact_iteration`, and :func:`exact_tree` for one draft-tree step;
* draft trees: :class:`DraftTree`, :func:`load_tree_verifier`, :func:`tree_bound`;
* optimal-transport bounds: :func:`optimal_acceptance`, :func:`optimal_acceptance_lp`;
* running suites: :func:`audit` (one call: a verifier on a suite, the report back),
  :func:`assert_passed`, :func:`load_suite`, :func:`run_suite`, :func:`audit_case`;
* the generation audit of a whole engine: :func:`audit_generation` (its result,
  :class:`GenerationAuditResult`), :func:`check_generation` (audit and fail unless PASS) and
  :func:`assert_generation_passed`;
* errors: :class:`SpectrAuditError`, :class:`InvalidArgument`, :class:`VerifierError`.
"""

from __future__ import annotations

import importlib
from typing import Any

from spectr_audit.errors import InvalidArgument, SpectrAuditError, VerifierError

__version__ = "0.1.0"

_LAZY = {
    "Verifier": "spectr_audit.contract.verifier",
    "VerifyOutput": "spectr_audit.contract.verifier",
    "FunctionVerifier": "spectr_audit.contract.verifier",
    "as_verifier": "spectr_audit.contract.convert",
    "check_verify_inputs": "spectr_audit.contract.verifier",
    "load_verifier": "spectr_audit.registry",
    "exact_iteration": "spectr_audit.exact.iteration",
    "exact_tree": "spectr_audit.exact.tree",
    "DraftTree": "spectr_audit.contract.tree",
    "load_tree_verifier": "spectr_audit.registry",
    "tree_bound": "spectr_audit.bounds.tree_lp",
    "statistical_tree_audit": "spectr_audit.statistical.audit",
    "optimal_acceptance": "spectr_audit.bounds.acceptance",
    "optimal_acceptance_lp": "spectr_audit.bounds.acceptance",
    "load_suite": "spectr_audit.run.suite",
    "run_suite": "spectr_audit.run.runner",
    "audit_case": "spectr_audit.run.runner",
    "InjectedUniforms": "spectr_audit.contract.randomness",
    "check_verifier": "spectr_audit.run.conformance",
    "audit": "spectr_audit.run.api",
    "assert_passed": "spectr_audit.run.api",
    "statistical_audit": "spectr_audit.statistical.audit",
    "sampler_law_agreement": "spectr_audit.statistical.agreement",
    "audit_generation": "spectr_audit.generation",
    "GenerationAuditResult": "spectr_audit.generation",
    "check_generation": "spectr_audit.generation.checks",
    "assert_generation_passed": "spectr_audit.generation.checks",
}

__all__ = ["__version__", "SpectrAuditError", "InvalidArgument", "VerifierError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'spectr_audit' has no attribute {name!r}")
