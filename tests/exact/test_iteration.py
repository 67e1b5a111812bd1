"""The exact single-iteration audit against a direct, one-tuple-at-a-time oracle."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.iteration import enumerate_drafts, exact_iteration, string_of
from spectr_audit.drafting.models import ContextFreeModel, random_markov
from spectr_audit.registry import load_verifier


def _cond(model, context):
    return model(torch.tensor([list(context)], dtype=torch.int64).reshape(1, -1))[0].tolist()


def _oracle(verifier, draft_model, target_model, num_drafts, draft_len, prefix):
    """E(s), F(w), B(u) by brute force: every ordered tuple, one output_probs call each."""
    vocab_size = draft_model.vocab_size
    seqs = []
    for seq in itertools.product(range(vocab_size), repeat=draft_len):
        prob = 1.0
        for i, tok in enumerate(seq):
            prob *= _cond(draft_model, prefix + seq[:i])[tok]
        if prob > 0:
            seqs.append((seq, prob))
    emitted = {}
    for combo in itertools.product(seqs, repeat=num_drafts):
        weight = 1.0
        for _, prob in combo:
            weight *= prob
        tokens = torch.tensor([[list(s) for s, _ in combo]], dtype=torch.int64)
        dp = torch.tensor([[[_cond(draft_model, prefix + s[:i]) for i in range(draft_len)] for s, _ in combo]], dtype=torch.float64)
        tp = torch.tensor([[[_cond(target_model, prefix + s[:i]) for i in range(draft_len + 1)] for s, _ in combo]], dtype=torch.float64)
        law = verifier.output_probs(tokens, dp, tp)[0]
        for k in range(num_drafts):
            for n in range(draft_len + 1):
                for y in range(vocab_size):
                    s = combo[k][0][:n] + (y,)
                    emitted[s] = emitted.get(s, 0.0) + weight * float(law[k, n, y])

    def target_joint(w, start=0):
        prob = 1.0
        for i in range(start, len(w)):
            prob *= _cond(target_model, prefix + w[:i])[w[i]]
        return prob

    implied = {}
    for w in itertools.product(range(vocab_size), repeat=draft_len + 1):
        implied[w] = sum(emitted.get(w[:m], 0.0) * target_joint(w, m) for m in range(1, draft_len + 2))
    caps = {}
    for m in range(1, draft_len + 2):
        for u in itertools.product(range(vocab_size), repeat=m):
            caps[u] = sum(v for s, v in emitted.items() if s[:m] == u)
    return emitted, implied, caps, target_joint


@settings(max_examples=15, deadline=None)
@given(
    name=st.sampled_from(["speculative", "spectr-tree", "rrs", "kseq"]),
    vocab_size=st.integers(2, 3),
    num_drafts=st.integers(1, 2),
    draft_len=st.integers(1, 2),
    seed=st.integers(0, 1000),
)
def test_exact_iteration_matches_brute_force(name, vocab_size, num_drafts, draft_len, seed):
    verifier = load_verifier(name)
    if not verifier.supports(num_drafts, draft_len):
        return
    draft_model = random_markov(vocab_size, 1, seed=seed, concentration=0.6)
    target_model = random_markov(vocab_size, 1, seed=seed + 1, concentration=0.6)
    prefix = (seed % vocab_size,)
    audit = exact_iteration(verifier, draft_model, target_model, num_drafts, draft_len, prefix=prefix)
    emitted, implied, caps, target_joint = _oracle(verifier, draft_model, target_model, num_drafts, draft_len, prefix)
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
    from spectr_audit.contract.verifier import as_verifier

    blind = as_verifier(lambda *a: None)
    with pytest.raises(InvalidArgument, match="has no exact law"):
        exact_iteration(blind, ContextFreeModel([1.0]), ContextFreeModel([1.0]), 1)


@pytest.mark.parametrize("base,length", [(3, 0), (3, 1), (4, 3), (1, 4), (5, 2), (2, 6)])
def test_product_grid_matches_itertools_product(base, length):
    import itertools

    from spectr_audit.exact.iteration import _product_grid

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
