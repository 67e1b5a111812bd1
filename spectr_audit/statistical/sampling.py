"""The Monte-Carlo harness: emitted strings, completed to N tokens, counted over a partition.

One *sample* is one verification: K drafts of length L are drawn after ``prefix``, the
verifier emits ``draft_tokens[draft_index, :num_accepted] + [next_token]`` (1 to L + 1 tokens),
and the string is completed with target samples to ``num_tokens`` (N) tokens.  When the
verifier is exact, the completed strings are i.i.d. draws from the target law q over V^N
(docs/audit/statistical.md), so their counts are multinomial with known
cell probabilities.

Counting uses a :class:`~spectr_audit.statistical.partition.PrefixPartition` of V^N (re-exported
here with :func:`~spectr_audit.statistical.partition.build_partition`).

Everything is batched torch code on any device, seeded by one ``torch.Generator``, and run in
chunks so memory stays bounded.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import torch

from spectr_audit.contract.verifier import Verifier, VerifyOutput, check_verify_output
from spectr_audit.contract.tree_verifier import check_tree_output
from spectr_audit.drafting.decoding import complete, decode, emitted_tokens
from spectr_audit.errors import InvalidArgument
from spectr_audit.drafting.harness import DraftBatch, draft
from spectr_audit.drafting.models import PAD, ContextFreeModel, Model, contexts_from
from spectr_audit.drafting.tree import draft_tree
from spectr_audit.contract.randomness import RandomSource, sample_categorical, uniform
from spectr_audit.statistical.partition import IMPOSSIBLE, PREFIX, RARE, PrefixPartition, build_partition

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
    "sample_tree_chunk",
    "tree_emitted_strings",
    "verify_batch",
    "verify_tree_batch",
]

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
    if validate_inputs or not verifier.standard_entry("verify"):
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
        ``[batch_size]`` int64: the stratum (draft tuple, or group of tuples) of each row, when asked for.
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
    strata_of: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> SampleChunk:
    """Draft, verify and complete ``batch_size`` independent samples (one verification each).

    The emitted string is completed with target samples; when the verifier returns a carried
    correction (:mod:`spectr_audit.contract.correction`) the completion follows the corrected target, as
    the decoding loop's next iterations would.  For ``num_tokens > draft_len + 1`` the decoding
    loop of :mod:`spectr_audit.drafting.decoding` runs the verifier for as many iterations as needed, and
    the first ``num_tokens`` tokens are the sample.  ``strata_of`` maps the drafts
    ``[batch_size, num_drafts, draft_len]`` to each row's stratum (``SampleChunk.strata``), read
    before the verifier sees them (one iteration only).
    """
    if num_tokens > draft_len + 1:
        return _decode_chunk(verifier, draft_model, target_model, num_drafts, draft_len, num_tokens, batch_size,
                             generator, prefix=prefix, device=device)
    batch = draw_drafts(draft_model, target_model, num_drafts, draft_len, batch_size, generator, prefix=prefix,
                        draft_scheme=verifier.draft_scheme, device=device, buffers=buffers)
    strata = None if strata_of is None else strata_of(batch.draft_tokens)
    output = verify_batch(verifier, batch, generator, validate_inputs=validate_inputs)
    return _complete_chunk(batch, output, draft_model, target_model, num_tokens, generator, prefix, strata)


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
    tree = batch.tree
    batch_size = batch.node_tokens.shape[0]
    if validate_inputs or not verifier.standard_entry("verify_tree"):
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
    device = torch.device(device)
    contexts = contexts_from(prefix, torch.zeros(batch_size, 0, dtype=torch.int64, device=device))
    batch = draft_tree(draft_model, target_model, contexts, tree, generator, draft_scheme)
    output = verify_tree_batch(verifier, batch, generator, validate_inputs=validate_inputs)
    strings, lengths = tree_emitted_strings(tree, batch.node_tokens, output, num_tokens)
    membership = (batch.node_tokens[:, list(tree.level(1))] == strings[:, :1]).any(-1)
    strings = complete_with_target(strings, lengths, target_model, generator, prefix=prefix)
    return SampleChunk(strings, lengths, membership)
