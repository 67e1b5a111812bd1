"""Sampling parameters through the faces: suite TOML, the runner, the CLI, the registry, check_verifier.

Every verdict here is deterministic: the verifiers have exact laws, the exact audit enumerates the
drafts of a context-free case (V = 6, fixed draft and target logits, docs/sampling.md) and each TV
is recomputed by the independent plain-Python oracle (:mod:`tests.oracles.sampling`).  A slip is
flagged when its TV is positive; the correct logits verifier and the probability rule handed the
processed laws are exact.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from spectr_audit.cli import main
from spectr_audit.contract.logits import LogitsVerifier
from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.errors import InvalidArgument
from spectr_audit.registry import describe, entries, find, load_verifier
from spectr_audit.run.runner import audit_case, run_suite
from spectr_audit.run.suite import load_suite, parse_suite, with_sampling
from spectr_audit.verifiers.library.sampling_bugs import load_sampling_bug, sampling_bug_names

from tests.oracles import sampling as oracle

pytestmark = pytest.mark.usefixtures("single_thread")

DRAFT_LOGITS = [1.2, 0.3, -0.5, 0.9, -1.4, 0.1]
TARGET_LOGITS = [0.2, 1.1, 0.4, -0.8, 0.6, -0.3]
LOGITS_ARGS = ["--logits", "--draft=" + ",".join(map(str, DRAFT_LOGITS)), "--target=" + ",".join(map(str, TARGET_LOGITS))]

#: (slip, setting): a wrong side, a wrong order, a skipped bonus, a skipped residual, an unrenormalised top-p.
FLAGGED = [
    ("params-draft-only", dict(temperature=0.6)),
    ("params-target-only", dict(top_k=3)),
    ("top-p-before-temperature", dict(temperature=0.6, top_p=0.8)),
    ("bonus-unprocessed", dict(top_p=0.8)),
    ("residual-unprocessed", dict(temperature=0.0)),
    ("top-p-unrenormalised-target", dict(top_p=0.8)),
]


def _case(setting: dict, draft_len: int = 1, **extra):
    raw = {"name": "c", "inputs": "logits", "draft": DRAFT_LOGITS, "target": TARGET_LOGITS, "num_drafts": 1,
           "draft_len": draft_len, "checks": ["exact", "optimality"], **setting, **extra}
    return parse_suite({"case": [raw]}).cases[0]


# -- the suite format ----------------------------------------------------------------------------


def test_suite_sampling_keys_and_expansion():
    suite = parse_suite({"case": [{"name": "grid", "inputs": "logits", "draft": DRAFT_LOGITS, "target": TARGET_LOGITS,
                                   "num_drafts": 1, "temperature": [0.5, 1.5], "top_k": [2, 3], "top_p": 0.9,
                                   "order": "sglang"}]})
    assert [c.name for c in suite.cases] == ["grid/temperature=0.5/top_k=2", "grid/temperature=0.5/top_k=3",
                                             "grid/temperature=1.5/top_k=2", "grid/temperature=1.5/top_k=3"]
    first = suite.cases[0]
    assert first.params == SamplingParams(temperature=0.5, top_k=2, top_p=0.9)
    assert (first.order, first.inputs) == ("sglang", "logits")
    # the raw logits are kept as given (-inf allowed), the law is their softmax
    assert first.draft_model.raw_logits.tolist() == DRAFT_LOGITS
    plain = parse_suite({"case": [{"name": "p", "draft": [0.6, 0.4], "target": [0.3, 0.7], "num_drafts": 1}]}).cases[0]
    assert plain.params is None and plain.sampling is None and plain.laws() is plain


def test_case_laws_are_the_processed_laws():
    case = _case(dict(top_k=2))
    laws = case.laws()
    # top-k 2 keeps the two largest logits, 1.2 (token 0) and 0.9 (token 3): softmax over them
    expected = torch.tensor([1.2, 0.9], dtype=torch.float64).softmax(0)
    assert laws.draft_model.probs[[0, 3]].tolist() == pytest.approx(expected.tolist(), abs=1e-15)
    assert float(laws.draft_model.probs.sum()) == pytest.approx(1.0) and laws.params is None


@pytest.mark.parametrize("raw, message", [
    ({"top_p": 0.0}, "top_p: must lie in"),
    ({"temperature": -1.0}, "temperature: must be finite and >= 0"),
    ({"top_k": 1.5}, "top_k: expected an integer"),
    ({"order": "no-such-engine"}, "unknown processing order"),
    ({"inputs": "scores"}, "inputs: expected one of"),
    ({"min_p": [0.1, True]}, "min_p: expected a number"),
])
def test_suite_sampling_errors_name_the_key(raw, message):
    case = {"name": "bad", "draft": [0.6, 0.4], "target": [0.3, 0.7], "num_drafts": 1, **raw}
    with pytest.raises(InvalidArgument, match=message) as info:
        parse_suite({"case": [case]}, source="s.toml")
    assert "s.toml case[0] ('bad')" in str(info.value)


def test_tree_cases_refuse_sampling_parameters():
    case = {"name": "t", "draft": [0.5, 0.3, 0.2], "target": [0.2, 0.3, 0.5], "tree": "paths:[[0],[1]]",
            "temperature": 0.5}
    with pytest.raises(InvalidArgument, match="sampling parameters are for chain cases"):
        parse_suite({"case": [case]})


def test_with_sampling_and_overrides():
    suite = parse_suite({"case": [{"name": "p", "draft": [0.6, 0.4], "target": [0.3, 0.7], "num_drafts": 1}]})
    changed = with_sampling(suite, SamplingParams(temperature=0.5), "transformers")
    assert changed.cases[0].params == SamplingParams(temperature=0.5) and changed.cases[0].order == "transformers"
    overridden = parse_suite({"case": [{"name": "p", "draft": [1.0, 0.0], "target": [0.0, 1.0], "num_drafts": 1,
                                        "temperature": 2.0}]}, sampling={"temperature": 0.5, "inputs": "logits"})
    assert overridden.cases[0].params == SamplingParams(temperature=0.5) and overridden.cases[0].inputs == "logits"
    with pytest.raises(InvalidArgument, match="one setting for all its rows"):
        with_sampling(suite, SamplingParams(temperature=[0.5, 1.0]))


# -- the runner: slips flagged with the oracle's TV ----------------------------------------------


@pytest.mark.parametrize("draft_len", [1, 2])
@pytest.mark.parametrize("bug, setting", FLAGGED, ids=[b for b, _ in FLAGGED])
def test_runner_flags_each_slip_with_its_tv(bug, setting, draft_len):
    result = audit_case(load_verifier(bug), _case(setting, draft_len))
    expected = oracle.bug_tv(bug, DRAFT_LOGITS, TARGET_LOGITS, setting, draft_len)
    assert result.error is None
    assert result.verdict == "FINDING" and result.as_expected  # declared inexact, flagged
    assert result.metrics["tv_distance"] == pytest.approx(expected, abs=1e-12)
    assert expected > 1e-3
    assert result.details["sampling"]["verifier_takes_logits"] is True
    assert result.metrics["sampling"].endswith("vllm order")


@pytest.mark.parametrize("setting", [dict(temperature=0.6), dict(top_k=3), dict(top_p=0.8), dict(temperature=0.0),
                                     dict(temperature=0.8, min_p=0.2)])
def test_runner_correct_rules_are_exact(setting):
    for name in ("logits-speculative", "speculative"):
        result = audit_case(load_verifier(name), _case(setting, 2))
        assert result.verdict == "exact", (name, result.failed_checks)
        assert result.metrics["tv_distance"] < 1e-12
        # "optimal": acceptance equals alpha* of the processed laws
        assert result.metrics["acceptance"] == pytest.approx(result.metrics["optimal_acceptance"], abs=1e-9)
        assert result.metrics["temperature"] == setting.get("temperature", 1.0)


def test_runner_bounds_are_those_of_the_processed_laws():
    """alpha* with top-k 2 keeps tokens {0, 3} on the draft side and {1, 4} on the target side: disjoint,
    so alpha* = 0 (the raw laws overlap: their alpha* is positive)."""
    result = audit_case(load_verifier("speculative"), _case(dict(top_k=2)))
    assert result.metrics["optimal_acceptance"] == 0.0
    raw = audit_case(load_verifier("speculative"), parse_suite({"case": [{
        "name": "raw", "inputs": "logits", "draft": DRAFT_LOGITS, "target": TARGET_LOGITS, "num_drafts": 1,
        "checks": ["optimality"]}]}).cases[0])
    assert raw.metrics["optimal_acceptance"] > 0.3


def test_multi_iteration_audit_with_parameters():
    """The exact multi-iteration audit hands a logits verifier the raw logits at every history."""
    from spectr_audit.drafting.models import random_markov
    from spectr_audit.exact.multi_iteration import exact_multi_iteration

    draft, target = random_markov(3, 1, seed=1), random_markov(3, 1, seed=2)
    params = SamplingParams(temperature=0.6, top_k=2)
    control = exact_multi_iteration(load_verifier("logits-speculative"), draft, target, 1, 2, 4, params=params)
    slip = exact_multi_iteration(load_verifier("params-draft-only"), draft, target, 1, 2, 4, params=params)
    assert control.tv_distance < 1e-12 and slip.tv_distance > 0.1


def test_builtin_sampling_suite_flags_every_slip():
    """suites/sampling.toml (its L = 1 cases): every slip flagged where listed, the correct rules exact."""
    suite = load_suite("sampling")
    suite = dataclasses.replace(suite, cases=tuple(c for c in suite.cases if c.draft_len == 1))
    report = run_suite(suite)
    assert report.passed, [(r.verifier, r.case, r.verdict) for r in report.results if not r.as_expected]
    verdicts = {(r.verifier, r.verdict) for r in report.results}
    assert {name for name, verdict in verdicts if verdict == "FINDING"} == set(sampling_bug_names())
    assert {name for name, verdict in verdicts if verdict == "exact"} == {"logits-speculative", "speculative"}
    assert all("sampling" in r.details for r in report.results)


def test_reports_name_the_parameters():
    from spectr_audit.reports.html import render_html
    from spectr_audit.reports.junit import render_junit
    from spectr_audit.reports.markdown import render_markdown
    from spectr_audit.results import AuditReport

    result = audit_case(load_verifier("bonus-unprocessed"), _case(dict(temperature=0.6, top_k=3)))
    report = AuditReport(results=(result,), suite="s")
    assert "| c | temperature 0.6, top_k 3 | vllm | logits | bonus-unprocessed |" in render_markdown(report)
    assert "temperature 0.6, top_k 3" in render_html(report, figures=False)
    junit = render_junit(report)
    assert 'name="sampling" value="temperature=0.6, top_k=3; vllm order"' in junit
    assert 'name="top_k" value="3"' in junit
    assert AuditReport.to_dict(report)["results"][0]["details"]["sampling"]["params"] == {"temperature": 0.6, "top_k": 3}


# -- the CLI -------------------------------------------------------------------------------------


def _cli_json(capsys, argv):
    code = main(argv + ["--json"])
    return code, json.loads(capsys.readouterr().out)["results"][0]


@pytest.mark.parametrize("bug, setting", FLAGGED, ids=[b for b, _ in FLAGGED])
def test_cli_audit_flags_each_slip_with_its_tv(capsys, bug, setting):
    flags = []
    for key, value in setting.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    code, result = _cli_json(capsys, ["audit", "--verifier", bug, "--num-drafts", "1", "--draft-len", "2", *LOGITS_ARGS,
                                      *flags])
    assert code == 0  # declared inexact and flagged: as expected
    assert result["verdict"] == "FINDING"
    assert result["metrics"]["tv_distance"] == pytest.approx(oracle.bug_tv(bug, DRAFT_LOGITS, TARGET_LOGITS, setting, 2),
                                                             abs=1e-12)


def test_cli_audit_control_and_probability_specs(capsys):
    code, result = _cli_json(capsys, ["audit", "--verifier", "logits-speculative", "--num-drafts", "1", *LOGITS_ARGS,
                                      "--temperature", "0.6", "--top-p", "0.8", "--order", "transformers"])
    assert code == 0 and result["verdict"] == "exact"
    assert result["metrics"]["sampling"] == "temperature=0.6, top_p=0.8; transformers order"
    # without --logits the lists are probabilities (their logs stand for the logits)
    code, result = _cli_json(capsys, ["audit", "--verifier", "params-draft-only", "--num-drafts", "1",
                                      "--draft", "0.5,0.3,0.2", "--target", "0.2,0.3,0.5", "--temperature", "0.5"])
    assert code == 0 and result["verdict"] == "FINDING" and result["details"]["sampling"]["inputs"] == "probs"


@pytest.mark.parametrize("flag, value, message", [
    ("--top-p", "0", "expected a number in (0, 1]"),
    ("--temperature", "-1", "expected a finite temperature >= 0"),
    ("--top-k", "2.5", "expected an integer >= 0"),
    ("--min-p", "1.5", "expected a number in [0, 1]"),
])
def test_cli_bad_sampling_values(capsys, flag, value, message):
    with pytest.raises(SystemExit) as info:
        main(["audit", "--verifier", "speculative", "--num-drafts", "1", "--draft", "0.5,0.5", "--target", "0.5,0.5",
              flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and message in err


def test_cli_run_overrides_the_suite(tmp_path, capsys):
    suite = tmp_path / "s.toml"
    suite.write_text('[[case]]\nname = "c"\ndraft = [1.2, 0.3, -0.5, 0.9, -1.4, 0.1]\n'
                     'target = [0.2, 1.1, 0.4, -0.8, 0.6, -0.3]\nnum_drafts = 1\ninputs = "logits"\n'
                     'checks = ["exact"]\nverifiers = ["params-draft-only", "logits-speculative"]\n')
    code = main(["run", "--suite", str(suite), "--out", str(tmp_path / "out"), "--json", "--progress", "none",
                 "--temperature", "0.6"])
    results = json.loads(capsys.readouterr().out)["results"]
    assert code == 0
    by_name = {r["verifier"]: r for r in results}
    assert by_name["logits-speculative"]["verdict"] == "exact"
    assert by_name["params-draft-only"]["metrics"]["tv_distance"] == pytest.approx(
        oracle.bug_tv("params-draft-only", DRAFT_LOGITS, TARGET_LOGITS, dict(temperature=0.6), 1), abs=1e-12)
    # without the override the parameters are neutral and the slip is invisible: a declared-inexact verifier
    # that passes is not as expected (exit 1)
    assert main(["run", "--suite", str(suite), "--out", str(tmp_path / "out2"), "--progress", "none"]) == 1


def test_cli_list_shows_which_take_logits(capsys):
    assert main(["list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["verifiers"] if "error" not in r}
    assert rows["logits-speculative"]["takes_logits"] and rows["params-draft-only"]["namespace"] == "sampling-bugs"
    assert rows["kseq"]["takes_logits"] is False
    assert main(["list"]) == 0
    text = capsys.readouterr().out
    assert "sampling-bugs:" in text and "takes logits and sampling parameters" in text


# -- the registry and check_verifier -------------------------------------------------------------


def test_registry_namespace_and_routing():
    names = [e.name for e in entries("sampling-bugs")]
    assert names == ["logits-speculative"] + sampling_bug_names()
    assert describe(find("sampling-bugs:top-p-before-temperature"))["takes_logits"] is True

    class EngineStyle:
        """An engine's own object: verify_logits only, no Verifier base."""

        name = "engine-style"
        max_drafts = 1

        def verify_logits(self, draft_tokens, draft_logits, target_logits, params, generator):
            return load_sampling_bug("bonus-unprocessed").verify_logits(draft_tokens, draft_logits, target_logits,
                                                                        params, generator)

    verifier = load_verifier(EngineStyle())
    assert isinstance(verifier, LogitsVerifier) and verifier.takes_logits and verifier.name == "engine-style"


def test_check_verifier_runs_logits_verifiers_at_three_settings():
    from spectr_audit.run.conformance import LOGITS_CHECK_SETTINGS, check_verifier

    report = check_verifier("logits-speculative", num_drafts=1)
    settings = {r.metrics["sampling"] for r in report.audit.results}
    assert len(settings) == len(LOGITS_CHECK_SETTINGS) >= 3
    assert any(r.metrics.get("temperature", 1.0) < 1 for r in report.audit.results)
    assert any(r.metrics.get("top_k", 0) > 0 for r in report.audit.results)
    assert any(r.metrics.get("top_p", 1.0) < 1 for r in report.audit.results)


def test_check_verifier_flags_a_plain_logits_function():
    """A plain function declared to take logits (fn.takes_logits = True) with a residual slip fails the check."""
    from spectr_audit.run.conformance import ConformanceFailure, check_verifier

    slip = load_sampling_bug("residual-unprocessed")

    def verify(draft_tokens, draft_logits, target_logits, params, generator):
        return slip.verify_logits(draft_tokens, draft_logits, target_logits, params, generator)

    def law(draft_tokens, draft_logits, target_logits, params):
        return slip.output_probs_logits(draft_tokens, draft_logits, target_logits, params)

    verify.takes_logits = True
    with pytest.raises(ConformanceFailure, match="residual|exact"):
        check_verifier(verify, output_probs=law, num_drafts=1, params=SamplingParams(temperature=0.6), num_samples=2000)
    # neutral parameters hide the slip
    assert check_verifier(verify, output_probs=law, num_drafts=1, params=SamplingParams(), num_samples=2000).passed


def test_the_runners_black_box_stage_equals_the_statistical_audit_with_parameters():
    """The runner binds the sampling parameters once (its request's binding, shared by every stage); its black-box
    stage gives what the public statistical audit gives when it is handed the raw models and the parameters, and
    a slip under temperature is still found there."""
    from spectr_audit.contract.convert import as_verifier
    from spectr_audit.run.options import AuditOptions
    from spectr_audit.statistical.audit import statistical_audit

    for name in ("logits-speculative", "residual-unprocessed"):
        source = load_verifier(name) if name != "residual-unprocessed" else load_sampling_bug(name)

        def verify(draft_tokens, draft_logits, target_logits, params, generator, _v=source):
            return _v.verify_logits(draft_tokens, draft_logits, target_logits, params, generator)

        verify.takes_logits = True  # no law: only the black-box stage can judge it
        case = _case(dict(temperature=0.6), 1, checks=["statistical"])
        options = AuditOptions(max_samples=4_000, seed=3)
        result = audit_case(as_verifier(verify), case, options)
        assert result.error is None and "pvalue" in result.metrics
        direct = statistical_audit(verify, case.draft_model, case.target_model, case.num_drafts, case.draft_len,
                                   prefix=case.prefix, alpha=options.alpha, min_detectable_tv=options.min_detectable_tv,
                                   power=options.power, max_samples=result.metrics["num_samples"], seed=options.seed,
                                   params=case.params, order=case.order)  # the probe spent part of the budget
        assert result.metrics["pvalue"] == direct.pvalue and result.metrics["num_samples"] == direct.num_samples
        assert result.metrics["acceptance"] == direct.acceptance
        assert (result.verdict == "FINDING") == (name == "residual-unprocessed")
