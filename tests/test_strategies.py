"""Hypothesis strategies for users' property tests (spectr_audit/strategies.py).

The strategies must produce valid inputs with the edge cases they promise, and, used as an engine
author would, find a planted bug and shrink it to the minimal case.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings

from spectr_audit.contract.logits import check_logits_inputs
from spectr_audit.contract.sampling import process_logits
from spectr_audit.contract.verifier import FunctionVerifier, VerifyOutput, check_verify_inputs
from spectr_audit.errors import InvalidArgument
from spectr_audit.strategies import (
    DTYPES,
    VerifyInputs,
    chains,
    distributions,
    draft_trees,
    emitted_tokens_in_target_support,
    sampling_params,
    verify_inputs,
)
from spectr_audit.verifiers.kseq import KSeq
from spectr_audit.verifiers.speculative import SpeculativeSampling

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _one_hot_shortcut(draft_tokens, draft_probs, target_probs, generator):
    """Planted bug: when the draft is certain of its first token (a one-hot row), accept the whole
    draft without consulting the target ("nothing to verify")."""
    out = SpeculativeSampling().verify(draft_tokens, draft_probs, target_probs, generator, validate=False)
    certain = draft_probs[:, 0, 0].max(-1).values == 1
    draft_len = draft_tokens.shape[2]
    bonus = target_probs[:, 0, draft_len].argmax(-1)
    num_accepted = torch.where(certain, torch.full_like(out.num_accepted, draft_len), out.num_accepted)
    next_token = torch.where(certain, bonus, out.next_token)
    return VerifyOutput(num_accepted, out.draft_index, next_token)


PLANTED = FunctionVerifier(_one_hot_shortcut, name="one-hot-shortcut", max_drafts=1)


def _violates(inputs: VerifyInputs) -> bool:
    out = PLANTED.verify(*inputs.args(), torch.Generator().manual_seed(0))
    return not emitted_tokens_in_target_support(inputs, out)


def test_planted_bug_is_found_and_shrunk_to_the_minimal_case():
    """Rows, vocabulary, kinds, dtype and tokens shrink away.  The draft length is pinned to 1: a
    shorter draft needs the failing node moved to the root, which shrinking cannot always do (the
    tip in docs/sampling.md)."""
    minimal = find(
        verify_inputs(num_drafts=1, draft_len=1, dtypes=DTYPES), _violates,
        settings=settings(max_examples=2000, database=None), random=random.Random(0),
    )
    # the smallest case that shows the bug: one row, one draft of one token, two tokens
    assert minimal.shape == (1, 1, 1, 2)
    assert minimal.draft_probs.dtype == torch.float64
    token = int(minimal.draft_tokens[0, 0, 0])
    assert minimal.draft_probs[0, 0, 0].tolist() == [1.0 if i == token else 0.0 for i in range(2)]
    assert float(minimal.target_probs[0, 0, 0, token]) == 0.0
    assert token == 0  # shrunk to the first token


def test_planted_bug_fails_a_given_test():
    @settings(max_examples=300, database=None, deadline=None)
    @given(verify_inputs(num_drafts=1))
    def property_test(inputs):
        assert not _violates(inputs)

    with pytest.raises(AssertionError):
        property_test()


@FAST
@given(verify_inputs(num_drafts=1, dtypes=DTYPES))
def test_correct_verifier_keeps_the_support(inputs):
    out = SpeculativeSampling().verify(*inputs.args(), torch.Generator().manual_seed(1))
    assert emitted_tokens_in_target_support(inputs, out)


@FAST
@given(verify_inputs(dtypes=DTYPES, batch_size=(1, 3), num_drafts=(1, 3), draft_len=(1, 3)))
def test_inputs_are_valid_and_prefix_consistent(inputs):
    check_verify_inputs(*inputs.args())
    tokens = inputs.draft_tokens
    batch_size, num_drafts, draft_len, _ = inputs.shape
    for b in range(batch_size):
        for i in range(num_drafts):
            for j in range(num_drafts):
                for level in range(draft_len + 1):
                    if tokens[b, i, :level].tolist() == tokens[b, j, :level].tolist():
                        assert torch.equal(inputs.target_probs[b, i, level], inputs.target_probs[b, j, level])
                        if level < draft_len:
                            assert torch.equal(inputs.draft_probs[b, i, level], inputs.draft_probs[b, j, level])


@FAST
@given(verify_inputs(logits=True, num_drafts=(1, 2)))
def test_logits_inputs_are_processed_laws(inputs):
    draft_tokens, draft_logits, target_logits, params = inputs.logits_args()
    check_logits_inputs(draft_tokens, draft_logits, target_logits, params)
    assert torch.equal(inputs.draft_probs, process_logits(draft_logits, params, inputs.order))
    drafted = inputs.draft_probs.gather(-1, draft_tokens.unsqueeze(-1))
    assert bool((drafted > 0).all())


def test_edge_cases_are_reached():
    """Each promised edge case is generated (found by a search, so the test can fail)."""
    find(distributions(), lambda row: float(row.max()) == 1.0)  # one-hot
    find(distributions(), lambda row: bool((row == 0).any()) and float(row.max()) < 1)  # zeros
    find(distributions(), lambda row: 0 < float(row.max() - row.min()) < 1e-6)  # near-equal
    find(distributions(dtypes=DTYPES), lambda row: row.dtype == torch.bfloat16)
    find(
        verify_inputs(num_drafts=1, draft_len=1),
        lambda inputs: 0 < float((inputs.target_probs[0, 0, 0] - inputs.draft_probs[0, 0, 0]).clamp(min=0).sum()) < 1e-8,
    )  # a tiny residual
    find(sampling_params(), lambda params: params.temperature == 0.0)
    find(sampling_params(vocab_size=4), lambda params: 0 < params.top_k < 4 and params.top_p < 1)


@FAST
@given(sampling_params(batch_size=3, order="eagle"))
def test_sampling_params_follow_the_order(params):
    assert params.batch_size == 3
    assert params.min_p.tolist() == [0.0, 0.0, 0.0]  # EAGLE has no min-p step


@FAST
@given(chains(num_drafts=(1, 4), draft_len=(1, 3), verifier=KSeq()))
def test_chains_respect_the_verifier(kl):
    assert KSeq().supports(*kl)


@FAST
@given(draft_trees(max_draft_nodes=6, max_depth=2))
def test_draft_trees(tree):
    assert 1 <= tree.num_draft_nodes <= 6 and tree.max_depth <= 2


def test_minimal_tree_and_chain():
    assert find(draft_trees(), lambda tree: True).num_draft_nodes == 1
    assert find(chains(), lambda kl: True) == (1, 1)


def test_bad_arguments():
    with pytest.raises(InvalidArgument, match="vocab_size: expected an int or a"):
        find(verify_inputs(vocab_size=(5, 2)), lambda inputs: True)
    with pytest.raises(InvalidArgument, match="no \\(K, L\\) in the ranges is supported"):
        find(chains(num_drafts=(2, 3), verifier=SpeculativeSampling()), lambda kl: True)
    with pytest.raises(InvalidArgument, match="drawn without logits"):
        find(verify_inputs(), lambda inputs: True).logits_args()


def test_hypothesis_is_not_imported_by_the_package():
    """Only spectr_audit.strategies imports Hypothesis (a test-time dependency)."""
    code = (
        "import sys, spectr_audit, spectr_audit.contract, spectr_audit.engines, spectr_audit.contract.sampling, "
        "spectr_audit.contract.logits, spectr_audit.engines.ragged, spectr_audit.engines.rng, "
        "spectr_audit.engines.workers, spectr_audit.verifiers.library.sampling_bugs\n"
        "print('hypothesis' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
