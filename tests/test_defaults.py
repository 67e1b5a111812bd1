"""One defaults module: every face reads its defaults from spectr_audit.defaults, none keeps a copy.

The main test changes every default in a fresh interpreter *before* the faces are imported, then
reads the defaults back from each face's signature, dataclass or option parser: a face that
reintroduces a literal (``alpha=1e-3``) keeps the old value and fails, even though the literal
equals today's default.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from spectr_audit import defaults

#: A value for every default, unlike any real one (so a copy of a real default cannot match it).
SENTINELS = {
    "ALPHA": 0.0123,
    "POWER": 0.876,
    "MIN_DETECTABLE_TV": 0.0321,
    "SEED": 7,
    "CHECK_SAMPLES": 12_345,
    "SAMPLER_MAX_SAMPLES": 54_321,
    "EXACT_TOL": 1.5e-13,
    "MULTI_TOL": 2.5e-10,
    "BOUND_TOL": 3.5e-10,
    "LP_TOL": 4.5e-7,
    "LP_SOLVER_TOL": 5.5e-12,
    "LP_SOLVER_FALLBACK_TOL": 6.5e-10,
    "LP_MAX_VARIABLES": 123_456,
    "LP_CROSS_CHECK_MAX_VARIABLES": 23_456,
    "MAX_MEMORY_FRACTION": 0.123,
    "MAX_MEMORY_FALLBACK": 3 * 2**30 + 7,
    "VERIFIER_TIMEOUT": 47.5,
    "EXACT_MAX_TUPLES": 1_234_567,
    "EXACT_MAX_HISTORIES": 123_457,
    "EXACT_CHUNK": 4321,
    "EXACT_MAX_TREE_REALISATIONS": 345_678,
    "EXACT_MAX_TREE_STRINGS": 3 * 2**20 + 1,
    "EXACT_TREE_CHUNK": 2345,
    "TREE_LP_MAX_REALISATIONS": 4321,
    "PARTITION_MAX_CELLS": 2**19 + 3,
    "MAX_STRATA": 3210,
    "MAX_STRATIFIED_ENTRIES": 2**19 + 5,
    "MIN_EXPECTED": 4.25,
    "MIN_CUT_MAX_SUPPORT": 17,
    "NULL_MAX_EXACT_OUTCOMES": 765_432,
    "MAX_COVARIANCE_CELLS": 1234,
    "MIN_PER_STRATUM": 29,
    "MAX_STRATIFIED_CELLS": 1357,
    "PLAN_MAX_BOUND_STRINGS": 3579,
    "FIRST_CHUNK": 3001,
    "ENGINE_TREE_CHUNK": 1717,
    "PROBE_CALLS": 3,
    "PROBE_ROWS": 13,
    "UNDECLARED_NUM_DRAFTS": [3],
    "UNDECLARED_DRAFT_LEN": [2],
}

_PROBE = textwrap.dedent(
    """
    import inspect, json, sys
    import spectr_audit.defaults as d
    for key, value in json.loads(sys.argv[1]).items():
        setattr(d, key, value)

    from spectr_audit import cli, plugin
    import importlib
    acceptance = importlib.import_module("spectr_audit.bounds.acceptance")
    block_lp = importlib.import_module("spectr_audit.bounds.block_lp")  # the package re-exports a function of that name
    from spectr_audit.lm.real_suite import RealLMOptions
    from spectr_audit.run import budget, conformance, runner
    from spectr_audit.statistical import agreement, audit, power
    from spectr_audit.statistical import _checks, _planning, gof, nulls, partition
    from spectr_audit.run import guard, suite
    from spectr_audit.contract.verifier import FunctionVerifier
    undeclared = FunctionVerifier(lambda draft_tokens, draft_probs, target_probs, generator: None)
    from spectr_audit.exact import iteration, multi_iteration
    tree_exact = importlib.import_module("spectr_audit.exact.tree")
    tree_lp = importlib.import_module("spectr_audit.bounds.tree_lp")
    tree_audit = importlib.import_module("spectr_audit.engines.tree_audit")

    def default(fn, name):
        return inspect.signature(fn).parameters[name].default

    def support_limit(compute):
        # 18 tokens of positive draft probability: above the sentinel limit, below the real one
        try:
            message = compute([1 / 18] * 18)
        except Exception as exc:
            message = str(exc)
        return int(message.split("limit of 2**")[1].split(" ")[0]) if "limit of 2**" in str(message) else None

    def run_optimality(draft):
        from types import SimpleNamespace
        from spectr_audit.drafting.models import ContextFreeModel
        from spectr_audit.run import checks
        case = SimpleNamespace(draft_model=ContextFreeModel(draft), target_model=ContextFreeModel(draft), prefix=(),
                               num_drafts=2)
        details = {}
        checks.optimality(case, "without_replacement", {}, details)
        return details.get("optimal_acceptance")

    def min_cut(draft):
        from spectr_audit.contract.tree import DraftTree
        from spectr_audit.drafting.models import ContextFreeModel
        return tree_lp.tree_optimal_acceptance(ContextFreeModel(draft), ContextFreeModel(draft), DraftTree.chains(2, 1),
                                               "without_replacement")

    def subparser(parser, command):
        action = next(a for a in parser._actions if getattr(a, "choices", None) and command in a.choices)
        return action.choices[command]

    run_parser = subparser(cli.build_parser(), "run")
    audit_parser = subparser(cli.build_parser(), "audit")
    run_defaults = {a.dest: a.default for a in run_parser._actions}
    run_help = {a.dest: a.help for a in run_parser._actions}

    class Group:
        def __init__(self):
            self.options = {}
        def addoption(self, *names, **kwargs):
            self.options[kwargs.get("dest", names[0])] = kwargs

    class Parser:
        def __init__(self):
            self.group, self.ini = Group(), {}
        def getgroup(self, *args):
            return self.group
        def addini(self, name, help, type=None, default=None):
            self.ini[name] = default

    pytest_parser = Parser()
    plugin.pytest_addoption(pytest_parser)
    options = runner.AuditOptions()
    real_lm = RealLMOptions()
    memory_fraction = round(budget.default_max_memory() / budget.physical_memory(), 6)
    budget.physical_memory = lambda: None  # unknown memory: the fallback
    out = {
        "budget.fraction": memory_fraction,
        "budget.fallback": budget.default_max_memory(),
        "cli.run.verifier_timeout": run_defaults["verifier_timeout"],
        "cli.audit.verifier_timeout": {a.dest: a.default for a in audit_parser._actions}["verifier_timeout"],
        "runner.verifier_timeout": options.verifier_timeout,
        "conformance.verifier_timeout": default(conformance.check_verifier, "verifier_timeout"),
        "cli.run.alpha": run_defaults["alpha"],
        "cli.run.alpha.help": "%g" % d.ALPHA in run_help["alpha"],
        "cli.run.seed": run_defaults["seed"],
        "cli.audit.seed": {a.dest: a.default for a in audit_parser._actions}["seed"],
        "plugin.settings.alpha": plugin._Settings().alpha,
        "plugin.settings.seed": plugin._Settings().seed,
        "plugin.settings.num_samples": plugin._Settings().num_samples,
        "plugin.ini.alpha": float(pytest_parser.ini["spectr_audit_alpha"]),
        "plugin.ini.seed": int(pytest_parser.ini["spectr_audit_seed"]),
        "plugin.ini.samples": int(pytest_parser.ini["spectr_audit_samples"]),
        "plugin.help.alpha": "%g" % d.ALPHA in pytest_parser.group.options["spectr_alpha"]["help"],
        "runner.alpha": options.alpha,
        "runner.power": options.power,
        "runner.min_detectable_tv": options.min_detectable_tv,
        "runner.seed": options.seed,
        "runner.sampler_max_samples": options.sampler_max_samples,
        "runner.EXACT_TOL": runner.EXACT_TOL,
        "runner.MULTI_TOL": runner.MULTI_TOL,
        "runner.BOUND_TOL": runner.BOUND_TOL,
        "runner.LP_TOL": runner.LP_TOL,
        "runner.LP_MAX_VARIABLES": runner.LP_MAX_VARIABLES,
        "conformance.alpha": default(conformance.check_verifier, "alpha"),
        "conformance.num_samples": default(conformance.check_verifier, "num_samples"),
        "conformance.seed": default(conformance.check_verifier, "seed"),
        "real_lm.alpha": real_lm.alpha,
        "real_lm.power": real_lm.power,
        "statistical_audit.alpha": default(audit.statistical_audit, "alpha"),
        "statistical_audit.power": default(audit.statistical_audit, "power"),
        "statistical_audit.min_detectable_tv": default(audit.statistical_audit, "min_detectable_tv"),
        "agreement.alpha": default(agreement.sampler_law_agreement, "alpha"),
        "agreement.power": default(agreement.sampler_law_agreement, "power"),
        "agreement.min_detectable_tv": default(agreement.sampler_law_agreement, "min_detectable_tv"),
        "power.required_samples.alpha": default(power.required_samples, "alpha"),
        "power.required_samples.power": default(power.required_samples, "power"),
        "power.required_samples.min_detectable_tv": default(power.required_samples, "min_detectable_tv"),
        "acceptance.lp.max_variables": default(acceptance.optimal_acceptance_lp, "max_variables"),
        "acceptance.lp_from_sets.max_variables": default(acceptance.optimal_acceptance_lp_from_sets, "max_variables"),
        "block_lp.tol": block_lp.CLARABEL_OPTIONS["tol_gap_abs"],
        "block_lp.fallback_tol": block_lp.CLARABEL_FALLBACK_OPTIONS["tol_gap_abs"],
        "exact.iteration.MAX_TUPLES": iteration.MAX_TUPLES,
        "exact.iteration.chunk_size": default(iteration.exact_iteration, "chunk_size"),
        "exact.multi_iteration.MAX_HISTORIES": multi_iteration.MAX_HISTORIES,
        "exact.tree.MAX_TREE_REALISATIONS": tree_exact.MAX_TREE_REALISATIONS,
        "exact.tree.MAX_TREE_STRINGS": tree_exact.MAX_TREE_STRINGS,
        "exact.tree.chunk_size": default(tree_exact.exact_tree, "chunk_size"),
        "acceptance.without_replacement.limit": support_limit(lambda p: acceptance.without_replacement_set_probs(p, 2)),
        "tree_lp.min_cut.limit": support_limit(min_cut),
        "run.checks.optimality.limit": support_limit(run_optimality),
        "engines.tree_audit.MAX_BOUND_REALISATIONS": tree_audit.MAX_BOUND_REALISATIONS,
        "gof.MIN_EXPECTED": gof.MIN_EXPECTED,
        "statistical_audit.min_expected": default(audit.statistical_audit, "min_expected"),
        "statistical_audit.max_cells": default(audit.statistical_audit, "max_cells"),
        "statistical_audit.max_strata": default(audit.statistical_audit, "max_strata"),
        "agreement.max_strata": default(agreement.sampler_law_agreement, "max_strata"),
        "agreement.min_expected": default(agreement.sampler_law_agreement, "min_expected"),
        "partition.max_cells": default(partition.build_partition, "max_cells"),
        "planning.MAX_STRATIFIED_ENTRIES": _planning.MAX_STRATIFIED_ENTRIES,
        "planning.MIN_PER_STRATUM": _planning.MIN_PER_STRATUM,
        "planning.MAX_STRATIFIED_CELLS": _planning.MAX_STRATIFIED_CELLS,
        "planning.block_efficiency_bound.max_strings": default(_planning._block_efficiency_bound, "max_strings"),
        "nulls.MAX_EXACT_OUTCOMES": nulls.MAX_EXACT_OUTCOMES,
        "agreement.MAX_COVARIANCE_CELLS": agreement.MAX_COVARIANCE_CELLS,
        "checks.FIRST_CHUNK": _checks.FIRST_CHUNK,
        "engines.tree_audit.chunk_size": default(tree_audit.tree_engine_audit, "chunk_size"),
        "runner.PROBE_CALLS": runner.PROBE_CALLS,
        "runner.probe_rows": runner.probe_rows(None),
        "guard.probe_checks.rows": default(guard.probe_checks, "rows"),
        "budget.PROBE_ROWS": budget.PROBE_ROWS,
        "budget.max_tuples": budget._MAX_TUPLES,
        "budget.max_histories": budget._MAX_HISTORIES,
        "budget.exact_chunk": budget._EXACT_CHUNK,
        "budget.max_cells": budget._MAX_CELLS,
        "budget.max_strata": budget._MAX_STRATA,
        "budget.min_expected": budget._MIN_EXPECTED,
        "suite.case_selection.num_drafts": list(suite.case_selection(undeclared)[0]),
        "suite.case_selection.draft_len": list(suite.case_selection(undeclared)[1]),
    }
    print(json.dumps(out))
    """
)

#: Each face's default -> the name in spectr_audit.defaults it must come from.
EXPECTED = {
    "exact.tree.chunk_size": "EXACT_TREE_CHUNK",
    "acceptance.without_replacement.limit": "MIN_CUT_MAX_SUPPORT",
    "tree_lp.min_cut.limit": "MIN_CUT_MAX_SUPPORT",
    "run.checks.optimality.limit": "MIN_CUT_MAX_SUPPORT",
    "engines.tree_audit.MAX_BOUND_REALISATIONS": "TREE_LP_MAX_REALISATIONS",
    "budget.fraction": "MAX_MEMORY_FRACTION",
    "budget.fallback": "MAX_MEMORY_FALLBACK",
    "cli.run.verifier_timeout": "VERIFIER_TIMEOUT",
    "cli.audit.verifier_timeout": "VERIFIER_TIMEOUT",
    "runner.verifier_timeout": "VERIFIER_TIMEOUT",
    "conformance.verifier_timeout": "VERIFIER_TIMEOUT",
    "cli.run.alpha": "ALPHA",
    "cli.run.seed": "SEED",
    "cli.audit.seed": "SEED",
    "plugin.settings.alpha": "ALPHA",
    "plugin.settings.seed": "SEED",
    "plugin.settings.num_samples": "CHECK_SAMPLES",
    "plugin.ini.alpha": "ALPHA",
    "plugin.ini.seed": "SEED",
    "plugin.ini.samples": "CHECK_SAMPLES",
    "runner.alpha": "ALPHA",
    "runner.power": "POWER",
    "runner.min_detectable_tv": "MIN_DETECTABLE_TV",
    "runner.seed": "SEED",
    "runner.sampler_max_samples": "SAMPLER_MAX_SAMPLES",
    "runner.EXACT_TOL": "EXACT_TOL",
    "runner.MULTI_TOL": "MULTI_TOL",
    "runner.BOUND_TOL": "BOUND_TOL",
    "runner.LP_TOL": "LP_TOL",
    "runner.LP_MAX_VARIABLES": "LP_CROSS_CHECK_MAX_VARIABLES",
    "conformance.alpha": "ALPHA",
    "conformance.num_samples": "CHECK_SAMPLES",
    "conformance.seed": "SEED",
    "real_lm.alpha": "ALPHA",
    "real_lm.power": "POWER",
    "statistical_audit.alpha": "ALPHA",
    "statistical_audit.power": "POWER",
    "statistical_audit.min_detectable_tv": "MIN_DETECTABLE_TV",
    "agreement.alpha": "ALPHA",
    "agreement.power": "POWER",
    "agreement.min_detectable_tv": "MIN_DETECTABLE_TV",
    "power.required_samples.alpha": "ALPHA",
    "power.required_samples.power": "POWER",
    "power.required_samples.min_detectable_tv": "MIN_DETECTABLE_TV",
    "acceptance.lp.max_variables": "LP_MAX_VARIABLES",
    "acceptance.lp_from_sets.max_variables": "LP_MAX_VARIABLES",
    "block_lp.tol": "LP_SOLVER_TOL",
    "block_lp.fallback_tol": "LP_SOLVER_FALLBACK_TOL",
    "exact.iteration.MAX_TUPLES": "EXACT_MAX_TUPLES",
    "exact.iteration.chunk_size": "EXACT_CHUNK",
    "exact.multi_iteration.MAX_HISTORIES": "EXACT_MAX_HISTORIES",
    "exact.tree.MAX_TREE_REALISATIONS": "EXACT_MAX_TREE_REALISATIONS",
    "exact.tree.MAX_TREE_STRINGS": "EXACT_MAX_TREE_STRINGS",
    "gof.MIN_EXPECTED": "MIN_EXPECTED",
    "statistical_audit.min_expected": "MIN_EXPECTED",
    "statistical_audit.max_cells": "PARTITION_MAX_CELLS",
    "statistical_audit.max_strata": "MAX_STRATA",
    "agreement.max_strata": "MAX_STRATA",
    "agreement.min_expected": "MIN_EXPECTED",
    "partition.max_cells": "PARTITION_MAX_CELLS",
    "planning.MAX_STRATIFIED_ENTRIES": "MAX_STRATIFIED_ENTRIES",
    "planning.MIN_PER_STRATUM": "MIN_PER_STRATUM",
    "planning.MAX_STRATIFIED_CELLS": "MAX_STRATIFIED_CELLS",
    "planning.block_efficiency_bound.max_strings": "PLAN_MAX_BOUND_STRINGS",
    "nulls.MAX_EXACT_OUTCOMES": "NULL_MAX_EXACT_OUTCOMES",
    "agreement.MAX_COVARIANCE_CELLS": "MAX_COVARIANCE_CELLS",
    "checks.FIRST_CHUNK": "FIRST_CHUNK",
    "engines.tree_audit.chunk_size": "ENGINE_TREE_CHUNK",
    "runner.PROBE_CALLS": "PROBE_CALLS",
    "runner.probe_rows": "PROBE_ROWS",
    "guard.probe_checks.rows": "PROBE_ROWS",
    "budget.PROBE_ROWS": "PROBE_ROWS",
    "budget.max_tuples": "EXACT_MAX_TUPLES",
    "budget.max_histories": "EXACT_MAX_HISTORIES",
    "budget.exact_chunk": "EXACT_CHUNK",
    "budget.max_cells": "PARTITION_MAX_CELLS",
    "budget.max_strata": "MAX_STRATA",
    "budget.min_expected": "MIN_EXPECTED",
    "suite.case_selection.num_drafts": "UNDECLARED_NUM_DRAFTS",
    "suite.case_selection.draft_len": "UNDECLARED_DRAFT_LEN",
}


@pytest.fixture(scope="module")
def probed() -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(SENTINELS)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sentinels_cover_every_default():
    assert set(SENTINELS) == set(defaults.__all__)
    assert all(SENTINELS[name] != getattr(defaults, name) for name in SENTINELS)


@pytest.mark.parametrize("face", sorted(EXPECTED))
def test_every_face_reads_its_default_from_the_defaults_module(probed, face):
    assert probed[face] == SENTINELS[EXPECTED[face]], (
        f"{face} = {probed[face]!r} does not follow spectr_audit.defaults.{EXPECTED[face]}: a literal copy?"
    )


def test_help_texts_quote_the_default(probed):
    assert probed["cli.run.alpha.help"] and probed["plugin.help.alpha"]


def test_the_defaults_module_imports_nothing():
    # The pytest plugin reads it at load, in every project that has spectr-audit installed.
    code = "import sys, spectr_audit.defaults; print(sorted(m for m in ('torch', 'scipy', 'numpy', 'cvxpy') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_values_are_the_documented_ones():
    # Hand-copied from the module's comments and the docs; changing a default is a deliberate act.
    assert (defaults.ALPHA, defaults.POWER, defaults.MIN_DETECTABLE_TV) == (1e-3, 0.99, 0.005)
    assert (defaults.EXACT_TOL, defaults.MULTI_TOL, defaults.BOUND_TOL, defaults.LP_TOL) == (1e-12, 1e-9, 1e-9, 1e-6)
    assert (defaults.CHECK_SAMPLES, defaults.SAMPLER_MAX_SAMPLES) == (20_000, 200_000)

    assert (defaults.EXACT_MAX_TUPLES, defaults.EXACT_MAX_HISTORIES, defaults.EXACT_CHUNK) == (2_000_000, 200_000, 8192)
    assert (defaults.PARTITION_MAX_CELLS, defaults.MAX_STRATA, defaults.MIN_EXPECTED) == (1 << 20, 4096, 5.0)
