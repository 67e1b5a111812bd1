"""The pytest plugin's generation audits: the ``spectr_generation`` fixture (and ``spectr_audit.check_generation``),
tested with ``pytester`` in scratch projects, like tests/test_plugin.py."""

from __future__ import annotations

import json
import textwrap
import xml.etree.ElementTree as ET

import pytest

pytest_plugins = ["pytester"]

# An engine author's module: the correct toy loop, and the same loop with a planted slip.
ENGINES = textwrap.dedent('''
    from spectr_audit.generation.library import ToyPair, correct_engine, slip_engine

    PAIR = ToyPair(vocab_size=12, seed=0)
    PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2, 2]]
    good = correct_engine(PAIR)
    bad = slip_engine("shared-stream", PAIR)
    score = PAIR.scorer()
''')

FAST = ("-p", "no:cacheprovider")


@pytest.fixture(scope="module", autouse=True)
def _warm_imports():
    """Import (and run once) what the in-process runs use: ``runpytest`` drops the modules a run imported
    first, and torch's extension modules cannot be imported twice in one process (tests/test_plugin.py)."""
    namespace: dict = {}
    exec(ENGINES, namespace)
    from spectr_audit.generation.checks import check_generation

    check_generation(namespace["good"], namespace["score"], namespace["PROMPTS"][:1], vocab_size=12, max_new_tokens=4,
                     arms=["single"])


@pytest.fixture
def project(pytester):
    pytester.makepyfile(my_engines=ENGINES)
    pytester.syspathinsert()
    return pytester


def test_the_fixture_passes_a_correct_engine_and_fails_a_slip(project):
    project.makepyfile(test_scratch_engine="""
        from my_engines import PROMPTS, bad, good, score

        def test_good(spectr_generation):
            result = spectr_generation(good, score, PROMPTS, vocab_size=12, max_new_tokens=12, min_detectable_tv=0.5)
            assert result.verdict == "PASS" and spectr_generation.seed == 0

        def test_bad(spectr_generation):
            spectr_generation(bad, score, PROMPTS, vocab_size=12, max_new_tokens=12)

        def test_on_the_verifier_fixture(spectr_audit):
            spectr_audit.check_generation(bad, score, PROMPTS, vocab_size=12, max_new_tokens=12)
    """)
    result = project.runpytest(*FAST, "--junitxml=junit.xml", "--spectr-report=out/report.json")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines([
        "E *AssertionError: spectr-audit generation audit: FINDING: shared-stream against toy target: test "
        "'independence / within a batch', p = * (alpha 0.001); * tokens in * jobs",
        "E *rejected: independence / within a batch: p = *",
        "*= spectr-audit =*",
        "generation audits (seed 0 unless a test set its own):",
        "PASS         toy speculative against toy target: test * p=* (alpha 0.001) n=* tokens mdtv=*/0.5 tv>=*  "
        "[[]test_scratch_engine.py::test_good]",
        "FINDING      shared-stream against toy target: test 'independence / within a batch' p=* "
        "[[]test_scratch_engine.py::test_bad]",
        "FINDING      shared-stream against toy target: *[[]test_scratch_engine.py::test_on_the_verifier_fixture]",
        "generation verdicts: 2 FINDING, 1 PASS",
        "spectr-audit generation report: *report.generation.json",
    ])
    # the failure is shown from the test's line, not from the plugin's source
    assert "spectr_audit/plugin.py" not in result.stdout.str()
    saved = json.loads((project.path / "out" / "report.generation.json").read_text())
    assert [r["verdict"] for r in saved["results"]] == ["PASS", "FINDING", "FINDING"]
    assert saved["results"][1]["nodeid"] == "test_scratch_engine.py::test_bad"
    cases = ET.parse(project.path / "junit.xml").getroot().iter("testcase")
    props = {p.get("name"): p.get("value") for c in cases if c.get("name") == "test_good" for p in c.iter("property")}
    assert props["spectr_generation.toy speculative.verdict"] == "PASS"
    assert int(props["spectr_generation.toy speculative.num_tokens"]) > 0


def test_inconclusive_fails_only_with_the_option(project):
    project.makepyfile(test_scratch_power="""
        from my_engines import PROMPTS, good, score

        def test_underpowered(spectr_generation):
            result = spectr_generation(good, score, PROMPTS[:2], vocab_size=12, max_new_tokens=8, arms=["single"])
            assert result.verdict == "INCONCLUSIVE"

        def test_audit_records_without_asserting(spectr_generation):
            assert spectr_generation.audit(good, score, PROMPTS[:1], vocab_size=12, max_new_tokens=4).verdict
    """)
    result = project.runpytest(*FAST)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["INCONCLUSIVE * [[]test_scratch_power.py::test_underpowered]"])
    result = project.runpytest(*FAST, "--spectr-fail-on-inconclusive", "-k", "underpowered")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["E *spectr-audit generation audit: INCONCLUSIVE: *above the planned 0.02",
                                 "E *too few tokens for the planned power*"])


def test_the_session_seed_and_alpha_reach_the_audit(project):
    project.makepyfile(test_scratch_settings="""
        from my_engines import PROMPTS, good, score

        def test_settings(spectr_generation):
            result = spectr_generation(good, score, PROMPTS[:2], vocab_size=12, max_new_tokens=8,
                                       min_detectable_tv=0.9)
            assert (spectr_generation.seed, spectr_generation.alpha, result.alpha) == (5, 0.01, 0.01)
    """)
    result = project.runpytest(*FAST, "--spectr-seed", "5", "--spectr-alpha", "0.01")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["generation audits (seed 5 unless a test set its own):"])


def test_the_fixture_loads_without_torch(pytester):
    # a test that only asks for the fixture imports nothing heavy: the audit is imported when it runs
    pytester.makepyfile("""
        import sys

        def test_fixture_is_light(spectr_generation):
            assert callable(spectr_generation)
            assert [m for m in ('torch', 'scipy', 'cvxpy') if m in sys.modules] == []
    """)
    result = pytester.runpytest_subprocess(*FAST)
    result.assert_outcomes(passed=1)
