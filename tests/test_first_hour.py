"""A new user's first hour with the verifier audit, replayed: the README's examples on the command line.

The README's K = 1, L = 1 function runs at K = 1, L = 1 by default, with the plan printed before the
first audit; a class written for one draft length is audited at that length only; a verifier that
raises is an error (its own exit status, the exception's last line and where it was raised), not a
finding; the summary counts say what they count; ``check_verifier``'s count agrees with its list.
Small budgets keep every run to seconds.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spectr_audit.cli import main
from spectr_audit.contract.verifier import FunctionVerifier
from spectr_audit.errors import InvalidArgument
from spectr_audit.results import EXIT_ERROR
from spectr_audit.run.conformance import check_verifier
from spectr_audit.run.suite import case_selection, load_suite, parse_values, select_cases
from spectr_audit.verifiers.library.broken import KSeqLowRho

README = Path(__file__).resolve().parents[1] / "README.md"

FIXED_L = textwrap.dedent("""
    from spectr_audit.verifiers.speculative import SpeculativeSampling


    class FixedThree(SpeculativeSampling):
        '''Written for L = 3 only, as an engine runs num_speculative_tokens = 3.'''
        name = "fixed-three"
        draft_len = 3


    class UpToThree(SpeculativeSampling):
        name = "up-to-three"
        max_draft_len = 3


    def raising_verify(draft_tokens, draft_probs, target_probs, generator):
        return draft_tokens[:, 0, 5]  # IndexError at L < 6
""")


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A scratch folder with the README's my_verifier.py and a few verifiers of one's own."""
    block = re.search(r"```python\n# my_verifier.py\n(.*?)```", README.read_text(), re.S)
    (tmp_path / "my_verifier.py").write_text(block.group(1))
    (tmp_path / "mine.py").write_text(FIXED_L)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run(capsys, *argv):
    code = main([*map(str, argv), "--progress", "none"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _results(out_dir: Path) -> list:
    return json.loads((out_dir / "report.json").read_text())["results"]


def test_the_readme_function_runs_at_k1_l1_by_default_and_its_plan_comes_first(project, capsys):
    code, out, err = run(capsys, "run", "--verifier", "my_verifier.py:my_verify", "--max-samples", "3000",
                         "--out", project / "r")
    assert code == 0, out + err
    assert err.startswith("plan: suite 'default': 6 audits of 1 verifier(s) on 6 case(s)")
    plan = err.split("\n")
    assert "my_verify: audited at K = num_drafts in {1}, L = draft_len in {1}" in plan[1]
    assert "the default for a bare function is K = 1, L = 1" in plan[1]
    assert re.search(r"samples: up to [\d,]+; exact enumeration: 0 draft tuples; estimated time: about \d+ (s|min)",
                     err)
    results = _results(project / "r")
    assert len(results) == 6
    assert {(r["metrics"]["num_drafts"], r["metrics"]["draft_len"]) for r in results} == {(1, 1)}
    assert "6 audits" in out and "0 findings not as expected, 0 errors" in out


def test_num_drafts_and_draft_len_select_the_suites_cases(project, capsys):
    code, out, err = run(capsys, "run", "--verifier", "my_verifier.py:my_verify", "--num-drafts", "1-2",
                         "--draft-len", "2", "--max-samples", "2000", "--out", project / "r")
    shapes = {(r["metrics"]["num_drafts"], r["metrics"]["draft_len"]) for r in _results(project / "r")}
    assert shapes == {(1, 2), (2, 2)}
    assert "K = num_drafts in {1, 2}, L = draft_len in {2} (--num-drafts as given; --draft-len as given)" in err
    # verifying the first token of the first draft only is lossless at any K and L (it accepts less): no finding
    assert code == 0, out


def test_a_fixed_length_class_is_audited_at_its_length_only(project, capsys):
    code, out, err = run(capsys, "run", "--verifier", "mine.py:FixedThree", "--out", project / "r")
    assert code == 0, out + err
    assert "fixed-three: audited at K = num_drafts in [1, 1], L = draft_len in {3} (as the verifier declares)" in err
    results = _results(project / "r")
    assert results and {r["metrics"]["draft_len"] for r in results} == {3}
    assert all(r["verdict"] == "exact" for r in results)
    # a class with only a bound runs at every L up to it, unless told otherwise
    run(capsys, "run", "--verifier", "mine.py:UpToThree", "--out", project / "b")
    assert {r["metrics"]["draft_len"] for r in _results(project / "b")} == {1, 2, 3}
    run(capsys, "run", "--verifier", "mine.py:UpToThree", "--draft-len", "3", "--out", project / "c")
    assert {r["metrics"]["draft_len"] for r in _results(project / "c")} == {3}


def test_a_raising_verifier_is_an_error_with_its_own_exit_status(project, capsys):
    code, out, err = run(capsys, "run", "--verifier", "mine.py:raising_verify", "--max-samples", "2000",
                         "--out", project / "r")
    assert code == EXIT_ERROR == 4
    head = out.splitlines()[0]
    assert "0 findings not as expected, 6 errors, 0 inconclusive -> ERROR" in head
    assert re.search(r"error: raising_verify on \S+: VerifierError: .*IndexError: .*\(raised at .*mine\.py:\d+ in "
                     r"raising_verify\)", out)
    assert "each traceback is under results[].details.traceback in" in out
    result = _results(project / "r")[0]
    assert result["verdict"] == "ERROR" and "mine.py" in result["details"]["traceback"]


def test_exit_statuses_are_documented_in_run_help(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    assert re.search(r"\n  4  no finding, but an audit could not run", text)
    assert "--num-drafts K" in text and "--draft-len L" in text


def test_the_summary_says_findings_on_rules_declared_inexact_are_expected(project, capsys):
    code, out, _ = run(capsys, "run", "--verifier", "broken:kseq-low-rho", "--num-drafts", "2", "--out", project / "r")
    assert code == 0
    match = re.search(r"(\d+) audits in [\d.]+s: (\d+) passed, (\d+) findings on rules declared inexact, as expected, "
                      r"0 findings not as expected, 0 errors, 0 inconclusive -> PASS", out)
    assert match, out
    audits, passed, expected = map(int, match.groups())
    assert expected >= 1 and passed + expected == audits


def test_check_verifier_counts_the_checks_it_lists():
    class Undeclared(KSeqLowRho):
        expected = None

    report = check_verifier(Undeclared(), num_drafts=2, raise_on_failure=False)
    message = report.message()
    failed, total = map(int, re.match(r"check_verifier\(kseq-low-rho\): (\d+) of (\d+) checks failed", message).groups())
    listed = len(re.findall(r"^\s+(check \S+ failed|contract: \[FAIL\]|fidelity on case .*: audit error)", message, re.M))
    assert failed == listed >= 2
    assert total == len(report.checks) + sum(len(r.checks) for r in report.audit.results)


def test_check_verifier_checks_a_fixed_length_verifier_at_its_length(project):
    import importlib
    import sys

    sys.path.insert(0, str(project))
    try:
        mine = importlib.import_module("mine")
    finally:
        sys.path.remove(str(project))
    report = check_verifier(mine.FixedThree, num_samples=2000)
    assert report.passed and {r.case.rsplit("L=", 1)[-1] for r in report.audit.results} == {"3"}


def test_undeclared_default_and_selection():
    bare = FunctionVerifier(lambda draft_tokens, draft_probs, target_probs, generator: None)
    bounded = FunctionVerifier(lambda draft_tokens, draft_probs, target_probs, generator: None, max_draft_len=2)
    assert not bare.declares_shape and bounded.declares_shape
    assert case_selection(bare) == ((1,), (1,))
    assert case_selection(bare, num_drafts="2-3") == ((2, 3), (1,))
    assert case_selection(bounded) == (None, None)
    suite = load_suite("default")
    picked = select_cases(suite, num_drafts=[2], draft_len="2")
    assert picked.cases and {(c.num_drafts, c.draft_len) for c in picked.cases} == {(2, 2)}
    with pytest.raises(InvalidArgument, match=r"no case of suite 'default' has K in \{9\}"):
        select_cases(suite, num_drafts=9)
    with pytest.raises(SystemExit) as info:  # argparse: a usage error, exit 2, naming the argument
        main(["run", "--verifier", "kseq", "--num-drafts", "0"])
    assert info.value.code == 2


def test_declared_values_on_a_verifier():
    fixed = FunctionVerifier(lambda draft_tokens, draft_probs, target_probs, generator: None, num_drafts=[1, 3],
                             draft_len=range(2, 4))
    assert [fixed.supports(k, length) for k, length in [(1, 2), (3, 3), (2, 2), (1, 1), (1, 4)]] == [
        True, True, False, False, False]
    assert (fixed.drafts_range(), fixed.draft_len_range()) == ("{1, 3}", "{2, 3}")
    with pytest.raises(InvalidArgument, match="draft_len: expected a positive integer, or a list or range of them"):
        FunctionVerifier(lambda draft_tokens, draft_probs, target_probs, generator: None, draft_len=0)


def test_a_function_declares_its_shape_as_attributes():
    from spectr_audit.contract.convert import as_verifier

    def verify(draft_tokens, draft_probs, target_probs, generator):
        return None

    verify.max_drafts, verify.draft_len = 1, 3
    wrapped = as_verifier(verify)
    assert wrapped.declares_shape and wrapped.supports(1, 3) and not wrapped.supports(1, 1)
    assert case_selection(wrapped) == (None, None)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(values=st.sets(st.integers(1, 12), min_size=1), split=st.booleans())
def test_parse_values_reads_back_any_set_written_as_ranges(values, split):
    # the oracle: write each run of consecutive values as a range (or every value alone), in shuffled order
    runs, ordered = [], sorted(values)
    for v in ordered:
        if runs and v == runs[-1][1] + 1 and not split:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = ",".join(f"{a}-{b}" if b > a else str(a) for a, b in reversed(runs))
    assert parse_values(text, "x") == tuple(ordered)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(declared=st.one_of(st.none(), st.sets(st.integers(1, 6), min_size=1)),
       low=st.integers(1, 3), high=st.one_of(st.none(), st.integers(3, 6)), k=st.integers(1, 7))
def test_supports_is_the_bounds_and_the_declared_values(declared, low, high, k):
    verifier = FunctionVerifier(lambda draft_tokens, draft_probs, target_probs, generator: None, min_drafts=low,
                                max_drafts=high, num_drafts=None if declared is None else sorted(declared))
    expected = low <= k and (high is None or k <= high) and (declared is None or k in declared)
    assert verifier.supports(k, 1) == expected


def test_the_plan_does_not_time_a_case_the_memory_budget_refuses(tmp_path, monkeypatch, capsys):
    """A case far over the budget (L = 10^6) is refused with the budget's message, and the plan never drafts a
    batch of it (drafting two rows of it once held 22 GB before the refusal)."""
    import spectr_audit.run.plan as plan

    drafted = []

    def no_drafting(*args, **kwargs):  # (the plan catches what a timing batch raises, so record the call)
        drafted.append(args[3:5])
        raise MemoryError("the plan drafted a timing batch of a case the memory budget refuses")

    monkeypatch.setattr(plan, "draft", no_drafting)
    suite = tmp_path / "huge.toml"
    suite.write_text('[[case]]\nname = "c0"\ndraft = [0.6, 0.4]\ntarget = [0.3, 0.7]\nnum_drafts = 1\n'
                     'draft_len = 1000000\n')
    code = main(["run", "--suite", str(suite), "--out", str(tmp_path / "out"), "--verifier", "speculative",
                 "--max-samples", "300"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "memory budget" in err and "L=1000000" in err and "Traceback" not in err
    assert drafted == []
