"""The generation audit's modes and decisions, on the toy pair with engines whose truth is known.

* the Holm family and the deciding test: the adjusted p-values are Holm's (statsmodels is the
  oracle), the audit's p-value is the smallest adjusted one among the deciding tests;
* the numerics floor: a reference that the scorer itself rejects moves the decision to the
  two-sample tests (an engine as far from the scorer as its reference passes; one farther is found);
* the e-process: its p-value is the average of the orders' plug-in e-processes, recomputed here
  from the stored records; an audit it stops is a FINDING;
* greedy mode (temperature 0, with a reference and a logits scorer): exact agreement passes,
  divergences at near-ties are reported as numerics, divergences at a margin are findings;
* the ratio order (with a draft scorer) finds a coupling that over-accepts drafted tokens, which the
  other orders miss at the same budget;
* the independence tests find requests that share a random stream, and calls that ignore the seed;
* a correct loop with an end-of-sequence token passes (and does stop there);
* any valid ``orderings`` runs, and the power is that of the all-tokens PIT test of the order it
  names (``probability`` when run, else the first given), recomputed here from its definition.
"""

from __future__ import annotations

import io
import math
import sqlite3

import numpy as np
import pytest
import torch
from scipy import optimize, stats
from statsmodels.stats.multitest import multipletests

from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.generation import audit_generation
from spectr_audit.generation.library import SpecEngine, ToyPair, correct_engine, slip_engine
from spectr_audit.generation.statistical_tests import PITEProcess

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 12
PAIR = ToyPair(vocab_size=VOCAB, seed=2)
PROMPTS = [[1, 2], [3, 4, 5], [6]]
BASE = dict(vocab_size=VOCAB, max_new_tokens=24, progress=False)
DECISIVE = {"support", "end-of-sequence", "greedy"}


def _holm_checks(result) -> None:
    family = [t for t in result.subtests if t.name not in DECISIVE]
    adjusted = multipletests([t.pvalue for t in family], method="holm")[1]
    assert [t.pvalue_adjusted for t in family] == pytest.approx(list(adjusted), rel=1e-12, abs=0)
    deciding = [t for t in family if t.name in result.deciding]
    assert deciding and set(result.deciding) <= {t.name for t in family}
    if result.test not in DECISIVE:
        best = min(deciding, key=lambda t: t.pvalue_adjusted)
        assert result.pvalue == best.pvalue_adjusted and result.test == best.name
        assert (result.verdict == "FINDING") == (result.pvalue <= result.alpha)


def test_the_family_is_holms_and_the_deciding_test_its_smallest_adjusted_p():
    for engine, extra in ((correct_engine(PAIR), {}), (slip_engine("positions-by-block", PAIR), {}),
                          (correct_engine(PAIR), dict(reference=PAIR.reference(), draft_score=PAIR.draft_scorer()))):
        result = audit_generation(engine, PAIR.scorer(), PROMPTS, rounds=2, **BASE, **extra)
        _holm_checks(result)
        names = {t.name for t in result.subtests}
        assert {"pit probability / all", "pit token-id / all", "surprisal / all", "e-process",
                "independence / within a batch", "independence / across calls"} <= names
        assert result.decided_by == "one-sample" and set(result.deciding) == names - DECISIVE


WARM = ToyPair(vocab_size=VOCAB, seed=2, params=SamplingParams(temperature=0.8))
SHARP = ToyPair(vocab_size=VOCAB, seed=2, params=SamplingParams(temperature=0.5))


def test_a_reference_the_scorer_rejects_moves_the_decision_to_the_two_sample_tests():
    settings = dict(rounds=4, seed=1, **BASE)
    # the engine and its reference both sample at temperature 0.8; the scorer says 1.0 (its numerics
    # differ from both engines'): against the scorer alone this is a FINDING
    alone = audit_generation(correct_engine(WARM), PAIR.scorer(), PROMPTS, **settings)
    assert alone.verdict == "FINDING"
    floor = audit_generation(correct_engine(WARM), PAIR.scorer(), PROMPTS, reference=WARM.reference(), **settings)
    assert floor.reference_rejected and floor.decided_by == "two-sample"
    assert all(n.startswith(("two-sample", "independence")) for n in floor.deciding)
    assert floor.verdict != "FINDING" and floor.stop_reason == "planned"  # no e-process stop with a reference
    assert len(floor.numerics_floor) == 2 and max(h.estimate for h in floor.numerics_floor) > 0
    _holm_checks(floor)
    # an engine farther from the scorer than its reference is found by the two-sample tests
    farther = audit_generation(correct_engine(SHARP), PAIR.scorer(), PROMPTS, reference=WARM.reference(), **settings)
    assert farther.verdict == "FINDING" and farther.test.startswith("two-sample")


def test_the_e_process_is_the_average_of_the_orders_and_a_stop_is_a_finding(tmp_path):
    path = str(tmp_path / "audit.sqlite")
    settings = dict(rounds=6, seed=3, store=path, **BASE)
    result = audit_generation(correct_engine(SHARP), PAIR.scorer(), PROMPTS, **settings)
    assert result.stop_reason == "e-process" and result.verdict == "FINDING"
    e_test = next(t for t in result.subtests if t.name == "e-process")
    assert e_test.pvalue_adjusted <= result.alpha
    # recomputed from the stored records, job by job: log of the mean of the orders' e-values, at its maximum
    processes = {o: PITEProcess() for o in ("probability", "token-id")}
    best = 0.0
    with sqlite3.connect(path) as db:
        for (blob,) in db.execute("SELECT payload FROM jobs ORDER BY job"):
            with np.load(io.BytesIO(blob)) as rec:
                logs = [processes[o].update(torch.from_numpy(rec[f"tok_pit_{o}"])) for o in processes]
            best = max(best, math.log(np.mean(np.exp(logs))))
    assert e_test.pvalue == pytest.approx(math.exp(-best), rel=1e-9)


# --- greedy ------------------------------------------------------------------------------------

#: seed 3: greedy paths with near-ties (top two logits within 0.05) from these prompts
GREEDY = ToyPair(vocab_size=VOCAB, seed=3, params=SamplingParams(temperature=0.0))


def _flipping(pair: ToyPair, low: float, high: float):
    """A greedy loop that emits the runner-up wherever the top two logits are ``low <= gap < high`` apart."""
    def generate(prompts, max_new_tokens, seed):
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        out = []
        for prompt, limit in zip(prompts, limits):
            state, tokens = pair.target.start(prompt), []
            while len(tokens) < limit:
                top = pair.target.logits(state).topk(2)
                gap = float(top.values[0] - top.values[1])
                token = int(top.indices[1] if low <= gap < high else top.indices[0])
                tokens.append(token)
                state = pair.target.step(state, token)
            out.append(tokens)
        return out

    generate.per_row_max_new_tokens = True
    return generate


GREEDY_PROMPTS = [[0, 0], [1, 5], [2, 3], [3, 7], [4, 6], [5, 10]]


def test_a_correct_greedy_loop_agrees_with_its_reference_token_for_token():
    result = audit_generation(correct_engine(GREEDY), GREEDY.logits_scorer(), GREEDY_PROMPTS,
                              reference=GREEDY.reference(), **BASE)
    assert result.greedy and result.decided_by == "greedy" and result.verdict == "PASS"
    assert result.divergences == () and result.zero_mass == ()
    assert any(t.name == "greedy" and t.statistic == 0 for t in result.subtests)
    # without a reference: every token the scorer's argmax
    alone = audit_generation(correct_engine(GREEDY), GREEDY.scorer(), GREEDY_PROMPTS, **BASE)
    assert alone.greedy and alone.verdict == "PASS"


def test_greedy_divergences_at_near_ties_are_numerics_and_at_a_margin_findings():
    near = audit_generation(_flipping(GREEDY, 0.0, 0.05), GREEDY.logits_scorer(), GREEDY_PROMPTS,
                            reference=GREEDY.reference(), logit_tol=0.1, **BASE)
    assert near.greedy and near.divergences and all(d.numerics and d.margin < 0.05 for d in near.divergences)
    assert near.zero_mass and all(z.numerics and z.margin < 0.05 for z in near.zero_mass)
    assert near.verdict == "PASS"
    far = audit_generation(_flipping(GREEDY, 0.3, 0.6), GREEDY.logits_scorer(), GREEDY_PROMPTS,
                           reference=GREEDY.reference(), logit_tol=0.1, **BASE)
    assert far.verdict == "FINDING" and far.test in ("support", "greedy") and far.pvalue == 0.0
    assert far.divergences and all(not d.numerics and 0.3 <= d.margin < 0.6 for d in far.divergences)
    assert next(t for t in far.subtests if t.name == "greedy").statistic > 0
    # without logits no margin is known: a divergence is a finding
    blind = audit_generation(_flipping(GREEDY, 0.0, 0.05), GREEDY.scorer(), GREEDY_PROMPTS,
                             reference=GREEDY.reference(), logit_tol=0.1, **BASE)
    assert blind.verdict == "FINDING" and all(d.margin is None and not d.numerics for d in blind.divergences)


# --- the ratio order ---------------------------------------------------------------------------


class OverAccept(SpecEngine):
    """Accepts a drafted token with probability ``min(1, 1.5 q / p)``: the coupling over-accepts the draft."""

    name = "over-accept"

    def accepts(self, q, p, coin):
        return coin < min(1.0, 1.5 * q / p)


def test_the_ratio_order_finds_an_over_accepting_coupling():
    pair = ToyPair(vocab_size=VOCAB, seed=2, draft_noise=1.0)
    settings = dict(rounds=8, seed=0, **BASE)
    with_draft = audit_generation(OverAccept(pair), pair.scorer(), PROMPTS, draft_score=pair.draft_scorer(),
                                  **settings)
    assert with_draft.verdict == "FINDING" and with_draft.test.startswith("pit ratio")
    assert "expected_acceptance_per_drafted_token" in with_draft.acceptance
    without = audit_generation(OverAccept(pair), pair.scorer(), PROMPTS, **settings)
    assert without.verdict != "FINDING"
    # and the correct loop with the same draft scorer is not a finding
    correct = audit_generation(correct_engine(pair), pair.scorer(), PROMPTS, draft_score=pair.draft_scorer(),
                               **settings)
    assert correct.verdict != "FINDING" and any(t.name == "pit ratio / all" for t in correct.subtests)


# --- independence ------------------------------------------------------------------------------


def test_the_independence_tests_find_shared_streams_and_ignored_seeds():
    settings = dict(rounds=6, seed=0, **BASE)
    shared = audit_generation(slip_engine("shared-stream", PAIR), PAIR.scorer(), PROMPTS, **settings)
    assert shared.verdict == "FINDING" and shared.test == "independence / within a batch"
    assert shared.agreement["identical_within"] == shared.agreement["pairs_within"] > 0
    engine = correct_engine(PAIR)

    def ignores_the_seed(prompts, max_new_tokens, seed):
        return engine.generate(prompts, max_new_tokens, 0)

    ignores_the_seed.per_row_max_new_tokens = True
    ignored = audit_generation(ignores_the_seed, PAIR.scorer(), PROMPTS, **settings)
    # (the repeated sequences also over-disperse the PIT bins, so the smallest p may be a PIT test's)
    across = next(t for t in ignored.subtests if t.name == "independence / across calls")
    assert ignored.verdict == "FINDING" and across.pvalue < 1e-6 and across.pvalue_adjusted <= ignored.alpha
    assert ignored.agreement["agree_across"] == ignored.agreement["pairs_across"] > 0
    correct = audit_generation(engine, PAIR.scorer(), PROMPTS, **settings)
    within = next(t for t in correct.subtests if t.name == "independence / within a batch")
    across = next(t for t in correct.subtests if t.name == "independence / across calls")
    assert correct.verdict != "FINDING" and within.pvalue > 1e-3 and across.pvalue > 1e-3


# --- end of sequence ---------------------------------------------------------------------------


@pytest.mark.parametrize("eos", [0, 5])
def test_a_correct_loop_with_an_end_of_sequence_token_passes_and_stops_there(eos):
    pair = ToyPair(vocab_size=VOCAB, seed=2, eos_token_id=eos)
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8]]
    arms = ("single", "equal", "repeated")  # every row may run to max_new_tokens (no per-row limits)
    result = audit_generation(correct_engine(pair), pair.scorer(), prompts, rounds=3, seed=2, eos_token_id=eos,
                              arms=arms, **BASE)
    assert result.verdict != "FINDING" and result.after_eos == ()
    assert next(t for t in result.subtests if t.name == "end-of-sequence").statistic == 0
    assert result.num_tokens < result.num_continuations * BASE["max_new_tokens"]  # some rows ended early
    slip = audit_generation(slip_engine("eos-inside-block", pair), pair.scorer(), prompts, rounds=3, seed=2,
                            eos_token_id=eos, arms=arms, **BASE)
    assert slip.verdict == "FINDING" and slip.test == "end-of-sequence" and slip.after_eos


# --- orderings and the power ---------------------------------------------------------------------

ORDERING_CASES = [
    (("token-id",), False, "token-id"),
    ("token-id", False, "token-id"),
    (("ratio",), True, "ratio"),
    (("token-id", "ratio"), True, "token-id"),
    (("token-id", "probability"), False, "probability"),
]


@pytest.mark.parametrize("orderings, draft, power_ordering", ORDERING_CASES,
                         ids=["token-id", "token-id-str", "ratio", "token-id-ratio", "token-id-probability"])
def test_any_valid_orderings_run_and_the_power_is_the_named_orders_all_tokens_test(orderings, draft, power_ordering):
    extra = dict(draft_score=PAIR.draft_scorer()) if draft else {}
    result = audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, rounds=2, seed=4, orderings=orderings,
                              **BASE, **extra)
    run = (orderings,) if isinstance(orderings, str) else orderings
    _holm_checks(result)
    assert {t.name.split()[1] for t in result.subtests if t.name.startswith("pit ")} == set(run)
    assert [h.ordering for h in result.held_out_tv] == list(run)
    assert result.power_ordering == power_ordering and result.to_dict()["power_ordering"] == power_ordering
    test = next(t for t in result.subtests if t.name == f"pit {power_ordering} / all")
    assert test.num_samples == result.num_tokens > 0
    assert math.isfinite(result.min_detectable_tv) and result.min_detectable_tv == test.min_detectable_tv
    # a correct loop, fixed seed: not a FINDING (false-alarm rate alpha = 1e-3 per audit)
    assert result.verdict == ("INCONCLUSIVE" if result.min_detectable_tv > result.requested_tv else "PASS")


def _noncentral_chi2_sf(x: float, df: int, lam: float) -> float:
    """P(chi2_df(lam) > x) as the Poisson(lam / 2) mixture of central chi-squares of df + 2j degrees."""
    j = np.arange(0, int(lam / 2 + 40 * math.sqrt(lam / 2 + 1) + 50))
    return float(np.sum(stats.poisson.pmf(j, lam / 2) * stats.chi2.sf(x, df + 2 * j)))


def test_the_power_of_a_token_id_audit_is_its_g_tests_recomputed_from_the_definition():
    alpha, power = 0.01, 0.9
    result = audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, rounds=2, seed=4, alpha=alpha,
                              power=power, orderings=["token-id"], **BASE)
    assert result.power_ordering == "token-id" and result.num_tokens > 0
    # every test the audit ran shares alpha (Bonferroni): its Holm family and the support check (no
    # end-of-sequence id, not greedy, both independence tests present)
    names = [t.name for t in result.subtests]
    assert "support" in names and "end-of-sequence" not in names and "greedy" not in names
    assert {"independence / within a batch", "independence / across calls", "e-process"} <= set(names)
    level = alpha / len(names)
    # the G-test of the 20 PIT bins against uniform has 19 degrees of freedom; a law at TV d from
    # uniform has Cohen's w >= 2 d, noncentrality n w^2: the smallest d detected with `power`
    df = 19
    critical = float(stats.chi2.isf(level, df))
    lam = optimize.brentq(lambda x: _noncentral_chi2_sf(critical, df, x) - power, 1e-6, 1e4, xtol=1e-12)
    expected = math.sqrt(lam / result.num_tokens) / 2
    assert result.min_detectable_tv == pytest.approx(expected, rel=1e-6)
    # and the verdict rests on it: just above the requested TV is INCONCLUSIVE, just below PASS
    settings = dict(rounds=2, seed=4, alpha=alpha, power=power, orderings=["token-id"], **BASE)
    low = audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, min_detectable_tv=expected * 0.99, **settings)
    high = audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, min_detectable_tv=expected * 1.01,
                            **settings)
    # a correct loop, fixed seed: not a FINDING (false-alarm rate alpha = 0.01 per audit)
    assert (low.verdict, high.verdict) == ("INCONCLUSIVE", "PASS")
    assert low.min_detectable_tv == high.min_detectable_tv == result.min_detectable_tv
