"""The token-level and tree verifiers: exact laws, oracles, samplers, hand-derived values."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from spectr_audit.bounds.acceptance import optimal_acceptance, spectr_guarantee
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.drafting.harness import draft
from spectr_audit.drafting.models import ContextFreeModel, random_markov
from spectr_audit.registry import load_verifier
from spectr_audit.run.runner import audit_case
from spectr_audit.run.suite import Case
from spectr_audit.verifiers._walk import NodeRule, ChainWalkVerifier, gather_tokens, normalise

from tests._stats import pooled_chisquare_pvalue
from tests.oracles.rules import RULES, tree_law

TOKEN_VERIFIERS = ["speculative", "kseq", "rrs", "rrs-wor"]
TREE_VERIFIERS = ["speculative", "spectr-tree", "rrs"]


@st.composite
def distributions(draw, vocab_size, min_support=1):
    """A probability vector with some exact zeros (at least ``min_support`` positive entries)."""
    weights = draw(st.lists(st.floats(0.0, 1.0), min_size=vocab_size, max_size=vocab_size))
    zeros = draw(st.lists(st.booleans(), min_size=vocab_size, max_size=vocab_size))
    values = [0.0 if z else w + 1e-3 for w, z in zip(weights, zeros)]
    for i in range(vocab_size):
        if sum(v > 0 for v in values) >= min_support:
            break
        values[i] = values[i] or 0.5
    total = sum(values)
    return [v / total for v in values]


@st.composite
def token_cases(draw):
    vocab_size = draw(st.integers(1, 5))
    num_drafts = draw(st.integers(1, 4))
    draft_probs = draw(distributions(vocab_size, min_support=1))
    target_probs = draw(distributions(vocab_size, min_support=1))
    return draft_probs, target_probs, num_drafts


@settings(max_examples=60, deadline=None)
@given(token_cases())
def test_token_verifiers_exact_and_within_bounds(case):
    draft_probs, target_probs, num_drafts = case
    draft_model, target_model = ContextFreeModel(draft_probs), ContextFreeModel(target_probs)
    alpha_star = optimal_acceptance(draft_probs, target_probs, num_drafts).item()
    for name in TOKEN_VERIFIERS:
        verifier = load_verifier(name)
        if not verifier.supports(num_drafts, 1):
            continue
        if verifier.draft_scheme == "without_replacement" and sum(p > 0 for p in draft_probs) < num_drafts:
            continue
        audit = exact_iteration(verifier, draft_model, target_model, num_drafts)
        assert audit.max_abs_error <= 1e-12, (name, audit.worst_strings())
        assert audit.prefix_cap_excess <= 1e-12, name
        if verifier.draft_scheme == "iid":
            assert audit.acceptance <= alpha_star + 1e-9, name
        if "spectr" in verifier.guarantees:
            assert audit.acceptance >= spectr_guarantee(num_drafts) * alpha_star - 1e-9


@settings(max_examples=40, deadline=None)
@given(
    vocab_size=st.integers(2, 4),
    num_drafts=st.integers(1, 3),
    draft_len=st.integers(1, 3),
    seed=st.integers(0, 10_000),
    temperature=st.sampled_from([0.3, 1.0, 3.0]),
)
def test_tree_verifiers_exact_on_markov_models(vocab_size, num_drafts, draft_len, seed, temperature):
    if vocab_size**draft_len > 27 and num_drafts == 3:
        num_drafts = 2  # keep the enumeration small
    draft_model = random_markov(vocab_size, 1, seed=seed, temperature=temperature)
    target_model = random_markov(vocab_size, 1, seed=seed + 1)
    for name in TREE_VERIFIERS:
        verifier = load_verifier(name)
        if not verifier.supports(num_drafts, draft_len):
            continue
        audit = exact_iteration(verifier, draft_model, target_model, num_drafts, draft_len, prefix=(seed % vocab_size,))
        assert audit.max_abs_error <= 1e-12, (name, audit.worst_strings())
        assert audit.prefix_cap_excess <= 1e-12, name


@st.composite
def oracle_cases(draw):
    """A rule of ``RULES``, a (K, L) with K <= 4, L <= 3 that its verifier supports, V in 2..4, and a seed.

    Drafts without replacement need K distinct tokens of positive draft probability: V >= K is drawn
    directly, and the rare draft model with fewer positive tokens (an underflow at concentration 0.5)
    is discarded with ``assume``.
    """
    name = draw(st.sampled_from(sorted(RULES)))
    verifier = load_verifier(name)
    num_drafts, draft_len = draw(st.sampled_from(
        [(k, n) for k in range(1, 5) for n in range(1, 4) if verifier.supports(k, n)]
    ))
    without_replacement = verifier.draft_scheme == "without_replacement"
    vocab_size = draw(st.integers(max(2, num_drafts) if without_replacement else 2, 4))
    seed = draw(st.integers(0, 10_000))
    draft_model = random_markov(vocab_size, 1, seed=seed, concentration=0.5)
    if without_replacement:
        assume(int((draft_model(torch.full((1, 1), -1))[0] > 0).sum()) >= num_drafts)
    return name, num_drafts, draft_len, vocab_size, seed, draft_model


@settings(max_examples=60, deadline=None)
@given(oracle_cases())
def test_fast_law_matches_plain_python_oracle(case):
    name, num_drafts, draft_len, vocab_size, seed, draft_model = case
    verifier = load_verifier(name)
    target_model = random_markov(vocab_size, 1, seed=seed + 7, concentration=0.5)
    contexts = torch.full((6, 1), -1, dtype=torch.int64)
    batch = draft(draft_model, target_model, contexts, num_drafts, draft_len,
                  torch.Generator().manual_seed(seed), verifier.draft_scheme)
    law = verifier.output_probs(batch.draft_tokens, batch.draft_probs, batch.target_probs)
    for b in range(contexts.shape[0]):
        expected = tree_law(RULES[name], batch.draft_tokens[b].tolist(), batch.draft_probs[b].tolist(),
                            batch.target_probs[b].tolist())
        dense = torch.zeros_like(law[b])
        for (k, n, y), mass in expected.items():
            dense[k, n, y] += mass
        torch.testing.assert_close(law[b], dense, atol=1e-9, rtol=0)


def _verdict_cells(out, num_drafts, draft_len, vocab_size):
    return ((out.draft_index * (draft_len + 1) + out.num_accepted) * vocab_size + out.next_token)


@pytest.mark.parametrize("name,num_drafts,draft_len", [
    ("speculative", 1, 3), ("kseq", 3, 1), ("spectr-tree", 3, 2), ("rrs", 3, 2), ("rrs-wor", 3, 1),
])
def test_sampled_verdicts_follow_output_probs(name, num_drafts, draft_len):
    """Pearson chi-square of sampled verdict cells against the verifier's own exact law.

    Each (draft tuple, verifier) pair is one test at false-alarm rate 1e-4 with a fixed
    seed (sparse cells, expected count < 5, are pooled). A failure means the sampler and
    ``output_probs`` disagree: rerun with another seed only to confirm, never to hide it.
    """
    verifier = load_verifier(name)
    vocab_size = 4
    draft_model = random_markov(vocab_size, 1, seed=3, concentration=0.7)
    target_model = random_markov(vocab_size, 1, seed=4, concentration=0.7)
    gen = torch.Generator().manual_seed(1234)
    batch = draft(draft_model, target_model, torch.full((3, 1), -1, dtype=torch.int64), num_drafts, draft_len, gen,
                  verifier.draft_scheme)
    law = verifier.output_probs(batch.draft_tokens, batch.draft_probs, batch.target_probs)
    reps = 40_000
    for b in range(3):
        rep = lambda t: t[b : b + 1].expand(reps, *t.shape[1:]).contiguous()
        out = verifier.verify(rep(batch.draft_tokens), rep(batch.draft_probs), rep(batch.target_probs), gen)
        counts = torch.bincount(_verdict_cells(out, num_drafts, draft_len, vocab_size),
                                minlength=law[b].numel()).double()
        pvalue = pooled_chisquare_pvalue(counts, law[b].reshape(-1) * reps)
        assert pvalue > 1e-4, (name, b, pvalue)


@dataclasses.dataclass(frozen=True)
class HandCase:
    """A hand-derived value (derivations in the comments and in docs/rules/)."""

    verifier: str
    draft: tuple
    target: tuple
    num_drafts: int
    draft_len: int
    acceptance: float = None  # membership acceptance P(Y in S)
    block_efficiency: float = None


HAND_CASES = [
    # single draft: acceptance = sum min(p, q) = 0.3 + 0.4
    HandCase("speculative", (0.6, 0.4), (0.3, 0.7), 1, 1, acceptance=0.7),
    # K-SEQ, the SpecTr worked example (docs/rules/kseq.md): rho* = 0.8 + sqrt(0.34), P_A = 0.62 + 0.4 sqrt(0.34) (at rho* P(Y in S) = P_A)
    HandCase("kseq", (0.6, 0.4), (0.3, 0.7), 2, 1, acceptance=0.62 + 0.4 * math.sqrt(0.34)),
    # RRS i.i.d.: (A,A) w.p. .36 is accepted only at the first try (prob .5; then R = (0, 1) rejects A);
    # every other tuple contains B, which is accepted w.p. 1 -> .36 * .5 + .64 = .82
    HandCase("rrs", (0.6, 0.4), (0.3, 0.7), 2, 1, acceptance=0.82),
    # without replacement, V = 2, K = 2: both tokens are always drafted
    HandCase("rrs-wor", (0.6, 0.4), (0.3, 0.7), 2, 1, acceptance=1.0),
    # p = (1, 0), q = (1/2, 1/2), K = 2: beta(rho) = 1/(2 rho); 1 - (1 - beta)^2 = rho beta = 1/2 gives P_A = 1/2,
    # which equals alpha* = min_T q(T) + 1 - p(T)^2 = 1/2 at T = {A}
    HandCase("kseq", (1.0, 0.0), (0.5, 0.5), 2, 1, acceptance=0.5),
    # block verification paper example: token-by-token E[tau] = 10/9, so E[len] = 1 + 10/9
    HandCase("speculative", (2 / 3, 1 / 3), (1 / 3, 2 / 3), 1, 2, block_efficiency=19 / 9),
    # K-SEQ with p = q: every draft is accepted, E[len] = L + 1
    HandCase("spectr-tree", (0.25, 0.75), (0.25, 0.75), 2, 3, block_efficiency=4.0),
    # disjoint supports: nothing is ever accepted; acceptance 0 and one token per step
    HandCase("kseq", (1.0, 0.0), (0.0, 1.0), 3, 1, acceptance=0.0, block_efficiency=1.0),
]


@pytest.mark.parametrize("case", HAND_CASES, ids=lambda c: f"{c.verifier}-K{c.num_drafts}-L{c.draft_len}")
def test_hand_derived_values(case):
    audit = exact_iteration(load_verifier(case.verifier), ContextFreeModel(case.draft), ContextFreeModel(case.target),
                            case.num_drafts, case.draft_len)
    assert audit.max_abs_error <= 1e-12
    if case.acceptance is not None:
        assert audit.acceptance == pytest.approx(case.acceptance, abs=1e-12)
    if case.block_efficiency is not None:
        assert audit.block_efficiency == pytest.approx(case.block_efficiency, abs=1e-12)


class _NaiveIndependentRule(NodeRule):
    """Each copy accepted independently with min(1, q/p) (no rho*): the seed's counter-example."""

    def __call__(self, tokens, survivors, draft_dist, target_dist):
        drafted = gather_tokens(draft_dist, tokens)
        accept = (gather_tokens(target_dist, tokens) / drafted).clamp(max=1.0)
        return accept, normalise((target_dist - draft_dist).clamp(min=0), target_dist)


class _NaiveIndependent(ChainWalkVerifier):
    name = "naive-independent"
    max_draft_len = 1
    rule = _NaiveIndependentRule()


def test_naive_independent_acceptance_is_reported_not_exact():
    # docs/rules/kseq.md: naive independent acceptance, p = (1, 0), q = (1/2, 1/2), K = 2 emits A with probability 3/4.
    case = Case("naive", ContextFreeModel([1.0, 0.0]), ContextFreeModel([0.5, 0.5]), num_drafts=2)
    result = audit_case(_NaiveIndependent(), case)
    assert not result.passed
    assert {c.name for c in result.failed_checks} >= {"exact", "acceptance<=optimal"}
    assert result.details["first_token_law"] == pytest.approx([0.75, 0.25], abs=1e-12)
    assert result.metrics["token_tv_distance"] == pytest.approx(0.25, abs=1e-12)


@pytest.mark.parametrize("name", ["speculative", "kseq", "spectr-tree", "rrs", "rrs-wor"])
def test_same_generator_seed_same_verdicts(name):
    verifier = load_verifier(name)
    num_drafts = 1 if name == "speculative" else 3
    draft_len = 1 if verifier.max_draft_len == 1 else 2
    models = random_markov(5, 1, seed=1), random_markov(5, 1, seed=2)
    batch = draft(*models, torch.full((64, 1), -1, dtype=torch.int64), num_drafts, draft_len,
                  torch.Generator().manual_seed(0), verifier.draft_scheme)
    args = (batch.draft_tokens, batch.draft_probs, batch.target_probs)
    first = verifier.verify(*args, torch.Generator().manual_seed(7))
    second = verifier.verify(*args, torch.Generator().manual_seed(7))
    other = verifier.verify(*args, torch.Generator().manual_seed(8))
    for field in ("num_accepted", "draft_index", "next_token"):
        assert torch.equal(getattr(first, field), getattr(second, field))
    assert not all(torch.equal(getattr(first, f), getattr(other, f)) for f in ("num_accepted", "next_token"))


def test_float32_and_half_inputs_give_valid_verdicts():
    verifier = load_verifier("kseq")
    models = random_markov(6, 1, seed=5), random_markov(6, 1, seed=6)
    batch = draft(*models, torch.full((32, 1), -1, dtype=torch.int64), 3, 1, torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = verifier.verify(batch.draft_tokens, batch.draft_probs.to(dtype), batch.target_probs.to(dtype),
                              torch.Generator().manual_seed(1))
        assert out.next_token.dtype == torch.int64
        assert bool(((out.next_token >= 0) & (out.next_token < 6)).all())


@pytest.mark.parametrize("vocab_size", [4, 700])  # one-level and two-level draws
def test_rows_without_residual_mass_draw_from_the_fallback(vocab_size):
    from spectr_audit.verifiers._walk import _sample_or_fallback

    residual = torch.zeros(3, vocab_size, dtype=torch.float32)
    residual[0, 1] = 2.0  # a row with mass: always token 1
    fallback = torch.zeros(3, vocab_size, dtype=torch.float32)
    fallback[:, vocab_size - 2] = 1.0  # rows 1 and 2 have no residual mass: token V - 2
    u = torch.tensor([0.3, 0.0, 0.99], dtype=torch.float64)
    assert _sample_or_fallback(residual, fallback, u).tolist() == [1, vocab_size - 2, vocab_size - 2]
    # every row with mass: the fallback is not needed
    assert _sample_or_fallback(residual[:1], fallback[:1], u[:1]).tolist() == [1]
