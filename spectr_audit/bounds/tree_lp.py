"""The best any lossless verifier can do with a given draft tree and draft scheme (docs/audit/bounds.md).

Two numbers per (draft model, target model, tree, scheme, prefix):

* **acceptance**: the optimal membership acceptance alpha*, the largest
  ``P(first emitted token is one of the root's children's tokens)`` over every lossless verifier.
  It depends only on the law of the set S of the root's children's tokens and equals
  ``min over token sets T of [q(T) + 1 - P(S subset of T)]`` (max-flow / min-cut), in closed form:

  - ``iid``: ``min_T [q(T) + 1 - p(T)^K]``, K the root's children
    (:func:`~spectr_audit.bounds.acceptance.optimal_acceptance`);
  - ``without_replacement``: the same minimum with ``P(S subset of T)`` the chance that K draws
    without replacement all land in T, taken over every T (a sum over the subsets of the draft's
    tokens of positive probability, at most ``defaults.MIN_CUT_MAX_SUPPORT`` of them);
  - ``topk``, ``none``: S is a fixed set (the tokens of the root's children's ranks), so
    ``alpha* = q(S)``.

* **accepted length**: the largest expected number of accepted draft tokens,
  ``E[len(s)] - 1``.  Closed forms: on depth-1 trees it is alpha* (one token at most is accepted,
  and it is accepted exactly when it is a child's token); under ``topk`` and ``none`` the drafts
  are one fixed tree, the first d emitted tokens of a lossless verifier are q-distributed, so at
  most ``sum over draft nodes n of q(path(n))`` is accepted, and target-only verification attains
  it.  Otherwise :func:`tree_lp` solves the LP over every realisation of the tree's drafts: the
  block LP of :mod:`spectr_audit.bounds.block_lp` with the strings a verifier may emit being a tree
  path followed by one token.  Its repair-allowed variant (prefix caps only) is reported too.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np
import torch

from spectr_audit import defaults
from spectr_audit.bounds.acceptance import (
    check_min_cut_support,
    optimal_acceptance,
    optimal_acceptance_lp_from_sets,
    without_replacement_set_probs,
)
from spectr_audit.bounds.block_lp import _solver_attempts, _string_lps, realisation_candidates
from spectr_audit.contract.tree import DraftTree
from spectr_audit.drafting.models import Model, contexts_from
from spectr_audit.drafting.tree import draft_tree
from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.law import check_vocab
from spectr_audit.exact.tree import (
    TreeDraftEnumeration,
    check_scheme,
    check_tree,
    enumerate_tree_drafts,
)

__all__ = [
    "TreeBound",
    "TreeLPResult",
    "tree_bound",
    "tree_lp",
    "tree_optimal_acceptance",
    "tree_paths_target_mass",
]


@dataclasses.dataclass(frozen=True)
class TreeLPResult:
    """Optima of the tree LPs for one (draft model, target model, tree, scheme, prefix).

    Values are expected accepted lengths ``E[len(s)] - 1`` (NaN unless the status is optimal).
    """

    draft_scheme: str
    num_realisations: int
    #: variables: pi(s | realisation) per (realisation, allowed string), then E(s)/q(s) per string
    num_variables: int
    solver: str
    #: optimum among verifiers exact with unmodified continuation
    accepted_length: float
    status: str
    #: optimum when a next-iteration repair is allowed (prefix caps only)
    repair_accepted_length: float
    repair_status: str
    #: alpha* by the transport LP over the law of the root's children's token set (a cross-check)
    acceptance: float
    acceptance_status: str

    @property
    def solved(self) -> bool:
        return self.status == "optimal" and self.repair_status == "optimal"


@dataclasses.dataclass(frozen=True)
class TreeBound:
    """The best acceptance and accepted length of a lossless verifier on a tree (see :func:`tree_bound`)."""

    draft_scheme: str
    #: alpha*, closed form
    acceptance: float
    acceptance_source: str
    #: the best E[accepted draft tokens], or None where neither a closed form nor the LP applies
    accepted_length: Optional[float]
    #: "closed form: ..." or "lp", or why none was computed
    accepted_length_source: str
    #: the LP's repair-allowed optimum, when the LP ran
    repair_accepted_length: Optional[float] = None
    lp: Optional[TreeLPResult] = None

    def to_dict(self) -> dict:
        out = {"draft_scheme": self.draft_scheme, "acceptance": self.acceptance,
               "acceptance_source": self.acceptance_source, "accepted_length": self.accepted_length,
               "accepted_length_source": self.accepted_length_source}
        if self.lp is not None:
            out["lp"] = {"status": self.lp.status, "repair_status": self.lp.repair_status,
                         "repair_accepted_length": self.lp.repair_accepted_length, "solver": self.lp.solver,
                         "num_variables": self.lp.num_variables, "num_realisations": self.lp.num_realisations,
                         "acceptance": self.lp.acceptance, "acceptance_status": self.lp.acceptance_status}
        return out


def _check(tree: DraftTree, draft_scheme: str, draft_model: Model, target_model: Model) -> int:
    check_tree(tree)
    check_scheme(draft_scheme)
    return check_vocab(draft_model, target_model)


def _root_laws(draft_model: Model, target_model: Model, prefix: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    ctx = contexts_from(prefix, torch.zeros(1, 0, dtype=torch.int64))
    return draft_model(ctx)[0].double(), target_model(ctx)[0].double()


def _min_cut(set_law: dict, target: np.ndarray) -> float:
    """``min_T [q(T) + 1 - P(S subset of T)]`` over every token set T (bit masks; a zeta transform).

    T runs over the subsets of the tokens the sets ``S`` hold: a token no draft reaches only adds its
    target mass to ``q(T)``, so the minimum is among them (:func:`~spectr_audit.bounds.acceptance.check_min_cut_support`
    bounds their number).
    """
    tokens = sorted(set().union(*set_law))
    check_min_cut_support(len(tokens), "tree")
    bit_of = {t: b for b, t in enumerate(tokens)}
    size = 1 << len(tokens)
    inside = np.zeros(size)  # P(S = mask)
    for key, mass in set_law.items():
        inside[sum(1 << bit_of[t] for t in key)] += mass
    target_mass = np.zeros(size)  # q(mask)
    for t, b in bit_of.items():
        target_mass[1 << b] = target[t]
    masks = np.arange(size)
    for bit in range(len(tokens)):  # sum over subsets: f[T] = sum_{S subset of T} f[S]
        has = (masks >> bit) & 1 == 1
        inside[has] += inside[masks[has] ^ (1 << bit)]
        target_mass[has] += target_mass[masks[has] ^ (1 << bit)]
    return float(np.clip(np.min(target_mass + 1.0 - inside), 0.0, 1.0))


def _topk_tokens(draft: torch.Tensor, ranks: Sequence[int]) -> list[int]:
    order = torch.sort(draft, descending=True, stable=True).indices
    if max(ranks) >= draft.numel():
        raise InvalidArgument(f"tree: a root child has rank {max(ranks)}, beyond the vocabulary of {draft.numel()}")
    return [int(order[r]) for r in ranks]


def tree_optimal_acceptance(
    draft_model: Model,
    target_model: Model,
    tree: DraftTree,
    draft_scheme: str,
    prefix: Sequence[int] = (),
) -> tuple[float, str]:
    """alpha* for the root's children under ``draft_scheme``, in closed form; returns (value, source).

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> draft, target = ContextFreeModel([0.5, 0.3, 0.2]), ContextFreeModel([0.2, 0.2, 0.6])
    >>> value, source = tree_optimal_acceptance(draft, target, DraftTree.chains(2, 1), "without_replacement")
    >>> round(value * 35, 9), source          # 31/35 (docs/audit/bounds.md)
    (31.0, 'closed form: min-cut over token sets (without replacement)')
    >>> round(tree_optimal_acceptance(draft, target, DraftTree.chains(2, 1), "topk")[0], 12)   # q({0, 1})
    0.4
    """
    _check(tree, draft_scheme, draft_model, target_model)
    draft, target = _root_laws(draft_model, target_model, prefix)
    num_children = len(tree.children[0])
    if draft_scheme == "iid":
        return optimal_acceptance(draft, target, num_children).item(), "closed form: min_T q(T) + 1 - p(T)^K (iid)"
    if draft_scheme == "without_replacement":
        law = without_replacement_set_probs(draft, num_children, argument="tree")
        return _min_cut(law, (target / target.sum()).numpy()), "closed form: min-cut over token sets (without replacement)"
    tokens = _topk_tokens(draft, [tree.ranks[c] for c in tree.children[0]])
    return float(target[tokens].sum() / target.sum()), "closed form: q of the fixed top-k set"


def tree_paths_target_mass(
    draft_model: Model,
    target_model: Model,
    tree: DraftTree,
    prefix: Sequence[int] = (),
) -> float:
    """``sum over draft nodes n of q(path(n))`` for the top-k tree: the best accepted length under ``topk`` / ``none``.

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> draft, target = ContextFreeModel([0.5, 0.3, 0.2]), ContextFreeModel([0.2, 0.3, 0.5])
    >>> tree = DraftTree.from_paths([(0,), (1,), (0, 0)])   # tokens 0, 1 and 0 -> 0
    >>> round(tree_paths_target_mass(draft, target, tree), 12)   # 0.2 + 0.3 + 0.2 * 0.2
    0.54
    """
    contexts = contexts_from(prefix, torch.zeros(1, 0, dtype=torch.int64))
    batch = draft_tree(draft_model, target_model, contexts, tree, None, "topk")
    tokens, target = batch.node_tokens[0], batch.target_probs[0]
    mass = [1.0] * tree.num_nodes
    for node in range(1, tree.num_nodes):
        parent = tree.parents[node]
        mass[node] = mass[parent] * float(target[parent, tokens[node]])
    return float(sum(mass[1:]))


def _root_set_law(enumeration: TreeDraftEnumeration) -> dict:
    kids = list(enumeration.tree.level(1))
    law: dict = {}
    for tokens, weight in zip(enumeration.node_tokens[:, kids].tolist(), enumeration.weights.tolist()):
        key = frozenset(tokens)
        law[key] = law.get(key, 0.0) + weight
    return law


def tree_lp(
    draft_model: Model,
    target_model: Model,
    tree: DraftTree,
    draft_scheme: str = "iid",
    *,
    prefix: Sequence[int] = (),
    solver: str = "CLARABEL",
    max_variables: int = defaults.LP_MAX_VARIABLES,
) -> TreeLPResult:
    """The best expected accepted length of a lossless verifier on ``tree``, by the LP over its realisations.

    Parameters
    ----------
    draft_model, target_model : Model
    tree : DraftTree
    draft_scheme : {"iid", "without_replacement", "topk", "none"}
    prefix : sequence of int
    solver : str
        A cvxpy LP solver; CLARABEL runs with ``CLARABEL_OPTIONS``, then ``CLARABEL_FALLBACK_OPTIONS``,
        then its defaults, as :func:`~spectr_audit.bounds.block_lp.block_lp`.
    max_variables : int
        Refuse (InvalidArgument) LPs with more variables.

    Returns
    -------
    TreeLPResult

    Notes
    -----
    For every realisation ``r`` of the drafts (:func:`~spectr_audit.exact.tree.enumerate_tree_drafts`) a
    verifier chooses a law ``pi(s | r)`` over the strings it may emit: the tokens of a tree path
    followed by one token, with ``q(s) > 0``.  Lossless with the unmodified continuation: for every
    ``w`` of ``D + 1`` tokens, ``sum_r P(r) sum_{s prefix of w} pi(s | r) q(w) / q(s) = q(w)``;
    the objective is ``E[len(s)]``.  About ``R (N + 1) V`` variables for R realisations.

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> draft, target = ContextFreeModel([0.6, 0.4]), ContextFreeModel([0.3, 0.7])
    >>> lp = tree_lp(draft, target, DraftTree.chains(2, 1))        # depth 1: alpha* = 0.94
    >>> round(lp.accepted_length, 6), round(lp.acceptance, 6), lp.status
    (0.94, 0.94, 'optimal')
    """
    vocab_size = _check(tree, draft_scheme, draft_model, target_model)
    attempts = _solver_attempts(solver)
    enumeration = enumerate_tree_drafts(draft_model, target_model, tree, draft_scheme, prefix)
    estimate = enumeration.num_realisations * tree.num_nodes * vocab_size
    if estimate > max_variables:
        raise InvalidArgument(
            f"max_variables: the tree LP needs up to {estimate} variables ({enumeration.num_realisations} realisations x "
            f"{tree.num_nodes} nodes x V = {vocab_size}), above max_variables={max_variables}")
    lps = _string_lps(*realisation_candidates(enumeration), enumeration.weights.numpy(), target_model, prefix,
                      tree.max_depth + 1, vocab_size, solver, attempts)
    _, root_target = _root_laws(draft_model, target_model, prefix)
    try:
        acceptance_lp = optimal_acceptance_lp_from_sets(_root_set_law(enumeration), root_target,
                                                        max_variables=max_variables)
        acceptance, acceptance_status = acceptance_lp.value, acceptance_lp.status
    except InvalidArgument as exc:
        acceptance, acceptance_status = math.nan, f"skipped: {exc}"
    return TreeLPResult(
        draft_scheme=draft_scheme,
        num_realisations=enumeration.num_realisations,
        num_variables=lps["num_variables"],
        solver=solver,
        accepted_length=lps["unmodified_value"] - 1.0,
        status=lps["unmodified_status"],
        repair_accepted_length=lps["repair_value"] - 1.0,
        repair_status=lps["repair_status"],
        acceptance=acceptance,
        acceptance_status=acceptance_status,
    )


def tree_bound(
    draft_model: Model,
    target_model: Model,
    tree: DraftTree,
    draft_scheme: str,
    *,
    prefix: Sequence[int] = (),
    lp: bool = True,
    max_variables: int = defaults.LP_CROSS_CHECK_MAX_VARIABLES,
) -> TreeBound:
    """The best acceptance and expected accepted length of any lossless verifier on ``tree`` under ``draft_scheme``.

    alpha* is always in closed form (:func:`tree_optimal_acceptance`).  The accepted length uses a
    closed form where one exists (depth-1 trees: alpha*; ``topk`` / ``none``:
    :func:`tree_paths_target_mass`), else :func:`tree_lp` when ``lp`` and the LP has at most
    ``max_variables`` variables (and the enumeration fits the exact audit's limits), else None
    with the reason in ``accepted_length_source``.

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> draft, target = ContextFreeModel([0.5, 0.3, 0.2]), ContextFreeModel([0.2, 0.3, 0.5])
    >>> bound = tree_bound(draft, target, DraftTree.from_paths([(0,), (1,), (0, 0)]), "topk")
    >>> round(bound.acceptance, 12), round(bound.accepted_length, 12)
    (0.5, 0.54)
    """
    _check(tree, draft_scheme, draft_model, target_model)
    acceptance, acceptance_source = tree_optimal_acceptance(draft_model, target_model, tree, draft_scheme, prefix)
    if tree.max_depth == 1:
        return TreeBound(draft_scheme, acceptance, acceptance_source, acceptance,
                         "closed form: alpha* (depth 1: one token at most is accepted)")
    if draft_scheme in ("topk", "none"):
        return TreeBound(draft_scheme, acceptance, acceptance_source,
                         tree_paths_target_mass(draft_model, target_model, tree, prefix),
                         "closed form: sum of q(path) over the draft nodes (deterministic drafts)")
    if not lp:
        return TreeBound(draft_scheme, acceptance, acceptance_source, None, "skipped: lp=False")
    try:
        result = tree_lp(draft_model, target_model, tree, draft_scheme, prefix=prefix, max_variables=max_variables)
    except InvalidArgument as exc:
        return TreeBound(draft_scheme, acceptance, acceptance_source, None, f"skipped: {exc}")
    if result.status != "optimal":
        return TreeBound(draft_scheme, acceptance, acceptance_source, None, f"lp status {result.status}", lp=result)
    repair = result.repair_accepted_length if result.repair_status == "optimal" else None
    return TreeBound(draft_scheme, acceptance, acceptance_source, result.accepted_length, "lp",
                     repair_accepted_length=repair, lp=result)
