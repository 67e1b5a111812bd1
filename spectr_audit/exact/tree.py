"""Exact audit of one verification step by enumerating every realisation of a draft tree's drafts.

One enumeration for chains and trees: a chain of K drafts of L tokens is ``DraftTree.chains(K, L)``
(:func:`spectr_audit.exact.iteration.exact_iteration` is its chain face).  For a
:class:`~spectr_audit.contract.tree.DraftTree` and a draft scheme, every *realisation* of the node tokens
is enumerated with its probability (docs/audit/exact.md):

``iid``
    every child of node ``n`` drawn independently from the draft law at ``n``: ``V**c`` choices
    for a node with ``c`` children, each child's factor its draft probability;
``without_replacement``
    the children of ``n`` drawn one after another with the tokens already drawn removed:
    ``V! / (V - c)!`` ordered choices, each child's factor ``p(x_i) / (mass not yet drawn)``;
``topk``, ``none``
    deterministic: child of rank ``r`` is the ``r``-th most likely draft token (ties to the smallest
    id), one realisation of weight 1 (``none`` passes no draft probabilities to the verifier).

Given the root, the root's children's branches are independent: each branch is expanded on its own,
a realisation is one realisation of each branch, its weight the product over branches of the product
of each branch's factors, and realisations come lexicographic in the branches' tokens, branch by
branch: on chain trees, the order and the floating-point products of the chain contract's draft
tuples.  Realisations of probability 0 are left out.  The verifier's exact law (``tree_output_probs``)
is summed over them, weighted, into ``E(s)``, the law of the emitted string (1 to ``D + 1`` tokens,
``D = tree.max_depth``); from it (:mod:`spectr_audit.exact.law`) ``F(w)``, the law of the first
``D + 1`` tokens when decoding continues with the unmodified target, the prefix caps ``B(u) <= q(u)``,
membership acceptance (the first emitted token is one of the root's children's tokens) and the
expected accepted length ``E[len(s)] - 1``.

Reach
-----
The enumeration holds every realisation (``MAX_TREE_REALISATIONS``, 500,000) and the laws every
string of up to ``D + 1`` tokens (``MAX_TREE_STRINGS``, ``V**(D + 1) <= 2**22``); beyond either
it refuses with :class:`~spectr_audit.errors.InvalidArgument`, naming the size and the limit.
The realisations number ``prod_n V**c_n`` (``iid``) or ``prod_n V!/(V - c_n)!``
(``without_replacement``) over the nodes with children, fewer where draft probabilities are 0;
so, for instance, V = 2 reaches i.i.d. trees of 18 draft nodes, V = 3 the first 8 paths of
the Medusa repository's 63-path ``mc_sim_7b_63`` tree (6,561 i.i.d. realisations, 0.06 s), V = 4
``DraftTree.cartesian([2, 2])`` (4,096, 0.02 s), and ``topk`` / ``none`` any tree with
``V**(D + 1) <= 2**22`` (one realisation).  The time is about 10 to 20 microseconds per realisation on two
CPU cores; docs/audit/exact.md lists measured sizes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from spectr_audit import defaults
from spectr_audit.contract.tree import TREE_DRAFT_SCHEMES, DraftTree, topk_order
from spectr_audit._validation import check_simplex
from spectr_audit.contract.chain_trees import ChainVerifierAsTree, chain_node_index
from spectr_audit.contract.convert import as_tree_verifier
from spectr_audit.contract.tree_verifier import TreeVerifier, check_tree_inputs, check_tree_output_probs
from spectr_audit.contract.verifier import Verifier, check_output_probs, check_verify_inputs
from spectr_audit.drafting.models import Model, contexts_from
from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.law import ExactIterationResult, check_vocab, _law_fields, _product_grid

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

    def _offsets(self) -> torch.Tensor:  # [num_nodes]
        return torch.tensor([self.path_offsets[d] for d in self.tree.depths], dtype=torch.int64)

    @property
    def node_paths(self) -> torch.Tensor:  # [num_realisations, num_nodes]
        """Row of each node's path in ``path_*_probs``."""
        return self.path_codes + self._offsets()

    def chunk(self, rows: slice) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """``(node_tokens, draft_probs, target_probs)`` of the realisations in ``rows``, as the harness gives them.

        ``draft_probs`` rows of leaves are zero (never read), and ``None`` under scheme ``"none"``.
        """
        tokens = self.node_tokens[rows]
        paths = self.path_codes[rows] + self._offsets()
        target = self.path_target_probs[paths]  # [n, num_nodes, V]
        if self.draft_scheme == "none":
            return tokens, None, target
        draft = self.path_draft_probs[paths]
        leaves = list(self.tree.leaves)
        draft[:, leaves] = 0.0
        return tokens, draft, target

    def chain_chunk(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(draft_tokens, draft_probs, target_probs)`` of the realisations in ``rows`` in the chain contract's shape
        (``[n, K, L]``, ``[n, K, L, V]``, ``[n, K, L + 1, V]``), gathered from the path tables in one step; the tree
        must be ``DraftTree.chains(K, L)`` (the rows are those :meth:`chunk` gives, laid out by draft)."""
        shape = self.tree.as_chains()
        if shape is None:
            raise InvalidArgument(f"tree: expected a chain tree (DraftTree.chains(K, L)), got {self.tree.describe()}")
        num_drafts, draft_len = shape
        index = chain_node_index(num_drafts, draft_len)  # [K, L + 1]: draft k's node at depth d
        paths = self.path_codes[rows][:, index] + torch.tensor(self.path_offsets[: draft_len + 1])  # [n, K, L + 1]
        tokens = self.node_tokens[rows][:, index[:, 1:]]
        return tokens, self.path_draft_probs[paths[:, :, :-1]], self.path_target_probs[paths]


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


def _path_table(model: Model, prefix: Sequence[int], vocab_size: int, max_depth: int) -> torch.Tensor:
    """The model's law after every token path of depth 0 .. ``max_depth``, depth-major: ``[sum_d V**d, V]``."""
    return torch.cat(
        [model(contexts_from(prefix, _product_grid(vocab_size, depth))).double() for depth in range(max_depth + 1)]
    )


def path_tables(draft_model: Model, target_model: Model, prefix: Sequence[int], vocab_size: int,
                max_depth: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """``(draft_table, target_table, offsets)``: both models' laws after every path of depth 0 .. ``max_depth``
    (``[sum_d V**d, V]``, depth-major) and ``offsets[d]``, the first row of the depth-``d`` paths."""
    offsets = [0]
    for depth in range(max_depth + 1):
        offsets.append(offsets[-1] + vocab_size**depth)
    return (_path_table(draft_model, prefix, vocab_size, max_depth), _path_table(target_model, prefix, vocab_size,
            max_depth), offsets)


def _choices(draft_scheme: str, vocab_size: int, num_children: int) -> torch.Tensor:  # [num_choices, num_children]
    """Every ordered choice of the children's tokens: all tuples (iid) or tuples of distinct tokens."""
    grid = _product_grid(vocab_size, num_children)
    if draft_scheme == "without_replacement":
        grid = grid[distinct_rows(grid)]
    return grid


def child_factors(dist: torch.Tensor, picks: torch.Tensor, draft_scheme: str) -> torch.Tensor:  # [R, c]
    """Each child's factor of P(children = picks | parent's draft law ``dist [R, V]``): its draft probability
    (``iid``), or its probability over the mass not yet drawn among its siblings (``without_replacement``)."""
    picked = dist.gather(1, picks)
    if draft_scheme == "iid":
        return picked
    # The mass left before each pick, summed over the tokens not yet drawn (1 - drawn mass would cancel
    # when the last tokens carry tiny mass).
    num_children = picks.shape[1]
    drawn = torch.zeros(picks.shape[0], num_children, dist.shape[1], dtype=torch.bool)
    for i in range(1, num_children):
        drawn[:, i] = drawn[:, i - 1].scatter(1, picks[:, i - 1 : i], True)
    remaining = torch.where(drawn, 0.0, dist.unsqueeze(1)).sum(-1)  # [R, c]
    return torch.where(remaining > 0, picked / torch.where(remaining > 0, remaining, torch.ones_like(remaining)),
                       torch.zeros_like(picked))


def branches(tree: DraftTree) -> list:
    """The nodes of each root child's branch (the child, then its descendants, in node order), in rank order."""
    out = []
    for child in tree.children[0]:
        nodes, stack = [], [child]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(tree.children[node])
        out.append(sorted(nodes))
    return out


def _refuse_size(tree: DraftTree, draft_scheme: str, vocab_size: int, size: int, node: int, limit: int) -> None:
    if size > limit:
        raise InvalidArgument(
            f"tree: the {draft_scheme!r} drafts over V = {vocab_size} of the {tree.describe()} reach {size} "
            f"realisations at node {node} (at most {tree_enumeration_size(tree, draft_scheme, vocab_size)} in "
            f"all), above the exact audit's limit of {limit}; use the statistical audit"
        )


def branch_realisations(tree: DraftTree, nodes: list, draft_scheme: str, root_law: torch.Tensor, tables: tuple,
                         others: int, limit: int):
    """Every realisation of one branch with positive probability: ``(tokens, codes, factors)``, each
    ``[R, num_nodes]`` (zero / one outside the branch), lexicographic in the branch's tokens in node order.

    ``factors`` holds each non-root node's factor of the draft probability, except the branch's own first
    token, whose factor under ``without_replacement`` depends on its siblings' tokens (set by the caller);
    ``others`` is the product of the earlier branches' sizes (for the size limit).
    """
    draft_table, offsets = tables
    vocab_size, num_nodes, child = root_law.shape[0], tree.num_nodes, nodes[0]
    keep = root_law > 0
    count = int(keep.sum())
    tokens = torch.zeros(count, num_nodes, dtype=torch.int64)
    tokens[:, child] = torch.arange(vocab_size)[keep]
    codes = tokens.clone()
    factors = torch.ones(count, num_nodes, dtype=torch.float64)
    running = root_law[keep]  # the branch's probability so far, to leave out what has none
    for node in nodes:
        kids = list(tree.children[node])
        if not kids:
            continue
        choices = _choices(draft_scheme, vocab_size, len(kids))  # [C, c]
        _refuse_size(tree, draft_scheme, vocab_size, others * tokens.shape[0] * choices.shape[0], node, limit)
        dist = draft_table[offsets[tree.depths[node]] + codes[:, node]]  # [R, V]
        rows = torch.arange(tokens.shape[0]).repeat_interleave(choices.shape[0])
        picks = choices.repeat(tokens.shape[0], 1)
        step = child_factors(dist[rows], picks, draft_scheme)  # [R * C, c]
        joint = running[rows] * step.prod(-1)
        positive = joint > 0
        rows, picks, step, running = rows[positive], picks[positive], step[positive], joint[positive]
        tokens, codes, factors = tokens[rows], codes[rows], factors[rows]
        tokens[:, kids], factors[:, kids] = picks, step
        codes[:, kids] = codes[:, node].unsqueeze(1) * vocab_size + picks
    return tokens, codes, factors


def distinct_rows(tokens: torch.Tensor) -> torch.Tensor:  # [R] bool
    """Which rows of ``tokens [R, c]`` hold ``c`` distinct tokens (siblings drawn without replacement)."""
    return ((tokens.unsqueeze(2) != tokens.unsqueeze(1)) | torch.eye(tokens.shape[1], dtype=torch.bool)).all(-1).all(-1)


def check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidArgument(f"chunk_size: expected a positive integer, got {chunk_size!r}")


def mixed_grid(sizes: Sequence[int]) -> torch.Tensor:  # [prod(sizes), len(sizes)] int64
    """Every index tuple, the last fastest (``itertools.product(*map(range, sizes))``)."""
    grid = torch.zeros(1, 0, dtype=torch.int64)
    for size in sizes:
        grid = torch.cat([grid.repeat_interleave(size, 0), torch.arange(size).repeat(grid.shape[0]).unsqueeze(1)], 1)
    return grid


def _realisations(tree: DraftTree, draft_scheme: str, draft_table: torch.Tensor, offsets: list, limit: int):
    """``(node_tokens, path_codes, weights)`` of every realisation with positive probability.

    The root's children and their branches are drawn independently given the root (under
    ``without_replacement`` the root's children are distinct), so a realisation is one realisation of
    each branch; its weight is the product over branches of the product of the branch's factors.
    Realisations come lexicographic in the branches' tokens, branch by branch: on
    ``DraftTree.chains(K, L)`` the order and the floating-point products of the chain contract's draft
    tuples (docs/audit/exact.md).
    """
    root_law, vocab_size = draft_table[0], draft_table.shape[1]
    kids = list(tree.children[0])
    tree_branches = branches(tree)
    lists, others = [], 1
    for nodes in tree_branches:
        lists.append(branch_realisations(tree, nodes, draft_scheme, root_law, (draft_table, offsets), others, limit))
        others *= lists[-1][0].shape[0]
        _refuse_size(tree, draft_scheme, vocab_size, others, nodes[0], limit)
    grid = mixed_grid([tokens.shape[0] for tokens, _, _ in lists])  # [G, K]
    tokens = torch.zeros(grid.shape[0], tree.num_nodes, dtype=torch.int64)
    codes = torch.zeros_like(tokens)
    factors = torch.ones(grid.shape[0], tree.num_nodes, dtype=torch.float64)
    for column, (nodes, (branch_tokens, branch_codes, branch_factors)) in enumerate(zip(tree_branches, lists)):
        rows = grid[:, column]
        tokens[:, nodes], codes[:, nodes] = branch_tokens[:, nodes][rows], branch_codes[:, nodes][rows]
        factors[:, nodes] = branch_factors[:, nodes][rows]
    if draft_scheme == "without_replacement":
        distinct = distinct_rows(tokens[:, kids])
        tokens, codes, factors = tokens[distinct], codes[distinct], factors[distinct]
    factors[:, kids] = child_factors(root_law.expand(tokens.shape[0], vocab_size), tokens[:, kids], draft_scheme)
    weights = torch.stack([factors[:, nodes].prod(-1) for nodes in tree_branches], dim=1).prod(-1)
    positive = weights > 0
    return tokens[positive], codes[positive], weights[positive]


def enumerate_tree_drafts(
    draft_model: Model,
    target_model: Model,
    tree: DraftTree,
    draft_scheme: str = "iid",
    prefix: Sequence[int] = (),
    *,
    max_realisations: int = MAX_TREE_REALISATIONS,
) -> TreeDraftEnumeration:
    """Every realisation of ``tree``'s node tokens under ``draft_scheme``, with its probability.

    A node's token is known before its children are drawn; the root's children's branches are
    independent given the root (distinct first tokens without replacement).  See the module docstring
    for the schemes and the limits; ``max_realisations`` is the limit on realisations.

    Raises
    ------
    InvalidArgument
        For a scheme that cannot draft the tree (more children than tokens to draw without
        replacement, a rank beyond the vocabulary under ``topk``), drafts with no realisation of
        positive probability, or an enumeration beyond ``max_realisations`` realisations or
        ``MAX_TREE_STRINGS`` strings.

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
    draft_table, target_table, offsets = path_tables(draft_model, target_model, prefix, vocab_size, tree.max_depth)
    if draft_scheme in ("topk", "none"):
        tokens = torch.zeros(1, tree.num_nodes, dtype=torch.int64)
        codes = torch.zeros(1, tree.num_nodes, dtype=torch.int64)
        for node in tree.internal_nodes:
            kids = list(tree.children[node])
            dist = draft_table[offsets[tree.depths[node]] + codes[:, node]]  # [1, V]
            tokens[:, kids] = topk_order(dist)[:, torch.tensor([tree.ranks[c] for c in kids])]
            codes[:, kids] = codes[:, node].unsqueeze(1) * vocab_size + tokens[:, kids]
        weights = torch.ones(1, dtype=torch.float64)
    else:
        tokens, codes, weights = _realisations(tree, draft_scheme, draft_table, offsets, max_realisations)
        if weights.numel() == 0:
            raise InvalidArgument(
                f"draft_model: the {draft_scheme!r} drafts of the {tree.describe()} have no realisation of positive "
                "probability (too few tokens of positive draft probability for the children to draw)"
            )
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


def _membership_slots(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots, live)``, each ``[K, 1 + width]``: the nodes of each branch after a leading slot, padded to the
    widest branch (``live`` marks the branch's nodes).  Membership sums the deeper nodes' mass in this layout,
    branch by branch: on ``DraftTree.chains(K, L)`` the chain contract's ``[K, L + 1]`` layout, so that chains
    keep the chain audit's floating-point sum."""
    nodes = branches(tree)
    width = max(len(b) for b in nodes)
    slots = torch.tensor([[0] + b + [0] * (width - len(b)) for b in nodes], dtype=torch.int64)
    live = torch.tensor([[False] + [True] * len(b) + [False] * (width - len(b)) for b in nodes])
    return slots, live


def _rows_checked(enumeration: TreeDraftEnumeration, tree: DraftTree, with_draft: bool) -> None:
    """Check the rows of the path tables that some realisation reads (every chunk is built from them)."""
    paths = enumeration.node_paths

    def used(columns) -> torch.Tensor:  # the table rows some realisation reads, in table order
        mask = torch.zeros(enumeration.path_target_probs.shape[0], dtype=torch.bool)
        mask[paths[:, columns].reshape(-1)] = True
        return mask

    check_simplex("target_probs", enumeration.path_target_probs[used(slice(None))])
    if with_draft:
        check_simplex("draft_probs", enumeration.path_draft_probs[used(list(tree.internal_nodes))])


def _tree_validated_once(verifier: TreeVerifier, enumeration: TreeDraftEnumeration) -> bool:
    """Check the verifier's inputs once, where its ``tree_output_probs`` is the contract's entry point (it takes
    ``validate=False``): the rows the realisations use, and one realisation's inputs in full (shapes, tokens,
    schemes), instead of every chunk's copies of them.  False (each chunk is checked) otherwise."""
    if not verifier.standard_entry("tree_output_probs"):
        return False
    tree = enumeration.tree
    tokens, draft_probs, target_probs = enumeration.chunk(slice(0, 1))
    check_tree_inputs(tree, tokens, draft_probs, target_probs, verifier.draft_schemes, who=repr(verifier.name))
    _rows_checked(enumeration, tree, draft_probs is not None)
    return True


def _chain_validated_once(verifier: Verifier, enumeration: TreeDraftEnumeration) -> bool:
    """:func:`_tree_validated_once` for a chain verifier's ``output_probs``, in the chain contract's terms."""
    if not verifier.standard_entry("output_probs"):
        return False
    check_verify_inputs(*enumeration.chain_chunk(slice(0, 1)))
    _rows_checked(enumeration, enumeration.tree, True)
    return True


def _tree_face(verifier: TreeVerifier, enumeration: TreeDraftEnumeration):
    """The weighted law of a chunk of realisations from a tree verifier's ``tree_output_probs`` on the tree's rows:
    ``rows -> (levels, deeper)`` (see :func:`emitted_laws`)."""
    tree, vocab_size = enumeration.tree, enumeration.vocab_size
    law_kwargs = {"validate": False} if _tree_validated_once(verifier, enumeration) else {}
    levels = [list(tree.level(depth)) for depth in range(tree.max_depth + 1)]
    slots, live = _membership_slots(tree)
    padded = not bool(live[:, 1:].all())  # branches of unequal sizes (never on chain trees)
    live = live.view(1, *live.shape, 1)

    def weighted_law(rows: slice):
        tokens, draft_probs, target_probs = enumeration.chunk(rows)
        law = check_tree_output_probs(
            verifier.tree_output_probs(tree, tokens, draft_probs, target_probs, **law_kwargs).double(),
            tree, tokens.shape[0], vocab_size, who=verifier.name,
        )
        weighted = law * enumeration.weights[rows].view(-1, 1, 1)  # [n, N + 1, V]
        deeper = weighted[:, slots]
        if padded:
            deeper = torch.where(live, deeper, torch.zeros((), dtype=torch.float64))
        return [weighted[:, nodes[0] : nodes[-1] + 1] for nodes in levels], deeper[:, :, 1:]

    return weighted_law


def _chain_face(verifier: Verifier, enumeration: TreeDraftEnumeration):
    """The weighted law of a chunk of realisations of ``DraftTree.chains(K, L)`` from a chain verifier's own
    ``output_probs`` on the chain contract's rows (:meth:`TreeDraftEnumeration.chain_chunk`), checked in the chain
    contract's words: ``rows -> (levels, deeper)`` (see :func:`emitted_laws`).

    The arithmetic is the tree face's on the chain law seen as a tree law (every draft's "nothing accepted" summed
    into the root, then weighted), so both faces give the same bits.
    """
    num_drafts, draft_len = enumeration.tree.as_chains()
    vocab_size = enumeration.vocab_size
    law_kwargs = {"validate": False} if _chain_validated_once(verifier, enumeration) else {}
    buffer: list = []  # the weighted law, one allocation for every chunk (a fresh one costs page faults)

    def weighted_law(rows: slice):
        tokens, draft_probs, target_probs = enumeration.chain_chunk(rows)
        law = check_output_probs(verifier.output_probs(tokens, draft_probs, target_probs, **law_kwargs),
                                 tokens.shape[0], num_drafts, draft_len, vocab_size, who=verifier.name).double()
        weights = enumeration.weights[rows]
        root = law[:, :, 0].sum(1, keepdim=True).mul_(weights.view(-1, 1, 1))  # [n, 1, V]
        if not buffer:
            buffer.append(torch.empty(law.shape, dtype=torch.float64))
        weighted = torch.mul(law, weights.view(-1, 1, 1, 1), out=buffer[0][: law.shape[0]])  # [n, K, L + 1, V]
        return [root] + [weighted[:, :, depth] for depth in range(1, draft_len + 1)], weighted[:, :, 1:]

    return weighted_law


def emitted_laws(verifier, enumeration: TreeDraftEnumeration, chunk_size: int) -> tuple[list, float]:
    """``E_m`` (the law of emitted strings of m + 1 tokens, m = 0 .. D) and the membership acceptance, over every
    realisation: the verifier's law of each chunk of realisations, weighted.

    Each chunk is built once, in the form the verifier takes: a :class:`~spectr_audit.contract.tree_verifier.TreeVerifier`
    gets the tree's rows (its ``tree_output_probs``); a chain :class:`~spectr_audit.contract.verifier.Verifier` (on
    ``DraftTree.chains(K, L)``) the chain contract's rows (its ``output_probs``).  A face gives, per chunk, the
    weighted law of each depth's nodes (``[n, |level|, V]``) and the drafted nodes' mass in the chain layout of the
    root's children's branches, which membership sums.
    """
    tree, vocab_size = enumeration.tree, enumeration.vocab_size
    weighted_law = (_chain_face if isinstance(verifier, Verifier) else _tree_face)(verifier, enumeration)
    emitted = [torch.zeros(vocab_size ** (m + 1), dtype=torch.float64) for m in range(tree.max_depth + 1)]
    membership = torch.zeros((), dtype=torch.float64)
    root_children = list(tree.level(1))
    for start in range(0, enumeration.num_realisations, chunk_size):
        rows = slice(start, start + chunk_size)
        levels, deeper = weighted_law(rows)
        for depth, (mass, (_, strings)) in enumerate(zip(levels, level_codes(tree, enumeration.path_codes[rows],
                                                                              vocab_size))):
            emitted[depth].scatter_add_(0, strings.reshape(-1), mass.reshape(-1))
        # membership: the first emitted token is among the root's children's tokens
        root = levels[0][:, 0]
        first = torch.zeros(root.shape, dtype=torch.bool).scatter(1, enumeration.node_tokens[rows][:, root_children], True)
        membership += deeper.sum() + (root * first).sum()
    return emitted, float(membership)


def block_efficiency(emitted: list) -> float:
    """``E[len(s)]``, the mean emitted length, from the emitted laws ``E_m``."""
    lengths = torch.arange(1, len(emitted) + 1, dtype=torch.float64)
    return float(sum(lengths[m] * emitted[m].sum() for m in range(len(emitted))))


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
    check_chunk_size(chunk_size)
    enumeration = enumerate_tree_drafts(draft_model, target_model, tree, draft_scheme, prefix)
    vocab_size = enumeration.vocab_size
    # a chain verifier on a chain tree takes its chunks in the chain contract's shape
    face = verifier.verifier if isinstance(verifier, ChainVerifierAsTree) else verifier
    emitted, membership = emitted_laws(face, enumeration, chunk_size)
    length_law = tuple(float(e.sum()) for e in emitted)
    accepted_length = float(sum(m * mass for m, mass in enumerate(length_law)))
    return ExactTreeResult(
        vocab_size=vocab_size,
        num_drafts=len(tree.children[0]),
        draft_len=tree.max_depth,
        num_draft_tuples=enumeration.num_realisations,
        **_law_fields(target_model, prefix, emitted, vocab_size),
        block_efficiency=block_efficiency(emitted),
        acceptance=membership,
        tree=tree,
        draft_scheme=draft_scheme,
        accepted_length=accepted_length,
        accepted_length_law=length_law,
    )
