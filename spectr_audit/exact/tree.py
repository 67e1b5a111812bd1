"""Exact audit of one tree verification step by enumerating every realisation of the tree's drafts.

For a :class:`~spectr_audit.contract.tree.DraftTree` and a draft scheme, every *realisation* of
the node tokens is enumerated with its probability (docs/audit/exact.md):

``iid``
    every child of node ``n`` drawn independently from the draft law at ``n``: ``V**c`` choices
    for a node with ``c`` children, weights the products of the draft probabilities;
``without_replacement``
    the children of ``n`` drawn one after another with the tokens already drawn removed:
    ``V! / (V - c)!`` ordered choices, weights ``prod p(x_i) / (mass not yet drawn)``;
``topk``, ``none``
    deterministic: child of rank ``r`` is the ``r``-th most likely draft token (ties to the smallest
    id), one realisation of weight 1 (``none`` passes no draft probabilities to the verifier).

Realisations of probability 0 are left out.  The verifier's exact law (``tree_output_probs``) is
summed over them, weighted, into ``E(s)``, the law of the emitted string (1 to ``D + 1`` tokens,
``D = tree.max_depth``); from it, exactly as for chains (:mod:`spectr_audit.exact.iteration`),
``F(w)``, the law of the first ``D + 1`` tokens when decoding continues with the unmodified
target, the prefix caps ``B(u) <= q(u)``, membership acceptance (the first emitted token is one of
the root's children's tokens) and the expected accepted length ``E[len(s)] - 1``.

Reach
-----
The enumeration holds every realisation (``MAX_TREE_REALISATIONS``, 500,000) and the laws every
string of up to ``D + 1`` tokens (``MAX_TREE_STRINGS``, ``V**(D + 1) <= 2**22``); beyond either
it refuses with :class:`~spectr_audit.errors.InvalidArgument`, naming the size and the limit.
The realisations number ``prod_n V**c_n`` (``iid``) or ``prod_n V!/(V - c_n)!``
(``without_replacement``) over the nodes with children, fewer where draft probabilities are 0;
so, for instance, V = 2 reaches i.i.d. trees of 18 draft nodes, V = 3 the first 8 paths of
the Medusa repository's 63-path ``mc_sim_7b_63`` tree (6,561 i.i.d. realisations, a few seconds), V = 4
``DraftTree.cartesian([2, 2])`` (4,096, under a second), and ``topk`` / ``none`` any tree with
``V**(D + 1) <= 2**22`` (one realisation).  The time is about 0.5 ms per realisation on two CPU
cores; docs/audit/exact.md lists measured sizes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from spectr_audit import defaults
from spectr_audit.contract.tree import TREE_DRAFT_SCHEMES, DraftTree, topk_order
from spectr_audit.contract.tree_verifier import TreeVerifier, check_tree_output_probs
from spectr_audit.contract.convert import as_tree_verifier
from spectr_audit.drafting.models import Model, contexts_from
from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.iteration import ExactIterationResult, _accumulate, check_vocab, _law_fields, _product_grid

__all__ = [
    "MAX_TREE_REALISATIONS",
    "MAX_TREE_STRINGS",
    "ExactTreeResult",
    "TreeDraftEnumeration",
    "enumerate_tree_drafts",
    "exact_tree",
    "tree_enumeration_size",
]

#: Refuse enumerations with more realisations of the tree's drafts than this.
MAX_TREE_REALISATIONS = defaults.EXACT_MAX_TREE_REALISATIONS
#: Refuse trees whose strings of ``max_depth + 1`` tokens number more than this (``V ** (D + 1)``).
MAX_TREE_STRINGS = defaults.EXACT_MAX_TREE_STRINGS


@dataclasses.dataclass(frozen=True)
class TreeDraftEnumeration:
    """Every realisation of a tree's node tokens with positive probability, and the node conditionals.

    The conditionals are stored once per distinct token path (``path_draft_probs`` and
    ``path_target_probs``, rows indexed by :attr:`node_paths`); :meth:`chunk` materialises the
    verifier's inputs for a slice of realisations.
    """

    tree: DraftTree
    draft_scheme: str
    vocab_size: int
    # [num_realisations] float64
    weights: torch.Tensor
    # [num_realisations, num_nodes] int64; entry 0 (the root) is 0
    node_tokens: torch.Tensor
    # [num_realisations, num_nodes] int64: each node's token path as a base-V code within its depth
    path_codes: torch.Tensor
    # [num_paths, vocab_size] float64: the draft law after each path (depth-major, see path_row)
    path_draft_probs: torch.Tensor
    # [num_paths, vocab_size] float64: the target law after each path
    path_target_probs: torch.Tensor
    #: ``path_offsets[d]``: the first row of the depth-``d`` paths (``sum_{e < d} V**e``)
    path_offsets: tuple

    @property
    def num_realisations(self) -> int:
        return int(self.weights.numel())

    @property
    def node_paths(self) -> torch.Tensor:  # [num_realisations, num_nodes]
        """Row of each node's path in ``path_*_probs``."""
        offsets = torch.tensor([self.path_offsets[d] for d in self.tree.depths], dtype=torch.int64)
        return self.path_codes + offsets

    def chunk(self, rows: slice) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """``(node_tokens, draft_probs, target_probs)`` of the realisations in ``rows``, as the harness gives them.

        ``draft_probs`` rows of leaves are zero (never read), and ``None`` under scheme ``"none"``.
        """
        tokens = self.node_tokens[rows]
        paths = self.node_paths[rows]
        target = self.path_target_probs[paths]  # [n, num_nodes, V]
        if self.draft_scheme == "none":
            return tokens, None, target
        draft = self.path_draft_probs[paths]
        leaves = list(self.tree.leaves)
        draft[:, leaves] = 0.0
        return tokens, draft, target


def check_scheme(draft_scheme: str) -> str:
    if draft_scheme not in TREE_DRAFT_SCHEMES:
        raise InvalidArgument(f"draft_scheme: expected one of {TREE_DRAFT_SCHEMES}, got {draft_scheme!r}")
    return draft_scheme


def check_tree(tree: DraftTree) -> None:
    if not isinstance(tree, DraftTree):
        raise InvalidArgument(f"tree: expected a DraftTree, got {type(tree).__name__}")


def level_codes(tree: DraftTree, path_codes: torch.Tensor, vocab_size: int):
    """``(nodes, codes [n, |level|, V])`` per depth d = 0 .. D: the codes of the strings of d + 1 tokens a step
    may emit, the path to a node of depth d (``path_codes [n, num_nodes]``) then any token."""
    for depth in range(tree.max_depth + 1):
        nodes = list(tree.level(depth))
        yield nodes, path_codes[:, nodes].unsqueeze(-1) * vocab_size + torch.arange(vocab_size)


def tree_enumeration_size(tree: DraftTree, draft_scheme: str, vocab_size: int) -> int:
    """The number of realisations before zero-probability ones are dropped (an upper bound).

    Examples
    --------
    >>> tree_enumeration_size(DraftTree.cartesian([2, 1]), "iid", 3)   # 3**2 at the root, 3 at each child
    81
    >>> tree_enumeration_size(DraftTree.cartesian([2, 1]), "without_replacement", 3)
    54
    """
    check_scheme(draft_scheme)
    if draft_scheme in ("topk", "none"):
        return 1
    size = 1
    for kids in tree.children:
        if kids:
            size *= vocab_size ** len(kids) if draft_scheme == "iid" else math.perm(vocab_size, len(kids))
    return size


def _path_tables(model: Model, prefix: Sequence[int], vocab_size: int, max_depth: int) -> torch.Tensor:
    """The model's law after every token path of depth 0 .. ``max_depth``, depth-major: ``[sum_d V**d, V]``."""
    return torch.cat(
        [model(contexts_from(prefix, _product_grid(vocab_size, depth))).double() for depth in range(max_depth + 1)]
    )


def _choices(draft_scheme: str, vocab_size: int, num_children: int) -> torch.Tensor:  # [num_choices, num_children]
    """Every ordered choice of the children's tokens: all tuples (iid) or tuples of distinct tokens."""
    grid = _product_grid(vocab_size, num_children)
    if draft_scheme == "without_replacement":
        distinct = (grid.unsqueeze(2) != grid.unsqueeze(1)) | torch.eye(num_children, dtype=torch.bool)
        grid = grid[distinct.all(-1).all(-1)]
    return grid


def _choice_weights(dist: torch.Tensor, choices: torch.Tensor, draft_scheme: str) -> torch.Tensor:  # [R, C]
    """P(children = choice | parent's draft law) for every row's law ``dist [R, V]`` and every choice."""
    picked = dist[:, choices]  # [R, C, c]
    if draft_scheme == "iid":
        return picked.prod(-1)
    # Without replacement: the mass left before each pick, summed over the tokens not yet drawn
    # (1 - drawn mass would cancel when the last tokens carry tiny mass).
    num_children = choices.shape[1]
    drawn = torch.zeros(choices.shape[0], num_children, dist.shape[1], dtype=torch.bool)
    for i in range(1, num_children):
        drawn[:, i] = drawn[:, i - 1].scatter(1, choices[:, i - 1 : i], True)
    remaining = (dist.unsqueeze(1).unsqueeze(1) * ~drawn).sum(-1)  # [R, C, c]
    ratio = torch.where(remaining > 0, picked / torch.where(remaining > 0, remaining, torch.ones_like(remaining)),
                        torch.zeros_like(picked))
    return ratio.prod(-1)


def enumerate_tree_drafts(
    draft_model: Model,
    target_model: Model,
    tree: DraftTree,
    draft_scheme: str = "iid",
    prefix: Sequence[int] = (),
) -> TreeDraftEnumeration:
    """Every realisation of ``tree``'s node tokens under ``draft_scheme``, with its probability.

    Nodes with children are expanded in node order (a node's token is known before its children
    are drawn).  See the module docstring for the schemes and the limits.

    Raises
    ------
    InvalidArgument
        For a scheme that cannot draft the tree (more children than tokens to draw without
        replacement, a rank beyond the vocabulary under ``topk``), or an enumeration beyond
        ``MAX_TREE_REALISATIONS`` realisations or ``MAX_TREE_STRINGS`` strings.

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> draft, target = ContextFreeModel([0.6, 0.4]), ContextFreeModel([0.3, 0.7])
    >>> enum = enumerate_tree_drafts(draft, target, DraftTree.chains(2, 1), "iid")
    >>> enum.node_tokens.tolist(), [round(w, 2) for w in enum.weights.tolist()]
    ([[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]], [0.36, 0.24, 0.24, 0.16])
    >>> enumerate_tree_drafts(draft, target, DraftTree.chains(2, 1), "topk").node_tokens.tolist()
    [[0, 0, 1]]
    """
    check_tree(tree)
    check_scheme(draft_scheme)
    vocab_size = check_vocab(draft_model, target_model)
    num_strings = vocab_size ** (tree.max_depth + 1)
    if num_strings > MAX_TREE_STRINGS:
        raise InvalidArgument(
            f"tree: strings of up to max_depth + 1 = {tree.max_depth + 1} tokens over V = {vocab_size} number "
            f"{num_strings}, above the exact tree audit's limit of {MAX_TREE_STRINGS}; use the statistical audit"
        )
    if draft_scheme == "without_replacement" and tree.max_children > vocab_size:
        raise InvalidArgument(
            f"tree: a node has {tree.max_children} children, more than the {vocab_size} tokens to draw without replacement"
        )
    if draft_scheme in ("topk", "none") and max(tree.ranks) >= vocab_size:
        raise InvalidArgument(f"tree: a node has rank {max(tree.ranks)}, beyond the vocabulary of {vocab_size} tokens")
    offsets = [0]
    for depth in range(tree.max_depth + 1):
        offsets.append(offsets[-1] + vocab_size**depth)
    draft_table = _path_tables(draft_model, prefix, vocab_size, tree.max_depth)
    target_table = _path_tables(target_model, prefix, vocab_size, tree.max_depth)
    num_nodes = tree.num_nodes
    tokens = torch.zeros(1, num_nodes, dtype=torch.int64)
    codes = torch.zeros(1, num_nodes, dtype=torch.int64)
    weights = torch.ones(1, dtype=torch.float64)
    for node in tree.internal_nodes:
        kids = list(tree.children[node])
        dist = draft_table[offsets[tree.depths[node]] + codes[:, node]]  # [R, V]
        if draft_scheme in ("topk", "none"):
            ranks = torch.tensor([tree.ranks[c] for c in kids])
            tokens[:, kids] = topk_order(dist)[:, ranks]
        else:
            choices = _choices(draft_scheme, vocab_size, len(kids))  # [C, c]
            size = tokens.shape[0] * choices.shape[0]
            if size > MAX_TREE_REALISATIONS:
                raise InvalidArgument(
                    f"tree: the {draft_scheme!r} drafts over V = {vocab_size} of the {tree.describe()} reach {size} "
                    f"realisations at node {node} (at most {tree_enumeration_size(tree, draft_scheme, vocab_size)} in "
                    f"all), above the exact tree audit's limit of {MAX_TREE_REALISATIONS}; use the statistical audit"
                )
            joint = weights.unsqueeze(1) * _choice_weights(dist, choices, draft_scheme)  # [R, C]
            keep = joint.reshape(-1) > 0
            rows = torch.arange(tokens.shape[0]).repeat_interleave(choices.shape[0])[keep]
            picks = choices.repeat(tokens.shape[0], 1)[keep]
            tokens, codes, weights = tokens[rows], codes[rows], joint.reshape(-1)[keep]
            tokens[:, kids] = picks
        codes[:, kids] = codes[:, node].unsqueeze(1) * vocab_size + tokens[:, kids]
    return TreeDraftEnumeration(
        tree=tree,
        draft_scheme=draft_scheme,
        vocab_size=vocab_size,
        weights=weights,
        node_tokens=tokens,
        path_codes=codes,
        path_draft_probs=draft_table,
        path_target_probs=target_table,
        path_offsets=tuple(offsets),
    )


@dataclasses.dataclass(frozen=True)
class ExactTreeResult(ExactIterationResult):
    """Exact law of one tree verification step (an :class:`~spectr_audit.exact.iteration.ExactIterationResult`).

    The inherited fields read with ``num_drafts`` the root's number of children, ``draft_len``
    the tree's depth D (strings of up to ``D + 1`` tokens) and ``num_draft_tuples`` the number of
    realisations.
    """

    tree: DraftTree
    draft_scheme: str
    #: E[accepted draft tokens] = E[len(s)] - 1
    accepted_length: float
    #: P(exactly d draft tokens accepted), d = 0 .. D
    accepted_length_law: tuple

    @property
    def num_realisations(self) -> int:
        return self.num_draft_tuples


def _tree_emitted_laws(verifier: TreeVerifier, enumeration: TreeDraftEnumeration,
                       chunk_size: int) -> tuple[list, float]:
    """``E_m`` (the law of emitted strings of m + 1 tokens, m = 0 .. D) and the membership acceptance."""
    tree, vocab_size = enumeration.tree, enumeration.vocab_size
    emitted = [torch.zeros(vocab_size ** (m + 1), dtype=torch.float64) for m in range(tree.max_depth + 1)]
    membership = torch.zeros((), dtype=torch.float64)
    root_children = list(tree.level(1))
    for start in range(0, enumeration.num_realisations, chunk_size):
        rows = slice(start, start + chunk_size)
        tokens, draft_probs, target_probs = enumeration.chunk(rows)
        law = check_tree_output_probs(
            verifier.tree_output_probs(tree, tokens, draft_probs, target_probs).double(),
            tree, tokens.shape[0], vocab_size, who=verifier.name,
        )
        weighted = law * enumeration.weights[rows].view(-1, 1, 1)  # [n, N + 1, V]
        by_depth = level_codes(tree, enumeration.path_codes[rows], vocab_size)
        levels = [(strings, weighted[:, nodes]) for nodes, strings in by_depth]  # by depth
        # membership: the first emitted token is among the root's children's tokens
        membership += _accumulate(emitted, levels, tokens[:, root_children], weighted[:, 0], weighted[:, 1:])
    return emitted, float(membership)


def exact_tree(
    verifier,
    draft_model: Model,
    target_model: Model,
    tree: DraftTree,
    *,
    draft_scheme: Optional[str] = None,
    prefix: Sequence[int] = (),
    chunk_size: int = defaults.EXACT_TREE_CHUNK,
) -> ExactTreeResult:
    """Exact law of one step of a tree verifier on ``tree`` after ``prefix``, by enumerating realisations.

    Parameters
    ----------
    verifier : TreeVerifier, or anything :func:`~spectr_audit.contract.convert.as_tree_verifier` takes
        Must have an exact law (``tree_output_probs``).  A chain verifier runs on chain trees.
    draft_model, target_model : Model
        Context-free, Markov, or any :class:`~spectr_audit.drafting.models.Model`.
    tree : DraftTree
    draft_scheme : str, optional
        One of the verifier's ``draft_schemes``; defaults to its first.  A scheme the verifier does
        not declare is refused: it would be blamed for a scheme mismatch, not a bug.
    prefix : sequence of int
        The context before the step.
    chunk_size : int
        Realisations per ``tree_output_probs`` call (bounds memory).

    Returns
    -------
    ExactTreeResult

    Raises
    ------
    InvalidArgument
        A verifier without an exact law, a tree or scheme it does not support, or an enumeration
        beyond the limits (the module docstring states them).

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> from spectr_audit.verifiers.tree import TreeRecursiveRejection
    >>> tree = DraftTree.from_paths([(0,), (1,), (0, 0)])
    >>> audit = exact_tree(TreeRecursiveRejection(), ContextFreeModel([0.6, 0.4]), ContextFreeModel([0.3, 0.7]), tree)
    >>> audit.max_abs_error < 1e-12, audit.num_realisations
    (True, 8)
    >>> round(audit.accepted_length + 1, 12) == round(audit.block_efficiency, 12)
    True
    """
    verifier = as_tree_verifier(verifier)
    if not verifier.has_tree_law:
        raise InvalidArgument(
            f"verifier: {verifier.name!r} has no exact tree law (tree_output_probs); use the statistical audit"
        )
    check_tree(tree)
    verifier.check_supports_tree(tree)
    draft_scheme = draft_scheme or verifier.draft_schemes[0]
    check_scheme(draft_scheme)
    if draft_scheme not in verifier.draft_schemes:
        raise InvalidArgument(
            f"draft_scheme: {verifier.name!r} verifies drafts of the schemes {verifier.draft_schemes}; auditing it under "
            f"{draft_scheme!r} would blame it for a draft-scheme mismatch, not a bug"
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidArgument(f"chunk_size: expected a positive integer, got {chunk_size!r}")
    enumeration = enumerate_tree_drafts(draft_model, target_model, tree, draft_scheme, prefix)
    vocab_size = enumeration.vocab_size
    emitted, membership = _tree_emitted_laws(verifier, enumeration, chunk_size)
    length_law = tuple(float(e.sum()) for e in emitted)
    accepted_length = float(sum(m * mass for m, mass in enumerate(length_law)))
    return ExactTreeResult(
        vocab_size=vocab_size,
        num_drafts=len(tree.children[0]),
        draft_len=tree.max_depth,
        num_draft_tuples=enumeration.num_realisations,
        **_law_fields(target_model, prefix, emitted, vocab_size),
        block_efficiency=accepted_length + 1.0,
        acceptance=membership,
        tree=tree,
        draft_scheme=draft_scheme,
        accepted_length=accepted_length,
        accepted_length_law=length_law,
    )
