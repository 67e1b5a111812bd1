"""The public module paths and names, and the deprecated aliases of the ones that moved.

:data:`PUBLIC` lists the modules and names the README and docs/ tell users to import, and the top-level
``spectr_audit`` names; a restructure that moves or drops one fails here until the old path keeps an alias
(``spectr_audit.deprecation.py``: a warning naming the new path, for one minor release) and the list
says where the name went.  Every ``from spectr_audit... import ...`` line of README.md and docs/ must
import, so that no page sends a reader to a path that is gone.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import spectr_audit

ROOT = Path(__file__).resolve().parents[1]

#: module -> the public names users import from it
PUBLIC = {
    "spectr_audit": (
        "__version__", "SpectrAuditError", "InvalidArgument", "VerifierError", "Verifier", "VerifyOutput",
        "FunctionVerifier", "as_verifier", "check_verify_inputs", "load_verifier", "exact_iteration", "exact_tree",
        "DraftTree", "load_tree_verifier", "tree_bound", "statistical_tree_audit", "optimal_acceptance",
        "optimal_acceptance_lp", "load_suite", "run_suite", "audit_case", "InjectedUniforms", "check_verifier",
        "audit", "assert_passed", "statistical_audit", "sampler_law_agreement", "audit_generation",
        "GenerationAuditResult", "check_generation", "assert_generation_passed",
    ),
    "spectr_audit.errors": ("SpectrAuditError", "InvalidArgument", "VerifierError"),
    "spectr_audit.results": ("Check", "AuditResult", "AuditReport", "EXIT_ERROR", "EXIT_INCONCLUSIVE", "VERDICTS"),
    "spectr_audit.contract.verifier": ("Verifier", "FunctionVerifier", "VerifyOutput", "check_verify_inputs",
                                       "SHAPE_ATTRS", "declared_values"),
    "spectr_audit.contract.convert": ("as_verifier", "as_tree_verifier"),
    "spectr_audit.contract.randomness": ("InjectedUniforms", "RandomSource"),
    "spectr_audit.contract.sampling": ("SamplingParams", "process_logits"),
    "spectr_audit.contract.requests": ("Request", "Constraint", "ConstraintViolation", "TokenAutomaton",
                                       "RegexConstraint", "JsonSchemaConstraint"),
    "spectr_audit.contract.history": ("HISTORY_ENGINES", "RequestLaws", "process_request", "process_request_step",
                                      "LLAMA_CPP_SAMPLING", "LLAMA_CPP_PENALTY_LAST_N"),
    "spectr_audit.contract.logits": ("verify_with_params", "output_probs_with_params"),
    "spectr_audit.contract.tree": ("DraftTree",),
    "spectr_audit.drafting.models": ("Model", "ContextFreeModel", "MarkovModel", "random_markov"),
    "spectr_audit.registry": ("load_verifier", "load_tree_verifier"),
    "spectr_audit.exact.iteration": ("exact_iteration",),
    "spectr_audit.exact.multi_iteration": ("exact_multi_iteration",),
    "spectr_audit.statistical.audit": ("statistical_audit",),
    "spectr_audit.bounds": ("block_lp", "kseq_acceptance", "optimal_acceptance", "optimal_acceptance_lp",
                            "spectr_guarantee"),
    "spectr_audit.bounds.tree_lp": ("tree_bound",),
    "spectr_audit.run.api": ("audit", "assert_passed"),
    "spectr_audit.run.conformance": ("check_verifier", "ConformanceFailure", "ConformanceResult", "standard_suite"),
    "spectr_audit.run.runner": ("run_suite", "audit_case", "AuditOptions"),
    "spectr_audit.run.suite": ("load_suite", "select_cases", "parse_values"),
    "spectr_audit.run.plan": ("plan_run", "RunPlan"),
    "spectr_audit.generation": ("audit_generation",),
    "spectr_audit.generation.library": ("ToyPair", "correct_engine", "slip_engine"),
    "spectr_audit.engine_adapters.requests": ("completions_fields", "transformers_generate_kwargs",
                                              "vllm_sampling_fields"),
    "spectr_audit.generation.library.request_slips": ("RequestSpecEngine", "REQUEST_SLIPS", "audit_request_slip",
                                                      "audit_every_feature"),
    "spectr_audit.engines.workers": ("RowParallelVerifier",),
    "spectr_audit.engine_adapters.factories": ("checkpoint_pair",),
    "spectr_audit.engine_adapters.hf": ("TransformersGenerator", "TransformersScorer", "load_causal_lm"),
    "spectr_audit.engine_adapters.prompts": ("shipped_prompt_ids",),
    "spectr_audit.engine_adapters.vllm_offline": ("VLLMGenerator", "start_llm"),
    "spectr_audit.strategies": ("emitted_tokens_in_target_support", "verify_inputs"),
}

#: old module path -> (new module path, {old name: new name} for names renamed on the way)
DEPRECATED = {
    "spectr_audit.models": ("spectr_audit.drafting.models", {}),
    "spectr_audit.randomness": ("spectr_audit.contract.randomness", {}),
    "spectr_audit.conformance": ("spectr_audit.run.conformance", {"ConformanceReport": "ConformanceResult"}),
}


@pytest.mark.parametrize("module_name", sorted(PUBLIC))
def test_every_public_name_is_where_the_list_says(module_name):
    module = importlib.import_module(module_name)
    missing = [name for name in PUBLIC[module_name] if not hasattr(module, name)]
    assert not missing, f"{module_name} lost {missing}: keep a deprecated alias at the old path, or update PUBLIC"
    unlisted = [name for name in PUBLIC[module_name] if name not in module.__all__ and name != "__version__"]
    assert not unlisted, f"{module_name}: {unlisted} are public but not in __all__"


def _doc_imports() -> list:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for match in re.finditer(r"^\s*from (spectr_audit[\w.]*) import ([\w, ]+)$", path.read_text(), re.M):
            names = [n.strip() for n in match.group(2).split(",") if n.strip()]
            found.append((path.relative_to(ROOT).as_posix(), match.group(1), tuple(names)))
    return found


def test_every_import_the_docs_show_works():
    imports = _doc_imports()
    assert len(imports) >= 15
    broken = []
    for where, module_name, names in imports:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            broken.append(f"{where}: {module_name} ({exc})")
            continue
        broken += [f"{where}: {module_name}.{name}" for name in names if not hasattr(module, name)]
    assert not broken, "docs import what is gone: " + "; ".join(broken)


def test_the_documented_modules_are_listed():
    documented = {module for _, module, _ in _doc_imports()}
    assert documented <= set(PUBLIC), f"add to PUBLIC: {sorted(documented - set(PUBLIC))}"


@pytest.mark.parametrize("old", sorted(DEPRECATED))
def test_a_moved_module_keeps_a_deprecated_alias_that_names_its_new_path(old, monkeypatch):
    new_name, renamed = DEPRECATED[old]
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)} is deprecated: it moved to {re.escape(new_name)}"):
        alias = importlib.import_module(old)
    new = importlib.import_module(new_name)
    assert all(getattr(alias, name) is getattr(new, name) for name in new.__all__)
    assert all(getattr(alias, old_name) is getattr(new, name) for old_name, name in renamed.items())
    assert set(alias.__all__) == set(new.__all__) | set(renamed)


def test_the_warning_points_at_the_importing_line():
    # in a fresh interpreter (pytest's import hooks add frames of their own): the user's line is named
    done = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-c",
                           "import spectr_audit\nfrom spectr_audit.models import MarkovModel"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "<string>:2: DeprecationWarning: spectr_audit.models is deprecated: it moved to " \
           "spectr_audit.drafting.models" in done.stderr


def test_importing_the_package_warns_of_nothing():
    done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c",
                           "import spectr_audit, spectr_audit.run.api, spectr_audit.cli"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
