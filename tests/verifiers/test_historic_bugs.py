"""The historic-bugs suite: every reproduced public bug is flagged, every fix passes.

Reference answers come from the catalogue in docs/historic-bugs.md (every case here names
``draft`` and ``target`` by role).  Statistical tests use fixed seeds;
each states its false-alarm rate.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.drafting.models import ContextFreeModel, MarkovModel
from spectr_audit.contract.randomness import InjectedUniforms
from spectr_audit.registry import load_verifier
from spectr_audit.run.runner import audit_case, run_suite
from spectr_audit.run.suite import Case, load_suite
from spectr_audit.verifiers.library import historic
from spectr_audit.registry import HISTORIC_VERIFIERS, load_historic
from spectr_audit.verifiers.library.historic import FIXED_COUNTERPART

EXACT_TOL = 1e-12


def _fixed(name):
    spec = FIXED_COUNTERPART[name]
    return None if spec is None else load_verifier(spec)


# name, draft, target, K, L, expected first-token law of the bug (None: not a first-token bug), TV of the bug
REFERENCE_CASES = [
    # docs/historic-bugs.md entry 14: the output is the draft law, TV .4
    ("always-accept-npu", [0.3, 0.7], [0.7, 0.3], 1, 1, [0.3, 0.7], 0.4),
    # entry 22: (.8333, 0, .1667), TV 1/3
    ("greedy-draft-soft-q", [0.6, 0.3, 0.1], [0.5, 0.3, 0.2], 1, 1, [5 / 6, 0.0, 1 / 6], 1 / 3),
    # entry 31: (.3643, .3643, .2714), TV .129 (= 0.9 / 7)
    ("eagle-residual-zeroing", [0.45, 0.45, 0.1], [0.3, 0.3, 0.4], 1, 1, [0.3 + 0.15 * 3 / 7] * 2 + [0.4 - 0.3 * 3 / 7], 0.9 / 7),
    # entry 37: (.55, .33, .12), TV .08
    ("residual-is-target", [0.6, 0.3, 0.1], [0.5, 0.3, 0.2], 1, 1, [0.55, 0.33, 0.12], 0.08),
    # entry 35: target (.5, .5) passes every proposal: output = draft law
    ("medusa-typical-acceptance", [0.9, 0.1], [0.5, 0.5], 1, 1, [0.9, 0.1], 0.4),
    # bonus-law bugs: first token right, the two-token law wrong
    ("stale-residual-bonus", [0.6, 0.4], [0.3, 0.7], 2, 1, [0.3, 0.7], None),
    ("bonus-without-temperature", [0.6, 0.3, 0.1], [0.5, 0.3, 0.2], 1, 1, [0.5, 0.3, 0.2], None),
    ("correction-from-bonus-row", [0.6, 0.3, 0.1], [0.5, 0.3, 0.2], 1, 2, [0.55, 0.33, 0.12], None),
]


@pytest.mark.parametrize("name, draft, target, num_drafts, draft_len, first_law, tv", REFERENCE_CASES)
def test_bug_matches_reference_and_fix_is_exact(name, draft, target, num_drafts, draft_len, first_law, tv):
    draft_model, target_model = ContextFreeModel(draft), ContextFreeModel(target)
    audit = exact_iteration(load_historic(name), draft_model, target_model, num_drafts, draft_len)
    assert audit.max_abs_error > 1e-3, f"{name} was not flagged"
    np.testing.assert_allclose(audit.first_token_law.numpy(), first_law, atol=1e-12)
    if tv is not None:
        assert audit.token_tv_distance == pytest.approx(tv, abs=1e-12)
    fixed = _fixed(name)
    if fixed is not None:
        assert exact_iteration(fixed, draft_model, target_model, num_drafts, draft_len).max_abs_error <= EXACT_TOL


def test_always_accept_exceeds_the_optimum():
    # docs/historic-bugs.md entry 14: acceptance 1.0 above alpha* = .6, which no exact verifier can reach.
    case = Case("c", ContextFreeModel([0.3, 0.7]), ContextFreeModel([0.7, 0.3]), 1, checks=("exact", "optimality"))
    result = audit_case(load_historic("always-accept-npu"), case)
    check = {c.name: c for c in result.checks}["acceptance<=optimal"]
    assert not check.passed and check.value == pytest.approx(1.0) and check.threshold == pytest.approx(0.6)


def test_strict_no_draft_probs_is_exact_but_suboptimal():
    # docs/historic-bugs.md entry 7: acceptance sum(target * draft) = .145 against the optimum .5.
    case = Case(
        "c", ContextFreeModel([0.1, 0.1, 0.2, 0.3, 0.3]), ContextFreeModel([0.4, 0.3, 0.15, 0.1, 0.05]), 1,
        checks=("exact", "optimality"),
    )
    strict = audit_case(load_historic("strict-no-draft-probs"), case)
    fixed = audit_case(load_verifier("speculative"), case)
    assert strict.passed and fixed.passed  # both exact
    assert strict.metrics["acceptance"] == pytest.approx(0.145, abs=1e-12)
    assert strict.metrics["optimal_acceptance"] == pytest.approx(0.5, abs=1e-12)
    assert strict.metrics["acceptance_ratio"] == pytest.approx(0.29, abs=1e-12)
    assert fixed.metrics["acceptance_ratio"] == pytest.approx(1.0, abs=1e-12)


def test_block_tokenwise_residual_flagged():
    pytest.importorskip("spectr_audit.verifiers.block")
    draft, target = ContextFreeModel([0.1, 0.2, 0.3, 0.4]), ContextFreeModel([0.3, 0.4, 0.27, 0.03])
    for draft_len in (2, 3):
        bug = exact_iteration(load_historic("block-tokenwise-residual"), draft, target, 1, draft_len)
        fixed = exact_iteration(_fixed("block-tokenwise-residual"), draft, target, 1, draft_len)
        assert bug.max_abs_error > 1e-4 and bug.prefix_cap_excess > 1e-4
        assert fixed.max_abs_error <= EXACT_TOL
        # same acceptance rule, so the same block efficiency: only the residual differs
        assert bug.block_efficiency == pytest.approx(fixed.block_efficiency, abs=1e-12)


def test_historic_suite_flags_every_bug_and_passes_every_fix():
    report = run_suite(load_suite("historic-bugs"))
    assert report.passed, [(r.verifier, r.case, r.error) for r in report.results if not r.as_expected]
    names = {r.verifier for r in report.results}
    by_case: dict = {}
    for r in report.results:
        by_case.setdefault(r.case, {})[r.verifier] = r
    for case, results in by_case.items():
        bugs = [r for name, r in results.items() if name in HISTORIC_VERIFIERS]
        fixes = [r for name, r in results.items() if name not in HISTORIC_VERIFIERS]
        assert len(bugs) == 1 and len(fixes) == 1, case
        bug, fix = bugs[0], fixes[0]
        assert fix.passed, (case, fix.failed_checks)
        if bug.expected is False:
            assert not bug.passed, f"{bug.verifier} not flagged on {case}"
        else:
            # OPT-only bugs are exact: the audit shows the loss as the acceptance ratio.
            assert bug.passed
            assert bug.metrics["acceptance_ratio"] < fix.metrics["acceptance_ratio"] - 0.1, case
    # every historic verifier with an exact law that a suite can flag is in the suite
    assert names >= {
        "always-accept-npu", "greedy-draft-soft-q", "eagle-residual-zeroing", "residual-is-target",
        "stale-residual-bonus", "bonus-without-temperature", "correction-from-bonus-row",
        "medusa-typical-acceptance", "strict-no-draft-probs", "target-only-siblings", "block-tokenwise-residual",
    }


# --- samplers agree with their own exact laws -----------------------------------------------

_MARKOV_DRAFT = MarkovModel(np.array([[0.7, 0.3, 0.0], [0.15, 0.35, 0.5], [0.2, 0.2, 0.6], [0.5, 0.3, 0.2]]), 1)
_MARKOV_TARGET = MarkovModel(np.array([[0.25, 0.5, 0.25], [0.65, 0.05, 0.3], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]]), 1)


@pytest.mark.parametrize(
    "name, num_drafts, draft_len",
    [
        ("always-accept-npu", 2, 1),
        ("greedy-draft-soft-q", 1, 1),
        ("eagle-residual-zeroing", 2, 2),
        ("residual-is-target", 1, 2),
        ("stale-residual-bonus", 3, 1),
        ("bonus-without-temperature", 1, 2),
        ("correction-from-bonus-row", 1, 2),
        ("medusa-typical-acceptance", 1, 2),
        ("strict-no-draft-probs", 1, 2),
        ("target-only-siblings", 3, 1),
        ("target-only-inclusive-coin", 2, 1),
        ("inclusive-coin", 1, 2),
        ("block-tokenwise-residual", 1, 2),
    ],
)
def test_sampler_follows_its_exact_law(name, num_drafts, draft_len):
    """Per-draft-tuple agreement of ``verify`` with ``output_probs``: false-alarm rate 1e-3 per case."""
    from spectr_audit.statistical.audit import sampler_law_agreement

    if name == "block-tokenwise-residual":
        pytest.importorskip("spectr_audit.verifiers.block")
    result = sampler_law_agreement(
        load_historic(name), _MARKOV_DRAFT, _MARKOV_TARGET, num_drafts, draft_len, num_samples=20_000, seed=1, alpha=1e-3
    )
    assert result.pvalue > 1e-3, f"{name}: sampler disagrees with its law (p = {result.pvalue:.3g})"


# --- vllm #16952: no exact law, audited statistically ----------------------------------------


def test_draft_probs_mutated_flagged_statistically():
    """Target (.7, .3), draft (.3, .7): acceptance .362 instead of .6; the audit rejects at alpha = 1e-3."""
    from spectr_audit.statistical.audit import statistical_audit

    draft, target = ContextFreeModel([0.3, 0.7]), ContextFreeModel([0.7, 0.3])
    bug = statistical_audit(load_historic("draft-probs-mutated"), draft, target, 1, 1, num_samples=40_000, seed=3)
    assert bug.rejects()
    # P(the verdict accepts x) = target(x) (1 - exp(-1 / target(x))) whatever the draft probability
    expected = sum(d * t * (1 - math.exp(-1 / t)) for d, t in ((0.3, 0.7), (0.7, 0.3)))
    batch_size = 40_000
    gen = torch.Generator().manual_seed(4)
    tokens = torch.multinomial(torch.tensor([0.3, 0.7]), batch_size, replacement=True, generator=gen).view(-1, 1, 1)
    draft_probs = torch.tensor([0.3, 0.7], dtype=torch.float64).expand(batch_size, 1, 1, 2).clone()
    target_probs = torch.tensor([0.7, 0.3], dtype=torch.float64).expand(batch_size, 1, 2, 2).clone()
    accepted = load_historic("draft-probs-mutated").verify(tokens, draft_probs, target_probs, gen).num_accepted
    # 4.4 standard errors: a false-alarm rate of about 1e-5
    assert abs(accepted.double().mean().item() - expected) < 4.4 * math.sqrt(expected * (1 - expected) / batch_size)
    fixed = statistical_audit(load_verifier("speculative"), draft, target, 1, 1, num_samples=40_000, seed=3)
    assert not fixed.rejects()  # false-alarm rate 1e-3
    assert fixed.acceptance == pytest.approx(0.6, abs=0.01)


# --- coin injection: bugs on a set of measure zero -------------------------------------------


def _single(draft_tokens, draft, target, bonus=None):
    """One row: ``draft_tokens`` [K] drafts of length 1 with context-free ``draft``/``target``."""
    tokens = torch.tensor(draft_tokens, dtype=torch.int64).view(1, -1, 1)
    num_drafts = tokens.shape[1]
    vocab_size = len(target)
    draft_probs = torch.tensor(draft, dtype=torch.float64).expand(1, num_drafts, 1, vocab_size).clone()
    rows = torch.tensor([target, bonus if bonus is not None else target], dtype=torch.float64)
    target_probs = rows.expand(1, num_drafts, 2, vocab_size).clone()
    return tokens, draft_probs, target_probs


@pytest.mark.parametrize("name, num_drafts", [("speculative", 1), ("kseq", 2), ("rrs", 2), ("inclusive-coin", 1)])
def test_zero_coin_never_accepts_a_zero_target_token(name, num_drafts):
    """docs/historic-bugs.md entry 9 (vllm v1 / pytorch #16706): u = 0 with target(x) = 0 must reject x."""
    verifier = load_historic(name) if name in HISTORIC_VERIFIERS else load_verifier(name)
    tokens, draft_probs, target_probs = _single([0] * num_drafts, [0.5, 0.5], [0.0, 1.0])
    out = verifier.verify(tokens, draft_probs, target_probs, InjectedUniforms([0.0] * 8))
    emitted = out.emitted(tokens)[0]
    if name == "inclusive-coin":
        assert emitted[0] == 0  # the bug: a token of target probability 0 is emitted
    else:
        assert emitted == [1]


@pytest.mark.parametrize("name", ["speculative", "kseq", "rrs", "inclusive-coin"])
def test_coin_just_below_one_accepts_a_certain_token(name):
    """u = 1 - 2^-53 with acceptance probability 1 (draft = target) must accept."""
    verifier = load_historic(name) if name in HISTORIC_VERIFIERS else load_verifier(name)
    tokens, draft_probs, target_probs = _single([2], [0.2, 0.3, 0.5], [0.2, 0.3, 0.5], bonus=[0.0, 1.0, 0.0])
    out = verifier.verify(tokens, draft_probs, target_probs, InjectedUniforms([1 - 2**-53] * 8))
    assert out.emitted(tokens)[0] == [2, 1]


# sglang #35771's regression table (docs/historic-bugs.md entry 18): candidates, target, coin -> (emitted, num_accepted)
SGLANG_BOUNDARY_TABLE = [
    ([2], [0.0, 1.0, 0.0], 0.0, 1, 0),
    ([1, 2, 3], [0.0, 0.25, 0.0, 0.75], 0.25, 3, 1),
    ([1], [0.0, 0.25, 0.75], 0.0, 1, 1),
    ([1], [0.0, 1.0], 1 - 2**-24, 1, 1),
]


@pytest.mark.parametrize("candidates, target, coin, token, num_accepted", SGLANG_BOUNDARY_TABLE)
def test_target_only_coin_boundaries(candidates, target, coin, token, num_accepted):
    vocab_size = len(target)
    tokens, draft_probs, target_probs = _single(candidates, [1 / vocab_size] * vocab_size, target)
    fixed = load_historic("target-only-siblings")
    out = fixed.verify(tokens, draft_probs, target_probs, InjectedUniforms([torch.tensor([[coin, 0.5]])]))
    emitted = out.emitted(tokens)[0]
    assert emitted[0] == token and int(out.num_accepted[0]) == num_accepted


def test_inclusive_coin_lands_in_the_wrong_bucket():
    bug = load_historic("target-only-inclusive-coin")
    # coin 0 accepts candidate 2 of target probability 0
    tokens, draft_probs, target_probs = _single([2], [1 / 3] * 3, [0.0, 1.0, 0.0])
    out = bug.verify(tokens, draft_probs, target_probs, InjectedUniforms([torch.tensor([[0.0, 0.5]])]))
    assert out.emitted(tokens)[0][0] == 2
    # an interior CDF boundary lands in the earlier bucket
    tokens, draft_probs, target_probs = _single([1, 2, 3], [0.25] * 4, [0.0, 0.25, 0.0, 0.75])
    out = bug.verify(tokens, draft_probs, target_probs, InjectedUniforms([torch.tensor([[0.25, 0.5]])]))
    assert out.emitted(tokens)[0][0] == 1


# --- other hand-derived cases ----------------------------------------------------------------


def test_bonus_and_first_unmatched_token():
    """docs/historic-bugs.md entry 13 (vllm PR #8320), greedy: drafts (1,2,3,5,7), target argmax (1,2,3,4,6,8)."""
    vocab_size = 9
    drafts = [1, 2, 3, 5, 7]
    argmax = [1, 2, 3, 4, 6, 8]
    tokens = torch.tensor(drafts).view(1, 1, -1)
    draft_probs = torch.nn.functional.one_hot(tokens, vocab_size).double()
    target_probs = torch.nn.functional.one_hot(torch.tensor(argmax).view(1, 1, -1), vocab_size).double()
    gen = torch.Generator().manual_seed(0)
    fixed = load_verifier("speculative").verify(tokens, draft_probs, target_probs, gen)
    assert fixed.emitted(tokens)[0] == [1, 2, 3, 4]
    bug = load_historic("correction-from-bonus-row").verify(tokens, draft_probs, target_probs, gen)
    assert bug.emitted(tokens)[0] == [1, 2, 3, 8]


@pytest.mark.parametrize("name, num_drafts", [("speculative", 1), ("kseq", 3), ("rrs", 3)])
def test_disjoint_supports_always_recover_the_target_token(name, num_drafts):
    """docs/historic-bugs.md entry 3 (vllm #9441): target (0, 1), draft (1, 0): the recovered token is 1 every time."""
    batch_size = 4096
    tokens = torch.zeros(batch_size, num_drafts, 1, dtype=torch.int64)
    draft_probs = torch.tensor([1.0, 0.0], dtype=torch.float64).expand(batch_size, num_drafts, 1, 2).clone()
    target_probs = torch.tensor([0.0, 1.0], dtype=torch.float64).expand(batch_size, num_drafts, 2, 2).clone()
    out = load_verifier(name).verify(tokens, draft_probs, target_probs, torch.Generator().manual_seed(0))
    assert bool((out.num_accepted == 0).all()) and bool((out.next_token == 1).all())


def test_greedy_draft_proposes_the_argmax_whatever_was_drafted():
    bug = load_historic("greedy-draft-soft-q")
    tokens, draft_probs, target_probs = _single([2], [0.6, 0.3, 0.1], [0.5, 0.3, 0.2])
    law = bug.output_probs(tokens, draft_probs, target_probs)
    np.testing.assert_allclose(law[0, 0, 0].numpy(), [5 / 6, 0.0, 1 / 6], atol=1e-15)
    assert float(law[0, 0, 1].sum()) == 0.0


# --- the module's own contract ---------------------------------------------------------------


def test_every_historic_verifier_cites_a_public_issue():
    for name in HISTORIC_VERIFIERS:
        if name == "block-tokenwise-residual" and not _has_block():
            continue
        verifier = load_historic(name)
        doc = type(verifier).__doc__ or ""
        assert re.search(r"#\d+|commit [0-9a-f]{7}", doc), f"{name}: docstring cites no issue or commit"
        assert verifier.name == name
        assert name in FIXED_COUNTERPART


def _has_block() -> bool:
    try:
        import spectr_audit.verifiers.block  # noqa: F401
    except ImportError:
        return False
    return True


def test_bad_arguments():
    with pytest.raises(InvalidArgument, match="unknown historic-bug verifier"):
        load_historic("no-such-bug")
    with pytest.raises(InvalidArgument, match="temperature"):
        historic.BonusWithoutTemperatureBug(temperature=0.0)
    with pytest.raises(InvalidArgument, match="hard_threshold"):
        historic.MedusaTypicalAcceptance(hard_threshold=2.0)
    with pytest.raises(InvalidArgument, match="supports num_drafts"):
        tokens, draft_probs, target_probs = _single([0, 1], [0.5, 0.5], [0.5, 0.5])
        load_historic("greedy-draft-soft-q").verify(tokens, draft_probs, target_probs)
