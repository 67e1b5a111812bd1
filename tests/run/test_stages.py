"""The stage table of an audit, of a chain case and a tree case alike: which stages run, that the runner runs
exactly those, and that the memory budget sizes each of them (one table for both)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from spectr_audit.drafting.models import ContextFreeModel
from spectr_audit.registry import load_verifier
from spectr_audit.run import budget, runner
from spectr_audit.run.runner import AuditOptions, Case, audit_case
from spectr_audit.run.stages import STAGES, audit_stages

#: (has_exact_law, carries a repair, draft scheme, checks, L) -> the stages, derived by hand from the table's rules.
STAGE_CASES = [
    (True, False, "iid", ("exact", "optimality"), 1, ("probe", "optimality", "exact", "bounds", "certificate")),
    (True, False, "iid", ("exact", "sampler", "block-lp"), 2,
     ("probe", "exact", "bounds", "sampler", "certificate", "block-lp")),
    (True, False, "iid", ("exact", "block-lp"), 1, ("probe", "exact", "bounds", "certificate")),
    (True, False, "without_replacement", ("exact", "block-lp"), 2, ("probe", "exact", "bounds", "certificate")),
    (True, True, "iid", ("exact",), 2, ("probe", "exact", "bounds", "multi-iteration", "certificate")),
    (True, True, "iid", ("multi-iteration",), 2, ("probe", "bounds", "multi-iteration", "certificate")),
    (True, False, "iid", ("multi-iteration",), 2, ("probe", "bounds", "certificate")),
    (True, False, "iid", ("statistical",), 1, ("probe", "bounds", "certificate")),
    (False, False, "iid", ("statistical", "exact", "sampler"), 1, ("probe", "statistical")),
    (False, False, "iid", ("exact",), 1, ("probe",)),
    (False, False, "iid", ("optimality", "statistical", "block-lp"), 3, ("probe", "optimality", "statistical", "block-lp")),
]


@pytest.mark.parametrize("exact, carries, scheme, checks, draft_len, expected", STAGE_CASES)
def test_the_stages_that_run(exact, carries, scheme, checks, draft_len, expected):
    verifier = NS(has_exact_law=exact, draft_scheme=scheme)
    if carries:
        verifier.carried_correction = lambda *args: None
    assert audit_stages(verifier, NS(checks=checks, draft_len=draft_len)) == expected


def test_the_memory_budget_sizes_every_stage_of_the_table():
    # a stage added to the table without a size would be a KeyError in the budget; an extra is sized when it runs
    from spectr_audit.run.stages import EXTRA_STAGES

    assert set(budget._STAGE_NEEDS) == {stage.name for stage in STAGES} - EXTRA_STAGES
    assert EXTRA_STAGES <= {stage.name for stage in STAGES}


def _case(checks, num_drafts=1, draft_len=2):
    return Case("stages", ContextFreeModel(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)),
                ContextFreeModel(torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)), num_drafts=num_drafts,
                draft_len=draft_len, checks=checks)


@pytest.mark.parametrize("name, checks, num_drafts, draft_len", [
    ("speculative", ("exact", "optimality", "sampler", "block-lp"), 1, 2),
    ("kseq", ("exact", "optimality"), 2, 1),
    ("speculative", ("statistical",), 1, 2),
])
def test_the_runner_runs_exactly_the_tables_stages_in_order(monkeypatch, name, checks, num_drafts, draft_len):
    ran = []
    for stage in STAGES:
        method = "_" + stage.name.replace("-", "_")
        original = getattr(runner._CaseAudit, method)

        def spy(self, _original=original, _name=stage.name):
            ran.append(_name)
            return _original(self)

        monkeypatch.setattr(runner._CaseAudit, method, spy)
    verifier = load_verifier(name)
    case = _case(checks, num_drafts, draft_len)
    result = audit_case(verifier, case, AuditOptions(max_samples=2_000, sampler_max_samples=2_000))
    assert result.error is None, result.error
    assert tuple(ran) == audit_stages(verifier, case)
    assert len(ran) >= 2


def test_a_black_box_runs_the_statistical_stage_and_the_budget_sizes_it():
    black_box = load_verifier("speculative")
    black_box = NS(name="black-box", has_exact_law=False, draft_scheme="iid", verify=black_box.verify)
    case = _case(("statistical", "optimality"))
    stages = audit_stages(black_box, case)
    assert stages == ("probe", "optimality", "statistical")
    needs = budget.audit_needs(black_box, case, AuditOptions())
    assert {need.stage for need in needs} == {"the verifier probe", "the optimality bound", "the statistical audit"}


def test_the_tables_carried_correction_rule_is_the_contracts():
    from spectr_audit.contract.correction import has_carried_correction
    from spectr_audit.registry import builtin_verifiers
    from spectr_audit.run.stages import carries_correction

    objects = [*builtin_verifiers(), NS(), NS(carried_correction=None), NS(carried_correction=lambda: None),
               NS(carried_correction=3)]
    assert [carries_correction(o) for o in objects] == [has_carried_correction(o) for o in objects]
    assert any(carries_correction(o) for o in objects) and not all(carries_correction(o) for o in objects)


def test_the_memory_budget_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, spectr_audit.run.budget; print(sorted(m for m in ('torch', 'scipy') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


@pytest.mark.parametrize("has_law, checks, expected", [
    (True, ("exact", "optimality"), ("optimality", "exact", "statistical", "bounds", "certificate")),
    (False, ("exact", "optimality"), ("optimality", "statistical", "bounds")),
    (True, ("optimality",), ("optimality", "bounds", "certificate")),
    (False, ("statistical",), ("statistical", "bounds")),
])
def test_the_tree_stages_that_run(has_law, checks, expected):
    # whatever else the tree verifier declares (a repair, a chain draft scheme), a tree case runs no chain-only stage
    tree_verifier = NS(has_tree_law=has_law, has_exact_law=True, draft_scheme="iid", carried_correction=lambda: None)
    assert audit_stages(tree_verifier, NS(checks=checks + ("sampler", "block-lp", "multi-iteration"), draft_len=2,
                                          tree="chains:2,2")) == expected


def test_a_tree_audit_runs_its_tables_stages_and_stands_the_sampler_down_after_an_exact_law(monkeypatch):
    from spectr_audit.registry import load_tree_verifier
    from spectr_audit.run.checks import statistical_check as real_statistical_check
    from spectr_audit.run.suite import load_suite

    ran, sampled = [], []
    for stage in STAGES:
        method = "_" + stage.name.replace("-", "_")
        original = getattr(runner._CaseAudit, method)

        def spy(self, _original=original, _name=stage.name):
            ran.append(_name)
            return _original(self)

        monkeypatch.setattr(runner._CaseAudit, method, spy)
    monkeypatch.setattr(runner, "statistical_check", lambda *a, **k: (sampled.append(True), real_statistical_check(*a, **k)))
    case = next(c for c in load_suite("default").cases if c.name.startswith("tree-chains-2-2"))
    tree_verifier = load_tree_verifier("tree-rrs")
    result = audit_case(tree_verifier, case, AuditOptions(max_samples=2_000))
    assert result.error is None, result.error
    assert tuple(ran) == audit_stages(tree_verifier, case) and "exact" in ran
    assert sampled == []  # the law was enumerated: the statistical stage stood down
    assert any(c.name == "exact" for c in result.checks)
