"""The pytest plugin, tested with ``pytester`` in scratch projects that install nothing but spectr-audit.

Most runs are in-process (``runpytest``) with small sample budgets; two run in a subprocess:
the check that loading the plugin through its entry point imports no torch, scipy or cvxpy,
and (slow) the README's scratch project: its files and its commands, run as written.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from importlib.metadata import distributions
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

README = Path(__file__).resolve().parents[1] / "README.md"

# A third party's verifier: a plain function, no exact law (audited from samples), and a
# broken variant (on rejection it samples the target instead of the residual).
VERIFIERS = textwrap.dedent('''
    import torch

    def good_verify(draft_tokens, draft_probs, target_probs, generator):
        token = draft_tokens[:, 0, 0]
        draft, target = draft_probs[:, 0, 0].double(), target_probs[:, 0, 0].double()
        ratio = target.gather(1, token[:, None])[:, 0] / draft.gather(1, token[:, None])[:, 0]
        accept = torch.rand(token.shape, generator=generator, dtype=torch.float64) < ratio.clamp(max=1)
        residual = (target - draft).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target)
        correction = torch.multinomial(residual, 1, generator=generator)[:, 0]
        bonus = torch.multinomial(target_probs[:, 0, 1].double(), 1, generator=generator)[:, 0]
        return accept.long(), torch.zeros_like(token), torch.where(accept, bonus, correction)

    def bad_verify(draft_tokens, draft_probs, target_probs, generator):
        accepted, index, next_token = good_verify(draft_tokens, draft_probs, target_probs, generator)
        fresh = torch.multinomial(target_probs[:, 0, 0].double(), 1, generator=generator)[:, 0]
        return accepted, index, torch.where(accepted == 0, fresh, next_token)
''')

FAST = ("--spectr-samples", "2000", "-p", "no:cacheprovider")


@pytest.fixture(scope="module", autouse=True)
def _warm_imports():
    """Run every code path the in-process runs use once, here, before any of them.

    ``runpytest`` restores ``sys.modules`` after each in-process run, dropping the modules the
    run imported first; torch's and scipy's extension modules cannot be imported twice in one
    process (a second import crashes it).  Importing them here keeps them in the snapshot.
    """
    namespace: dict = {}
    exec(VERIFIERS, namespace)
    from spectr_audit.run.conformance import check_verifier
    from spectr_audit.reports.html import render_html
    from spectr_audit.reports.junit import render_junit
    from spectr_audit.reports.markdown import render_markdown

    from spectr_audit.run.suite import parse_suite

    one_case = parse_suite({"case": [{"name": "seed", "draft": [0.6, 0.4], "target": [0.3, 0.7], "num_drafts": 2}]})
    check_verifier(namespace["good_verify"], num_drafts=2, num_samples=500, suite=one_case)
    report = check_verifier("kseq", num_drafts=2, num_samples=500, suite=one_case).audit
    render_html(report), render_junit(report), render_markdown(report)


@pytest.fixture
def project(pytester):
    pytester.makepyfile(my_verifiers=VERIFIERS)
    pytester.syspathinsert()
    return pytester


def test_entry_point_is_registered(request):
    # pytest registers entry-point plugins under the entry point's name.
    import spectr_audit.plugin

    assert request.config.pluginmanager.get_plugin("spectr_audit") is spectr_audit.plugin
    declared = {(ep.name, ep.value) for dist in distributions() if dist.metadata["Name"] == "spectr-audit"
                for ep in dist.entry_points if ep.group == "pytest11"}
    assert ("spectr_audit", "spectr_audit.plugin") in declared


def test_loading_the_plugin_imports_no_torch_scipy_or_cvxpy(pytester):
    heavy = "('torch', 'scipy', 'cvxpy')"
    code = f"import spectr_audit.plugin, sys; bad = [m for m in {heavy} if m in sys.modules]; assert not bad, bad"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # The same through pytest itself: the plugin is loaded from its entry point, options parsed.
    pytester.makepyfile(f"""
        import sys

        def test_nothing_heavy_loaded(request):
            assert request.config.pluginmanager.has_plugin("spectr_audit")
            assert request.config.getoption("spectr_seed") == 3
            assert [m for m in {heavy} if m in sys.modules] == []
    """)
    result = pytester.runpytest_subprocess("--spectr-seed", "3", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_fixture_and_marker_audit_a_plain_function(project):
    project.makepyfile(test_scratch_mine="""
        import pytest
        from my_verifiers import good_verify

        def test_fixture(spectr_audit):
            report = spectr_audit.check(good_verify, num_drafts=1)
            assert report.passed and spectr_audit.num_samples == 2000

        @pytest.mark.spectr_audit(verifier=good_verify, num_drafts=1)
        def test_marker():
            pass

        @pytest.mark.spectr_audit(num_drafts=1)
        def test_marker_defaults(spectr_audit):
            spectr_audit.check(good_verify)
    """)
    result = project.runpytest(*FAST, "--junitxml=junit.xml", "--spectr-report=out/report.json")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([
        "*= spectr-audit =*",
        "seed 0, gate: none",
        # the cap, what the audits drew, and the level each ran at (alpha split over the check's 5 cases)
        "samples: at most 2000 per statistical audit's main design*; drawn: * per audit (n= below)",
        "alpha 0.001 per check, split over the check's statistical tests (Bonferroni): each audit ran at "
        "0.0002 = 0.001 / 5",
        # 2000 samples are far below the planned power: nothing rejected, so INCONCLUSIVE, with the TV estimate,
        # its interval and the minimum detectable TV reached against the planned one
        "INCONCLUSIVE good_verify on seed-spectr/K=1/L=1: tv>=0 (est *, <=*) mdtv=*/0.005 p=* acc=* [[]*] acc/alpha*=* "
        "block_eff=*  [[]test_scratch_mine.py::test_fixture]",
        "*[[]test_scratch_mine.py::test_marker]",
        "*[[]test_scratch_mine.py::test_marker_defaults]",
        "spectr-audit report: *report.json",
    ])
    report = json.loads((project.path / "out" / "report.json").read_text())
    assert report["suite"] == "pytest" and len(report["results"]) == 15
    assert all(r["passed"] and r["metrics"]["pvalue"] > 0.001 for r in report["results"])
    cases = ET.parse(project.path / "junit.xml").getroot().iter("testcase")
    props = {p.get("name"): p.get("value") for c in cases if c.get("name") == "test_fixture"
             for p in c.iter("property")}
    assert props["spectr_audit.good_verify.seed-spectr/K=1/L=1.passed"] == "True"
    assert float(props["spectr_audit.good_verify.seed-spectr/K=1/L=1.pvalue"]) > 0.001


def test_a_broken_verifier_fails_its_test_naming_case_and_cells(project):
    project.makepyfile(test_scratch_mine="""
        import pytest
        from my_verifiers import bad_verify

        def test_fixture(spectr_audit):
            spectr_audit.check(bad_verify, num_drafts=1)

        @pytest.mark.spectr_audit(verifier=bad_verify, num_drafts=1)
        def test_marker():
            pass
    """)
    result = project.runpytest(*FAST)
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "E *ConformanceFailure: check_verifier(bad_verify): 5 of 20 checks failed (0 of the contract's 5; 5 in the fidelity audits of 5 of 5 cases)",
        "E *fidelity on case 'seed-spectr/K=1/L=1':",
        "E *check statistical failed: value *, threshold 0.0002 *",
        "E *worst cells (observed vs expected count): *",
        "FINDING      bad_verify on seed-spectr/K=1/L=1: *[[]test_scratch_mine.py::test_fixture]",
        "FINDING      bad_verify on seed-spectr/K=1/L=1: *[[]test_scratch_mine.py::test_marker]",
    ])


def test_the_marker_leaves_a_failing_body_alone(project):
    project.makepyfile(test_scratch_mine="""
        import pytest
        from my_verifiers import good_verify

        @pytest.mark.spectr_audit(verifier=good_verify, num_drafts=1)
        def test_marker():
            assert 1 == 2, "the body's own failure"
    """)
    result = project.runpytest(*FAST)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the body's own failure*"])
    assert "spectr-audit =" not in result.stdout.str()  # no audit ran


def test_gate_option_fails_the_test_that_breaks_it(pytester):
    pytester.makepyfile(test_scratch_gate="""
        def test_kseq(spectr_audit):
            spectr_audit.check("kseq", num_drafts=2)

        def test_speculative(spectr_audit):
            spectr_audit.check("speculative", num_drafts=1)
    """)
    result = pytester.runpytest(*FAST, "--spectr-fail-under-acceptance-ratio", "0.95", "--spectr-max-tv", "1e-9")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "E *spectr-audit gate failed: 1 violation(s) of acceptance_ratio >= 0.95, tv_distance <= 1e-09",
        "E *kseq on seed-spectr/K=2/L=1: acceptance_ratio = 0.9077 breaks acceptance_ratio >= 0.95"
        "  [[]--spectr-fail-under-acceptance-ratio 0.95]",
        "GATE         kseq on seed-spectr/K=2/L=1: *",
    ])


def test_a_gate_no_audit_measured_fails_the_session(pytester):
    pytester.makepyfile(test_scratch_gate="""
        def test_exact(spectr_audit):
            spectr_audit.check("kseq", num_drafts=1)
    """)
    result = pytester.runpytest(*FAST, "--spectr-gate", "block_lp_repair_optimum>=1")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["GATE     --spectr-gate block_lp_repair_optimum>=1: no audit of this session "
                                 "measured 'block_lp_repair_optimum'*"])


@pytest.mark.parametrize("argv,message", [
    (("--spectr-max-tv", "x"), "*argument --spectr-max-tv: expected a number, got 'x'"),
    (("--spectr-gate", "tv<=1"), "*argument --spectr-gate: unknown metric 'tv'*"),
    (("--spectr-alpha", "2"), "*argument --spectr-alpha: --spectr-alpha: expected a number in (0, 1), got '2'"),
    (("--spectr-samples", "10"), "*argument --spectr-samples/--spectr-max-samples: * expected an integer >= 100, got '10'"),
    (("--spectr-max-seconds", "0"), "*argument --spectr-max-seconds: * expected a positive number of seconds, got '0'"),
    (("--spectr-certify-tv", "1.5"), "*argument --spectr-certify-tv: * expected a number in (0, 1), got '1.5'"),
])
def test_bad_options_are_usage_errors_when_arguments_are_parsed(pytester, argv, message):
    pytester.makepyfile("def test_never_run(): raise AssertionError('collected')")
    result = pytester.runpytest(*argv)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_ini_keys_and_command_line_precedence(pytester):
    pytester.makeini("""
        [pytest]
        spectr_audit_seed = 7
        spectr_audit_samples = 500
        spectr_audit_alpha = 0.01
        spectr_audit_report = reports/session.md
        spectr_audit_gate =
            tv_distance <= 1e-9
            acceptance_ratio>=50%
    """)
    pytester.makepyfile(test_scratch_ini="""
        def test_settings(spectr_audit, request):
            assert (spectr_audit.seed, spectr_audit.num_samples, spectr_audit.alpha) == (11, 500, 0.01)
            assert [str(t) for t in spectr_audit.thresholds] == [
                "tv_distance <= 1e-09", "acceptance_ratio >= 0.5"]
            assert spectr_audit.options().seed == 11
            assert spectr_audit.generator().initial_seed() == 11
            report = spectr_audit.audit("kseq", suite="seed.toml")
            spectr_audit.assert_passed(report)
    """)
    pytester.path.joinpath("seed.toml").write_text(
        '[[case]]\nname = "seed-spectr"\ndraft = [0.6, 0.4]\ntarget = [0.3, 0.7]\nnum_drafts = [1, 2]\n'
        'checks = ["exact", "optimality"]\n')
    result = pytester.runpytest("--spectr-seed", "11", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    markdown = (pytester.path / "reports" / "session.md").read_text()
    assert "| kseq | seed-spectr/K=2 | exact |" in markdown


@pytest.mark.parametrize("ini,message", [
    ("spectr_audit_gate = acceptance_ratio=>1", "ini option spectr_audit_gate: expected 'METRIC OP NUMBER'*"),
    ("spectr_audit_seed = -1", "ini option spectr_audit_seed: expected an integer >= 0, got '-1'"),
])
def test_bad_ini_values_are_usage_errors(pytester, ini, message):
    pytester.makeini(f"[pytest]\n{ini}\n")
    pytester.makepyfile("def test_never_run(): raise AssertionError('collected')")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}"])


def test_marker_with_an_unknown_argument_errors_the_test(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.mark.spectr_audit(verifier="kseq", num_draft=2)
        def test_typo():
            pass
    """)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*InvalidArgument: @pytest.mark.spectr_audit on test_*.py::test_typo: "
                                 "unknown argument(s) num_draft*"])


def test_the_marker_is_registered(pytester):
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.spectr_audit(verifier=None, *"])


def _readme_files() -> dict:
    files = {}
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.S):
        first = block.splitlines()[0]
        if first.startswith("# ") and first[2:].endswith(".py"):
            files[first[2:]] = block
    return files


@pytest.mark.slow
def test_readme_scratch_project_through_the_plugin_and_the_cli_gate(pytester):
    """The README's own verifier and tests, run with the README's commands."""
    files = _readme_files()
    assert set(files) == {"my_verifier.py", "test_my_verifier.py"}
    for name, text in files.items():
        pytester.path.joinpath(name).write_text(text)
    result = pytester.runpytest_subprocess("--spectr-samples", "3000", "--junitxml=pytest-junit.xml",
                                           "--spectr-report=spectr-audit-report/pytest.html")
    result.assert_outcomes(passed=3)
    assert (pytester.path / "spectr-audit-report" / "pytest.html").read_text().startswith("<!DOCTYPE html>")
    gate = next(line for line in README.read_text().splitlines()
                if line.startswith("spectr-audit run --verifier my_verifier.py:MyVerifier"))
    proc = subprocess.run([sys.executable, "-m", "spectr_audit.cli", *gate.split()[1:]], cwd=pytester.path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gate held -> PASS" in proc.stdout
    junit = ET.parse(pytester.path / "spectr-audit-report" / "junit.xml").getroot().find("testsuite")
    assert junit.get("failures") == "0" and int(junit.get("tests")) >= 5
    # The same gate fails (exit 1) for a verifier that breaks it: K-SEQ reaches 0.9077 alpha* here.
    pytester.path.joinpath("seed.toml").write_text(
        '[[case]]\nname = "seed"\ndraft = [0.6, 0.4]\ntarget = [0.3, 0.7]\nnum_drafts = 2\n')
    proc = subprocess.run([sys.executable, "-m", "spectr_audit.cli", "run", "--verifier", "kseq", "--suite", "seed.toml",
                           "--out", "gate-fail", "--fail-under-acceptance-ratio", "0.99", "--progress", "none"],
                          cwd=pytester.path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    assert "gate failed" in proc.stderr and "kseq on seed: acceptance_ratio = 0.9077 breaks" in proc.stderr


def test_fail_on_inconclusive_fails_an_underpowered_check_and_certify_passes_a_cheap_certificate(project):
    project.makepyfile(test_scratch_power="""
        from spectr_audit.run.suite import parse_suite
        from my_verifiers import good_verify

        ONE = parse_suite({"case": [{"name": "seed", "draft": [0.6, 0.4], "target": [0.3, 0.7], "num_drafts": 1}]})

        def test_check(spectr_audit):
            spectr_audit.check(good_verify, num_drafts=1, suite=ONE)
    """)
    # 2000 samples: nothing rejected, below the planned power -> the test fails with the reason
    result = project.runpytest(*FAST, "--spectr-fail-on-inconclusive")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*INCONCLUSIVE: good_verify on seed: *: INCONCLUSIVE: exactness not rejected*"
                                 "above the 0.005 planned*"])
    # certifying TV <= 0.1 on V = 2 takes a few thousand samples: CERTIFIED within the budget
    result = project.runpytest("--spectr-samples", "50000", "-p", "no:cacheprovider", "--spectr-certify-tv", "0.1")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*certify TV <= 0.1*", "CERTIFIED    good_verify on seed: tv>=0 (est *, <=*)*"])
    # a budget too small for the certificate: not certified, and certifying fails on that
    result = project.runpytest("--spectr-samples", "200", "-p", "no:cacheprovider", "--spectr-certify-tv", "0.01")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*INCONCLUSIVE: good_verify on seed: uncertified*"])


def test_xdist_workers_send_their_audits_to_the_controller(project, tmp_path):
    pytest.importorskip("xdist")
    project.makepyfile(test_scratch_xdist="""
        import pytest
        from spectr_audit.run.suite import parse_suite
        from my_verifiers import bad_verify

        ONE = parse_suite({"case": [{"name": "seed", "draft": [0.6, 0.4], "target": [0.3, 0.7], "num_drafts": 2}]})

        @pytest.mark.parametrize("k", [1, 2])
        def test_exact(spectr_audit, k):
            spectr_audit.check("kseq", num_drafts=k, suite=ONE if k == 2 else None)

        def test_broken(spectr_audit):
            spectr_audit.check(bad_verify, num_drafts=1, suite=parse_suite(
                {"case": [{"name": "bad", "draft": [0.6, 0.4], "target": [0.3, 0.7], "num_drafts": 1}]}))
    """)
    report = tmp_path / "report.json"
    result = project.runpytest_subprocess(*FAST, "-n", "2", f"--spectr-report={report}",
                                          "--spectr-gate", "block_lp_repair_optimum>=1")
    result.assert_outcomes(passed=2, failed=1)
    # the controller's summary lists the audits of both workers, and the report holds them all
    result.stdout.fnmatch_lines(["*= spectr-audit =*", "*FINDING      bad_verify on bad: *[[]test_scratch_xdist.py::test_broken]"])
    lines = [line for line in result.stdout.lines if "[test_scratch_xdist.py::" in line]
    nodeids = {re.search(r"\[(test_scratch_xdist\.py::\S+)\]$", line).group(1) for line in lines}
    assert nodeids == {"test_scratch_xdist.py::test_exact[1]", "test_scratch_xdist.py::test_exact[2]",
                       "test_scratch_xdist.py::test_broken"}
    data = json.loads(report.read_text())
    num_kseq_cases = sum(1 for line in lines if "test_exact[" in line)
    assert len(data["results"]) == len(lines) == num_kseq_cases + 1 >= 6
    # the session gate saw every worker's audits: no audit measured the metric, so it fails on the controller
    result.stdout.fnmatch_lines(["GATE     --spectr-gate block_lp_repair_optimum>=1: no audit of this session*"])


def test_spectr_num_drafts_and_draft_len_narrow_the_sessions_audits(project):
    project.makepyfile(test_shapes="""
        from my_verifiers import good_verify

        def test_suite(spectr_audit):
            report = spectr_audit.audit(good_verify, suite="default")
            assert {(r.metrics["num_drafts"], r.metrics["draft_len"]) for r in report.results} == {(2, 2)}

        def test_check(spectr_audit):
            report = spectr_audit.check(good_verify)
            assert {r.case.split("/", 1)[1] for r in report.audit.results} == {"K=2/L=2"}

        def test_a_bare_function_without_selection(spectr_audit):
            spectr_audit.num_drafts = spectr_audit.draft_len = None
            report = spectr_audit.audit(good_verify, suite="default")
            assert {(r.metrics["num_drafts"], r.metrics["draft_len"]) for r in report.results} == {(1, 1)}
    """)
    result = project.runpytest(*FAST, "--spectr-num-drafts", "2", "--spectr-draft-len", "2")
    result.assert_outcomes(passed=3)
    result = project.runpytest(*FAST, "--spectr-draft-len", "0")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*--spectr-draft-len*expected positive integers or ranges*"])
