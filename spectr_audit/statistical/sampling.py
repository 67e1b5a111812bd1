"""The Monte-Carlo harness: emitted strings, completed to N tokens, counted over a partition.

One *sample* is one verification: K drafts of length L are drawn after ``prefix``, the
verifier emits ``draft_tokens[draft_index, :num_accepted] + [next_token]`` (1 to L + 1 tokens),
and the string is completed with target samples to ``num_tokens`` (N) tokens.  When the
verifier is exact, the completed strings are i.i.d. draws from the target law q over V^N
(docs/audit/statistical.md), so their counts are multinomial with known
cell probabilities.

Counting uses a :class:`PrefixPartition` of V^N: a prefix tree grown from the root, where a
node u is split into its children only while their expected counts are large enough, and a
node's rare children share one cell.  When V^N is small and the sample large, every string is
its own cell (the full V^N partition); otherwise a string's cell is "all strings that start
with u" for its deepest tree node u (or "u followed by a rare token").  The tree needs target
calls only at candidate nodes, so it also serves Markov and other context-dependent targets and
large vocabularies.

Everything is batched torch code on any device, seeded by one ``torch.Generator``, and run in
chunks so memory stays bounded.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from spectr_audit.contract.verifier import Verifier, VerifyOutput, check_verify_output
from spectr_audit.drafting.decoding import complete, decode, emitted_tokens
from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.iteration import DraftEnumeration
from spectr_audit.drafting.harness import DraftBatch, draft
from spectr_audit.drafting.models import PAD, ContextFreeModel, Model, contexts_from
from spectr_audit.contract.randomness import RandomSource, sample_categorical, uniform

__all__ = [
    "IMPOSSIBLE",
    "PREFIX",
    "PrefixPartition",
    "RARE",
    "SampleChunk",
    "build_partition",
    "complete_with_target",
    "default_chunk_size",
    "draw_drafts",
    "emitted_strings",
    "sample_chunk",
    "sample_stratified_chunk",
    "sample_tree_chunk",
    "tree_emitted_strings",
    "verify_batch",
    "verify_tree_batch",
]

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
    max_cells: int = 1 << 20,
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


# ---------------------------------------------------------------------------------------------
# Drafting, verification, completion
# ---------------------------------------------------------------------------------------------


def default_chunk_size(num_drafts: int, draft_len: int, vocab_size: int, device: torch.device | str = "cpu") -> int:
    """Rows per chunk: ``target_probs`` of about 8 MB on a CPU (the working set then stays in
    cache, which measured 2x faster than 256 MB chunks), 256 MB on an accelerator; a power of
    two between 2^6 and 2^18.  (32 MB chunks measured the same as 8 MB ones at V = 8, K = 4,
    within this 2-core machine's noise.)"""
    per_row = num_drafts * (draft_len + 1) * vocab_size
    budget = 1 << 20 if torch.device(device).type == "cpu" else 1 << 25  # float64 entries
    size = 1 << max(0, int(math.floor(math.log2(max(1, budget // per_row)))))
    return int(min(1 << 18, max(1 << 6, size)))


def _sample_one(
    probs: torch.Tensor,  # [vocab_size], non-negative
    u: torch.Tensor,  # [...] uniforms in [0, 1)
) -> torch.Tensor:  # [...] int64
    """Inverse-CDF draws from one distribution (no zero-mass token is ever returned)."""
    cdf = probs.cumsum(0)
    idx = torch.searchsorted(cdf, u.to(cdf.dtype) * cdf[-1], right=True)
    last_positive = int((probs > 0).nonzero().max())
    return idx.clamp_(max=last_positive)


def draw_drafts(
    draft_model: Model,
    target_model: Model,
    num_drafts: int,
    draft_len: int,
    batch_size: int,
    generator: RandomSource,
    *,
    prefix: Sequence[int] = (),
    draft_scheme: str = "iid",
    device: torch.device | str = "cpu",
    buffers: Optional[dict] = None,
) -> DraftBatch:
    """``batch_size`` draft trees after ``prefix``, with the conditionals at every node.

    Context-free draft and target models with i.i.d. drafting take a fast path (one inverse-CDF
    search per token, conditionals broadcast); everything else goes through
    :func:`spectr_audit.drafting.harness.draft`.  Conditionals are materialised either way, so a
    verifier that writes into its inputs (a historic bug class) behaves as it would in an engine.
    ``buffers``: a dict the caller keeps between chunks; the fast path then copies the
    conditionals into the same tensors every chunk (rewriting whatever a verifier wrote there)
    instead of allocating fresh ones, which measured 15-25% of a Monte-Carlo audit at V = 8, K = 4.
    """
    device = torch.device(device)
    if draft_scheme == "iid" and isinstance(draft_model, ContextFreeModel) and isinstance(target_model, ContextFreeModel):
        draft_dist = draft_model.probs.to(device)
        target_dist = target_model.probs.to(device)
        vocab_size = draft_dist.numel()
        u = uniform(generator, (batch_size, num_drafts, draft_len), device)
        draft_tokens = _sample_one(draft_dist, u)
        draft_shape = (batch_size, num_drafts, draft_len, vocab_size)
        target_shape = (batch_size, num_drafts, draft_len + 1, vocab_size)
        if buffers is None:
            return DraftBatch(draft_tokens, draft_dist.expand(draft_shape).clone(), target_dist.expand(target_shape).clone())
        key = (draft_shape, target_shape, draft_dist.dtype, target_dist.dtype, device)
        if key not in buffers:
            buffers.clear()  # one shape at a time: the last, partial chunk replaces the full ones
            buffers[key] = (torch.empty(draft_shape, dtype=draft_dist.dtype, device=device),
                            torch.empty(target_shape, dtype=target_dist.dtype, device=device))
        draft_probs, target_probs = buffers[key]
        draft_probs.copy_(draft_dist.expand(draft_shape))
        target_probs.copy_(target_dist.expand(target_shape))
        return DraftBatch(draft_tokens, draft_probs, target_probs)
    contexts = contexts_from(prefix, torch.zeros(batch_size, 0, dtype=torch.int64, device=device))
    return draft(draft_model, target_model, contexts, num_drafts, draft_len, generator, draft_scheme)


def verify_batch(verifier: Verifier, batch: DraftBatch, generator: RandomSource, *, validate_inputs: bool) -> VerifyOutput:
    """Run the verifier on a drafted batch; its output is always checked against the contract.

    Inputs built by this harness are valid by construction, so after the first chunk
    (``validate_inputs=False``) the input validation of :meth:`Verifier.verify` is skipped,
    unless the verifier overrides ``verify`` itself.
    """
    batch_size, num_drafts, draft_len = batch.draft_tokens.shape
    if validate_inputs or type(verifier).verify is not Verifier.verify:
        raw = verifier.verify(batch.draft_tokens, batch.draft_probs, batch.target_probs, generator)
    else:
        raw = verifier._verify(batch.draft_tokens, batch.draft_probs, batch.target_probs, generator)
    return check_verify_output(raw, batch_size, num_drafts, draft_len, batch.draft_probs.shape[-1], who=verifier.name)


def emitted_strings(
    draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
    output: VerifyOutput,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([batch_size, num_tokens], [batch_size])
    """The emitted strings, left-aligned in ``[batch_size, num_tokens]`` with ``PAD`` after them, and their lengths.

    :func:`spectr_audit.drafting.decoding.emitted_tokens`, widened to ``num_tokens`` columns.
    """
    batch_size, _, draft_len = draft_tokens.shape
    if num_tokens < draft_len + 1:
        raise InvalidArgument(f"num_tokens: must be >= draft_len + 1 = {draft_len + 1}, got {num_tokens}")
    tokens, lengths = emitted_tokens(draft_tokens, output)
    strings = torch.full((batch_size, num_tokens), PAD, dtype=torch.int64, device=draft_tokens.device)
    strings[:, : draft_len + 1] = tokens
    return strings, lengths


def complete_with_target(
    strings: torch.Tensor,  # [batch_size, num_tokens], PAD after each row's first `lengths` tokens
    lengths: torch.Tensor,  # [batch_size]
    target_model: Model,
    generator: RandomSource,
    *,
    prefix: Sequence[int] = (),
) -> torch.Tensor:  # [batch_size, num_tokens]
    """Fill every row to ``num_tokens`` tokens with autoregressive target samples (in place)."""
    batch_size, num_tokens = strings.shape
    device = strings.device
    context_free = isinstance(target_model, ContextFreeModel)
    for position in range(1, num_tokens):
        need = lengths <= position
        if context_free:
            draws = _sample_one(target_model.probs.to(device), uniform(generator, (batch_size,), device))
            strings[:, position] = torch.where(need, draws, strings[:, position])
            continue
        rows = need.nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        dist = target_model(contexts_from(prefix, strings[rows, :position])).double()
        strings[rows, position] = sample_categorical(dist, uniform(generator, (rows.numel(),), device))
    return strings


@dataclasses.dataclass(frozen=True)
class SampleChunk:
    """One chunk of completed samples.

    Attributes
    ----------
    strings : torch.Tensor
        ``[batch_size, num_tokens]`` int64: emitted strings completed with target samples.
    lengths : torch.Tensor
        ``[batch_size]`` int64: emitted length (1 to L + 1), or ``None`` for multi-iteration runs.
    membership : torch.Tensor
        ``[batch_size]`` bool: the first emitted token is among the drafts' first tokens
        (``None`` for multi-iteration runs).
    strata : torch.Tensor or None
        ``[batch_size]`` int64: the draft tuple of each row, for stratified samples.
    """

    # [batch_size, num_tokens]
    strings: torch.Tensor
    # [batch_size]
    lengths: Optional[torch.Tensor]
    # [batch_size]
    membership: Optional[torch.Tensor]
    # [batch_size]
    strata: Optional[torch.Tensor] = None


def _first_membership(draft_tokens: torch.Tensor, strings: torch.Tensor) -> torch.Tensor:
    """Whether each row's first emitted token is among its drafts' first tokens."""
    return (draft_tokens[:, :, 0] == strings[:, :1]).any(-1)


def sample_chunk(
    verifier: Verifier,
    draft_model: Model,
    target_model: Model,
    num_drafts: int,
    draft_len: int,
    num_tokens: int,
    batch_size: int,
    generator: RandomSource,
    *,
    prefix: Sequence[int] = (),
    device: torch.device | str = "cpu",
    validate_inputs: bool = False,
    buffers: Optional[dict] = None,
) -> SampleChunk:
    """Draft, verify and complete ``batch_size`` independent samples (one verification each).

    The emitted string is completed with target samples; when the verifier returns a carried
    correction (:mod:`spectr_audit.contract.correction`) the completion follows the corrected target, as
    the decoding loop's next iterations would.  For ``num_tokens > draft_len + 1`` the decoding
    loop of :mod:`spectr_audit.drafting.decoding` runs the verifier for as many iterations as needed, and
    the first ``num_tokens`` tokens are the sample.
    """
    if num_tokens > draft_len + 1:
        return _decode_chunk(verifier, draft_model, target_model, num_drafts, draft_len, num_tokens, batch_size,
                             generator, prefix=prefix, device=device)
    batch = draw_drafts(draft_model, target_model, num_drafts, draft_len, batch_size, generator, prefix=prefix,
                        draft_scheme=verifier.draft_scheme, device=device, buffers=buffers)
    output = verify_batch(verifier, batch, generator, validate_inputs=validate_inputs)
    return _complete_chunk(batch, output, draft_model, target_model, num_tokens, generator, prefix, None)


def _complete_chunk(batch, output, draft_model, target_model, num_tokens, generator, prefix, strata) -> SampleChunk:
    """Emitted strings of a verified batch, completed (under the verifier's carried correction, if any)."""
    strings, lengths = emitted_strings(batch.draft_tokens, output, num_tokens)
    membership = _first_membership(batch.draft_tokens, strings)
    if output.correction is not None:
        # A verifier that repairs the next iteration's target is judged together with its repair.
        device = strings.device
        strings = complete(target_model, strings.cpu(), lengths.cpu(), num_tokens, generator, prefix=prefix,
                           correction=output.correction, draft_model=draft_model).to(device)
    else:
        strings = complete_with_target(strings, lengths, target_model, generator, prefix=prefix)
    return SampleChunk(strings, lengths, membership, strata)


def sample_stratified_chunk(
    verifier: Verifier,
    enumeration: DraftEnumeration,
    strata: torch.Tensor,  # [batch_size] int64, rows of `enumeration`
    draft_model: Model,
    target_model: Model,
    num_tokens: int,
    generator: RandomSource,
    *,
    prefix: Sequence[int] = (),
    device: torch.device | str = "cpu",
    validate_inputs: bool = False,
) -> SampleChunk:
    """Verify given draft tuples (one row per entry of ``strata``) and complete the strings.

    ``draft_model`` is read only by carried corrections.
    """
    device = torch.device(device)
    strata = strata.to(device)
    batch = DraftBatch(
        enumeration.draft_tokens.to(device)[strata],
        enumeration.draft_probs.to(device)[strata],
        enumeration.target_probs.to(device)[strata],
    )
    output = verify_batch(verifier, batch, generator, validate_inputs=validate_inputs)
    return _complete_chunk(batch, output, draft_model, target_model, num_tokens, generator, prefix, strata)


def _decode_chunk(verifier, draft_model, target_model, num_drafts, draft_len, num_tokens, batch_size, generator, *,
                  prefix, device) -> SampleChunk:
    """Multi-iteration samples: the first ``num_tokens`` tokens of :func:`spectr_audit.drafting.decoding.decode`."""
    tokens = decode(verifier, draft_model, target_model, num_tokens, num_drafts, draft_len, batch_size, generator,
                    prefix=tuple(prefix))
    return SampleChunk(tokens.to(device), None, None)


# ---------------------------------------------------------------------------------------------
# Draft trees: the same sample, drafted as a tree
# ---------------------------------------------------------------------------------------------


def verify_tree_batch(verifier, batch, generator: RandomSource, *, validate_inputs: bool):
    """Run a tree verifier on a drafted tree batch; its output is always checked against the contract.

    As :func:`verify_batch`: after the first chunk the input validation is skipped unless the
    verifier overrides ``verify_tree`` itself.
    """
    from spectr_audit.contract.tree_verifier import TreeVerifier, check_tree_output

    tree = batch.tree
    batch_size = batch.node_tokens.shape[0]
    if validate_inputs or type(verifier).verify_tree is not TreeVerifier.verify_tree:
        raw = verifier.verify_tree(tree, batch.node_tokens, batch.draft_probs, batch.target_probs, generator)
    else:
        raw = verifier._verify_tree(tree, batch.node_tokens, batch.draft_probs, batch.target_probs, generator)
    return check_tree_output(raw, tree, batch_size, batch.target_probs.shape[-1], who=verifier.name)


def tree_emitted_strings(
    tree,
    node_tokens: torch.Tensor,  # [batch_size, num_nodes]
    output,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([batch_size, num_tokens], [batch_size])
    """The emitted strings (the path to ``accepted_node``, then ``next_token``), left-aligned with ``PAD`` after.

    Examples
    --------
    >>> from spectr_audit.contract.tree import DraftTree
    >>> from spectr_audit.contract.tree_verifier import TreeVerifyOutput
    >>> tree = DraftTree.from_paths([(0,), (1,), (0, 0)])
    >>> out = TreeVerifyOutput(torch.tensor([3, 0]), torch.tensor([2, 1]))
    >>> strings, lengths = tree_emitted_strings(tree, torch.tensor([[0, 1, 0, 2]] * 2), out, 3)
    >>> strings.tolist(), lengths.tolist()
    ([[1, 2, 2], [1, -1, -1]], [3, 1])
    """
    batch_size = node_tokens.shape[0]
    if num_tokens < tree.max_depth + 1:
        raise InvalidArgument(f"num_tokens: must be >= max_depth + 1 = {tree.max_depth + 1}, got {num_tokens}")
    device = node_tokens.device
    accepted = output.accepted_node
    depth = torch.tensor(tree.depths, dtype=torch.int64, device=device)[accepted]  # [batch_size]
    path = tree.path_index(device)[accepted]  # [batch_size, max_depth], -1 padded
    strings = torch.full((batch_size, num_tokens), PAD, dtype=torch.int64, device=device)
    if tree.max_depth:
        tokens = node_tokens.gather(1, path.clamp(min=0))
        strings[:, : tree.max_depth] = torch.where(path >= 0, tokens, torch.full_like(tokens, PAD))
    strings.scatter_(1, depth.unsqueeze(1), output.next_token.unsqueeze(1))
    return strings, depth + 1


def sample_tree_chunk(
    verifier,
    tree,
    draft_scheme: str,
    draft_model: Model,
    target_model: Model,
    num_tokens: int,
    batch_size: int,
    generator: RandomSource,
    *,
    prefix: Sequence[int] = (),
    device: torch.device | str = "cpu",
    validate_inputs: bool = False,
) -> SampleChunk:
    """Draft ``tree`` under ``draft_scheme`` (:func:`spectr_audit.drafting.tree.draft_tree`), verify, complete.

    One sample per row, as :func:`sample_chunk`: the emitted string (1 to ``max_depth + 1``
    tokens) completed with target samples to ``num_tokens``.  ``membership``: the first emitted
    token is one of the root's children's tokens.
    """
    from spectr_audit.drafting.tree import draft_tree

    device = torch.device(device)
    contexts = contexts_from(prefix, torch.zeros(batch_size, 0, dtype=torch.int64, device=device))
    batch = draft_tree(draft_model, target_model, contexts, tree, generator, draft_scheme)
    output = verify_tree_batch(verifier, batch, generator, validate_inputs=validate_inputs)
    strings, lengths = tree_emitted_strings(tree, batch.node_tokens, output, num_tokens)
    membership = (batch.node_tokens[:, list(tree.level(1))] == strings[:, :1]).any(-1)
    strings = complete_with_target(strings, lengths, target_model, generator, prefix=prefix)
    return SampleChunk(strings, lengths, membership)
