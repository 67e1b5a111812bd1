"""The exact single-iteration audit against a direct, one-tuple-at-a-time oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.iteration import enumerate_drafts, exact_iteration, string_of
from spectr_audit.drafting.models import ContextFreeModel, random_markov
from spectr_audit.registry import load_verifier

from tests.oracles.iteration import brute_force_iteration


@st.composite
def brute_force_cases(draw):
    """A verifier and a (K, L) it supports, K, L in {1, 2}: every drawn case is audited."""
    name = draw(st.sampled_from(["speculative", "spectr-tree", "rrs", "kseq"]))
    verifier = load_verifier(name)
    shape = draw(st.sampled_from([(k, n) for k in (1, 2) for n in (1, 2) if verifier.supports(k, n)]))
    return (name, *shape)


@settings(max_examples=15, deadline=None)
@given(case=brute_force_cases(), vocab_size=st.integers(2, 3), seed=st.integers(0, 1000))
def test_exact_iteration_matches_brute_force(case, vocab_size, seed):
    name, num_drafts, draft_len = case
    verifier = load_verifier(name)
    draft_model = random_markov(vocab_size, 1, seed=seed, concentration=0.6)
    target_model = random_markov(vocab_size, 1, seed=seed + 1, concentration=0.6)
    prefix = (seed % vocab_size,)
    audit = exact_iteration(verifier, draft_model, target_model, num_drafts, draft_len, prefix=prefix)
    emitted, implied, caps, target_joint = brute_force_iteration(verifier, draft_model, target_model, num_drafts, draft_len, prefix)
    for m in range(1, draft_len + 2):
        for code in range(vocab_size**m):
            s = string_of(code, m, vocab_size)
            assert float(audit.emitted_law[m - 1][code]) == pytest.approx(emitted.get(s, 0.0), abs=1e-12)
            assert float(audit.prefix_law[m - 1][code]) == pytest.approx(caps[s], abs=1e-12)
            assert float(audit.target_law[m - 1][code]) == pytest.approx(target_joint(s), abs=1e-12)
    for code in range(vocab_size ** (draft_len + 1)):
        w = string_of(code, draft_len + 1, vocab_size)
        assert float(audit.implied_law[code]) == pytest.approx(implied[w], abs=1e-12)
    block = sum(len(s) * v for s, v in emitted.items())
    assert audit.block_efficiency == pytest.approx(block, abs=1e-12)


def test_string_codes_put_the_first_token_first():
    assert string_of(5, 3, 2) == (1, 0, 1)
    assert string_of(0, 2, 7) == (0, 0)


@pytest.mark.parametrize("scheme,num_drafts", [("iid", 3), ("without_replacement", 2), ("without_replacement", 3)])
def test_enumerated_draft_weights_sum_to_one(scheme, num_drafts):
    model = ContextFreeModel([0.5, 0.2, 0.3, 0.0])
    enum = enumerate_drafts(model, model, num_drafts, 1, scheme)
    assert float(enum.weights.sum()) == pytest.approx(1.0, abs=1e-12)
    if scheme == "without_replacement":
        # distinct tokens only, never the zero-probability token
        for row in enum.draft_tokens[:, :, 0].tolist():
            assert len(set(row)) == len(row) and 3 not in row


def test_without_replacement_needs_enough_support():
    model = ContextFreeModel([0.5, 0.5, 0.0])
    with pytest.raises(InvalidArgument, match="num_drafts: 3 distinct drafts"):
        enumerate_drafts(model, model, 3, 1, "without_replacement")


def test_verifier_without_exact_law_is_refused():
    from spectr_audit.contract.convert import as_verifier

    blind = as_verifier(lambda *a: None)
    with pytest.raises(InvalidArgument, match="has no exact law"):
        exact_iteration(blind, ContextFreeModel([1.0]), ContextFreeModel([1.0]), 1)


@pytest.mark.parametrize("base,length", [(3, 0), (3, 1), (4, 3), (1, 4), (5, 2), (2, 6)])
def test_product_grid_matches_itertools_product(base, length):
    import itertools

    from spectr_audit.exact.law import _product_grid

    expected = torch.tensor(list(itertools.product(range(base), repeat=length)), dtype=torch.int64)
    assert torch.equal(_product_grid(base, length), expected.reshape(base**length, length))


class _OffSimplexAfterToken(ContextFreeModel):
    """A target model whose conditional after token 1 sums to 1.2: invalid, and reached only at depth 1."""

    def __call__(self, contexts):
        probs = super().__call__(contexts).clone()
        after_one = contexts[:, -1] == 1 if contexts.shape[1] else torch.zeros(contexts.shape[0], dtype=torch.bool)
        probs[after_one] *= 1.2
        return probs


@pytest.mark.parametrize("verifier_name,num_drafts", [("kseq", 3), ("rrs-wor", 2)])
def test_exact_audit_still_rejects_bad_conditionals(verifier_name, num_drafts):
    """The audit validates each enumerated sequence's conditionals once instead of every tuple's copy of
    them; a bad row must still be named (here a target conditional that sums to 1.2)."""
    draft_model = ContextFreeModel([0.2, 0.5, 0.3])
    target_model = _OffSimplexAfterToken([0.3, 0.3, 0.4])
    with pytest.raises(InvalidArgument, match="target_probs"):
        exact_iteration(load_verifier(verifier_name), draft_model, target_model, num_drafts)


def test_output_probs_validate_flag_skips_only_the_input_checks():
    verifier = load_verifier("kseq")
    enum = enumerate_drafts(ContextFreeModel([0.2, 0.5, 0.3]), ContextFreeModel([0.3, 0.3, 0.4]), 3, 1)
    tokens, draft_probs, target_probs = enum.chunk(slice(None))
    assert torch.equal(
        verifier.output_probs(tokens, draft_probs, target_probs, validate=False),
        verifier.output_probs(tokens, draft_probs, target_probs),
    )
    off_simplex = target_probs * 1.2
    with pytest.raises(InvalidArgument, match="target_probs"):
        verifier.output_probs(tokens, draft_probs, off_simplex)
    verifier.output_probs(tokens, draft_probs, off_simplex, validate=False)  # the caller vouched for its rows
    with pytest.raises(InvalidArgument):  # the verifier's K/L range is still checked
        verifier.output_probs(tokens.repeat(1, 1, 2), draft_probs.repeat(1, 1, 2, 1),
                              target_probs.repeat(1, 1, 2, 1)[:, :, :3], validate=False)
