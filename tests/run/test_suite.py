"""Suites as TOML files: parsing, expansion and clear errors."""

from __future__ import annotations

import pytest

from spectr_audit.errors import InvalidArgument
from spectr_audit.drafting.models import ContextFreeModel, MarkovModel
from spectr_audit.run.suite import builtin_suites, load_suite, parse_suite


def _case(**fields):
    base = {"name": "c", "draft": [0.5, 0.5], "target": [0.25, 0.75], "num_drafts": 2}
    base.update(fields)
    return {"case": [base]}


def test_default_suite_loads_with_the_seed_cases():
    suite = load_suite("default")
    names = {c.name for c in suite.cases}
    assert {"seed-spectr/K=2", "seed-naive-independent/K=2"} <= names
    assert max(c.vocab_size for c in suite.cases) == 16
    assert max(c.num_drafts for c in suite.cases) == 6
    assert any(c.draft_len > 1 and isinstance(c.draft_model, MarkovModel) for c in suite.cases)
    assert "default" in builtin_suites()


def test_lists_expand_into_named_cases():
    suite = parse_suite(_case(num_drafts=[1, 2], draft_len=[1, 3]))
    assert [c.name for c in suite.cases] == ["c/K=1/L=1", "c/K=1/L=3", "c/K=2/L=1", "c/K=2/L=3"]


def test_model_kinds():
    suite = parse_suite({"case": [
        {"name": "d", "num_drafts": 1, "draft": {"dirichlet": {"vocab_size": 5, "seed": 1}},
         "target": {"logits": [0.0, 1.0, 2.0, 3.0, 4.0], "temperature": 0.5}},
        {"name": "m", "num_drafts": 1, "draft": {"markov": {"vocab_size": 2, "seed": 1}},
         "target": {"table": [[0.5, 0.5], [0.1, 0.9], [1.0, 0.0]], "order": 1}},
    ]})
    d, m = suite.cases
    assert isinstance(d.draft_model, ContextFreeModel) and d.vocab_size == 5
    assert abs(float(d.target_model.probs.sum()) - 1) < 1e-12
    assert isinstance(m.target_model, MarkovModel)


@pytest.mark.parametrize(
    "data,message",
    [
        ({}, "expected at least one [[case]]"),
        ({"case": [{"draft": [1.0], "target": [1.0], "num_drafts": 1}]}, "name: expected a non-empty string"),
        (_case(num_drafts=0), "num_drafts: expected an integer >= 1"),
        (_case(num_drafts="2"), "num_drafts: expected an integer >= 1"),
        (_case(draft_len=[1, 0]), "draft_len: expected an integer >= 1"),
        (_case(draft=[0.5, 0.6]), "draft: probabilities must sum to 1"),
        (_case(target=[0.5, 0.25, 0.25]), "different vocab sizes"),
        (_case(checks=["exact", "magic"]), "checks: expected a list drawn from"),
        (_case(prefix=[5]), "prefix: expected a list of token ids in [0, 2)"),
        (_case(colour="red"), "unknown key(s) ['colour']"),
        (_case(draft={"dirichlet": {"vocab_size": 0}}), "vocab_size: expected a positive integer"),
        (_case(draft={"gaussian": {}}), "unknown model kind"),
        ({"case": [{"name": "x", "draft": [1.0], "target": [1.0], "num_drafts": 1}] * 2}, "duplicate case name"),
        ({"suite": {"nme": "typo"}, "case": _case()["case"]}, "unknown key(s) ['nme']"),
    ],
)
def test_bad_suites_name_the_case_and_the_problem(data, message):
    with pytest.raises(InvalidArgument) as info:
        parse_suite(data, source="suite file 'x.toml'")
    assert message in str(info.value)
    assert str(info.value).startswith("suite file 'x.toml'")


def test_bad_toml_and_missing_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[[case]\nname = ")
    with pytest.raises(InvalidArgument, match="not valid TOML"):
        load_suite(str(bad))
    with pytest.raises(InvalidArgument, match="does not exist"):
        load_suite(str(tmp_path / "missing.toml"))


def test_the_sampler_check_says_when_its_budget_left_it_underpowered():
    """The sampler-vs-law check on K-SEQ (whose sampler follows its law): with a 2,000-sample budget the
    planned minimum detectable TV (0.02) is out of reach, so the check is inconclusive (not a pass); with the
    default budget it passes with the planned power."""
    from spectr_audit.registry import load_verifier
    from spectr_audit.run.runner import AuditOptions, audit_case

    suite = parse_suite({"case": [{"name": "s", "draft": [0.5, 0.3, 0.2], "target": [0.2, 0.3, 0.5],
                                   "num_drafts": 2, "checks": ["sampler"]}]})
    small = audit_case(load_verifier("kseq"), suite.cases[0],
                       AuditOptions(min_detectable_tv=0.02, sampler_max_samples=2000))
    check = next(c for c in small.checks if c.name == "sampler-law")
    assert check.inconclusive and check.passed and "INCONCLUSIVE" in check.detail and small.inconclusive
    assert small.metrics["sampler_min_detectable_tv"] > 0.02
    full = audit_case(load_verifier("kseq"), suite.cases[0], AuditOptions(min_detectable_tv=0.02))
    check = next(c for c in full.checks if c.name == "sampler-law")
    assert check.passed and not check.inconclusive and "INCONCLUSIVE" not in check.detail and not full.inconclusive
    assert full.metrics["sampler_min_detectable_tv"] <= 0.02 * (1 + 1e-9)
