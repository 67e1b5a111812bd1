"""The verifier contract: everything a verifier may import.

The contract (:mod:`.verifier`), carried corrections (:mod:`.correction`) and the one
randomness seam (:mod:`.randomness`).  It imports nothing of the audit.
"""

from __future__ import annotations

from .verifier import (
    DRAFT_SCHEMES,
    DraftScheme,
    PROB_ATOL,
    Verifier,
    FunctionVerifier,
    VerifyOutput,
    as_verifier,
    check_verify_inputs,
    check_verify_output,
    check_output_probs,
)
from .correction import (
    CarriedCorrection,
    CorrectionChain,
    JointResidualCorrection,
    emitted_path_probs,
    has_carried_correction,
)
from .randomness import (
    CATEGORICAL_BLOCK,
    InjectedUniforms,
    RandomSource,
    block_sums,
    sample_categorical,
    sample_categorical_from_cdf,
    sample_categorical_with_total,
    uniform,
)

__all__ = [
    "DRAFT_SCHEMES",
    "DraftScheme",
    "PROB_ATOL",
    "Verifier",
    "FunctionVerifier",
    "VerifyOutput",
    "as_verifier",
    "check_verify_inputs",
    "check_verify_output",
    "check_output_probs",
    "CarriedCorrection",
    "CorrectionChain",
    "JointResidualCorrection",
    "emitted_path_probs",
    "has_carried_correction",
    "CATEGORICAL_BLOCK",
    "InjectedUniforms",
    "RandomSource",
    "block_sums",
    "sample_categorical",
    "sample_categorical_from_cdf",
    "sample_categorical_with_total",
    "uniform",
]
