"""The generation audit: what an engine's ``generate()`` emits, every token, against the target model's own law.

* :func:`audit_generation` (:mod:`.audit`) and its result (:mod:`.results`);
* the contract (:mod:`.contract`): generators, scorers, their outputs;
* the method: the randomized PIT and surprisal of every token (:mod:`.pit`), the tests
  (:mod:`.tests`), the batch designs (:mod:`.designs`), the sample store (:mod:`.store`);
* :mod:`.library`: a correct generation loop over a small model pair and planted slips.

docs/generation.md describes the contract and the method.
"""

from __future__ import annotations

from spectr_audit.generation.audit import GenerationInterrupted, audit_generation
from spectr_audit.generation.contract import (
    GenerationContractError,
    GenerationOutput,
    ScoredLogits,
    as_generator,
    as_scorer,
)
from spectr_audit.generation.designs import ARMS
from spectr_audit.generation.results import GenerationAuditResult

__all__ = [
    "ARMS",
    "GenerationAuditResult",
    "GenerationContractError",
    "GenerationInterrupted",
    "GenerationOutput",
    "ScoredLogits",
    "as_generator",
    "as_scorer",
    "audit_generation",
]
