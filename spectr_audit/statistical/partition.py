"""The prefix-tree partition of V^N that the statistical audit counts completed strings on.

A :class:`PrefixPartition` is grown from the root: a node u is split into its children only
while their expected counts are large enough, and a node's rare children share one cell.  When
V^N is small and the sample large, every string is its own cell (the full V^N partition);
otherwise a string's cell is "all strings that start with u" for its deepest tree node u (or "u
followed by a rare token").  The tree needs target calls only at candidate nodes, so it also
serves Markov and other context-dependent targets and large vocabularies
(docs/audit/statistical.md, "The partition").

:meth:`PrefixPartition.truncation` coarsens a partition to the first d tokens
(:class:`Truncation`): the cells the audit's per-depth tests and intervals count on.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from spectr_audit import defaults
from spectr_audit.drafting.models import PAD, Model, contexts_from
from spectr_audit.errors import InvalidArgument

__all__ = ["IMPOSSIBLE", "PREFIX", "PrefixPartition", "RARE", "Truncation", "build_partition"]

#: Target-model calls while building a partition use at most this many contexts at once.
_MODEL_BATCH = 65536


# ---------------------------------------------------------------------------------------------
# The partition of V^N
# ---------------------------------------------------------------------------------------------


#: Kinds of cells: all strings starting with a prefix u; u followed by any of its rare next
#: tokens; u followed by any token the target never emits there.
PREFIX, RARE, IMPOSSIBLE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class PrefixPartition:
    """A partition of the strings of length N by a prefix tree.

    A cell is one of: every string that starts with a prefix u (``PREFIX``; a single string
    when ``len(u) = N``); every string that continues u with one of its *rare* next tokens
    (``RARE``: tokens whose expected count is too small for a cell of their own); every string
    that continues u with a token of target probability 0 there (``IMPOSSIBLE``).

    Attributes
    ----------
    vocab_size, num_tokens : int
        V and N.
    expanded_row : torch.Tensor
        ``[num_nodes]`` int64: the row of ``children`` of a split node, -1 for a leaf.
    children : torch.Tensor
        ``[num_split, vocab_size]`` int64: the child node of each split node for each token
        (rare tokens share one leaf, impossible tokens another).
    leaf_cell : torch.Tensor
        ``[num_nodes]`` int64: the cell index of a leaf, -1 for a split node.
    cell_probs : torch.Tensor
        ``[num_cells]`` float64: target probability of each cell.
    cell_strings : torch.Tensor
        ``[num_cells, num_tokens]`` int64: the prefix u of each cell, ``PAD`` after it.
    cell_depth : torch.Tensor
        ``[num_cells]`` int64: ``len(u)``.
    cell_kind : torch.Tensor
        ``[num_cells]`` int64: ``PREFIX``, ``RARE`` or ``IMPOSSIBLE``.
    """

    vocab_size: int
    num_tokens: int
    # [num_nodes]
    expanded_row: torch.Tensor
    # [num_split, vocab_size]
    children: torch.Tensor
    # [num_nodes]
    leaf_cell: torch.Tensor
    # [num_cells]
    cell_probs: torch.Tensor
    # [num_cells, num_tokens]
    cell_strings: torch.Tensor
    # [num_cells]
    cell_depth: torch.Tensor
    # [num_cells]
    cell_kind: torch.Tensor

    @property
    def num_cells(self) -> int:
        """Number of cells (leaves of the prefix tree)."""
        return int(self.cell_probs.numel())

    @property
    def is_full(self) -> bool:
        """Whether every string of positive probability is its own cell (the full V^N partition)."""
        positive = self.cell_kind != IMPOSSIBLE
        return bool(((self.cell_depth == self.num_tokens) & (self.cell_kind == PREFIX))[positive].all())

    def cells_of(self, strings: torch.Tensor) -> torch.Tensor:  # [n]
        """Cell index of each completed string ``strings [n, num_tokens]`` (a walk down the tree)."""
        expanded_row = self.expanded_row.to(strings.device)
        children = self.children.to(strings.device)
        node = torch.zeros(strings.shape[0], dtype=torch.int64, device=strings.device)
        for depth in range(self.num_tokens):
            row = expanded_row[node]
            split = row >= 0
            child = children[row.clamp(min=0), strings[:, depth]]
            node = torch.where(split, child, node)
        return self.leaf_cell.to(strings.device)[node]

    def describe(self, cell: int) -> str:
        """A readable cell name: ``"3 1 4"``, ``"3 1 *"`` (strings starting 3 1), ``"3 (rare) *"``."""
        depth = int(self.cell_depth[cell])
        kind = int(self.cell_kind[cell])
        tokens = [str(t) for t in self.cell_strings[cell, :depth].tolist()]
        if kind != PREFIX:
            tokens.append("(rare)" if kind == RARE else "(impossible)")
        return " ".join(tokens + (["*"] if len(tokens) < self.num_tokens else []))

    def truncation(self, depth: int) -> "Truncation":
        """This partition coarsened to the first ``depth`` tokens (``1 <= depth <= num_tokens``).

        A cell defined by at most ``depth`` tokens (``u *`` with ``len(u) <= depth``, or ``u``
        followed by a rare or impossible token with ``len(u) < depth``) stays a cell; the cells
        defined by more tokens are merged by their first ``depth`` tokens into ``u[:depth] *``.
        The result is a coarsening of this partition, so every TV distance on it is at most the
        one on this partition, and a test on it sees the law of the first ``depth`` tokens.

        Examples
        --------
        >>> from spectr_audit.drafting.models import ContextFreeModel
        >>> full = build_partition(ContextFreeModel([0.5, 0.3, 0.2]), 2, num_samples=10_000)
        >>> first = full.truncation(1)
        >>> first.num_cells, [round(float(p), 6) for p in first.cell_probs]
        (3, [0.5, 0.3, 0.2])
        >>> first.describe(int(first.mapping[int(full.cells_of(torch.tensor([[2, 1]]))[0])]))
        '2 *'
        """
        if not 1 <= int(depth) <= self.num_tokens:
            raise InvalidArgument(f"depth: expected 1 to {self.num_tokens}, got {depth!r}")
        depth = int(depth)
        defining = self.cell_depth + (self.cell_kind != PREFIX).long()
        merged = defining > depth
        kept = (~merged).nonzero().squeeze(1)
        mapping = torch.empty(self.num_cells, dtype=torch.int64)
        mapping[kept] = torch.arange(kept.numel(), dtype=torch.int64)
        groups = torch.zeros(0, depth, dtype=torch.int64)
        if bool(merged.any()):
            groups, inverse = torch.unique(self.cell_strings[merged, :depth], dim=0, return_inverse=True)
            mapping[merged] = kept.numel() + inverse
        num_cells = kept.numel() + groups.shape[0]
        probs = torch.zeros(num_cells, dtype=torch.float64).index_add_(0, mapping, self.cell_probs.double())
        return Truncation(self, depth, mapping, probs, kept, groups)

    def summary(self) -> str:
        """The partition in words, as reports state it.

        Examples
        --------
        >>> from spectr_audit.drafting.models import ContextFreeModel
        >>> build_partition(ContextFreeModel([0.5, 0.3, 0.2]), 2, num_samples=10_000).summary()
        '9 cells: every string of V^2 its own cell (V = 3)'
        >>> build_partition(ContextFreeModel([0.5, 0.3, 0.2]), 2, num_samples=30).summary()
        '4 cells: a prefix tree of V^2 (V = 3), cells of depth 1-2: 3 prefix, 1 rare-token, 0 impossible'
        """
        kinds = [int((self.cell_kind == kind).sum()) for kind in (PREFIX, RARE, IMPOSSIBLE)]
        if self.is_full:
            impossible = f", {kinds[2]} impossible" if kinds[2] else ""
            return f"{self.num_cells} cells: every string of V^{self.num_tokens} its own cell (V = {self.vocab_size}{impossible})"
        low, high = int(self.cell_depth.min()), int(self.cell_depth.max())
        depths = f"{low}" if low == high else f"{low}-{high}"
        return (f"{self.num_cells} cells: a prefix tree of V^{self.num_tokens} (V = {self.vocab_size}), cells of depth "
                f"{depths}: {kinds[0]} prefix, {kinds[1]} rare-token, {kinds[2]} impossible")


@dataclasses.dataclass(frozen=True)
class Truncation:
    """A :class:`PrefixPartition` coarsened to the first ``depth`` tokens (:meth:`PrefixPartition.truncation`).

    Attributes
    ----------
    partition : PrefixPartition
        The partition it coarsens.
    depth : int
    mapping : torch.Tensor
        ``[partition.num_cells]`` int64: the truncated cell of each cell of ``partition``.
    cell_probs : torch.Tensor
        ``[num_cells]`` float64: target probability of each truncated cell.
    kept : torch.Tensor
        ``[num_kept]`` int64: the cells of ``partition`` that stay cells (the first ``num_kept`` cells).
    groups : torch.Tensor
        ``[num_groups, depth]`` int64: the prefix of each merged cell (the cells after the kept ones).
    """

    partition: PrefixPartition
    depth: int
    # [partition.num_cells]
    mapping: torch.Tensor
    # [num_cells]
    cell_probs: torch.Tensor
    # [num_kept]
    kept: torch.Tensor
    # [num_groups, depth]
    groups: torch.Tensor

    @property
    def num_cells(self) -> int:
        """Number of truncated cells."""
        return int(self.cell_probs.numel())

    def counts(self, counts: torch.Tensor) -> torch.Tensor:  # [num_cells]
        """Counts over ``partition``'s cells ``[partition.num_cells]`` summed into the truncated cells."""
        counts = counts.detach().cpu().double()
        return torch.zeros(self.num_cells, dtype=torch.float64).index_add_(0, self.mapping, counts)

    def describe(self, cell: int) -> str:
        """A readable cell name, as :meth:`PrefixPartition.describe` (``"3 1 *"``: strings starting 3 1)."""
        num_kept = int(self.kept.numel())
        if cell < num_kept:
            return self.partition.describe(int(self.kept[cell]))
        tokens = [str(t) for t in self.groups[cell - num_kept].tolist()]
        return " ".join(tokens + ["*"])


@dataclasses.dataclass
class _Growth:
    """The prefix tree while it grows: nodes are numbered in creation order (the root is 0)."""

    num_nodes: int = 1
    num_cells: int = 1
    #: per split level: the ids of its split nodes, and their children ``[num_split, vocab_size]``
    split_ids: list = dataclasses.field(default_factory=list)
    split_children: list = dataclasses.field(default_factory=list)
    #: (ids, probs, strings [m, depth], depth, kind) of each batch of leaves, in cell order
    leaves: list = dataclasses.field(default_factory=list)


def _next_token_probs(target_model: Model, prefix: Sequence[int], strings: torch.Tensor, device) -> torch.Tensor:
    """The target's conditionals ``[num_strings, vocab_size]`` after ``prefix + u`` for each row u (float64, CPU)."""
    return torch.cat([
        target_model(contexts_from(prefix, strings[i : i + _MODEL_BATCH].to(device))).double().cpu()
        for i in range(0, strings.shape[0], _MODEL_BATCH)
    ])


def _worth_splitting(child_probs, parent_probs, depth, num_samples, min_expected, num_cells, max_cells):
    """Which candidate nodes split (most probable first, within ``max_cells``); their children's kinds.

    Returns ``(worth, big, zero, rare, new_cells)``: the nodes to split, each child's kind (a cell
    of its own, target probability 0, rare), and the cells each split would add.
    """
    big = num_samples * child_probs >= min_expected
    zero = child_probs <= 0
    rare = ~big & ~zero
    num_big = big.sum(1)
    rare_mass = (child_probs * rare).sum(1)
    worth = (num_big >= 2) | ((num_big == 1) & (num_samples * rare_mass >= min_expected))
    if depth == 0:
        worth = torch.ones_like(worth)
    # Each split turns one cell into (#big + rare lump + impossible lump) cells.
    new_cells = num_big + rare.any(1).long() + zero.any(1).long() - 1
    order = torch.argsort(torch.where(worth, parent_probs, torch.full_like(rare_mass, -1.0)), descending=True)
    budget_ok = torch.zeros_like(worth)
    budget_ok[order] = (num_cells + new_cells[order].cumsum(0)) <= max_cells
    worth &= budget_ok | (depth == 0)
    return worth, big, zero, rare, new_cells


def _split_nodes(growth: _Growth, depth, ids, child_probs, strings, big, zero, rare, new_cells, vocab_size):
    """Split the nodes ``ids``: number their children, record the rare and impossible lumps as leaves.

    Returns the next level's open nodes: ``(ids, probs, strings [m, depth + 1])`` of the big children.
    """
    num_split = ids.numel()
    growth.num_cells += int(new_cells.sum())
    # Child ids: one per big child, then one rare lump and one impossible lump per node that has them.
    big_ids = growth.num_nodes + big.reshape(-1).long().cumsum(0).reshape(num_split, vocab_size) - 1
    growth.num_nodes += int(big.sum())
    has_rare, has_zero = rare.any(1), zero.any(1)
    rare_ids = growth.num_nodes + has_rare.long().cumsum(0) - 1
    growth.num_nodes += int(has_rare.sum())
    zero_ids = growth.num_nodes + has_zero.long().cumsum(0) - 1
    growth.num_nodes += int(has_zero.sum())
    children = torch.where(big, big_ids, torch.where(zero, zero_ids.unsqueeze(1), rare_ids.unsqueeze(1)))
    growth.split_ids.append(ids)
    growth.split_children.append(children)
    growth.leaves.append((rare_ids[has_rare], (child_probs * rare).sum(1)[has_rare], strings[has_rare], depth, RARE))
    growth.leaves.append((zero_ids[has_zero], torch.zeros(int(has_zero.sum()), dtype=torch.float64),
                          strings[has_zero], depth, IMPOSSIBLE))
    tokens = torch.arange(vocab_size).expand(num_split, vocab_size)
    next_strings = torch.cat([strings.unsqueeze(1).expand(-1, vocab_size, -1)[big], tokens[big].unsqueeze(1)], 1)
    return big_ids[big], child_probs[big], next_strings


def _grow_level(growth: _Growth, depth, level, target_model, prefix, num_samples, min_expected, max_cells, device):
    """Split the open nodes ``level = (ids, probs, strings)`` of one depth that are worth it; the rest are leaves.

    Returns the next depth's open nodes.
    """
    level_ids, level_probs, level_strings = level
    vocab_size = target_model.vocab_size
    candidate = level_probs > 0
    if depth > 0:
        candidate &= num_samples * level_probs >= 2 * min_expected
    cand_index = candidate.nonzero().squeeze(1)
    split = torch.zeros_like(candidate)
    if cand_index.numel():
        strings = level_strings[cand_index]
        # [num_candidates, vocab_size]
        child_probs = level_probs[cand_index].unsqueeze(1) * _next_token_probs(target_model, prefix, strings, device)
        worth, big, zero, rare, new_cells = _worth_splitting(child_probs, level_probs[cand_index], depth, num_samples,
                                                             min_expected, growth.num_cells, max_cells)
        split[cand_index[worth]] = True
        keep = worth.nonzero().squeeze(1)
        next_level = _split_nodes(growth, depth, level_ids[cand_index[worth]], child_probs[keep], strings[keep],
                                  big[keep], zero[keep], rare[keep], new_cells[keep], vocab_size)
    else:
        next_level = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float64),
                      torch.zeros(0, depth + 1, dtype=torch.int64))
    growth.leaves.append((level_ids[~split], level_probs[~split], level_strings[~split], depth, PREFIX))
    return next_level


def _assemble(growth: _Growth, vocab_size: int, num_tokens: int, device) -> PrefixPartition:
    """The grown tree as a :class:`PrefixPartition`: leaves become cells in the order they were recorded."""
    leaves = growth.leaves
    expanded_row = torch.full((growth.num_nodes,), -1, dtype=torch.int64)
    all_split = torch.cat(growth.split_ids)
    expanded_row[all_split] = torch.arange(all_split.numel(), dtype=torch.int64)
    leaf_ids = torch.cat([ids for ids, *_ in leaves])
    leaf_cell = torch.full((growth.num_nodes,), -1, dtype=torch.int64)
    leaf_cell[leaf_ids] = torch.arange(leaf_ids.numel(), dtype=torch.int64)
    cell_strings = []
    for ids, _, strings, depth, _ in leaves:
        padded = torch.full((ids.numel(), num_tokens), PAD, dtype=torch.int64)
        padded[:, :depth] = strings
        cell_strings.append(padded)
    return PrefixPartition(
        vocab_size=vocab_size,
        num_tokens=num_tokens,
        expanded_row=expanded_row.to(device),
        children=torch.cat(growth.split_children).to(device),
        leaf_cell=leaf_cell.to(device),
        cell_probs=torch.cat([probs for _, probs, *_ in leaves]),
        cell_strings=torch.cat(cell_strings),
        cell_depth=torch.cat([torch.full((ids.numel(),), depth, dtype=torch.int64) for ids, _, _, depth, _ in leaves]),
        cell_kind=torch.cat([torch.full((ids.numel(),), kind, dtype=torch.int64) for ids, _, _, _, kind in leaves]),
    )


def build_partition(
    target_model: Model,
    num_tokens: int,
    num_samples: int,
    *,
    prefix: Sequence[int] = (),
    min_expected: float = 5.0,
    max_cells: int = defaults.PARTITION_MAX_CELLS,
    device: torch.device | str = "cpu",
) -> PrefixPartition:
    """Grow the prefix-tree partition of V^N used to count ``num_samples`` completed strings.

    Parameters
    ----------
    target_model : Model
        The target; called on ``prefix + u`` for every candidate node u.
    num_tokens : int
        N, the length of the completed strings.
    num_samples : int
        The sample size the partition is planned for.
    prefix : sequence of int
        The context before the audited step.
    min_expected : float
        A child of expected count ``num_samples * q(ux)`` below this is *rare*: the rare
        children of a node share one cell.  A node u of depth < N is split when that yields at
        least two cells of at least ``min_expected`` expected samples (the root always is).
    max_cells : int
        Cap on the number of cells; when a level would exceed it, only its most probable nodes
        are split.
    device : torch.device or str

    Returns
    -------
    PrefixPartition

    Notes
    -----
    Strings of target probability 0 land in ``IMPOSSIBLE`` cells of probability 0: a sample
    there proves the verifier inexact (the audit's ``support`` check).  When V^N is small
    and the sample large, the result is the full V^N partition.

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> target = ContextFreeModel([0.5, 0.3, 0.2])
    >>> full = build_partition(target, 2, num_samples=10_000)
    >>> full.num_cells, full.is_full, full.describe(int(full.cells_of(torch.tensor([[2, 1]]))[0]))
    (9, True, '2 1')
    >>> coarse = build_partition(target, 2, num_samples=30)  # expected counts 15, 9, 6 after one token
    >>> sorted(coarse.describe(c) for c in range(coarse.num_cells))
    ['0 (rare)', '0 0', '1 *', '2 *']
    """
    if num_tokens < 1:
        raise InvalidArgument(f"num_tokens: expected >= 1, got {num_tokens}")
    vocab_size = target_model.vocab_size
    if max_cells < vocab_size + 2:
        raise InvalidArgument(f"max_cells: must be at least vocab_size + 2 = {vocab_size + 2}, got {max_cells}")
    device = torch.device(device)
    num_samples = max(int(num_samples), 1)
    growth = _Growth()
    # The open nodes of the current depth: ids, target probabilities, strings [m, depth].
    level = (torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.float64), torch.zeros(1, 0, dtype=torch.int64))
    for depth in range(num_tokens):
        level = _grow_level(growth, depth, level, target_model, prefix, num_samples, min_expected, max_cells, device)
    growth.leaves.append((*level, num_tokens, PREFIX))
    return _assemble(growth, vocab_size, num_tokens, device)
