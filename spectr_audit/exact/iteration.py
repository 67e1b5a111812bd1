"""Exact audit of one chain verification step: the chain face of the one step audit.

A chain of K drafts of L tokens is the draft tree ``DraftTree.chains(K, L)``: :func:`exact_iteration`
audits the chain verifier with the tree audit's enumeration and law (:mod:`spectr_audit.exact.tree`,
:mod:`spectr_audit.exact.law`), each chunk of draft tuples handed to the verifier's own ``output_probs``
in the chain contract's shape, and gives what it found in the chain contract's terms
(docs/audit/exact.md):

* ``F(w)``: the law of the first ``L + 1`` tokens when decoding continues with
  the unmodified target after the step; the step is exact iff ``F = q``;
* ``B(u) = P(emitted string starts with u)``: the prefix cap ``B(u) <= q(u)``
  must hold for every ``u``, or no later correction can repair the step;
* block efficiency ``E[len(s)]`` and membership acceptance
  ``P(first emitted token is among the drafts' first tokens)``, both computed
  from emitted strings.

:func:`enumerate_drafts` gives the same draft tuples in the chain contract's shape, for the audits
that work on chains only (the multi-iteration audit, the block LP, the stratified statistical design).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from spectr_audit import defaults
from spectr_audit.contract.tree import DraftTree
from spectr_audit.contract.verifier import Verifier
from spectr_audit.drafting.models import Model, contexts_from
from spectr_audit.drafting.processed import bind_params
from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.law import ExactIterationResult, _law_fields, check_vocab, string_of
from spectr_audit.exact.tree import (
    block_efficiency,
    branch_realisations,
    check_chunk_size,
    child_factors,
    distinct_rows,
    emitted_laws,
    enumerate_tree_drafts,
    mixed_grid,
    path_tables,
)

__all__ = ["DraftEnumeration", "ExactIterationResult", "enumerate_drafts", "exact_iteration", "string_of"]

#: Refuse enumerations larger than this many draft tuples.
MAX_TUPLES = defaults.EXACT_MAX_TUPLES


@dataclasses.dataclass(frozen=True)
class DraftEnumeration:
    """Every draft tuple with positive probability, and the conditionals at its nodes.

    Stored as the distinct draft sequences, their conditionals and an index of tuples into them;
    ``draft_tokens``, ``draft_probs`` and ``target_probs`` materialise every tuple (``[N, K, ...]``)
    and :meth:`chunk` a slice of them, so an exact audit never holds all tuples' conditionals at once.
    """

    # [num_tuples]
    weights: torch.Tensor
    # [num_tuples, num_drafts] int64, rows of `sequences`
    index: torch.Tensor
    # [M, draft_len]: the distinct draft sequences the tuples use
    sequences: torch.Tensor
    # [M, draft_len, vocab_size]
    sequence_draft_probs: torch.Tensor
    # [M, draft_len + 1, vocab_size]
    sequence_target_probs: torch.Tensor

    def chunk(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(draft_tokens, draft_probs, target_probs)`` of the tuples in ``rows``."""
        index = self.index[rows]
        return self.sequences[index], self.sequence_draft_probs[index], self.sequence_target_probs[index]

    @property
    def draft_tokens(self) -> torch.Tensor:  # [num_tuples, num_drafts, draft_len]
        return self.sequences[self.index]

    @property
    def draft_probs(self) -> torch.Tensor:  # [num_tuples, num_drafts, draft_len, vocab_size]
        return self.sequence_draft_probs[self.index]

    @property
    def target_probs(self) -> torch.Tensor:  # [num_tuples, num_drafts, draft_len + 1, vocab_size]
        return self.sequence_target_probs[self.index]


def _check_exact_law(verifier: Verifier) -> None:
    if not verifier.has_exact_law:
        raise InvalidArgument(f"verifier: {verifier.name!r} has no exact law (output_probs); use the statistical audit")


def enumerate_drafts(
    draft_model: Model,
    target_model: Model,
    num_drafts: int,
    draft_len: int,
    draft_scheme: str = "iid",
    prefix: Sequence[int] = (),
) -> DraftEnumeration:
    """Enumerate draft tuples of ``num_drafts`` drafts of ``draft_len`` tokens, in the chain contract's shape.

    ``iid``: every ordered tuple of K sequences, each drawn autoregressively from the
    draft model (weights are products).  ``without_replacement`` (L = 1 only): ordered
    tuples of distinct tokens, ``prod p(x_i) / (1 - sum_{j<i} p(x_j))``.

    These are the realisations of ``DraftTree.chains(K, L)``
    (:func:`~spectr_audit.exact.tree.enumerate_tree_drafts`), drawn branch by branch with the same code:
    the same tuples, in the same order, with the same floating-point weights and conditionals.
    """
    vocab_size = check_vocab(draft_model, target_model)
    _check_chain_drafts(draft_model, prefix, num_drafts, draft_len, draft_scheme)
    draft_table, target_table, offsets = path_tables(draft_model, target_model, prefix, vocab_size, draft_len)
    # one draft's realisations: the draft sequences of positive probability, lexicographic
    chain = DraftTree.chains(1, draft_len)
    nodes = list(range(1, draft_len + 1))
    root_law = draft_table[0]
    tokens, codes, factors = branch_realisations(chain, nodes, draft_scheme, root_law, (draft_table, offsets), 1,
                                                 MAX_TUPLES)
    num_seqs = tokens.shape[0]
    if num_seqs**num_drafts > MAX_TUPLES:
        raise InvalidArgument(
            f"num_drafts: {num_seqs}^{num_drafts} draft tuples exceed the exact-audit limit of {MAX_TUPLES}"
        )
    index = mixed_grid([num_seqs] * num_drafts)  # [N, K]
    firsts = tokens[:, 1]
    if draft_scheme == "iid":
        factors[:, 1] = root_law[firsts]
        weights = factors[:, nodes].prod(-1)[index].prod(-1)
    else:
        first = firsts[index]  # [N, K]
        distinct = distinct_rows(first)
        index, first = index[distinct], first[distinct]
        weights = child_factors(root_law.expand(index.shape[0], vocab_size), first, draft_scheme).prod(-1)
    positive = weights > 0
    weights, index = weights[positive], index[positive]
    used, index = torch.unique(index, return_inverse=True)  # only the sequences some tuple uses
    paths = torch.cat([torch.zeros(num_seqs, 1, dtype=torch.int64), codes[:, nodes]], dim=1)[used]  # [M, L + 1]
    rows = paths + torch.tensor(offsets[: draft_len + 1])
    return DraftEnumeration(
        weights=weights,
        index=index,
        sequences=tokens[used][:, nodes],
        sequence_draft_probs=draft_table[rows[:, :-1]],
        sequence_target_probs=target_table[rows],
    )


def _check_chain_drafts(draft_model: Model, prefix: Sequence[int], num_drafts: int, draft_len: int,
                        draft_scheme: str) -> None:
    """The chain contract's drafts: K >= 1 drafts of L >= 1 tokens, i.i.d. or (L = 1) without replacement from
    enough tokens of positive draft probability."""
    if num_drafts < 1 or draft_len < 1:
        raise InvalidArgument(f"num_drafts, draft_len: must be >= 1, got {num_drafts}, {draft_len}")
    if draft_scheme == "iid":
        return
    if draft_scheme != "without_replacement":
        raise InvalidArgument(f"draft_scheme: expected 'iid' or 'without_replacement', got {draft_scheme!r}")
    if draft_len != 1:
        raise InvalidArgument(f"draft_len: drafting without replacement is defined for draft_len = 1, got {draft_len}")
    support = int((draft_model(contexts_from(prefix, torch.zeros(1, 0, dtype=torch.int64)))[0] > 0).sum())
    if num_drafts > support:
        raise InvalidArgument(
            f"num_drafts: {num_drafts} distinct drafts cannot be drawn without replacement from a draft "
            f"distribution with {support} tokens of positive probability"
        )
    if math.perm(support, num_drafts) > MAX_TUPLES:
        raise InvalidArgument("num_drafts: too many ordered draft tuples for an exact audit")


def exact_iteration(
    verifier: Verifier,
    draft_model: Model,
    target_model: Model,
    num_drafts: int,
    draft_len: int = 1,
    *,
    prefix: Sequence[int] = (),
    draft_scheme: Optional[str] = None,
    chunk_size: int = defaults.EXACT_CHUNK,
    params=None,
    order="vllm",
) -> ExactIterationResult:
    """Exact law of one step of ``verifier`` after ``prefix``, by enumerating draft tuples.

    Parameters
    ----------
    verifier : Verifier
        Must have an exact law (``output_probs``).
    draft_model, target_model : Model
    num_drafts, draft_len : int
    prefix : sequence of int
        The context before the step.
    draft_scheme : str, optional
        Defaults to the verifier's declared scheme.
    chunk_size : int
        Draft tuples per ``output_probs`` call (bounds memory).
    params : SamplingParams, optional
        Sampling parameters (one setting, scalars).  The models are then raw: the drafts are
        enumerated from the processed draft law, the step is held to the processed target law
        (:func:`~spectr_audit.contract.sampling.process_logits` with ``order``), and a verifier
        that takes logits gets the raw logits of every node and ``params``
        (:func:`~spectr_audit.contract.logits.output_probs_with_params`; docs/sampling.md).
        ``None``: the models' laws as they are (the probability path).
    order : str, sequence of str or ProcessingOrder
        The engine's processing conventions (default ``"vllm"``).

    Returns
    -------
    ExactIterationResult

    Notes
    -----
    Cost is ``(V^L)^K`` tuples for i.i.d. drafts: ordered tuples are needed because
    verifiers may depend on the order of the drafts (K-SEQ does).

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> from spectr_audit.registry import load_verifier
    >>> audit = exact_iteration(load_verifier("kseq"), ContextFreeModel([0.6, 0.4]),
    ...                         ContextFreeModel([0.3, 0.7]), num_drafts=2)
    >>> audit.max_abs_error < 1e-12
    True

    With sampling parameters, a verifier that applies them to the draft only is flagged:

    >>> from spectr_audit.contract.sampling import SamplingParams
    >>> from spectr_audit.drafting.processed import ContextFreeLogitsModel
    >>> audit = exact_iteration(load_verifier("params-draft-only"), ContextFreeLogitsModel([1.0, 0.0, -1.0]),
    ...                         ContextFreeLogitsModel([0.0, 1.0, -1.0]), num_drafts=1,
    ...                         params=SamplingParams(temperature=0.5))
    >>> round(audit.tv_distance, 4)
    0.2071
    """
    if params is not None:
        verifier, draft_model, target_model = bind_params(verifier, draft_model, target_model, params, order, prefix)
    _check_exact_law(verifier)
    verifier.check_supports(num_drafts, draft_len)
    draft_scheme = draft_scheme or verifier.draft_scheme
    vocab_size = check_vocab(draft_model, target_model)
    _check_chain_drafts(draft_model, prefix, num_drafts, draft_len, draft_scheme)
    check_chunk_size(chunk_size)
    # One exact audit for chains and trees: the chains are the tree DraftTree.chains(K, L); each chunk of its
    # realisations goes to the verifier's own output_probs in the chain contract's shape.
    tree = DraftTree.chains(num_drafts, draft_len)
    enumeration = enumerate_tree_drafts(draft_model, target_model, tree, draft_scheme, prefix,
                                        max_realisations=MAX_TUPLES)
    emitted, membership = emitted_laws(verifier, enumeration, chunk_size)
    return ExactIterationResult(
        vocab_size=vocab_size,
        num_drafts=num_drafts,
        draft_len=draft_len,
        num_draft_tuples=enumeration.num_realisations,
        **_law_fields(target_model, prefix, emitted, vocab_size),
        block_efficiency=block_efficiency(emitted),
        acceptance=membership,
    )
