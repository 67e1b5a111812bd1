"""The stages the statistical audit and the sampler-vs-law check share: hand-derived cases."""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import pytest

from spectr_audit.drafting.models import ContextFreeModel
from spectr_audit.errors import InvalidArgument
from spectr_audit.registry import load_verifier
from spectr_audit.statistical._checks import chunk_schedule
from spectr_audit.statistical._stages import (
    COMMON_PARAMETERS,
    budgeted,
    deciding_test,
    family_result,
    holm_family,
    stream_chunks,
    support_test,
    validate_common,
    with_min_detectable_tv,
)
from spectr_audit.statistical.agreement import sampler_law_agreement
from spectr_audit.statistical.audit import statistical_audit, statistical_tree_audit
from spectr_audit.statistical.gof import TestResult
from spectr_audit.statistical.power import min_detectable_tv
from spectr_audit.statistical.results import LawAgreementResult

DRAFT = ContextFreeModel([0.6, 0.4])
TARGET = ContextFreeModel([0.3, 0.7])


@pytest.mark.parametrize(
    "planned, num_samples, max_samples, expected",
    [
        (1000, None, None, (1000, "planned")),
        (1000, 50, None, (50, "planned")),  # an exact size replaces the plan
        (1000, None, 300, (300, "max_samples")),
        (1000, 5000, 300, (300, "max_samples")),  # the budget caps an exact size too
        (1000, None, 1000, (1000, "planned")),  # a budget that is not binding is no stop reason
        (1000, None, 4000, (1000, "planned")),
    ],
)
def test_budgeted(planned, num_samples, max_samples, expected):
    assert budgeted(planned, num_samples, max_samples) == expected


def test_stream_chunks_runs_the_schedule_and_reports_why_it_stopped():
    sizes = list(chunk_schedule(20_000, 8192))
    assert sizes == [4096, 8192, 7712]
    seen = []
    assert stream_chunks(20_000, 8192, None, lambda size, done: seen.append((size, done))) == (20_000, "planned")
    assert seen == [(4096, 0), (8192, 4096), (7712, 12288)]
    # A stop reason ends the loop after the chunk that gave it.
    reason = lambda size, done: "support" if done >= 4096 else None  # noqa: E731
    assert stream_chunks(20_000, 8192, None, reason) == (12288, "support")
    # A deadline already past stops after the first chunk, but not when nothing is left to run.
    assert stream_chunks(20_000, 8192, 0.0, lambda size, done: None) == (4096, "max_seconds")
    assert stream_chunks(4096, 8192, 0.0, lambda size, done: None) == (4096, "planned")


def test_holm_family_support_and_the_deciding_test():
    tests = [TestResult("a", 1.0, 0.04), TestResult("b", 2.0, 0.01), TestResult("c", 3.0, 0.03)]
    family = holm_family(tests)
    # Holm by hand: sorted 0.01, 0.03, 0.04 -> 3 * 0.01, max(0.03, 2 * 0.03), max(0.06, 1 * 0.04)
    assert [t.pvalue_adjusted for t in family] == pytest.approx([0.06, 0.03, 0.06])
    assert holm_family([]) == ()
    clean = support_test(0.0, 100, "none")
    assert (clean.pvalue, clean.pvalue_adjusted, clean.num_samples) == (1.0, 1.0, 100)
    assert deciding_test(family, clean).name == "b"
    violated = support_test(3.0, 100, "three")
    assert (violated.pvalue, violated.pvalue_adjusted) == (0.0, 0.0)
    assert deciding_test(family, violated) is violated
    tied = holm_family([TestResult("first", 0.0, 0.5), TestResult("second", 0.0, 0.5)])
    assert deciding_test(tied, clean).name == "first"  # the first on ties



def test_family_result_is_decided_by_the_deciding_test_and_keeps_the_family():
    args = SimpleNamespace(verifier=SimpleNamespace(name="v"), alpha=0.01, seed=3, power=0.9)
    family = holm_family([TestResult("a", 1.0, 0.04), TestResult("b", 2.0, 0.01)])
    sizes = dict(num_samples=50, min_detectable_tv=0.1, worst_cells=(), seconds=0.5)
    result = family_result(LawAgreementResult, args, family, support_test(0.0, 50, "none"), **sizes, num_strata=2)
    # Holm by hand: sorted 0.01, 0.04 -> 2 * 0.01 = 0.02, max(0.02, 1 * 0.04) = 0.04; "b" decides
    assert (result.test, result.statistic, result.pvalue) == ("b", 2.0, pytest.approx(0.02))
    assert [t.name for t in result.subtests] == ["a", "b", "support"]
    assert (result.verifier, result.alpha, result.seed, result.power) == ("v", 0.01, 3, 0.9)
    assert (result.num_samples, result.min_detectable_tv, result.seconds, result.num_strata) == (50, 0.1, 0.5, 2)
    violated = family_result(LawAgreementResult, args, family, support_test(1.0, 50, "one"), **sizes, num_strata=0)
    assert (violated.test, violated.statistic, violated.pvalue, violated.rejects()) == ("support", 1.0, 0.0, True)


def test_with_min_detectable_tv():
    two_cells = with_min_detectable_tv(TestResult("x", 0.0, 1.0, num_cells=2), 10_000, 1e-3, 0.99)
    assert two_cells.min_detectable_tv == min_detectable_tv(10_000, 2, 1e-3, 0.99)
    for num_cells in (None, 1):
        assert with_min_detectable_tv(TestResult("x", 0.0, 1.0, num_cells=num_cells), 10_000, 1e-3, 0.99
                                      ).min_detectable_tv == math.inf


def test_validate_common_fills_defaults_and_names_the_bad_argument():
    args = validate_common(
        load_verifier("kseq"), DRAFT, TARGET, 2, 1, prefix=[1], alpha=0.01, min_detectable_tv=0.05, power=0.9, num_samples=None,
        max_samples=100, max_seconds=2, seed=7, device="cpu", chunk_size=None, min_expected=5.0,
    )
    assert (args.verifier.name, args.vocab_size, args.prefix, args.max_seconds, args.seed) == ("kseq", 2, (1,), 2.0, 7)
    assert args.chunk_size >= 1
    with pytest.raises(InvalidArgument, match="^seed:"):
        validate_common(load_verifier("kseq"), DRAFT, TARGET, 2, 1, prefix=(), alpha=0.01, min_detectable_tv=0.05, power=0.9,
                        num_samples=None, max_samples=None, max_seconds=None, seed=1.5, device="cpu",
                        chunk_size=None, min_expected=5.0)


@pytest.mark.parametrize("audit", [statistical_audit, sampler_law_agreement])
@pytest.mark.parametrize(
    "kwargs, argument",
    [({"alpha": 0}, "alpha"), ({"power": 1.0}, "power"), ({"min_detectable_tv": 0}, "min_detectable_tv"),
     ({"num_samples": 0}, "num_samples"), ({"max_samples": -1}, "max_samples"), ({"max_seconds": 0}, "max_seconds"),
     ({"seed": "0"}, "seed"), ({"chunk_size": 0}, "chunk_size"), ({"prefix": [2]}, "prefix")],
)
def test_both_audits_validate_the_shared_arguments_alike(audit, kwargs, argument):
    with pytest.raises(InvalidArgument, match=f"^{argument}:"):
        audit(load_verifier("kseq"), DRAFT, TARGET, 2, 1, **kwargs)


def test_the_entry_points_take_the_shared_arguments_under_one_name_and_default():
    # both entry points pass the shared arguments on by name: their signatures must spell them alike
    shared = inspect.signature(validate_common).parameters
    audit = inspect.signature(statistical_audit).parameters
    agreement = inspect.signature(sampler_law_agreement).parameters
    for name in COMMON_PARAMETERS:
        assert name in shared
        assert (audit[name].kind, audit[name].default, audit[name].annotation) == (
            agreement[name].kind, agreement[name].default, agreement[name].annotation), name
    assert list(audit)[:5] == list(agreement)[:5] == list(COMMON_PARAMETERS)[:5]
    # the tree entry point forwards every other keyword to statistical_audit
    assert list(inspect.signature(statistical_tree_audit).parameters)[:3] == list(COMMON_PARAMETERS)[:3]


def black_box(draft_tokens, draft_probs, target_probs, generator):
    raise AssertionError("never run: validation comes first")


def test_the_entry_points_pass_every_shared_argument_on():
    # each shared argument reaches validation under its own name: a bad value of any one is refused
    # naming it, by both entry points (a dropped or swapped keyword would pass it silently)
    good = dict(prefix=[1], alpha=0.01, min_detectable_tv=0.05, power=0.9, num_samples=None, max_samples=100,
                max_seconds=2, seed=7, device="cpu", chunk_size=64, min_expected=5.0)
    bad = dict(prefix=[5], alpha=2.0, min_detectable_tv=1.5, power=0.0, num_samples=-3, max_samples=-1,
               max_seconds=-2, seed="x", device="no-such-device", chunk_size=-64, min_expected=-1.0)
    for entry in (statistical_audit, sampler_law_agreement):
        for name in good:
            with pytest.raises(InvalidArgument, match=f"^{name}:"):
                entry(load_verifier("kseq"), DRAFT, TARGET, 2, 1, **{**good, name: bad[name]})


def test_the_agreement_check_needs_an_exact_law():
    with pytest.raises(InvalidArgument, match="^verifier: 'black_box' has no output_probs"):
        sampler_law_agreement(black_box, DRAFT, TARGET, 2, 1)
