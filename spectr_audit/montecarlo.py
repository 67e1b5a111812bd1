"""The Monte-Carlo harness: emitted strings, completed to N tokens, counted over a partition.

One *sample* is one verification: K drafts of length L are drawn after ``prefix``, the
verifier emits ``draft_tokens[draft_index, :num_accepted] + [next_token]`` (1 to L + 1 tokens),
and the string is completed with target samples to ``num_tokens`` (N) tokens.  When the
verifier is exact, the completed strings are i.i.d. draws from the target law q over V^N
(DESIGN.md, "What the audit measures", item 4), so their counts are multinomial with known
cell probabilities.

Counting uses a :class:`PrefixPartition` of V^N: a prefix tree grown from the root, where a
node u is split into its V children only while ``num_samples * q(u)`` is large enough.  When
V^N is small and the sample large, every string is its own cell (the full V^N partition);
otherwise a string's cell is its deepest tree node, i.e. "all strings that start with u".  The
tree needs target calls only at split nodes, so it also serves Markov and other
context-dependent targets and large vocabularies.

Everything is batched torch code on any device, seeded by one ``torch.Generator``, and run in
chunks so memory stays bounded.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from spectr_audit.contract import Verifier, VerifyOutput, check_verify_output
from spectr_audit.decoding import complete, decode
from spectr_audit.errors import InvalidArgument
from spectr_audit.exact import DraftEnumeration
from spectr_audit.harness import DraftBatch, draft
from spectr_audit.models import PAD, ContextFreeModel, Model, contexts_from
from spectr_audit.randomness import RandomSource, sample_categorical, uniform

__all__ = [
    "PrefixPartition",
    "SampleChunk",
    "build_partition",
    "complete_with_target",
    "default_chunk_size",
    "draw_drafts",
    "emitted_strings",
    "sample_chunk",
    "sample_stratified_chunk",
    "verify_batch",
]

#: Target-model calls while building a partition use at most this many contexts at once.
_MODEL_BATCH = 65536


# ---------------------------------------------------------------------------------------------
# The partition of V^N
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrefixPartition:
    """A partition of the strings of length N into cells "every string that starts with u".

    Attributes
    ----------
    vocab_size, num_tokens : int
        V and N.
    expanded_row : torch.Tensor
        ``[num_nodes]`` int64: the row of ``children`` of a split node, -1 for a leaf.
    children : torch.Tensor
        ``[num_split, vocab_size]`` int64: node ids of the children of each split node.
    leaf_cell : torch.Tensor
        ``[num_nodes]`` int64: the cell index of a leaf, -1 for a split node.
    cell_probs : torch.Tensor
        ``[num_cells]`` float64: target probability of each cell.
    cell_strings : torch.Tensor
        ``[num_cells, num_tokens]`` int64: the prefix u of each cell, ``PAD`` after its depth.
    cell_depth : torch.Tensor
        ``[num_cells]`` int64: ``len(u)``; ``num_tokens`` for a cell holding a single string.
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

    @property
    def num_cells(self) -> int:
        """Number of cells (leaves of the prefix tree)."""
        return int(self.cell_probs.numel())

    @property
    def is_full(self) -> bool:
        """Whether every cell is a single string of length N (the full V^N partition)."""
        return bool((self.cell_depth == self.num_tokens).all())

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
        """A readable cell name: ``"3 1 4"`` for one string, ``"3 1 *"`` for all strings starting 3 1."""
        depth = int(self.cell_depth[cell])
        tokens = [str(t) for t in self.cell_strings[cell, :depth].tolist()]
        return " ".join(tokens + (["*"] if depth < self.num_tokens else []))


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
        The target; called on ``prefix + u`` for every split node u.
    num_tokens : int
        N, the length of the completed strings.
    num_samples : int
        The sample size the partition is planned for.
    prefix : sequence of int
        The context before the audited step.
    min_expected : float
        A node u of depth < N is split when ``num_samples * q(u) >= 2 * min_expected`` (the
        root always is), so that a split can yield cells with the usual chi-square minimum of
        ``min_expected`` expected counts; smaller cells are pooled later by the tests.
    max_cells : int
        Cap on the number of cells; when a level would exceed it, only its most probable nodes
        are split.
    device : torch.device or str

    Returns
    -------
    PrefixPartition

    Notes
    -----
    Strings of target probability 0 stay in cells of probability 0; a sample landing there
    proves the verifier inexact (the audit's ``support`` check).
    """
    if num_tokens < 1:
        raise InvalidArgument(f"num_tokens: expected >= 1, got {num_tokens}")
    vocab_size = target_model.vocab_size
    if max_cells < vocab_size:
        raise InvalidArgument(f"max_cells: must be at least vocab_size = {vocab_size}, got {max_cells}")
    device = torch.device(device)
    threshold = 2.0 * min_expected / max(num_samples, 1)
    # Nodes are numbered depth by depth; `level_*` hold the current depth's nodes.
    level_ids = torch.zeros(1, dtype=torch.int64)
    level_probs = torch.ones(1, dtype=torch.float64)
    level_strings = torch.zeros(1, 0, dtype=torch.int64)
    num_nodes = 1
    num_leaves = 1
    split_ids, split_children = [], []
    leaf_ids, leaf_probs, leaf_strings, leaf_depths = [], [], [], []

    def add_leaves(ids, probs, strings, depth):
        leaf_ids.append(ids)
        leaf_probs.append(probs)
        padded = torch.full((ids.numel(), num_tokens), PAD, dtype=torch.int64)
        padded[:, :depth] = strings
        leaf_strings.append(padded)
        leaf_depths.append(torch.full((ids.numel(),), depth, dtype=torch.int64))

    for depth in range(num_tokens):
        split = (level_probs > 0) & (level_probs >= threshold)
        if depth == 0:
            split = torch.ones_like(split)
        budget = (max_cells - num_leaves) // max(vocab_size - 1, 1) if vocab_size > 1 else level_ids.numel()
        if int(split.sum()) > budget:
            order = torch.argsort(torch.where(split, level_probs, torch.full_like(level_probs, -1.0)), descending=True)
            keep = torch.zeros_like(split)
            keep[order[: max(budget, 0)]] = True
            split = split & keep
        add_leaves(level_ids[~split], level_probs[~split], level_strings[~split], depth)
        ids, probs, strings = level_ids[split], level_probs[split], level_strings[split]
        num_split = ids.numel()
        if num_split == 0:
            level_ids = torch.zeros(0, dtype=torch.int64)
            break
        cond = torch.cat(
            [
                target_model(contexts_from(prefix, strings[i : i + _MODEL_BATCH].to(device))).double().cpu()
                for i in range(0, num_split, _MODEL_BATCH)
            ]
        )  # [num_split, vocab_size]
        child_ids = num_nodes + torch.arange(num_split * vocab_size, dtype=torch.int64).reshape(num_split, vocab_size)
        split_ids.append(ids)
        split_children.append(child_ids)
        num_nodes += num_split * vocab_size
        num_leaves += num_split * (vocab_size - 1)
        level_ids = child_ids.reshape(-1)
        level_probs = (probs.unsqueeze(1) * cond).reshape(-1)
        tokens = torch.arange(vocab_size, dtype=torch.int64).repeat(num_split).unsqueeze(1)
        level_strings = torch.cat([strings.repeat_interleave(vocab_size, dim=0), tokens], dim=1)
    if level_ids.numel():
        add_leaves(level_ids, level_probs, level_strings, num_tokens)

    expanded_row = torch.full((num_nodes,), -1, dtype=torch.int64)
    if split_ids:
        all_split = torch.cat(split_ids)
        expanded_row[all_split] = torch.arange(all_split.numel(), dtype=torch.int64)
        children = torch.cat(split_children)
    else:
        children = torch.zeros(0, vocab_size, dtype=torch.int64)
    ids = torch.cat(leaf_ids)
    leaf_cell = torch.full((num_nodes,), -1, dtype=torch.int64)
    leaf_cell[ids] = torch.arange(ids.numel(), dtype=torch.int64)
    return PrefixPartition(
        vocab_size=vocab_size,
        num_tokens=num_tokens,
        expanded_row=expanded_row.to(device),
        children=children.to(device),
        leaf_cell=leaf_cell.to(device),
        cell_probs=torch.cat(leaf_probs),
        cell_strings=torch.cat(leaf_strings),
        cell_depth=torch.cat(leaf_depths),
    )


# ---------------------------------------------------------------------------------------------
# Drafting, verification, completion
# ---------------------------------------------------------------------------------------------


def default_chunk_size(num_drafts: int, draft_len: int, vocab_size: int) -> int:
    """Rows per chunk: about 2^25 float64 entries in ``target_probs``, between 2^6 and 2^18."""
    per_row = num_drafts * (draft_len + 1) * vocab_size
    size = 1 << max(0, int(math.floor(math.log2(max(1, (1 << 25) // per_row)))))
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
) -> DraftBatch:
    """``batch_size`` draft trees after ``prefix``, with the conditionals at every node.

    Context-free draft and target models with i.i.d. drafting take a fast path (one inverse-CDF
    search per token, conditionals broadcast); everything else goes through
    :func:`spectr_audit.harness.draft`.  Conditionals are materialised either way, so a
    verifier that writes into its inputs (a historic bug class) behaves as it would in an engine.
    """
    device = torch.device(device)
    if draft_scheme == "iid" and isinstance(draft_model, ContextFreeModel) and isinstance(target_model, ContextFreeModel):
        draft_dist = draft_model.probs.to(device)
        target_dist = target_model.probs.to(device)
        vocab_size = draft_dist.numel()
        u = uniform(generator, (batch_size, num_drafts, draft_len), device)
        draft_tokens = _sample_one(draft_dist, u)
        draft_probs = draft_dist.expand(batch_size, num_drafts, draft_len, vocab_size).clone()
        target_probs = target_dist.expand(batch_size, num_drafts, draft_len + 1, vocab_size).clone()
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
    """The emitted strings, left-aligned in ``[batch_size, num_tokens]`` with ``PAD`` after them, and their lengths."""
    batch_size, _, draft_len = draft_tokens.shape
    if num_tokens < draft_len + 1:
        raise InvalidArgument(f"num_tokens: must be >= draft_len + 1 = {draft_len + 1}, got {num_tokens}")
    rows = torch.arange(batch_size, device=draft_tokens.device)
    chosen = draft_tokens[rows, output.draft_index]  # [batch_size, draft_len]
    positions = torch.arange(num_tokens, device=draft_tokens.device)
    strings = torch.full((batch_size, num_tokens), PAD, dtype=torch.int64, device=draft_tokens.device)
    strings[:, :draft_len] = torch.where(positions[:draft_len] < output.num_accepted.unsqueeze(1), chosen, PAD)
    strings.scatter_(1, output.num_accepted.unsqueeze(1), output.next_token.unsqueeze(1))
    return strings, output.num_accepted + 1


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
) -> SampleChunk:
    """Draft, verify and complete ``batch_size`` independent samples (one verification each).

    The emitted string is completed with target samples; when the verifier returns a carried
    correction (:mod:`spectr_audit.correction`) the completion follows the corrected target, as
    the decoding loop's next iterations would.  For ``num_tokens > draft_len + 1`` the decoding
    loop of :mod:`spectr_audit.decoding` runs the verifier for as many iterations as needed, and
    the first ``num_tokens`` tokens are the sample.
    """
    if num_tokens > draft_len + 1:
        return _decode_chunk(verifier, draft_model, target_model, num_drafts, draft_len, num_tokens, batch_size,
                             generator, prefix=prefix, device=device)
    batch = draw_drafts(draft_model, target_model, num_drafts, draft_len, batch_size, generator, prefix=prefix,
                        draft_scheme=verifier.draft_scheme, device=device)
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
    """Multi-iteration samples: the first ``num_tokens`` tokens of :func:`spectr_audit.decoding.decode`."""
    tokens = decode(verifier, draft_model, target_model, num_tokens, num_drafts, draft_len, batch_size, generator,
                    prefix=tuple(prefix))
    return SampleChunk(tokens.to(device), None, None)
