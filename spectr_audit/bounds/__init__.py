"""Optimality bounds: alpha* (closed form and LP), SpecTr's guarantee, the block LPs, and the draft-tree bounds.
"""

from __future__ import annotations

from .acceptance import (
    KSeqAcceptanceResult,
    OptimalAcceptanceLPResult,
    OptimalAcceptanceResult,
    kseq_acceptance,
    optimal_acceptance,
    optimal_acceptance_lp,
    optimal_acceptance_lp_from_sets,
    spectr_guarantee,
)
from .block_lp import (
    BlockLPResult,
    CLARABEL_FALLBACK_OPTIONS,
    CLARABEL_OPTIONS,
    block_lp,
)
from .tree_lp import (
    TreeBound,
    TreeLPResult,
    tree_bound,
    tree_lp,
    tree_optimal_acceptance,
    tree_paths_target_mass,
)

__all__ = [
    "KSeqAcceptanceResult",
    "OptimalAcceptanceLPResult",
    "OptimalAcceptanceResult",
    "kseq_acceptance",
    "optimal_acceptance",
    "optimal_acceptance_lp",
    "optimal_acceptance_lp_from_sets",
    "spectr_guarantee",
    "BlockLPResult",
    "CLARABEL_FALLBACK_OPTIONS",
    "CLARABEL_OPTIONS",
    "block_lp",
    "TreeBound",
    "TreeLPResult",
    "tree_bound",
    "tree_lp",
    "tree_optimal_acceptance",
    "tree_paths_target_mass",
]
