"""The statistical audit's entry point for draft trees (private; re-exported by :mod:`spectr_audit.statistical.audit`)."""

from __future__ import annotations

from typing import Optional

from spectr_audit.drafting.models import Model
from spectr_audit.errors import InvalidArgument
from spectr_audit.statistical.results import StatisticalAuditResult


def statistical_tree_audit(
    verifier,
    draft_model: Model,
    target_model: Model,
    tree,
    *,
    draft_scheme: Optional[str] = None,
    **kwargs,
) -> StatisticalAuditResult:
    """Audit a (black-box) tree verifier's exactness from its emitted strings on ``tree``.

    The pipeline of :func:`statistical_audit` (validate -> plan -> sample -> test, same arguments
    as keywords), each sample a fresh draft of ``tree`` under ``draft_scheme``
    (:func:`spectr_audit.drafting.tree.draft_tree`; default the verifier's first scheme), the
    emitted string (1 to ``max_depth + 1`` tokens) completed with target samples to
    ``max_depth + 1`` tokens.  ``acceptance<=optimal`` tests the root's membership acceptance
    against the tree's alpha* (docs/audit/bounds.md); under ``topk`` and ``none``
    ``block-efficiency<=bound`` tests the mean emitted length against ``1 + sum_n q(path(n))``.
    The stratified design and the multi-iteration run are for chains only.

    Parameters
    ----------
    verifier : TreeVerifier, or anything :func:`~spectr_audit.contract.tree_verifier.as_tree_verifier` takes
    draft_model, target_model : Model
    tree : DraftTree
    draft_scheme : str, optional
        One of the verifier's ``draft_schemes``.
    **kwargs
        Any keyword of :func:`statistical_audit` (``alpha``, ``num_samples``, ``max_samples``,
        ``seed``, ...).

    Examples
    --------
    >>> from spectr_audit.contract.tree import DraftTree
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> from spectr_audit.registry import load_tree_verifier
    >>> tree = DraftTree.from_paths([(0,), (1,), (0, 0)])
    >>> result = statistical_tree_audit(load_tree_verifier("tree-target-only"), ContextFreeModel([0.5, 0.3, 0.2]),
    ...                                 ContextFreeModel([0.2, 0.3, 0.5]), tree, draft_scheme="topk",
    ...                                 num_samples=20_000)
    >>> result.rejects()
    False
    """
    from spectr_audit.contract.tree import DraftTree
    # at call time: the audit module re-exports this function
    from spectr_audit.statistical.audit import statistical_audit

    if not isinstance(tree, DraftTree):
        raise InvalidArgument(f"tree: expected a DraftTree, got {type(tree).__name__}")
    return statistical_audit(verifier, draft_model, target_model, len(tree.children[0]), tree.max_depth,
                             tree=tree, draft_scheme=draft_scheme, **kwargs)
