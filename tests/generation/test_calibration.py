"""The generation audit's false-alarm rates, by construction and on the correct speculative loop.

(a) Each test of spectr_audit.generation.statistical_tests on data drawn from its own null: uniform PIT values
(``pit_test``, ``PITEProcess``), surprisals of tokens drawn from known random laws
(``surprisal_test``), two samples of one law (``two_sample_test``), independent first tokens
(``agreement_test``).  A row (test, sample size, level) fails when its rejections exceed the upper
quantile of Binomial(draws, level) at a meta-level of 1% over the whole table (Bonferroni over its
rows): each such test has a false-alarm rate of at most 1% of its own, and is deterministic
(fixed seeds).  ``held_out_tv``'s lower bound must cover the true mean per-token TV, when tokens
are drawn from a known perturbed law, at least as often as its confidence says (same rule).

(b) The whole audit on the correct loop over the toy pair (ToyPair / SpecEngine), seeded audits
with small prompts: the number of FINDINGs must stay within the upper 99% quantile of
Binomial(audits, alpha) (the audit's familywise rate is at most alpha, so each check has a
false-alarm rate of at most 1%).  The default stage runs 40 audits per setting; the slow stage 200
and more, at alpha = 0.05 and the default 1e-3, also with a reference generator (two-sample mode)
and a draft scorer (ratio order).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from spectr_audit import defaults
from spectr_audit.generation import audit_generation
from spectr_audit.generation.engine_specs import TOY_CONDITIONS, _ToyConditions
from spectr_audit.generation.library import ToyPair, correct_engine
from spectr_audit.generation.pit import token_stats
from spectr_audit.generation.statistical_tests import (
    PITEProcess,
    agreement_test,
    held_out_tv,
    pit_test,
    surprisal_test,
    two_sample_test,
)

pytestmark = pytest.mark.usefixtures("single_thread")

META = 0.01
ALPHAS = (0.05, 0.01, 0.001)


def _limit(draws: int, level: float, rows: int) -> int:
    """The most rejections of ``draws`` level-``level`` tests compatible with the level, at meta-level META / rows."""
    return int(stats.binom.ppf(1.0 - META / rows, draws, level))


def _over(table: list) -> list:
    """The rows ``(name, level, rejections, draws)`` whose rejections exceed the Bonferroni-adjusted quantile."""
    return [(name, level, count, draws, _limit(draws, level, len(table))) for name, level, count, draws in table
            if count > _limit(draws, level, len(table))]


def _rows(name: str, pvalues, levels=ALPHAS) -> list:
    pvalues = np.asarray(pvalues)
    return [(name, level, int((pvalues <= level).sum()), pvalues.size) for level in levels]


# ---------------------------------------------------------------------------------------------
# (a) each test on data drawn from its null
# ---------------------------------------------------------------------------------------------


def _random_laws(rng, num: int, size: int) -> np.ndarray:
    """Generic, tied, sparse and one-hot laws (the kinds an engine's processed laws take)."""
    out = rng.dirichlet(np.full(size, 0.5), size=num)
    kind = rng.integers(0, 4, num)
    ties = rng.integers(0, 3, (num, size)).astype(np.float64)
    ties[ties.sum(1) == 0, 0] = 1.0
    out[kind == 1] = (ties / ties.sum(1, keepdims=True))[kind == 1]
    sparse = np.where(rng.random((num, size)) < 0.5, 0.0, out)
    sparse[sparse.sum(1) == 0, 0] = 1.0
    out[kind == 2] = (sparse / sparse.sum(1, keepdims=True))[kind == 2]
    out[kind == 3] = np.eye(size)[rng.integers(0, size, num)][kind == 3]
    return out


def _draw(rng, laws: np.ndarray) -> np.ndarray:
    cumulative = laws.cumsum(1)
    cumulative[:, -1] = 1.0
    return (rng.random((laws.shape[0], 1)) < cumulative).argmax(1)


def _null_pvalues(family: str, n: int, draws: int, rng) -> list:
    """``draws`` p-values of one test on samples of size ``n`` drawn from its null."""
    out = []
    for _ in range(draws):
        if family == "pit_test":
            out.append(pit_test(torch.from_numpy(rng.random(n)), "pit", level=1e-3, power=0.99).pvalue)
        elif family == "surprisal_test":  # surprisals of tokens drawn from known random laws (V = 12)
            laws = _random_laws(rng, n, 12)
            tokens = _draw(rng, laws)
            st = token_stats(torch.from_numpy(laws), torch.from_numpy(tokens), torch.from_numpy(rng.random(n)))
            out.append(surprisal_test(st.surprisal, st.entropy, st.surprisal_var, "s").pvalue)
        elif family == "two_sample_test":  # two samples of one (non-uniform) law, of different sizes
            a, b = rng.beta(2.0, 1.0, n), rng.beta(2.0, 1.0, n // 2 + 7)
            out.append(two_sample_test(torch.from_numpy(a), torch.from_numpy(b), "two").pvalue)
        elif family == "agreement_test":  # pairs of independent first tokens from random laws
            first = _random_laws(rng, max(n // 10, 5), 6)
            agree = _draw(rng, first) == _draw(rng, first)
            out.append(agreement_test(agree, (first ** 2).sum(1), "agree").pvalue)
        else:  # the e-process over batches of uniform PIT values, read at its maximum (any stopping time)
            process = PITEProcess()
            for batch in np.array_split(rng.random(n), 8):
                process.update(torch.from_numpy(batch))
            out.append(process.pvalue)
    return out


FAMILIES = ("pit_test", "surprisal_test", "two_sample_test", "agreement_test", "PITEProcess")


def _null_table(families: tuple, draws: int, sizes: tuple, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [row for family in families for n in sizes
            for row in _rows(f"{family} n={n}", _null_pvalues(family, n, draws, rng))]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_test_holds_its_level_on_data_from_its_null(family):
    # 100 values: the smallest stratum the audit tests; 1000: a typical one
    table = _null_table((family,), draws=1500, sizes=(100, 1000), seed=FAMILIES.index(family))
    assert len(table) == 6
    assert _over(table) == []


def test_the_check_can_fail():
    # the same rule flags a test that rejects at twice its level (the plain chi-square on 20
    # bins of 5 expected values is close; a test at 2 alpha is not)
    rng = np.random.default_rng(2)
    pvalues = np.minimum(1.0, 0.5 * rng.random(2000))
    assert _over(_rows("twice too liberal", pvalues)) != []


def _perturbed_tokens(rng, num: int, size: int, tv: float):
    """Tokens drawn from laws exactly ``tv`` from their targets (mass moved to the most likely token)."""
    targets = rng.dirichlet(np.full(size, 1.0), size=num)
    top = np.eye(size)[targets.argmax(1)]
    rest = targets * (1 - top)
    movable = rest.sum(1, keepdims=True)
    share = np.minimum(tv, movable)
    sample = targets + share * top - share * rest / movable
    true_tv = 0.5 * np.abs(sample - targets).sum(1)
    return targets, _draw(rng, sample), true_tv


@pytest.mark.parametrize("tv", [0.0, 0.05, 0.2])
def test_held_out_tv_covers_the_true_mean_tv(tv):
    rng = np.random.default_rng(3)
    draws, confidence = 1000, 0.95
    misses = 0
    lowers = []
    for _ in range(draws):
        num = 600
        targets, tokens, true_tv = _perturbed_tokens(rng, num, 8, tv)
        st = token_stats(torch.from_numpy(targets), torch.from_numpy(tokens), torch.from_numpy(rng.random(num)))
        fold = torch.from_numpy(np.repeat(np.arange(num // 20) % 2, 20))  # continuations of 20 tokens
        bound = held_out_tv(st.pit["probability"], fold, "probability", confidence)
        misses += bound.lower > float(true_tv.mean()) + 1e-12
        lowers.append(bound.lower)
    # at most 1 - confidence of the bounds miss (the upper 99% quantile of Binomial(draws, 0.05))
    assert misses <= _limit(draws, 1 - confidence, 1)
    if tv >= 0.2:  # and the bound is not vacuous
        assert np.mean(lowers) > 0.3 * tv


def test_held_out_tv_weights_the_halves_by_tokens():
    # half 0: 100 tokens, all in bin 0; half 1: 900 tokens, 60 in bin 0 and 840 spread over the
    # other 19 bins (44.2 each, under the 45 of uniformity).  Each half's over-represented set is
    # {bin 0}, |A| = 0.05: half 0 judged gives 100 - 5 = 95, half 1 judged 60 - 45 = 15.  The mean
    # over all 1000 tokens is 0.11 (the average of the halves' means would be 0.48).
    spread = (np.arange(840) % 19 + 1 + 0.5) / 20
    pit = torch.from_numpy(np.concatenate([np.full(100, 0.01), np.full(60, 0.02), spread]))
    fold = torch.from_numpy(np.concatenate([np.zeros(100, dtype=np.int64), np.ones(900, dtype=np.int64)]))
    bound = held_out_tv(pit, fold, "probability", 0.95)
    assert bound.num_tokens == 1000 and bound.estimate == pytest.approx(0.11, abs=1e-12)
    radius = (math.sqrt(math.log(1 / 0.025) * 100 / 2) + math.sqrt(math.log(1 / 0.025) * 900 / 2)) / 1000
    assert bound.lower == pytest.approx(max(0.0, 0.11 - radius), abs=1e-12)


# ---------------------------------------------------------------------------------------------
# (b) the whole audit on the correct loop
# ---------------------------------------------------------------------------------------------


def _audit(index: int, alpha: float, mode: str):
    """One seeded audit of the correct loop: a pair and prompts of its own, 16-32 tokens a row."""
    rng = np.random.default_rng(1000 + index)
    vocab = int(rng.integers(8, 17))
    eos = int(rng.integers(0, vocab)) if index % 3 == 0 else None
    pair = ToyPair(vocab_size=vocab, seed=index, eos_token_id=eos, draft_noise=None if index % 4 == 1 else 0.3)
    prompts = [[int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 5)))] for _ in range(2)]
    extra = {}
    if mode == "reference":
        extra["reference"] = pair.reference()
    if mode == "draft":
        extra["draft_score"] = pair.draft_scorer()
    if mode in ("auto", "auto-reference"):  # rounds until the planned power: a stop on the count of tokens
        extra.update(rounds="auto", min_detectable_tv=0.15)
    if mode == "auto-reference":  # the reference on the first rounds, then only until its own test has its tokens
        extra["reference"] = pair.reference()
    if mode == "conditions":  # every serving condition of the toy, each its own engine and stratum
        extra["conditions"] = {name: _ToyConditions(pair, None)(name) for name in TOY_CONDITIONS}
    return audit_generation(correct_engine(pair), pair.scorer(), prompts, vocab_size=vocab,
                            max_new_tokens=int(rng.integers(16, 33)), batch_size=2, seed=index, alpha=alpha,
                            eos_token_id=eos, progress=False, **extra)


def _false_alarms(num: int, alpha: float, mode: str, start: int = 0) -> tuple:
    results = [_audit(start + i, alpha, mode) for i in range(num)]
    assert all(r.num_tokens > 0 and not r.failures for r in results)
    if mode == "draft":
        assert all("ratio" in {t.name.split()[1] for t in r.subtests if t.name.startswith("pit ")} for r in results)
    if mode in ("reference", "auto-reference"):
        assert all(any(t.name.startswith("two-sample") for t in r.subtests) for r in results)
    findings = [r for r in results if r.verdict == "FINDING"]
    return len(findings), [(r.test, r.pvalue) for r in findings]


def _check_false_alarms(num: int, alpha: float, mode: str, rows: int = 1) -> None:
    count, which = _false_alarms(num, alpha, mode)
    assert count <= _limit(num, alpha, rows), (count, which)


@pytest.mark.parametrize("alpha", [0.05, defaults.ALPHA])
def test_the_correct_loop_is_rarely_a_finding(alpha):
    _check_false_alarms(40, alpha, "plain")


def test_the_correct_loop_under_every_serving_condition_is_rarely_a_finding():
    _check_false_alarms(40, 0.05, "conditions")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "reference", "draft", "auto", "auto-reference", "conditions"])
@pytest.mark.parametrize("alpha", [0.05, defaults.ALPHA])
def test_the_correct_loop_is_rarely_a_finding_over_many_audits(alpha, mode):
    _check_false_alarms(240, alpha, mode, rows=6)


@pytest.mark.slow
def test_each_test_holds_its_level_on_data_from_its_null_with_more_draws():
    table = _null_table(FAMILIES, draws=10_000, sizes=(100, 400, 3000), seed=5)
    assert _over(table) == []


def _print_table(draws: int = 2000):  # python -c "from tests.generation.test_calibration import _print_table as p; p()"
    table = _null_table(FAMILIES, draws=draws, sizes=(100, 1000), seed=1)
    for name, level, count, total in table:
        print(f"{name:28s} {level:6g} {count:5d} / {total}  limit {_limit(total, level, len(table))}")
