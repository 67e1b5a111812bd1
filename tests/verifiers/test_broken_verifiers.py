"""The library of broken verifiers: each is really broken, by the amount we say, and is flagged.

The standard case of the library: V = 8, context-free draft and target drawn from
Dirichlet(1) with seeds 1 and 2; K = 4 for verifiers that take several drafts, K = 1
otherwise; L = 2 for block-first-failure, L = 1 otherwise.  The slow test audits every broken
and every correct verifier at the default budget (each broken one flagged, each correct one passing); the default run
uses smaller, fixed budgets.  Audits run at false-alarm rate 1e-3 with fixed seeds.
"""

from __future__ import annotations

import pytest

from spectr_audit.contract.verifier import Verifier
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.drafting.models import ContextFreeModel
from spectr_audit.registry import load_verifier
from spectr_audit.statistical.audit import sampler_law_agreement, statistical_audit
from spectr_audit.verifiers.block import BlockVerification
from spectr_audit.registry import (
    BROKEN_VERIFIERS,
    INCONSISTENT_VERIFIERS,
    broken_names,
    broken_verifiers,
    load_broken,
)
from spectr_audit.errors import InvalidArgument

from tests._models import DRAFT8, DRAFT_MARKOV, TARGET8, TARGET_MARKOV

pytestmark = pytest.mark.usefixtures("single_thread")  # one torch thread (tests/conftest.py)


def standard_case(verifier: Verifier) -> tuple[int, int]:
    """(K, L) of the library's standard case for ``verifier``."""
    num_drafts = 4 if verifier.supports(4, 1) or verifier.supports(4, 2) else 1
    draft_len = 1 if verifier.supports(num_drafts, 1) else 2
    return num_drafts, draft_len


def test_registry_lists_every_broken_verifier():
    assert len(BROKEN_VERIFIERS) >= 9
    assert broken_names() == list(BROKEN_VERIFIERS)
    for name, verifier in zip(broken_names(), broken_verifiers()):
        assert isinstance(verifier, Verifier)
        assert verifier.name == name
        assert verifier.expected == "inexact"
        assert verifier.has_exact_law
        assert verifier.description.startswith("BROKEN")
    for name in INCONSISTENT_VERIFIERS:
        assert load_broken(name).name == name
    with pytest.raises(InvalidArgument, match="name"):
        load_broken("no-such-verifier")


def test_broken_names_do_not_shadow_builtins():
    from spectr_audit.registry import BUILTIN_VERIFIERS

    assert not set(BROKEN_VERIFIERS) & set(BUILTIN_VERIFIERS)


# Hand-derived laws (exact rationals or values from the cited sources), in our letters:
# draft p, target q.  (name, p, q, K, L, first-token law)
HAND_CASES = [
    # naive independent acceptance of each copy (docs/rules/kseq.md), p = (1, 0), q = (1/2, 1/2), K = 2
    ("independent-accept", [1.0, 0.0], [0.5, 0.5], 2, 1, [0.75, 0.25]),
    # docs/historic-bugs.md entry 37 (residual = target): output min(p, q) + (1 - sum min) q
    ("resample-target", [0.6, 0.3, 0.1], [0.5, 0.3, 0.2], 1, 1, [0.55, 0.33, 0.12]),
    # EAGLE #20: residual = q with the rejected token zeroed
    ("residual-drop-rejected", [0.45, 0.45, 0.1], [0.3, 0.3, 0.4], 1, 1, [0.3642857142857143, 0.3642857142857143,
                                                                          0.2714285714285714]),
    # vllm-ascend #13730: every draft accepted, the output follows the draft
    ("always-accept", [0.7, 0.3], [0.3, 0.7], 1, 1, [0.7, 0.3]),
    # inflated ratio 1.03: token 0 accepted with min(1, 1.03 * 0.3 / 0.6) = 0.515; the rest of
    # the mass goes to the residual (q - p)_+ = token 1
    ("inflated-ratio", [0.6, 0.4], [0.3, 0.7], 1, 1, [0.6 * 0.515, 1 - 0.6 * 0.515]),
]


@pytest.mark.parametrize("name,draft_probs,target_probs,num_drafts,draft_len,first_token_law", HAND_CASES)
def test_hand_derived_laws(name, draft_probs, target_probs, num_drafts, draft_len, first_token_law):
    audit = exact_iteration(load_broken(name), ContextFreeModel(draft_probs), ContextFreeModel(target_probs),
                            num_drafts, draft_len)
    assert audit.first_token_law.tolist() == pytest.approx(first_token_law, abs=1e-12)


def test_bonus_from_draft_keeps_the_first_token_and_breaks_the_second():
    audit = exact_iteration(load_broken("bonus-from-draft"), ContextFreeModel([0.6, 0.4]),
                            ContextFreeModel([0.3, 0.7]), 1, 1)
    assert audit.token_tv_distance < 1e-12
    # Draft 0 is accepted with joint probability 0.3, draft 1 with 0.4, and both are followed by a
    # bonus from p = (.6, .4); a rejection (0.3) emits token 1, completed from q = (.3, .7).
    joint = audit.implied_law.reshape(2, 2)
    assert joint.reshape(-1).tolist() == pytest.approx([0.18, 0.12, 0.24 + 0.09, 0.16 + 0.21], abs=1e-12)
    assert audit.tv_distance == pytest.approx(0.21, abs=1e-12)


def test_block_first_failure_differs_from_block_verification_only_in_the_scan():
    # Sun et al.'s example: p = (2/3, 1/3), q = (1/3, 2/3), L = 2.  Block verification is exact
    # with E[tau] = 11/9; the forward scan is not exact.
    draft_model, target_model = ContextFreeModel([2 / 3, 1 / 3]), ContextFreeModel([1 / 3, 2 / 3])
    correct = exact_iteration(BlockVerification(), draft_model, target_model, 1, 2)
    broken = exact_iteration(load_broken("block-first-failure"), draft_model, target_model, 1, 2)
    assert correct.tv_distance < 1e-12
    assert correct.block_efficiency == pytest.approx(1 + 11 / 9)
    assert broken.tv_distance > 0.01
    assert not load_broken("block-first-failure").supports(1, 1)  # for L = 1 the two scans coincide


@pytest.mark.parametrize("name", broken_names())
def test_each_broken_verifier_is_inexact_on_the_standard_case(name):
    verifier = load_broken(name)
    num_drafts, draft_len = standard_case(verifier)
    audit = exact_iteration(verifier, DRAFT8, TARGET8, num_drafts, draft_len)
    # the default budget is planned for TV 0.005: every library member is beyond it
    assert audit.tv_distance >= 0.005


@pytest.mark.parametrize("name", broken_names() + list(INCONSISTENT_VERIFIERS))
def test_each_broken_sampler_follows_its_stated_law(name):
    # The exact TVs above are those of the samplers only if sampler and law agree (level 1e-3).
    # kseq-sampler-drift is the exception by design.
    verifier = load_broken(name)
    num_drafts, draft_len = standard_case(verifier)
    if "kseq" in name:  # the K-SEQ rule is slow (rho* by bisection per row): a smaller case
        num_drafts = 2
    result = sampler_law_agreement(verifier, DRAFT8, TARGET8, num_drafts, draft_len, num_samples=8192, seed=1)
    assert result.rejects() == (name in INCONSISTENT_VERIFIERS), result.to_dict()


# Fixed budgets for the default run, chosen well above what each needs (see the module docstring of
# spectr_audit.verifiers.library.broken for the samples each needed at the default settings).
QUICK_BUDGETS = {
    "independent-accept": 20_000,
    "kseq-low-rho": 250_000,
    "kseq-dedup": 20_000,
    "rrs-skip-duplicates": 20_000,
    "resample-target": 20_000,
    "inflated-ratio": 400_000,
    "bonus-from-draft": 20_000,
    "block-first-failure": 20_000,
    "residual-drop-rejected": 20_000,
    "always-accept": 20_000,
}


@pytest.mark.parametrize("name", broken_names())
def test_each_broken_verifier_is_flagged_quickly(name):
    budget = QUICK_BUDGETS[name]
    verifier = load_broken(name)
    num_drafts, draft_len = standard_case(verifier)
    result = statistical_audit(verifier, DRAFT8, TARGET8, num_drafts, draft_len, max_samples=budget, seed=0,
                               stratify=False)
    assert result.rejects(), result.to_dict()


def test_broken_verifiers_are_flagged_on_a_markov_target():
    # Context-dependent laws: the bonus position differs from the last draft position.
    draft_model, target_model = DRAFT_MARKOV, TARGET_MARKOV
    for name in ("bonus-from-draft", "residual-drop-rejected", "block-first-failure"):
        verifier = load_broken(name)
        draft_len = 2 if name == "block-first-failure" else 1
        exact = exact_iteration(verifier, draft_model, target_model, 1, draft_len, prefix=(3,))
        assert exact.tv_distance > 0.01
        result = statistical_audit(verifier, draft_model, target_model, 1, draft_len, prefix=(3,),
                                   max_samples=50_000, seed=0)
        assert result.rejects(), (name, result.to_dict())


@pytest.mark.slow
@pytest.mark.parametrize("name", broken_names())
def test_each_broken_verifier_is_flagged_at_the_default_budget(name):
    verifier = load_broken(name)
    num_drafts, draft_len = standard_case(verifier)
    result = statistical_audit(verifier, DRAFT8, TARGET8, num_drafts, draft_len, seed=0)
    assert result.rejects(), result.to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("name,num_drafts,draft_len", [("speculative", 1, 1), ("kseq", 4, 1), ("rrs", 4, 1),
                                                        ("rrs-wor", 4, 1), ("block", 1, 2), ("spectr-tree", 2, 2)])
def test_each_correct_verifier_passes_at_the_default_budget(name, num_drafts, draft_len):
    verifier = load_verifier(name)
    result = statistical_audit(verifier, DRAFT8, TARGET8, num_drafts, draft_len, seed=0)
    assert not result.rejects(), result.to_dict()
    assert result.min_detectable_tv <= 0.005 * (1 + 1e-6)
