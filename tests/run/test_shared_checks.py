"""The checks chain and tree verifiers share, in the same words on both: the contract checks of
check_verifier (chain and ``tree=...``), its sampler-versus-exact-law check, the runner's loading
of the verifiers a case names, and alpha* of drafts without replacement (one min-cut for a run, a tree
and the statistical audit's plan).

Each broken verifier here breaks one thing on purpose; the expected words are the check's own
(docs/report-schema.md).  The sampler checks run with fixed seeds; the broken samplers are off their
law by far (p-values below 1e-20 on these seeds), so the false-alarm rate does not enter.
"""

from __future__ import annotations

import itertools
import re
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from spectr_audit.drafting.models import ContextFreeModel
from spectr_audit.registry import load_tree_verifier
from spectr_audit.run.checks import first_position, optimality
from spectr_audit.run.conformance import check_verifier
from spectr_audit.run.conformance_checks import CONTRACT_CHECKS
from spectr_audit.run.runner import plan_jobs
from spectr_audit.run.suite import parse_suite
from spectr_audit.statistical import _planning

from tests.oracles.acceptance import brute_force_alpha_from_sets
from tests.oracles.acceptance import without_replacement_set_probs as oracle_set_probs

pytestmark = pytest.mark.usefixtures("single_thread")

TREE = "paths:[[0],[1],[0,0]]"
WHERE = "draft tree: 3 draft nodes, depth 2, per level [2, 1]"
_GOOD = load_tree_verifier("tree-target-only")


def _good(tree, node_tokens, draft_probs, target_probs, generator):
    return _GOOD.verify_tree(tree, node_tokens, draft_probs, target_probs, generator)


def _good_law(tree, node_tokens, draft_probs, target_probs):
    return _GOOD.tree_output_probs(tree, node_tokens, draft_probs, target_probs)


def _modifies_inputs(tree, node_tokens, draft_probs, target_probs, generator):
    out = _good(tree, node_tokens, draft_probs, target_probs, generator)
    target_probs.copy_(target_probs.flip(-1))
    return out


_calls = itertools.count()


def _ignores_generator(tree, node_tokens, draft_probs, target_probs, generator):
    """Draws from a generator of its own, seeded anew at each call."""
    return _good(tree, node_tokens, draft_probs, target_probs, torch.Generator().manual_seed(next(_calls)))


def _emits_token_zero(tree, node_tokens, draft_probs, target_probs, generator):
    zeros = torch.zeros(node_tokens.shape[0], dtype=torch.int64)
    return zeros, zeros  # at the root, where the i.i.d. contract target forbids token 0


def _int32_fields(tree, node_tokens, draft_probs, target_probs, generator):
    out = _good(tree, node_tokens, draft_probs, target_probs, generator)
    return out.accepted_node.int(), out.next_token.int()


def _stops_at_the_root(tree, node_tokens, draft_probs, target_probs, generator):
    """Emits at the root the token its law gives a deeper node: a string of probability 0 under that law."""
    out = _good(tree, node_tokens, draft_probs, target_probs, generator)
    return torch.zeros_like(out.accepted_node), out.next_token


@pytest.mark.parametrize("verify, law, scheme, failed, detail", [
    (_modifies_inputs, None, "topk", "inputs unchanged", "verify_tree modified target_probs in place"),
    (_ignores_generator, None, "topk", "deterministic under a fixed generator",
     "two calls with torch.Generator().manual_seed(0) differ at rows "),
    (_emits_token_zero, None, "iid", "emitted tokens have target mass",
     "rows 0, 1, 2, 3, 4, 5, 6, 7 ... emit a token whose target probability is 0 (an exact verifier never does)"),
    (_stops_at_the_root, _good_law, "topk", "sampler follows the exact law",
     "which its own tree_output_probs gives probability 0"),
], ids=["modifies inputs", "ignores the generator", "emits a forbidden token", "sampler off its own law"])
def test_a_broken_tree_verifier_fails_the_contract_check_it_breaks_in_the_chain_words(verify, law, scheme, failed,
                                                                                      detail):
    report = check_verifier(verify, tree=TREE, draft_scheme=scheme, output_probs=law, num_samples=2000,
                            raise_on_failure=False)
    failures = {c.name: c for c in report.checks if not c.passed}
    assert failed in failures, [str(c) for c in report.checks]
    assert failures[failed].where == f"{WHERE}, {scheme}"
    assert detail in failures[failed].detail


def test_a_tree_output_outside_the_contract_stops_that_combination_at_its_first_check():
    report = check_verifier(_int32_fields, tree=TREE, draft_scheme="topk", num_samples=2000, raise_on_failure=False)
    assert [(c.name, c.passed) for c in report.checks] == [("output contract", False)]
    assert "int64" in report.checks[0].detail


def test_a_correct_tree_function_passes_every_contract_check_in_order():
    report = check_verifier(_good, tree=TREE, draft_scheme="topk", output_probs=_good_law, num_samples=2000)
    assert [c.name for c in report.checks] == [
        "output contract", "inputs unchanged", "deterministic under a fixed generator",
        "emitted tokens have target mass", "float32 inputs", "exact law is a distribution",
        "sampler follows the exact law"]
    assert report.checks[0].detail == "int64 [batch_size] fields in range"


def test_a_chain_and_a_tree_verifier_are_held_to_one_set_of_contract_checks():
    chain = check_verifier("speculative", num_drafts=1, num_samples=2000)
    tree = check_verifier(_good, tree=TREE, draft_scheme="topk", output_probs=_good_law, num_samples=2000)
    assert [c.name for c in chain.checks] == [c.name for c in tree.checks] == list(CONTRACT_CHECKS)


# --- the sampler against its own law: Pearson's test on three rows ---------------------------


def _tree_law_at_node_1(tree, node_tokens, draft_probs, target_probs):
    law = torch.zeros_like(target_probs, dtype=torch.float64)
    law[:, 1] = target_probs[:, 1].double()
    return law


def _tree_cubed_target(tree, node_tokens, draft_probs, target_probs, generator):
    """Accepts node 1 and draws from the target there cubed: the law's strings, at the wrong frequencies."""
    weights = target_probs[:, 1].double() ** 3
    token = torch.multinomial(weights / weights.sum(-1, keepdim=True), 1, generator=generator)[:, 0]
    return torch.ones(node_tokens.shape[0], dtype=torch.int64), token


def _chain_law_at_the_root(draft_tokens, draft_probs, target_probs):
    law = torch.zeros(target_probs.shape, dtype=torch.float64)  # [batch_size, num_drafts, draft_len + 1, vocab_size]
    law[:, 0, 0] = target_probs[:, 0, 0].double()
    return law


def _chain_cubed_target(draft_tokens, draft_probs, target_probs, generator):
    """Rejects every draft and draws from the target cubed: the law's strings, at the wrong frequencies."""
    weights = target_probs[:, 0, 0].double() ** 3
    zeros = torch.zeros(draft_tokens.shape[0], dtype=torch.int64)
    return zeros, zeros, torch.multinomial(weights / weights.sum(-1, keepdim=True), 1, generator=generator)[:, 0]


def test_a_tree_sampler_off_its_law_is_named_by_its_row_and_samples():
    report = check_verifier(_tree_cubed_target, tree="paths:[[0],[1]]", draft_scheme="topk",
                            output_probs=_tree_law_at_node_1, num_samples=2000, raise_on_failure=False)
    (check,) = [c for c in report.checks if not c.passed]
    assert check.name == "sampler follows the exact law"
    # three rows of max(200, 2000 // 3) = 666 samples each; the tree detail names no cell
    assert re.fullmatch(r"node tokens \[\d+(, \d+)*\]: Pearson p = \S+ over 666 samples", check.detail), check.detail


def test_a_chain_sampler_off_its_law_is_named_by_its_drafts_samples_and_worst_cell():
    report = check_verifier(_chain_cubed_target, num_drafts=1, output_probs=_chain_law_at_the_root,
                            num_samples=3000, raise_on_failure=False)
    (check,) = [c for c in report.checks if not c.passed]
    assert check.name == "sampler follows the exact law"
    # three draft tuples of max(200, 3000 // 3) = 1000 samples each
    assert re.fullmatch(r"drafts \[\[\d+\]\]: Pearson p = \S+ over 1000 samples; worst cell \[\d+\]: "
                        r"observed \d+ vs expected \d+\.\d", check.detail), check.detail


# --- the runner: the verifiers a case names ---------------------------------------------------


def test_the_verifiers_a_case_names_are_loaded_once_per_kind_and_an_unloadable_one_is_an_error_result():
    named = ["rrs", "no-such-verifier"]
    chain = {"draft": [0.6, 0.4], "target": [0.3, 0.7], "num_drafts": 2, "verifiers": named}
    tree = {"draft": [0.6, 0.4], "target": [0.3, 0.7], "tree": "chains:2,1", "draft_scheme": "iid", "verifiers": named}
    suite = parse_suite({"case": [{"name": "chain-1", **chain}, {"name": "tree", **tree}, {"name": "chain-2", **chain}]})
    jobs, errors = plan_jobs(suite)
    by_case = {case.name: verifier for verifier, case in jobs}
    assert sorted(by_case) == ["chain-1", "chain-2", "tree"]
    assert by_case["chain-1"] is by_case["chain-2"]  # one load for both chain cases
    assert hasattr(by_case["tree"], "verify_tree") and not hasattr(by_case["chain-1"], "verify_tree")
    assert [(e.verifier, e.case) for e in errors] == [("no-such-verifier", c) for c in ("chain-1", "tree", "chain-2")]
    assert all(e.error.startswith("InvalidArgument: ") and "'no-such-verifier'" in e.error for e in errors)


@settings(max_examples=40, deadline=None)
@given(vocab_size=st.integers(2, 6), num_drafts=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_a_run_and_the_plan_take_alpha_star_of_drafts_without_replacement_from_one_min_cut(vocab_size, num_drafts,
                                                                                            seed):
    assume(num_drafts <= vocab_size)
    rng = np.random.default_rng(seed)
    draft, target = rng.dirichlet(np.full(vocab_size, 0.8)), rng.dirichlet(np.full(vocab_size, 0.8))
    case = NS(draft_model=ContextFreeModel(draft), target_model=ContextFreeModel(target), prefix=(),
              num_drafts=num_drafts)
    metrics, details = {}, {}
    alpha_star = optimality(case, "without_replacement", metrics, details)
    # the slow way: the recursive set law, then the minimum over every token set by brute force
    expected = brute_force_alpha_from_sets(oracle_set_probs(draft, num_drafts), target)
    assert alpha_star == metrics["optimal_acceptance"] == pytest.approx(expected, abs=1e-12)
    assert details["optimal_acceptance_source"] == "closed form: min-cut over token sets (without replacement)"
    plan_args = NS(verifier=NS(draft_scheme="without_replacement"), num_drafts=num_drafts, prefix=(),
                   draft_model=case.draft_model, target_model=case.target_model)
    draft_root, target_root = first_position(case)
    assert _planning._optimal_acceptance(plan_args, draft_root, target_root) == alpha_star  # one bound, bit for bit


def test_beyond_the_min_cut_limit_neither_a_run_nor_the_plan_has_alpha_star(monkeypatch):
    from spectr_audit import defaults

    draft = [0.2] * 5
    case = NS(draft_model=ContextFreeModel(draft), target_model=ContextFreeModel(draft), prefix=(), num_drafts=2)
    plan_args = NS(verifier=NS(draft_scheme="without_replacement"), num_drafts=2, prefix=(),
                   draft_model=case.draft_model, target_model=case.target_model)
    root = first_position(case)
    monkeypatch.setattr(defaults, "MIN_CUT_MAX_SUPPORT", 5)
    assert optimality(case, "without_replacement", {}, {}) == pytest.approx(1.0)  # draft = target: every token a draft
    assert _planning._optimal_acceptance(plan_args, *root) is not None
    monkeypatch.setattr(defaults, "MIN_CUT_MAX_SUPPORT", 4)
    metrics, details = {}, {}
    assert optimality(case, "without_replacement", metrics, details) is None
    assert "optimal_acceptance" not in metrics
    assert re.match(r"skipped: tree: .* 5 tokens .* limit of 2\*\*4 \(spectr_audit.defaults.MIN_CUT_MAX_SUPPORT\)",
                    details["optimal_acceptance"])
    assert _planning._optimal_acceptance(plan_args, *root) is None
