"""Slow, obviously-correct oracles for sampling parameters: plain Python, one row at a time.

* :func:`process`: one row of logits to the law an engine samples from, written straight from
  the definitions in ``docs/sampling.md`` (sets, ``sorted`` with explicit keys, ``math.exp``).
* :func:`speculative_tv`: the exact TV distance between the target law and the law of the
  first ``L + 1`` tokens for single-draft speculative sampling whose acceptance, residual and
  bonus use the given (possibly wrong) laws, in a context-free model (every node has the same
  draft and target rows), by enumerating every emitted string.
* :data:`SAMPLING_BUGS`: what each broken verifier of ``spectr_audit.verifiers.library.sampling_bugs``
  does, restated as the laws it feeds into the acceptance, residual and bonus.
"""

from __future__ import annotations

import itertools
import math

#: The engines' conventions (restated, not imported).
ENGINES = {
    "vllm": dict(steps=("temperature", "min_p", "top_k", "top_p"), greedy_below=1e-5),
    "sglang": dict(
        steps=("temperature", "top_k", "top_p", "min_p"), top_k_ties="rank", top_p_boundary="inclusive",
        top_p_mass="unfiltered", tie_order="lowest_index_first", greedy_below=1e-6,
    ),
    "transformers": dict(steps=("temperature", "top_k", "top_p", "min_p")),
    "eagle": dict(steps=("temperature", "top_p", "top_k"), greedy_below=1e-5, greedy_inclusive=True),
}


def _softmax_over(scaled, kept):
    top = max(scaled[i] for i in kept)
    weights = {i: math.exp(scaled[i] - top) for i in kept}
    total = sum(weights.values())
    return [weights[i] / total if i in weights else 0.0 for i in range(len(scaled))]


def process(
    logits,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    steps=("temperature", "min_p", "top_k", "top_p"),
    top_k_ties="keep",
    top_p_boundary="strict",
    top_p_mass="renormalised",
    tie_order="highest_index_first",
    greedy_below=0.0,
    greedy_inclusive=False,
):
    """One row of logits (a list, ``-inf`` allowed) to probabilities."""
    vocab_size = len(logits)
    greedy = temperature == 0 or temperature < greedy_below or (greedy_inclusive and temperature <= greedy_below)
    if greedy:
        best = max(logits)
        winner = min(i for i in range(vocab_size) if logits[i] == best)
        return [1.0 if i == winner else 0.0 for i in range(vocab_size)]

    def tie_key(i):
        return i if tie_order == "lowest_index_first" else -i

    scaled = list(logits)
    finite = {i for i in range(vocab_size) if logits[i] != -math.inf}
    kept = set(finite)
    for step in steps:
        if step == "temperature":
            scaled = [x / temperature for x in scaled]
        elif step == "top_k" and 0 < top_k < vocab_size:
            ranking = sorted(kept, key=lambda i: (-scaled[i], tie_key(i)))
            if top_k_ties == "keep":
                values = sorted((scaled[i] for i in kept), reverse=True) + [-math.inf] * vocab_size
                kth = values[top_k - 1]
                kept = {i for i in kept if scaled[i] >= kth}
            else:
                kept = set(ranking[:top_k])
        elif step == "top_p" and top_p < 1:
            pool = kept if top_p_mass == "renormalised" else finite
            probs = _softmax_over(scaled, pool)
            ahead, inside = 0.0, set()
            for i in sorted(pool, key=lambda i: (-scaled[i], tie_key(i))):
                if ahead < top_p or (top_p_boundary == "inclusive" and ahead == top_p):
                    inside.add(i)
                ahead += probs[i]
            kept &= inside
        elif step == "min_p" and min_p > 0:
            top = max(scaled[i] for i in kept)
            kept = {i for i in kept if math.exp(scaled[i] - top) >= min_p}
    return _softmax_over(scaled, kept)


def process_engine(logits, engine, **params):
    """:func:`process` with the conventions of ``engine`` (a key of :data:`ENGINES`)."""
    return process(logits, **params, **ENGINES[engine])


# ---------------------------------------------------------------------------------------------
# Exact TV of speculative sampling with possibly wrong laws (context-free, one draft)
# ---------------------------------------------------------------------------------------------


def _positive_part_normalised(target, draft):
    residual = [max(t - d, 0.0) for t, d in zip(target, draft)]
    total = sum(residual)
    if total > 0:
        return [r / total for r in residual]
    total = sum(target)
    return [t / total for t in target]


def speculative_tv(draft, accept_draft, accept_target, residual_draft, residual_target, bonus, target, draft_len):
    """TV(target^(L+1), law of the first L + 1 tokens) for one draft of ``draft_len`` tokens.

    Drafts are drawn from ``draft``; a drafted ``x`` is accepted with
    ``min(1, accept_target[x] / accept_draft[x])``; the first rejection emits a token of
    ``(residual_target - residual_draft)_+`` normalised (``residual_target`` normalised when that
    is empty); a fully accepted draft emits a token of ``bonus`` (normalised).  After the step,
    decoding continues with ``target``.
    """
    vocab_size = len(target)

    def accept(x):
        if accept_draft[x] > 0:
            return min(1.0, accept_target[x] / accept_draft[x])
        return 1.0 if accept_target[x] > 0 else 0.0

    residual = _positive_part_normalised(residual_target, residual_draft)
    bonus_total = sum(bonus)
    bonus = [b / bonus_total for b in bonus]
    reject_mass = sum(draft[x] * (1 - accept(x)) for x in range(vocab_size))
    emitted = {}  # emitted string -> probability
    for accepted in range(draft_len + 1):
        for prefix in itertools.product(range(vocab_size), repeat=accepted):
            reach = 1.0
            for x in prefix:
                reach *= draft[x] * accept(x)
            last = bonus if accepted == draft_len else [reject_mass * r for r in residual]
            for y in range(vocab_size):
                emitted[prefix + (y,)] = emitted.get(prefix + (y,), 0.0) + reach * last[y]
    tv = 0.0
    for string in itertools.product(range(vocab_size), repeat=draft_len + 1):
        implied = 0.0
        for cut in range(1, draft_len + 2):
            continuation = 1.0
            for w in string[cut:]:
                continuation *= target[w]
            implied += emitted.get(string[:cut], 0.0) * continuation
        true = 1.0
        for w in string:
            true *= target[w]
        tv += abs(implied - true)
    return tv / 2


def _without(steps, name):
    return tuple(s for s in steps if s != name)


def bug_laws(bug, draft_logits, target_logits, params, engine="vllm"):
    """``(draft, accept_draft, accept_target, residual_draft, residual_target, bonus, target)`` of ``bug``."""
    conventions = dict(ENGINES[engine])
    steps = conventions.pop("steps")
    draft = process(draft_logits, **params, steps=steps, **conventions)
    target = process(target_logits, **params, steps=steps, **conventions)
    raw_draft = process(draft_logits)
    raw_target = process(target_logits)
    if bug in ("logits-speculative", "probs-speculative"):
        return draft, draft, target, draft, target, target, target
    if bug == "params-draft-only":
        return draft, draft, raw_target, draft, raw_target, raw_target, target
    if bug == "params-target-only":
        return draft, raw_draft, target, raw_draft, target, target, target
    if bug == "top-p-before-temperature":
        wrong = ("top_p",) + _without(steps, "top_p")
        misordered = process(target_logits, **params, steps=wrong, **conventions)
        return draft, draft, misordered, draft, misordered, misordered, target
    if bug == "bonus-unprocessed":
        return draft, draft, target, draft, target, raw_target, target
    if bug == "residual-unprocessed":
        return draft, draft, target, draft, raw_target, target, target
    if bug == "top-p-unrenormalised-target":
        before = process(target_logits, **params, steps=_without(steps, "top_p"), **conventions)
        masked = [b if t > 0 else 0.0 for b, t in zip(before, target)]
        return draft, draft, masked, draft, masked, masked, target
    raise KeyError(bug)


#: The bugs the oracle knows, in library order.
SAMPLING_BUGS = (
    "params-draft-only",
    "params-target-only",
    "top-p-before-temperature",
    "bonus-unprocessed",
    "residual-unprocessed",
    "top-p-unrenormalised-target",
)


def bug_tv(bug, draft_logits, target_logits, params, draft_len, engine="vllm"):
    """Exact TV of ``bug`` in the context-free case."""
    draft, accept_draft, accept_target, residual_draft, residual_target, bonus, target = bug_laws(
        bug, draft_logits, target_logits, params, engine
    )
    return speculative_tv(draft, accept_draft, accept_target, residual_draft, residual_target, bonus, target, draft_len)
