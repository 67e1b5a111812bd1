"""The generation audit's old module paths still import, warn with ``DeprecationWarning`` naming the new path, and
offer the same objects."""

from __future__ import annotations

import importlib
import sys

import pytest

#: old path -> (new path, names read through the old path)
MOVED = {
    "spectr_audit.run.generation": ("spectr_audit.generation.checks", ["check_generation", "FACTORY_KEYS",
                                                                        "verdict_line", "write_reports"]),
    "spectr_audit.run.generation_cases": ("spectr_audit.generation.cases", ["GenerationCase", "AUDIT_KEYS"]),
    "spectr_audit.run.generation_engines": ("spectr_audit.generation.engine_specs", ["load_generation_engine", "_prune"]),
    "spectr_audit.run.generation_verdict": ("spectr_audit.generation.verdict", ["verdict_line", "result_json"]),
    "spectr_audit.generation.tests": ("spectr_audit.generation.statistical_tests", []),
    "spectr_audit.lm.generation": ("spectr_audit.engine_adapters.smollm", ["SmolLMEngine", "SmolLMScorer"]),
    "spectr_audit.engines.e2e": ("spectr_audit.engine_adapters", []),
    "spectr_audit.engines.e2e.repro": ("spectr_audit.engine_adapters.repro", ["write_repro"]),
    "spectr_audit.engines.e2e.factories": ("spectr_audit.engine_adapters.factories", []),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_offers_the_same_objects(old, monkeypatch):
    new, names = MOVED[old]
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: it moved to {new}"):
        alias = importlib.import_module(old)
    moved = importlib.import_module(new)
    assert set(getattr(moved, "__all__", ())) <= set(alias.__all__)
    for name in [*getattr(moved, "__all__", ()), *names]:
        assert getattr(alias, name) is getattr(moved, name), name


def test_the_old_suite_module_keeps_its_runner_and_warns_for_the_moved_names():
    from spectr_audit.generation import suite
    from spectr_audit.run import generation_suite

    assert "run_generation_suite" in generation_suite.__all__
    with pytest.warns(DeprecationWarning, match="spectr_audit.generation.suite"):
        assert generation_suite.GenerationSuiteReport is suite.GenerationSuiteReport
    with pytest.raises(AttributeError):
        generation_suite.no_such_name
