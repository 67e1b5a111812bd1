"""The generation audit's Python faces: check_generation, assert_generation_passed, engines by spec,
prompts files and the [[generation]] cases of suites (spectr_audit.generation.checks)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import spectr_audit
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.library import SLIPS, ToyPair, correct_engine, slip_engine
from spectr_audit.generation.library.request_slips import REQUEST_SLIPS
from spectr_audit.generation.library.serving import SERVING_SLIPS
from spectr_audit.generation import checks as gen
from spectr_audit.run.generation_suite import run_generation_suite
from spectr_audit.run.suite import load_suite, parse_suite

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2, 2]]
FAST = {"max_new_tokens": 12, "rounds": 1}


@pytest.fixture(scope="module")
def pair():
    return ToyPair(vocab_size=12, seed=0)


def test_the_names_are_reachable_from_the_top_level_package_lazily():
    assert spectr_audit.check_generation is gen.check_generation
    assert spectr_audit.assert_generation_passed is gen.assert_generation_passed
    from spectr_audit.generation import GenerationAuditResult, audit_generation

    assert spectr_audit.audit_generation is audit_generation
    assert spectr_audit.GenerationAuditResult is GenerationAuditResult
    assert {"audit_generation", "check_generation", "assert_generation_passed"} <= set(spectr_audit.__all__)
    # the faces' module is light: the audit (torch, scipy) is imported when an audit runs
    code = ("import sys, spectr_audit, spectr_audit.generation.checks; spectr_audit.check_generation; "
            "bad = [m for m in ('torch', 'scipy', 'cvxpy') if m in sys.modules]; assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_check_generation_returns_the_result_of_a_correct_engine(pair):
    result = spectr_audit.check_generation(correct_engine(pair), pair.scorer(), PROMPTS, vocab_size=12,
                                           min_detectable_tv=0.5, **FAST)
    assert result.verdict == "PASS" and result.passed and result.num_tokens > 0


def test_inconclusive_fails_only_with_fail_on_inconclusive(pair):
    result = spectr_audit.check_generation(correct_engine(pair), pair.scorer(), PROMPTS[:2], vocab_size=12,
                                           max_new_tokens=8, arms=["single"])
    assert result.verdict == "INCONCLUSIVE"
    with pytest.raises(AssertionError, match=r"INCONCLUSIVE: .*min detectable TV .* above the planned 0\.02"):
        spectr_audit.check_generation(correct_engine(pair), pair.scorer(), PROMPTS[:2], vocab_size=12,
                                      max_new_tokens=8, arms=["single"], fail_on_inconclusive=True)
    with pytest.raises(AssertionError, match="too few tokens for the planned power"):
        spectr_audit.assert_generation_passed(result, fail_on_inconclusive=True)
    assert spectr_audit.assert_generation_passed(result) is result


def test_a_slip_fails_with_the_verdict_line_and_the_deciding_test(pair):
    with pytest.raises(AssertionError) as info:
        spectr_audit.check_generation(slip_engine("shared-stream", pair), pair.scorer(), PROMPTS, vocab_size=12,
                                      **FAST)
    message = str(info.value)
    first = message.splitlines()[0]
    assert first.startswith("spectr-audit generation audit: FINDING: shared-stream against toy target: test ")
    assert "independence / within a batch" in message and "p = " in first and "(alpha 0.001)" in first
    assert "rejected: independence / within a batch: p = " in message


def test_a_decisive_token_is_shown(pair):
    sampled = ToyPair(vocab_size=12, seed=0, params=_params(**SLIPS["residual-unprocessed"].params))
    with pytest.raises(AssertionError) as info:
        spectr_audit.check_generation(slip_engine("residual-unprocessed", sampled), sampled.scorer(), PROMPTS,
                                      vocab_size=12, **FAST)
    assert "test 'support', p = 0 (decisive)" in str(info.value)
    assert "zero-mass token: " in str(info.value)


def _params(**fields):
    from spectr_audit.contract.sampling import SamplingParams

    return SamplingParams(**fields)


def test_assert_generation_passed_takes_a_result_or_the_audit_arguments(pair):
    result = spectr_audit.assert_generation_passed(correct_engine(pair), pair.scorer(), PROMPTS, vocab_size=12,
                                                   min_detectable_tv=0.5, **FAST)
    assert result.passed
    assert spectr_audit.assert_generation_passed(result) is result
    with pytest.raises(AssertionError, match="FINDING: positions-by-block"):
        spectr_audit.assert_generation_passed(slip_engine("positions-by-block", pair), pair.scorer(), PROMPTS,
                                              vocab_size=12, **FAST)
    with pytest.raises(InvalidArgument, match="result: expected a GenerationAuditResult"):
        spectr_audit.assert_generation_passed({"verdict": "PASS"})
    with pytest.raises(InvalidArgument, match="given a result, it takes no audit arguments"):
        spectr_audit.assert_generation_passed(result, vocab_size=12)


def test_verdict_line_and_exit_status():
    from types import SimpleNamespace

    result = SimpleNamespace(verdict="INCONCLUSIVE", generator="g", scorer="s", pvalue=0.5, alpha=1e-3, test="pit",
                             num_tokens=1, num_jobs=1, incomplete=False, stop_reason="max_tokens",
                             min_detectable_tv=0.3, requested_tv=0.02)
    assert gen.verdict_line(result, 3) == ("INCONCLUSIVE: g against s: test 'pit', p = 0.5 (alpha 0.001); 1 token in "
                                           "1 job; min detectable TV 0.3 above the planned 0.02; stopped: max_tokens: "
                                           "exit 3")
    assert gen.status_of(result) == 0 and gen.status_of(result, True) == 3
    assert gen.status_of(SimpleNamespace(verdict="PASS", incomplete=True)) == 130
    assert gen.status_of(SimpleNamespace(verdict="ERROR", incomplete=False)) == 4


# ---------------------------------------------------------------------------------------------
# Engines by spec
# ---------------------------------------------------------------------------------------------


def test_toy_specs_resolve_to_the_toy_loop_and_its_slips():
    engine = gen.load_generation_engine("toy")
    assert engine.vocab_size == gen.TOY_VOCAB_SIZE and engine.prompts == gen.toy_prompts()
    assert engine.expected == "pass" and engine.reference is not None and not engine.reference_by_default
    eos = gen.load_generation_engine("toy:eos-inside-block", vocab_size=10)
    assert eos.eos_token_id == gen.TOY_EOS_TOKEN_ID and eos.expected == "finding" and eos.vocab_size == 10
    deep = gen.load_generation_engine("toy:past-context-length")
    assert deep.max_new_tokens == SLIPS["past-context-length"].max_new_tokens
    sampled = gen.load_generation_engine("toy:params-draft-only", top_k=3)
    assert sampled.generate.pair.params.describe() == {"temperature": 0.6, "top_k": 3}
    names = [row["spec"] for row in gen.generation_engine_names()]
    assert names == (["toy"] + [f"toy:{name}" for name in SLIPS] + [f"toy:{name}" for name in SERVING_SLIPS]
                     + ["toy-requests"] + [f"toy-requests:{name}" for name in REQUEST_SLIPS])
    serving = gen.load_generation_engine("toy:preempt-drops-last-step")
    assert serving.expected == "finding" and serving.default_conditions == ("preemption",)


@pytest.mark.parametrize("spec, kwargs, message", [
    ("toy:shared-strem", {}, "no toy slip 'shared-strem' (did you mean 'shared-stream'?)"),
    ("toy:", {}, "'toy:' names no slip"),
    ("tyo", {}, "'tyo' is neither 'toy', 'toy:SLIP' nor an import string"),
    ("", {}, "expected 'toy', 'toy:SLIP'"),
    ("toy", {"vocab_size": 1}, "vocab_size: expected an integer >= 2"),
    ("toy", {"eos_token_id": 40}, "eos_token_id: 40 is not a token id"),
    ("toy", {"options": {"a": 1}}, "options: only for a factory engine"),
    ("os.path:join", {"temperature": 0.5}, "temperature: only for the toy engine"),
    ("no_such_module_xyz:make", {}, "cannot import module 'no_such_module_xyz'"),
])
def test_bad_specs_are_named(spec, kwargs, message):
    with pytest.raises(InvalidArgument) as info:
        gen.load_generation_engine(spec, argument="--engine", **kwargs)
    assert message in str(info.value)


FACTORIES = textwrap.dedent('''
    from spectr_audit.generation.library import ToyPair, correct_engine

    PAIR = ToyPair(vocab_size=12, seed=0)

    def as_dict(temperature=None):
        return {"generate": correct_engine(PAIR), "score": PAIR.scorer(), "vocab_size": 12,
                "reference": PAIR.reference(), "prompts": [[1, 2], [3, 4, 5]], "name": f"mine T={temperature}"}

    class Engine:
        per_row_max_new_tokens = True
        name = "object engine"
        vocab_size = 12

        def __init__(self):
            self.loop = correct_engine(PAIR)

        def generate(self, prompts, max_new_tokens, seed):
            return self.loop.generate(prompts, max_new_tokens, seed)

        def score(self, prompts, continuations):
            return PAIR.scorer()(prompts, continuations)

    def no_score():
        return {"generate": correct_engine(PAIR), "vocab_size": 12}

    def typo():
        return {"generate": correct_engine(PAIR), "score": PAIR.scorer(), "vocab_sise": 12}

    def raises():
        raise RuntimeError("no GPU here")
''')


@pytest.fixture
def factories(tmp_path):
    path = tmp_path / "factories.py"
    path.write_text(FACTORIES)
    return path


def test_factories_return_dicts_or_objects(factories):
    engine = gen.load_generation_engine(f"{factories}:as_dict", options={"temperature": 0.7})
    assert engine.name == "mine T=0.7" and engine.prompts == [[1, 2], [3, 4, 5]] and engine.reference_by_default
    result = gen.audit_engine(engine, min_detectable_tv=0.9, **FAST)
    assert result.verdict == "PASS" and result.generator == "toy speculative"
    assert any(t.name.startswith("two-sample") for t in result.subtests)  # a factory's reference is used
    assert not any(t.name.startswith("two-sample") for t in gen.audit_engine(engine, reference=False, **FAST).subtests)
    obj = gen.load_generation_engine(f"{factories}:Engine")
    assert obj.vocab_size == 12 and obj.prompts is None and isinstance(obj.generate, object)
    result = gen.audit_engine(obj, PROMPTS, min_detectable_tv=0.9, **FAST)
    # the object itself is the generator: its name and per_row_max_new_tokens are read
    assert result.generator == "object engine" and result.passed
    with pytest.raises(InvalidArgument, match="prompts: the engine .* gives none"):
        gen.audit_engine(obj)


@pytest.mark.parametrize("attr, message", [
    ("no_score", "without score"),
    ("typo", "unknown key(s) ['vocab_sise']"),
    ("raises", "raised RuntimeError: no GPU here"),
    ("PAIR", "is a ToyPair, not a factory"),
])
def test_bad_factories_are_named(factories, attr, message):
    with pytest.raises(InvalidArgument) as info:
        gen.load_generation_engine(f"{factories}:{attr}", argument="--engine")
    assert str(info.value).startswith("--engine: ") and message in str(info.value)


def test_vocab_size_fills_in_or_must_agree(factories):
    with pytest.raises(InvalidArgument, match="vocab_size: 16 given, but the factory .* says 12"):
        gen.load_generation_engine(f"{factories}:as_dict", vocab_size=16)


def test_read_prompts_json_and_lines(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("[[1, 2, 3], [4]]")
    assert gen.read_prompts(path) == [[1, 2, 3], [4]]
    path = tmp_path / "p.txt"
    path.write_text("1 2 3\n\n# a comment\n4 5\n")
    assert gen.read_prompts(path) == [[1, 2, 3], [4, 5]]
    path.write_text("1 2\n3 x\n")
    with pytest.raises(InvalidArgument, match="--prompts: .* line 2: expected space-separated token ids"):
        gen.read_prompts(path)
    path.write_text("[[1, 2], []]")
    with pytest.raises(InvalidArgument, match="prompt 1 is not a non-empty list"):
        gen.read_prompts(path)
    path.write_text("[[1, 2]")
    with pytest.raises(InvalidArgument, match="is not valid JSON"):
        gen.read_prompts(path)
    with pytest.raises(InvalidArgument, match="cannot read"):
        gen.read_prompts(tmp_path / "missing.txt")


# ---------------------------------------------------------------------------------------------
# [[generation]] cases of suites
# ---------------------------------------------------------------------------------------------


def test_the_builtin_generation_suite_lists_the_toy_loop_and_the_cheap_slips():
    suite = load_suite("generation")
    assert suite.cases == () and suite.generation
    engines = {case.engine: case for case in suite.generation}
    assert engines["toy"].expected == "pass"
    slips = {e[4:] for e in engines if e.startswith("toy:")}
    assert slips == set(SLIPS) - {"low-precision-draft"}
    assert all(engines[f"toy:{s}"].expected == "finding" for s in slips)
    # the verifier runner refuses it, pointing at the generation command
    from spectr_audit.run.runner import run_suite

    with pytest.raises(InvalidArgument, match="spectr-audit generation --suite"):
        run_suite(suite)


def _suite(**case):
    return {"generation": [{"name": "c", "engine": "toy", **case}]}


@pytest.mark.parametrize("data, message", [
    (_suite(colour="red"), "unknown key(s) ['colour']"),
    (_suite(name="a b"), "name: expected letters, digits"),
    (_suite(engine="toy:nope"), "engine: no toy slip 'nope'"),
    (_suite(engine="mine"), "engine: 'mine' is neither"),
    (_suite(expected="maybe"), "expected: expected one of ['pass', 'finding']"),
    (_suite(rounds=0), "rounds: expected an integer >= 1"),
    (_suite(alpha=1.5), "alpha: expected a number in (0, 1)"),
    (_suite(arms=["single", "bogus"]), "arms: expected a non-empty list drawn from"),
    (_suite(prompts=[[1], []]), "prompts: expected a non-empty list of non-empty token-id lists"),
    (_suite(options={"x": 1}), "options: only for a factory engine"),
    (_suite(engine="pkg.mod:make", temperature=0.5), "temperature: only for a toy engine"),
    (_suite(draft_noise=-1), "draft_noise: expected a number in [0, inf)"),
    ({"generation": [{"name": "c", "engine": "toy"}, {"name": "c", "engine": "toy"}]}, "duplicate case name 'c'"),
    ({"generation": 3}, "generation: expected [[generation]] tables"),
])
def test_bad_generation_cases_name_the_table_and_the_key(data, message):
    with pytest.raises(InvalidArgument) as info:
        parse_suite(data, source="suite file 'x.toml'")
    assert message in str(info.value) and str(info.value).startswith("suite file 'x.toml'")


def test_a_suite_may_mix_verifier_cases_and_generation_cases():
    suite = parse_suite({"case": [{"name": "seed", "draft": [0.6, 0.4], "target": [0.3, 0.7], "num_drafts": 1}],
                         **_suite(draft_noise="none", temperature=0.5, max_new_tokens=8)})
    assert len(suite.cases) == 1 and len(suite.generation) == 1
    case = suite.generation[0]
    assert case.engine_options == {"draft_noise": None, "temperature": 0.5}
    assert case.audit_options == {"max_new_tokens": 8} and case.reference is None
    with pytest.raises(InvalidArgument, match=r"expected at least one \[\[case\]\]"):
        parse_suite({})


def test_a_generation_suite_runs_each_case_against_what_it_expects(tmp_path, factories):
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "mine.py").write_text(factories.read_text())
    path = tmp_path / "mine.toml"
    path.write_text(textwrap.dedent('''
        [suite]
        name = "mine"

        [[generation]]
        name = "correct"
        engine = "toy"
        max_new_tokens = 12
        min_detectable_tv = 0.5

        [[generation]]
        name = "shared-stream"
        engine = "toy:shared-stream"
        max_new_tokens = 12

        [[generation]]
        name = "factory"
        engine = "engines/mine.py:as_dict"   # relative to this file
        options = { temperature = 0.9 }
        max_new_tokens = 8
        reference = false

        [[generation]]
        name = "wrongly-expected"
        engine = "toy"
        expected = "finding"
        max_new_tokens = 8
        arms = ["single"]
    '''))
    seen = []
    report = run_generation_suite(str(path), on_start=lambda case: seen.append(case.name),
                                      store_dir=tmp_path / "stores")
    assert seen == ["correct", "shared-stream", "factory", "wrongly-expected"]
    verdicts = {r.case: (r.result.verdict, r.as_expected) for r in report.results}
    assert verdicts["correct"] == ("PASS", True)
    assert verdicts["shared-stream"] == ("FINDING", True)
    assert verdicts["factory"][1] and report.results[2].result.generator == "toy speculative"
    assert verdicts["wrongly-expected"][1] is False
    assert not report.passed and report.exit_status() == 1
    assert sorted(p.name for p in (tmp_path / "stores").iterdir()) == [
        "correct.sqlite", "factory.sqlite", "shared-stream.sqlite", "wrongly-expected.sqlite"]
    data = report.to_dict()
    assert data["kind"] == "generation-suite" and data["results"][1]["result"]["verdict"] == "FINDING"
    with pytest.raises(InvalidArgument, match="has no \\[\\[generation\\]\\] cases"):
        run_generation_suite("default")


def test_the_readme_generation_example_runs_as_written():
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S)
                 if "check_generation(slip_engine" in b)
    passing, _, failing = block.rpartition("spectr_audit.check_generation(slip_engine")
    namespace: dict = {}
    exec(compile(passing, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    assert namespace["result"].verdict == "PASS"
    with pytest.raises(AssertionError, match="FINDING"):
        exec(compile("spectr_audit.check_generation(slip_engine" + failing, "README.md", "exec"), namespace)  # noqa: S102
