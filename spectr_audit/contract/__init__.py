"""The verifier contract: everything a verifier may import.

The contract (:mod:`.verifier`), carried corrections (:mod:`.correction`), the one
randomness seam (:mod:`.randomness`), draft trees (:mod:`.tree`), the tree-verifier
contract (:mod:`.tree_verifier`), chains as trees (:mod:`.chain_trees`), the converters (:mod:`.convert`), sampling parameters
(:mod:`.sampling`), a whole request and its constraints (:mod:`.requests`), the law of each token under a request and
the row's own history (:mod:`.history`), verifiers that take logits (:mod:`.logits`) and verifiers called under a per-call time limit
(:mod:`.limited`).  It imports nothing of the audit.
"""

from __future__ import annotations

from .verifier import (
    DRAFT_SCHEMES,
    DraftScheme,
    PROB_ATOL,
    Verifier,
    FunctionVerifier,
    VerifyOutput,
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
from .tree import (
    TREE_DRAFT_SCHEMES,
    TreeDraftScheme,
    DraftTree,
    draft_scheme_violation,
    topk_order,
)
from .tree_verifier import (
    TreeVerifier,
    TreeVerifyOutput,
    FunctionTreeVerifier,
    check_tree_inputs,
    check_tree_output,
    check_tree_output_probs,
)
from .convert import as_tree_verifier, as_verifier
from .chain_trees import (
    TreeInputs,
    ChainVerifierAsTree,
    TreeVerifierAsChain,
    chain_node_index,
    chains_as_tree_inputs,
    tree_inputs_as_chains,
    chain_output_as_tree,
    tree_output_as_chain,
    chain_law_as_tree,
    tree_law_as_chain,
)
from .limited import TimeLimitedTreeVerifier, TimeLimitedVerifier
from .sampling import (
    PROCESSING_ORDERS,
    ProcessingOrder,
    SamplingParams,
    logits_from_probs,
    process_logits,
    processing_order,
)
from .requests import (
    Constraint,
    ConstraintViolation,
    JsonSchemaConstraint,
    RegexConstraint,
    Request,
    TokenAutomaton,
)
from .history import HISTORY_ENGINES, RequestLaws, process_request, process_request_step
from .logits import (
    FunctionLogitsVerifier,
    LogitsVerifier,
    as_logits_verifier,
    check_logits_inputs,
    output_probs_with_params,
    takes_logits,
    verify_with_params,
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
    "TREE_DRAFT_SCHEMES",
    "TreeDraftScheme",
    "DraftTree",
    "draft_scheme_violation",
    "topk_order",
    "TreeVerifier",
    "TreeVerifyOutput",
    "FunctionTreeVerifier",
    "as_tree_verifier",
    "check_tree_inputs",
    "check_tree_output",
    "check_tree_output_probs",
    "TreeInputs",
    "ChainVerifierAsTree",
    "TreeVerifierAsChain",
    "chain_node_index",
    "chains_as_tree_inputs",
    "tree_inputs_as_chains",
    "chain_output_as_tree",
    "tree_output_as_chain",
    "chain_law_as_tree",
    "tree_law_as_chain",
    "TimeLimitedTreeVerifier",
    "TimeLimitedVerifier",
    "PROCESSING_ORDERS",
    "ProcessingOrder",
    "SamplingParams",
    "logits_from_probs",
    "process_logits",
    "processing_order",
    "Constraint",
    "ConstraintViolation",
    "JsonSchemaConstraint",
    "RegexConstraint",
    "Request",
    "TokenAutomaton",
    "HISTORY_ENGINES",
    "RequestLaws",
    "process_request",
    "process_request_step",
    "FunctionLogitsVerifier",
    "LogitsVerifier",
    "as_logits_verifier",
    "check_logits_inputs",
    "output_probs_with_params",
    "takes_logits",
    "verify_with_params",
]
