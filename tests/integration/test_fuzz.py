"""Fuzzing every built-in verifier and the exact audit over random shapes and distributions.

``FUZZ_EXAMPLES`` hypothesis cases per verifier for the verifier fuzz (random batch size, K,
L, V, temperatures from near-greedy to flat, exact zeros), and ``AUDIT_EXAMPLES`` for the
exact-audit fuzz.  Run ``python -m pytest tests/integration/test_fuzz.py -q`` to reproduce; the counts
are the ``max_examples`` below (hypothesis runs up to that many distinct cases).  Every case is drawn
valid for its verifier (a (K, L) it supports; K distinct draft tokens for drafts without replacement;
an enumeration the exact audit can afford), so every case runs the verifier.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from spectr_audit.contract.verifier import check_verify_output
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.drafting.harness import draft
from spectr_audit.drafting.models import random_markov
from spectr_audit.registry import builtin_names, load_verifier

FUZZ_EXAMPLES = 60
AUDIT_EXAMPLES = 25


def _shapes(verifier):
    """The (K, L) with K <= 4 and L <= 3 that ``verifier`` supports."""
    return [(k, n) for k in range(1, 5) for n in range(1, 4) if verifier.supports(k, n)]


@st.composite
def fuzz_case(draw, verifier, max_tuples=None):
    """A random case that ``verifier`` accepts: a supported (K, L), V in 1..6 (V >= K for drafts without
    replacement), and at most ``max_tuples`` ordered draft tuples (V^L)^K when given."""
    num_drafts, draft_len = draw(st.sampled_from(_shapes(verifier)))
    min_vocab = num_drafts if verifier.draft_scheme == "without_replacement" else 1
    max_vocab = 6
    if max_tuples is not None:
        max_vocab = max(v for v in range(min_vocab, 7) if (v**draft_len) ** num_drafts <= max_tuples)
    return dict(
        batch_size=draw(st.integers(1, 4)),
        num_drafts=num_drafts,
        draft_len=draft_len,
        vocab_size=draw(st.integers(min_vocab, max_vocab)),
        draft_temperature=draw(st.sampled_from([0.05, 0.3, 1.0, 5.0])),
        target_temperature=draw(st.sampled_from([0.05, 0.3, 1.0, 5.0])),
        concentration=draw(st.sampled_from([0.05, 0.5, 3.0])),
        seed=draw(st.integers(0, 2**20)),
    )


def _assume_enough_support(verifier, draft_model, num_drafts):
    """Drafts without replacement need K tokens of positive draft probability (sharp models underflow to 0)."""
    if verifier.draft_scheme == "without_replacement":
        assume(int((draft_model(torch.full((1, 1), -1))[0] > 0).sum()) >= num_drafts)


@pytest.mark.parametrize("name", builtin_names())
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(data=st.data())
def test_fuzz_verifier(name, data):
    verifier = load_verifier(name)
    case = data.draw(fuzz_case(verifier), label="case")
    num_drafts, draft_len, vocab_size = case["num_drafts"], case["draft_len"], case["vocab_size"]
    draft_model = random_markov(vocab_size, 1, seed=case["seed"], concentration=case["concentration"],
                                temperature=case["draft_temperature"])
    target_model = random_markov(vocab_size, 1, seed=case["seed"] + 1, concentration=case["concentration"],
                                 temperature=case["target_temperature"])
    _assume_enough_support(verifier, draft_model, num_drafts)
    contexts = torch.full((case["batch_size"], 1), -1, dtype=torch.int64)
    gen = torch.Generator().manual_seed(case["seed"])
    batch = draft(draft_model, target_model, contexts, num_drafts, draft_len, gen, verifier.draft_scheme)
    args = (batch.draft_tokens, batch.draft_probs, batch.target_probs)
    out = verifier.verify(*args, gen)
    check_verify_output(out, case["batch_size"], num_drafts, draft_len, vocab_size)
    if verifier.has_exact_law:
        law = verifier.output_probs(*args)
        assert bool(torch.isfinite(law).all()) and bool((law >= 0).all())
        torch.testing.assert_close(law.sum((1, 2, 3)), torch.ones(case["batch_size"], dtype=law.dtype), atol=1e-9, rtol=0)
        rows = torch.arange(case["batch_size"])
        assert bool((law[rows, out.draft_index, out.num_accepted, out.next_token] > 0).all())


@pytest.mark.parametrize("name", [name for name in builtin_names() if load_verifier(name).has_exact_law])
@settings(max_examples=AUDIT_EXAMPLES, deadline=None)
@given(data=st.data())
def test_fuzz_exact_audit(name, data):
    from spectr_audit.contract.correction import has_carried_correction

    verifier = load_verifier(name)
    case = data.draw(fuzz_case(verifier, max_tuples=5000), label="case")
    num_drafts, draft_len, vocab_size = case["num_drafts"], case["draft_len"], case["vocab_size"]
    draft_model = random_markov(vocab_size, 1, seed=case["seed"], concentration=case["concentration"],
                                temperature=case["draft_temperature"])
    target_model = random_markov(vocab_size, 1, seed=case["seed"] + 1, concentration=case["concentration"],
                                 temperature=case["target_temperature"])
    _assume_enough_support(verifier, draft_model, num_drafts)
    audit = exact_iteration(verifier, draft_model, target_model, num_drafts, draft_len)
    total = sum(float(law.sum()) for law in audit.emitted_law)
    assert abs(total - 1) < 1e-12
    # at least one token per step: 1 up to rounding (the emitted masses sum to 1 within 1e-12)
    assert 1 - 1e-12 <= audit.block_efficiency <= draft_len + 1 + 1e-12
    assert 0 <= audit.tv_distance <= 1
    if verifier.expected != "inexact" and not has_carried_correction(verifier):
        assert audit.max_abs_error <= 1e-12, audit.worst_strings()
