"""The exact audit: single-iteration and multi-iteration laws, and one draft-tree step, by enumeration.
"""

from __future__ import annotations

from .iteration import (
    DraftEnumeration,
    ExactIterationResult,
    enumerate_drafts,
    exact_iteration,
    string_of,
)
from .tree import (
    ExactTreeResult,
    TreeDraftEnumeration,
    enumerate_tree_drafts,
    exact_tree,
    tree_enumeration_size,
)
from .multi_iteration import (
    MultiIterationResult,
    exact_multi_iteration,
    target_string_law,
)

__all__ = [
    "DraftEnumeration",
    "ExactIterationResult",
    "enumerate_drafts",
    "exact_iteration",
    "string_of",
    "MultiIterationResult",
    "exact_multi_iteration",
    "target_string_law",
    "ExactTreeResult",
    "TreeDraftEnumeration",
    "enumerate_tree_drafts",
    "exact_tree",
    "tree_enumeration_size",
]
