"""Exact audit of the whole decoding loop: the law of the first N tokens it produces.

The loop of :func:`spectr_audit.drafting.decoding.decode` is run symbolically: every
history (the tokens committed so far, iteration by iteration, and the carried
corrections live after it) is a row with its probability.  One iteration
enumerates every draft tuple at each history's context, applies the live
corrections to the target, takes the verifier's exact law (``output_probs``)
and branches each row into its emitted strings, advancing the corrections and
adding the verifier's new one (``carried_correction``).  Histories that reach
``num_tokens`` tokens add their probability to the law of their first
``num_tokens`` tokens; histories that agree in tokens and in their live
corrections are merged.  The result is compared with the target's law of
``num_tokens``-token strings.

This is the judge of verifiers with carried corrections (greedy block
verification with its repair, SpecTr-GBV's Algorithm 2): their single
iteration is not exact with the unmodified target, the whole loop may be.

It also reports the largest prefix-cap excess over the iterations met:
``B_t(u) - q_t(u)``, where ``B_t(u)`` is the probability that the iteration
started at a history emits a string starting with ``u`` and ``q_t`` is the
target that iteration verified against (corrections applied).  Where it is
positive no correction of later iterations can repair that iteration.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch

from spectr_audit import defaults
from spectr_audit.contract.verifier import Verifier, VerifyOutput, check_output_probs
from spectr_audit.contract.correction import CorrectionChain
from spectr_audit.contract.logits import output_probs_with_params, takes_logits
from spectr_audit.drafting.decoding import append_tokens, emitted_tokens
from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.iteration import _check_exact_law, enumerate_drafts
from spectr_audit.exact.law import _worst_strings, string_of, target_laws
from spectr_audit.drafting.models import PAD, Model, contexts_from
from spectr_audit.drafting.processed import audit_params, is_processed, node_logits, processed_model

__all__ = ["MultiIterationResult", "exact_multi_iteration", "target_string_law"]

#: Refuse to follow more live histories than this at once.
MAX_HISTORIES = defaults.EXACT_MAX_HISTORIES


@dataclasses.dataclass(frozen=True)
class MultiIterationResult:
    """Exact law of the first ``num_tokens`` tokens of the decoding loop, against the target's.

    Laws are flat float64 tensors of size ``vocab_size ** num_tokens`` indexed by the
    base-V code of the string (first token most significant), as in :mod:`spectr_audit.exact.iteration`.
    """

    verifier: str
    vocab_size: int
    num_drafts: int
    draft_len: int
    num_tokens: int
    # [vocab_size ** num_tokens]
    decoded_law: torch.Tensor
    # [vocab_size ** num_tokens]
    target_law: torch.Tensor
    tv_distance: float
    max_abs_error: float
    #: largest B_t(u) - q_t(u) over the iterations met, 0 when no cap is exceeded (up to rounding)
    prefix_cap_excess: float
    #: tokens since the loop start up to the iteration start, then u, where that excess occurs (() if none)
    worst_prefix: tuple
    #: E[number of iterations until num_tokens tokens exist]
    expected_iterations: float
    #: histories followed, summed over iterations (a cost measure)
    num_histories: int

    def worst_strings(self, count: int = 5) -> list[dict]:
        """The strings with the largest ``|decoded - target|``."""
        return _worst_strings(self.decoded_law, self.target_law, "decoded", self.num_tokens, self.vocab_size, count)


def target_string_law(target_model: Model, num_tokens: int, prefix: Sequence[int] = ()) -> torch.Tensor:
    """q(w) for every string w of ``num_tokens`` tokens after ``prefix``: ``[V ** num_tokens]``."""
    laws = target_laws(target_model, prefix, num_tokens)[1]
    return laws[-1] if laws else torch.ones(1, dtype=torch.float64)


@dataclasses.dataclass(frozen=True)
class _Histories:
    """Live histories: committed tokens (left-aligned), probabilities, corrections."""

    # [n, capacity]
    tokens: torch.Tensor
    # [n]
    lengths: torch.Tensor
    # [n]
    weight: torch.Tensor
    # [n]
    iterations: torch.Tensor
    chain: CorrectionChain

    def take(self, index: torch.Tensor) -> "_Histories":
        return _Histories(self.tokens[index], self.lengths[index], self.weight[index], self.iterations[index],
                          self.chain.select(index))

    def contexts(self, prefix: tuple) -> list[tuple]:
        """Each history's context: ``prefix`` and its committed tokens."""
        return [prefix + tuple(row[:length]) for row, length in zip(self.tokens.tolist(), self.lengths.tolist())]


def _codes(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Base-V code of each row of ``tokens [n, m]`` (first token most significant)."""
    powers = vocab_size ** torch.arange(tokens.shape[1] - 1, -1, -1, dtype=torch.int64)
    return (tokens * powers).sum(-1)


def _merge(histories: _Histories) -> _Histories:
    """Sum the probabilities of histories equal in tokens and in live corrections."""
    n = histories.weight.shape[0]
    if n == 0:
        return histories
    fingerprint = histories.chain.fingerprint(n)
    if fingerprint is None:
        return histories
    key = torch.cat([histories.tokens.double(), histories.lengths.double().unsqueeze(1), fingerprint], dim=1)
    _, group = torch.unique(key, dim=0, return_inverse=True)
    num_groups = int(group.max()) + 1
    first = torch.full((num_groups,), n, dtype=torch.int64).scatter_reduce(0, group, torch.arange(n), "amin")
    weight = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, histories.weight)
    merged = histories.take(first)
    # Merged histories may have taken different numbers of iterations: keep their probability-weighted
    # mean, which is all that expected_iterations needs.
    iterations = torch.zeros(num_groups, dtype=torch.float64).index_add_(
        0, group, histories.weight * histories.iterations.double()
    )
    return dataclasses.replace(merged, weight=weight, iterations=iterations / weight.clamp(min=1e-300))


@dataclasses.dataclass(frozen=True)
class _Tuples:
    """Every draft tuple at every live history's context, one row each, corrections applied."""

    # [n]: the live history of each row
    history: torch.Tensor
    # [n, num_drafts, draft_len]
    draft_tokens: torch.Tensor
    # [n, num_drafts, draft_len, vocab_size]
    draft_probs: torch.Tensor
    # [n, num_drafts, draft_len + 1, vocab_size]: the target after the row's live corrections
    target_probs: torch.Tensor
    # [n]: P(draft tuple | history)
    weights: torch.Tensor
    #: the live corrections of each row, and what they saw of the drafts (for ``advance``)
    chain: CorrectionChain
    seen: list


@dataclasses.dataclass
class _Tally:
    """What the loop has accumulated so far."""

    # [vocab_size ** num_tokens]: the law of the first num_tokens tokens, from finished histories
    decoded: torch.Tensor
    expected_iterations: float = 0.0
    #: 0 and () when no cap is exceeded, as in the single-iteration audit
    prefix_cap_excess: float = 0.0
    worst_prefix: tuple = ()
    num_histories: int = 0


def _draft_tuples(live: _Histories, prefix: tuple, enumerations: dict, draft_model: Model, target_model: Model,
                  num_drafts: int, draft_len: int, draft_scheme: str) -> _Tuples:
    """Every draft tuple at each live history's context (enumerations cached by context), corrections applied."""
    history_of_row, enum_rows = [], []
    for h, context in enumerate(live.contexts(prefix)):
        if context not in enumerations:
            enumerations[context] = enumerate_drafts(draft_model, target_model, num_drafts, draft_len, draft_scheme,
                                                     context)
        num_tuples = enumerations[context].weights.shape[0]
        history_of_row.append(torch.full((num_tuples,), h, dtype=torch.int64))
        enum_rows.append(enumerations[context])
    history_of_row = torch.cat(history_of_row)
    draft_tokens = torch.cat([e.draft_tokens for e in enum_rows])
    draft_probs = torch.cat([e.draft_probs for e in enum_rows])
    chain = live.chain.select(history_of_row)
    target_probs, seen = chain.adjust(draft_tokens, draft_probs, torch.cat([e.target_probs for e in enum_rows]))
    return _Tuples(history_of_row, draft_tokens, draft_probs, target_probs, torch.cat([e.weights for e in enum_rows]),
                   chain, seen)


def _refuse_hidden_corrections(verifier: Verifier, tuples: _Tuples) -> None:
    """A verifier whose samples carry corrections cannot be judged without knowing them."""
    probe = verifier.verify(tuples.draft_tokens, tuples.draft_probs, tuples.target_probs,
                            torch.Generator().manual_seed(0))
    if probe.correction is not None:
        raise InvalidArgument(
            f"verifier: {verifier.name!r} returns carried corrections but has no carried_correction "
            f"method; pass carried_correction= to the audit"
        )


def _iterate(live: _Histories, tuples: _Tuples, law: torch.Tensor, correct: Optional[Callable], num_tokens: int,
             vocab_size: int, tally: _Tally) -> _Histories:
    """One iteration: branch each history into its emitted strings; finished ones go to the law, the rest merge."""
    conditional = law * tuples.weights.view(-1, 1, 1, 1)  # given the history
    row, index, accepted, token = (conditional > 0).nonzero().unbind(1)
    emitted, counts = emitted_tokens(tuples.draft_tokens[row], VerifyOutput(accepted, index, token))
    mass = conditional[row, index, accepted, token]
    source = tuples.history[row]

    # Prefix cap of each iteration met, against the target it verified against.
    cap, where = _prefix_cap_excess(source, emitted, counts, mass, tuples.target_probs[row, index].double(), vocab_size)
    if cap > tally.prefix_cap_excess:
        history, prefix_u = where
        length = int(live.lengths[history])
        tally.prefix_cap_excess, tally.worst_prefix = cap, tuple(live.tokens[history, :length].tolist()) + prefix_u

    tokens, lengths = append_tokens(live.tokens[source], live.lengths[source], emitted, counts)
    new = None
    if correct is not None:
        new = correct(tuples.draft_tokens[row], tuples.draft_probs[row], tuples.target_probs[row], accepted, index,
                      token)
    branched = _Histories(
        tokens=tokens,
        lengths=lengths,
        weight=live.weight[source] * mass,
        iterations=live.iterations[source] + 1,
        chain=tuples.chain.select(row).advance(
            tuples.draft_tokens[row], tuples.draft_probs[row], [s[row] for s in tuples.seen], accepted, index, token,
            new=new,
        ),
    )
    done = lengths >= num_tokens
    tally.decoded.index_add_(0, _codes(tokens[done, :num_tokens], vocab_size), branched.weight[done])
    tally.expected_iterations += float((branched.weight[done] * branched.iterations[done]).sum())
    return _merge(branched.take((~done).nonzero().squeeze(1)))


def exact_multi_iteration(
    verifier: Verifier,
    draft_model: Model,
    target_model: Model,
    num_drafts: int,
    draft_len: int,
    num_tokens: int,
    *,
    prefix: Sequence[int] = (),
    draft_scheme: Optional[str] = None,
    carried_correction: Optional[Callable] = None,
    max_histories: int = MAX_HISTORIES,
    params=None,
    order="vllm",
) -> MultiIterationResult:
    """Exact law of the first ``num_tokens`` tokens of the decoding loop with ``verifier``.

    Parameters
    ----------
    verifier : Verifier
        Must have an exact law (``output_probs``).  If it carries corrections it must
        provide ``carried_correction`` (see :mod:`spectr_audit.contract.correction`).
    draft_model, target_model : Model
    num_drafts, draft_len : int
        K and L of every iteration.
    num_tokens : int
        N: the length of the strings whose law is compared with the target's.
    prefix : sequence of int
        The context before the first iteration.
    draft_scheme : str, optional
        Defaults to the verifier's declared scheme.
    carried_correction : callable, optional
        Overrides ``verifier.carried_correction`` (e.g. for a wrapped third-party verifier).
    max_histories : int
        Refuse (InvalidArgument) when more live histories than this would be followed.
    params : SamplingParams, optional
        Sampling parameters (one setting, scalars): the models are then raw, every iteration
        drafts from the processed draft law, the loop is held to the processed target's law,
        and a verifier that takes logits gets the raw logits at every node of every history and
        ``params`` (docs/sampling.md).  Such a verifier cannot carry a correction (a correction
        adjusts the target's probabilities, which it is not handed).
    order : str, sequence of str or ProcessingOrder
        The engine's processing conventions (default ``"vllm"``).

    Returns
    -------
    MultiIterationResult

    Notes
    -----
    Cost: each iteration enumerates ``(V^L)^K`` draft tuples per live history; histories
    grow with ``num_tokens`` (at most about ``sum_m V^m`` distinct token strings, times
    the distinct correction states).  Keep V, K, L, N small.

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> from spectr_audit.registry import load_verifier
    >>> audit = exact_multi_iteration(load_verifier("greedy-block-repaired"), ContextFreeModel([2/3, 1/3]),
    ...                               ContextFreeModel([1/3, 2/3]), num_drafts=1, draft_len=2, num_tokens=3)
    >>> audit.tv_distance < 1e-12
    True
    """
    _check_exact_law(verifier)
    if not isinstance(num_tokens, int) or num_tokens < 1:
        raise InvalidArgument(f"num_tokens: expected an integer >= 1, got {num_tokens!r}")
    verifier.check_supports(num_drafts, draft_len)
    draft_scheme = draft_scheme or verifier.draft_scheme
    correct = carried_correction or getattr(verifier, "carried_correction", None)
    logits_law = None
    if params is not None:
        draft_model, target_model, logits_law = _with_params(verifier, draft_model, target_model, params, order,
                                                             correct is not None)
    vocab_size = draft_model.vocab_size
    prefix = tuple(int(t) for t in prefix)

    capacity = num_tokens + draft_len
    live = _Histories(
        tokens=torch.full((1, capacity), PAD, dtype=torch.int64),
        lengths=torch.zeros(1, dtype=torch.int64),
        weight=torch.ones(1, dtype=torch.float64),
        iterations=torch.zeros(1, dtype=torch.float64),
        chain=CorrectionChain(),
    )
    tally = _Tally(torch.zeros(vocab_size**num_tokens, dtype=torch.float64))
    enumerations: dict = {}
    while live.weight.numel():
        tally.num_histories += live.weight.numel()
        if live.weight.numel() > max_histories:
            raise InvalidArgument(
                f"num_tokens: {live.weight.numel()} live histories exceed max_histories={max_histories}; "
                f"lower num_tokens, draft_len or num_drafts"
            )
        tuples = _draft_tuples(live, prefix, enumerations, draft_model, target_model, num_drafts, draft_len,
                               draft_scheme)
        raw_law = (verifier.output_probs(tuples.draft_tokens, tuples.draft_probs, tuples.target_probs)
                   if logits_law is None else logits_law(live, prefix, enumerations, tuples))
        law = check_output_probs(raw_law.double(), tuples.draft_tokens.shape[0], num_drafts, draft_len, vocab_size,
                                 who=verifier.name)
        if correct is None and tally.num_histories == 1:
            _refuse_hidden_corrections(verifier, tuples)
        live = _iterate(live, tuples, law, correct, num_tokens, vocab_size, tally)

    target = target_string_law(target_model, num_tokens, prefix)
    diff = tally.decoded - target
    return MultiIterationResult(
        verifier=verifier.name,
        vocab_size=vocab_size,
        num_drafts=num_drafts,
        draft_len=draft_len,
        num_tokens=num_tokens,
        decoded_law=tally.decoded,
        target_law=target,
        tv_distance=float(diff.abs().sum() / 2),
        max_abs_error=float(diff.abs().max()),
        prefix_cap_excess=tally.prefix_cap_excess,
        worst_prefix=tally.worst_prefix,
        expected_iterations=tally.expected_iterations,
        num_histories=tally.num_histories,
    )


def _with_params(verifier, draft_model, target_model, params, order, carries: bool):
    """The processed models, and (for a verifier that takes logits) the function giving its law on a round's tuples."""
    params = audit_params(params)
    if is_processed(draft_model) or is_processed(target_model):
        raise InvalidArgument("draft_model, target_model: give the raw models; the parameters process them")
    draft_model, target_model = processed_model(draft_model, params, order), processed_model(target_model, params, order)
    if not takes_logits(verifier):
        return draft_model, target_model, None  # handed the processed laws, as verify_with_params would
    if carries:
        raise InvalidArgument(
            f"verifier: {verifier.name!r} takes logits and carries a correction; a correction adjusts target "
            f"probabilities, which a logits verifier is not handed"
        )
    cache: dict = {}

    def law(live: _Histories, prefix: tuple, enumerations: dict, tuples: _Tuples) -> torch.Tensor:
        # the raw logits of every tuple, in _draft_tuples' row order (histories in turn), cached by context
        draft_rows, target_rows = [], []
        for context in live.contexts(prefix):
            if context not in cache:
                tokens = enumerations[context].draft_tokens  # [N, K, L]
                contexts = contexts_from(context, torch.zeros(tokens.shape[0], 0, dtype=torch.int64))
                padded = torch.cat([tokens, tokens[:, :, :1]], dim=2)  # the last column is never read
                cache[context] = (node_logits(draft_model, contexts, tokens, tokens.shape[2]),
                                  node_logits(target_model, contexts, padded, tokens.shape[2] + 1))
            draft_rows.append(cache[context][0])
            target_rows.append(cache[context][1])
        return output_probs_with_params(verifier, tuples.draft_tokens, torch.cat(draft_rows), torch.cat(target_rows),
                                        params, order=order, validate=False)

    return draft_model, target_model, law


def _prefix_cap_excess(
    history: torch.Tensor,  # [n] history of each emitted cell
    emitted: torch.Tensor,  # [n, draft_len + 1] emitted strings, PAD after counts
    counts: torch.Tensor,  # [n]
    mass: torch.Tensor,  # [n] probability of the cell given its history
    path_target: torch.Tensor,  # [n, draft_len + 1, vocab_size] effective target along the cell's draft
    vocab_size: int,
) -> tuple[float, tuple]:
    """max over histories and prefixes u of B(u) - q(u), and (history, u) where it occurs."""
    max_len = emitted.shape[1]
    positions = torch.arange(max_len)
    inside = positions < counts.unsqueeze(1)  # [n, L + 1]
    safe = torch.where(inside, emitted, torch.zeros_like(emitted))
    # q(u_j) for u_j = the first j + 1 emitted tokens: product of the target along the path.
    step = path_target.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    joint = torch.where(inside, step, torch.ones_like(step)).cumprod(-1)
    codes = torch.zeros_like(safe)
    code = torch.zeros_like(safe[:, 0])
    for j in range(max_len):
        code = code * vocab_size + safe[:, j]
        codes[:, j] = code
    span = vocab_size**max_len
    key = (history.unsqueeze(1) * max_len + positions) * span + codes  # [n, L + 1]
    key, joint, weight = key[inside], joint[inside], mass.unsqueeze(1).expand_as(inside)[inside]
    unique, group = torch.unique(key, return_inverse=True)
    prefix_mass = torch.zeros(unique.shape[0], dtype=torch.float64).index_add_(0, group, weight)
    target = torch.zeros(unique.shape[0], dtype=torch.float64).scatter_reduce(0, group, joint, "amax", include_self=False)
    gap = prefix_mass - target
    if gap.numel() == 0:
        return float("-inf"), (0, ())
    value, at = gap.max(0)
    k = int(unique[at])
    code, rest = k % span, k // span
    length = rest % max_len + 1
    return float(value), (rest // max_len, string_of(code, length, vocab_size))
