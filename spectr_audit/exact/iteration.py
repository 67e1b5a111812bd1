"""Exact audit of one verification step by enumerating every draft tuple.

For small V, K and L every draft tuple is enumerated with its probability under
the drafting scheme, the verifier's exact conditional law (``output_probs``) is
summed, and the law ``E(s)`` of the emitted string is obtained in float64.
From it (docs/audit/exact.md):

* ``F(w)``: the law of the first ``L + 1`` tokens when decoding continues with
  the unmodified target after the step; the step is exact iff ``F = q``;
* ``B(u) = P(emitted string starts with u)``: the prefix cap ``B(u) <= q(u)``
  must hold for every ``u``, or no later correction can repair the step;
* block efficiency ``E[len(s)]`` and membership acceptance
  ``P(first emitted token is among the drafts' first tokens)``, both computed
  from emitted strings.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Optional, Sequence

import torch

from spectr_audit import defaults
from spectr_audit.contract.verifier import Verifier, check_output_probs, check_verify_inputs
from spectr_audit.errors import InvalidArgument
from spectr_audit.drafting.models import Model, contexts_from
from spectr_audit.drafting.processed import bind_params

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


def _product_grid(base: int, length: int) -> torch.Tensor:  # [base ** length, length] int64
    """``itertools.product(range(base), repeat=length)`` as a tensor, in the same order (last index fastest)."""
    codes = torch.arange(base**length, dtype=torch.int64).unsqueeze(1)
    powers = base ** torch.arange(length - 1, -1, -1, dtype=torch.int64)
    return codes // powers % base


def _sequence_conditionals(model: Model, prefix: Sequence[int], sequences: torch.Tensor, depth: int) -> torch.Tensor:
    """Conditionals of ``model`` after ``prefix + sequences[:, :l]`` for l < depth: ``[M, depth, V]``."""
    return torch.stack(
        [model(contexts_from(prefix, sequences[:, :level])) for level in range(depth)], dim=1
    ).double()


def check_vocab(draft_model: Model, target_model: Model) -> int:
    """The models' common vocabulary size; they must agree."""
    vocab_size = draft_model.vocab_size
    if target_model.vocab_size != vocab_size:
        raise InvalidArgument(
            f"target_model: vocab_size {target_model.vocab_size} differs from draft_model's {vocab_size}"
        )
    return vocab_size


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
    """Enumerate draft tuples of ``num_drafts`` drafts of ``draft_len`` tokens.

    ``iid``: every ordered tuple of K sequences, each drawn autoregressively from the
    draft model (weights are products).  ``without_replacement`` (L = 1 only): ordered
    tuples of distinct tokens, ``prod p(x_i) / (1 - sum_{j<i} p(x_j))``.
    """
    vocab_size = check_vocab(draft_model, target_model)
    if num_drafts < 1 or draft_len < 1:
        raise InvalidArgument(f"num_drafts, draft_len: must be >= 1, got {num_drafts}, {draft_len}")
    if draft_scheme == "iid":
        # All sequences of length L with positive draft probability.
        seqs = _product_grid(vocab_size, draft_len)
        draft_cond = _sequence_conditionals(draft_model, prefix, seqs, draft_len)
        seq_prob = draft_cond.gather(-1, seqs.unsqueeze(-1)).squeeze(-1).prod(-1)
        keep = seq_prob > 0
        seqs, seq_prob, draft_cond = seqs[keep], seq_prob[keep], draft_cond[keep]
        num_seqs = seqs.shape[0]
        if num_seqs ** num_drafts > MAX_TUPLES:
            raise InvalidArgument(
                f"num_drafts: {num_seqs}^{num_drafts} draft tuples exceed the exact-audit limit of {MAX_TUPLES}"
            )
        index = _product_grid(num_seqs, num_drafts)
        weights = seq_prob[index].prod(-1)
    elif draft_scheme == "without_replacement":
        if draft_len != 1:
            raise InvalidArgument(f"draft_len: drafting without replacement is defined for draft_len = 1, got {draft_len}")
        seqs = torch.arange(vocab_size, dtype=torch.int64).unsqueeze(1)
        draft_cond = _sequence_conditionals(draft_model, prefix, seqs, 1)
        probs = draft_cond[0, 0]
        support = [t for t in range(vocab_size) if probs[t] > 0]
        if num_drafts > len(support):
            raise InvalidArgument(
                f"num_drafts: {num_drafts} distinct drafts cannot be drawn without replacement from a draft "
                f"distribution with {len(support)} tokens of positive probability"
            )
        if math.perm(len(support), num_drafts) > MAX_TUPLES:
            raise InvalidArgument("num_drafts: too many ordered draft tuples for an exact audit")
        index = torch.tensor(list(itertools.permutations(support, num_drafts)), dtype=torch.int64)
        picked = probs[index]  # [N, K]
        # Mass left before each pick, summed over the tokens not yet drawn (1 - cumsum would cancel
        # catastrophically when the last tokens carry tiny mass).
        drawn = torch.zeros(index.shape[0], num_drafts, vocab_size, dtype=torch.bool)
        for i in range(1, num_drafts):
            drawn[:, i] = drawn[:, i - 1].scatter(1, index[:, i - 1 : i], True)
        remaining = torch.where(drawn, torch.zeros_like(probs), probs).sum(-1)  # [N, K]
        weights = (picked / remaining).prod(-1)
    else:
        raise InvalidArgument(f"draft_scheme: expected 'iid' or 'without_replacement', got {draft_scheme!r}")
    target_cond = _sequence_conditionals(target_model, prefix, seqs, draft_len + 1)
    used, index = torch.unique(index, return_inverse=True)  # only the sequences some tuple uses
    return DraftEnumeration(
        weights=weights,
        index=index,
        sequences=seqs[used],
        sequence_draft_probs=draft_cond[used],
        sequence_target_probs=target_cond[used],
    )


def string_of(code: int, length: int, vocab_size: int) -> tuple[int, ...]:
    """Decode a base-V string code (most significant token first)."""
    out = []
    for _ in range(length):
        out.append(code % vocab_size)
        code //= vocab_size
    return tuple(reversed(out))


@dataclasses.dataclass(frozen=True)
class ExactIterationResult:
    """Exact law of one verification step and the quantities derived from it.

    Laws over strings of length m are flat float64 tensors of size ``V**m``,
    indexed by the base-V code of the string (first token most significant).
    """

    vocab_size: int
    num_drafts: int
    draft_len: int
    num_draft_tuples: int
    #: E_m(s) = P(the step emits exactly s), for m = 1 .. L + 1
    emitted_law: tuple
    #: q(w) over strings of length m = 1 .. L + 1
    target_law: tuple
    #: F(w): law of the first L + 1 tokens when decoding continues with the unmodified target
    # [vocab_size ** (draft_len + 1)]
    implied_law: torch.Tensor
    #: B_m(u) = P(the emitted string starts with u), m = 1 .. L + 1
    prefix_law: tuple
    tv_distance: float
    max_abs_error: float
    token_tv_distance: float
    prefix_cap_excess: float
    worst_prefix: tuple
    #: E[len(s)], the mean emitted length
    block_efficiency: float
    #: membership acceptance: P(first emitted token is among the drafts' first tokens)
    acceptance: float

    @property
    def first_token_law(self) -> torch.Tensor:  # [vocab_size]
        """P(first emitted token = y)."""
        return self.prefix_law[0]

    def worst_strings(self, count: int = 5) -> list[dict]:
        """The strings w of length L + 1 with the largest |F(w) - q(w)|."""
        return _worst_strings(self.implied_law, self.target_law[-1], "implied", self.draft_len + 1, self.vocab_size,
                              count)


def _worst_strings(law: torch.Tensor, target: torch.Tensor, law_key: str, length: int, vocab_size: int,
                   count: int) -> list[dict]:
    """The (at most ``count``) strings of ``length`` tokens with the largest ``|law - target|`` > 0, largest first."""
    diff = (law - target).abs()
    top = torch.topk(diff, min(count, diff.numel()))
    return [
        {
            "string": list(string_of(int(code), length, vocab_size)),
            law_key: float(law[code]),
            "target": float(target[code]),
        }
        for code in top.indices.tolist()
        if float(diff[code]) > 0
    ]


def emitted_codes(draft_tokens: torch.Tensor, vocab_size: int) -> list:  # each [n, K, V]
    """Codes of the strings a step may emit, by number accepted: ``draft_tokens[:, k, :accepted]`` then any token."""
    draft_len = draft_tokens.shape[-1]
    powers = vocab_size ** torch.arange(draft_len - 1, -1, -1, dtype=torch.int64)
    return [
        (draft_tokens[:, :, :accepted] * powers[draft_len - accepted :]).sum(-1).unsqueeze(-1) * vocab_size
        + torch.arange(vocab_size)
        for accepted in range(draft_len + 1)
    ]


def _accumulate(emitted: list, levels, first_tokens: torch.Tensor, root_mass: torch.Tensor,
                deeper_mass: torch.Tensor) -> torch.Tensor:
    """Add one chunk's ``(codes, mass)`` per emitted length to ``emitted``; return its membership acceptance,
    from the drafted first tokens ``[n, k]``, the root's emission law ``[n, V]`` and every deeper node's."""
    for length, (codes, mass) in enumerate(levels):
        emitted[length].scatter_add_(0, codes.reshape(-1), mass.reshape(-1))
    first = torch.zeros(root_mass.shape, dtype=torch.bool).scatter(1, first_tokens, True)
    return deeper_mass.sum() + (root_mass * first).sum()


def _emitted_laws(verifier: Verifier, enumeration: DraftEnumeration, num_drafts: int, draft_len: int, vocab_size: int,
                  chunk_size: int) -> tuple[list, float]:
    """``E_m`` (the law of emitted strings of each length m + 1) and the membership acceptance, over every tuple."""
    num_tuples = enumeration.weights.shape[0]
    emitted = [torch.zeros(vocab_size ** (m + 1), dtype=torch.float64) for m in range(draft_len + 1)]
    membership = torch.zeros((), dtype=torch.float64)
    # Every tuple is made of the enumerated sequences: validate their conditionals once (as one-draft
    # inputs) instead of every tuple's copy of them, where the verifier takes the standard entry point.
    validate_tuples = verifier.__class__.output_probs is not Verifier.output_probs
    if not validate_tuples:
        check_verify_inputs(enumeration.sequences.unsqueeze(1), enumeration.sequence_draft_probs.unsqueeze(1),
                            enumeration.sequence_target_probs.unsqueeze(1))
    law_kwargs = {} if validate_tuples else {"validate": False}
    for start in range(0, num_tuples, chunk_size):
        sl = slice(start, start + chunk_size)
        (tokens, draft_probs, target_probs), weights = enumeration.chunk(sl), enumeration.weights[sl]
        law = check_output_probs(
            verifier.output_probs(tokens, draft_probs, target_probs, **law_kwargs).double(),
            tokens.shape[0], num_drafts, draft_len, vocab_size, who=verifier.name,
        )
        weighted = law * weights.view(-1, 1, 1, 1)  # [n, K, L + 1, V]
        levels = zip(emitted_codes(tokens, vocab_size), weighted.unbind(2))  # by number accepted
        # membership: first emitted token among the drafts' first tokens
        membership += _accumulate(emitted, levels, tokens[:, :, 0], weighted[:, :, 0, :].sum(1), weighted[:, :, 1:, :])
    return emitted, float(membership)


def target_laws(target_model: Model, prefix: Sequence[int], num_tokens: int) -> tuple[list, list]:
    """The target's conditionals after every string of m tokens (``[V^m, V]``) and its laws of strings of
    m + 1 tokens (``[V^(m+1)]``), for m = 0 .. ``num_tokens - 1``."""
    vocab_size = target_model.vocab_size
    conditionals, laws = [], []
    joint = torch.ones(1, dtype=torch.float64)
    for m in range(num_tokens):
        cond = target_model(contexts_from(prefix, _product_grid(vocab_size, m))).double()  # [V^m, V]
        joint = (joint.unsqueeze(-1) * cond).reshape(-1)
        conditionals.append(cond)
        laws.append(joint)
    return conditionals, laws


def _target_and_implied_laws(target_model: Model, prefix: Sequence[int], emitted: list) -> tuple[list, torch.Tensor]:
    """Target laws q(w) over strings of length 1 .. L + 1, and the implied law F of the first L + 1 tokens."""
    conditionals, target_law = target_laws(target_model, prefix, len(emitted))
    implied = emitted[0]
    for m in range(1, len(emitted)):
        implied = (implied.unsqueeze(-1) * conditionals[m]).reshape(-1) + emitted[m]
    return target_law, implied


def _prefix_laws(emitted: list, vocab_size: int) -> list:
    """``B_m(u) = E_m(u) + sum_x B_{m+1}(ux)``: P(the emitted string starts with u), m = 1 .. L + 1."""
    prefix_law = [emitted[-1]]
    for m in range(len(emitted) - 2, -1, -1):
        prefix_law.insert(0, emitted[m] + prefix_law[0].reshape(-1, vocab_size).sum(-1))
    return prefix_law


def _worst_prefix_cap(prefix_law: list, target_law: list, vocab_size: int) -> tuple[float, tuple]:
    """``max_u B(u) - q(u)`` and the u where it occurs (0 and () when no cap is exceeded)."""
    excess, worst = 0.0, ()
    for m, (cap, target) in enumerate(zip(prefix_law, target_law)):
        over = cap - target
        value, code = over.max(0)
        if float(value) > excess:
            excess, worst = float(value), string_of(int(code), m + 1, vocab_size)
    return excess, worst


def _law_fields(target_model: Model, prefix: Sequence[int], emitted: list, vocab_size: int) -> dict:
    """The :class:`ExactIterationResult` fields that follow from the emitted laws ``E_m`` and the target."""
    target_law, implied = _target_and_implied_laws(target_model, prefix, emitted)
    prefix_law = _prefix_laws(emitted, vocab_size)
    excess, worst = _worst_prefix_cap(prefix_law, target_law, vocab_size)
    diff = implied - target_law[-1]
    return dict(
        emitted_law=tuple(emitted),
        target_law=tuple(target_law),
        implied_law=implied,
        prefix_law=tuple(prefix_law),
        tv_distance=float(diff.abs().sum() / 2),
        max_abs_error=float(diff.abs().max()),
        token_tv_distance=float((prefix_law[0] - target_law[0]).abs().sum() / 2),
        prefix_cap_excess=excess,
        worst_prefix=worst,
    )


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
    enumeration = enumerate_drafts(draft_model, target_model, num_drafts, draft_len, draft_scheme, prefix)
    vocab_size = draft_model.vocab_size
    emitted, membership = _emitted_laws(verifier, enumeration, num_drafts, draft_len, vocab_size, chunk_size)
    lengths = torch.arange(1, draft_len + 2, dtype=torch.float64)
    block_efficiency = float(sum(lengths[m] * emitted[m].sum() for m in range(draft_len + 1)))
    return ExactIterationResult(
        vocab_size=vocab_size,
        num_drafts=num_drafts,
        draft_len=draft_len,
        num_draft_tuples=enumeration.weights.shape[0],
        **_law_fields(target_model, prefix, emitted, vocab_size),
        block_efficiency=block_efficiency,
        acceptance=membership,
    )
