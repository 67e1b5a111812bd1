"""The stages the statistical audit and the sampler-vs-law check share: hand-derived cases."""

from __future__ import annotations

import math

import pytest

from spectr_audit.drafting.models import ContextFreeModel
from spectr_audit.errors import InvalidArgument
from spectr_audit.registry import load_verifier
from spectr_audit.statistical._checks import chunk_schedule
from spectr_audit.statistical._stages import (
    budgeted,
    deciding_test,
    holm_family,
    stream_chunks,
    support_test,
    validate_common,
    with_min_detectable_tv,
)
from spectr_audit.statistical.agreement import sampler_law_agreement
from spectr_audit.statistical.audit import statistical_audit
from spectr_audit.statistical.gof import TestResult
from spectr_audit.statistical.power import min_detectable_tv

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
