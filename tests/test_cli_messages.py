"""What the command line and the pytest plugin tell a user says what happened, and where.

The ``audit`` verdict line against the declaration, the list of suites a bad ``--suite`` is
told (the same as ``spectr-audit list``), the option blamed for an unsupported K, the help of
``audit`` and ``bound`` (whose examples run), the plugin's session header (samples drawn, the
level each audit ran at) and its failure traceback (the test's line, not the plugin's source).
"""

from __future__ import annotations

import json
import re
import shlex
import textwrap

import pytest

from spectr_audit.cli import build_parser, main, suite_names

pytest_plugins = ["pytester"]


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _help(capsys, command: str) -> str:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# audit: the verdict against the declaration
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("verifier, code, line", [
    ("broken:kseq-low-rho", 0, "kseq-low-rho on cli: FINDING, as declared (declared inexact): exit 0"),
    ("historic:target-only-siblings", 0, "target-only-siblings on cli: exact, as declared (declared exact): exit 0"),
    ("kseq", 0, "kseq on cli: exact: exit 0"),
])
def test_audit_first_line_states_the_verdict_the_declaration_and_the_exit_status(capsys, verifier, code, line):
    status, out, _ = run_cli(capsys, "audit", "--verifier", verifier, "--draft", "0.5,0.3,0.2",
                             "--target", "0.2,0.3,0.5", "--num-drafts", "2")
    assert status == code
    assert out.splitlines()[0] == line


def test_audit_of_an_inexact_verifier_not_declared_says_not_as_declared_and_exits_1(capsys, tmp_path):
    # a third party's K-SEQ with rho 3% low, declared exact: its finding is NOT as declared
    plugin = tmp_path / "lowrho.py"
    plugin.write_text(textwrap.dedent("""
        from spectr_audit.verifiers.library.broken import KSeqLowRho

        class Claimed(KSeqLowRho):
            name = "claimed-exact"
            expected = "exact"
    """))
    status, out, _ = run_cli(capsys, "audit", "--verifier", f"{plugin}:Claimed", "--draft", "0.5,0.3,0.2",
                             "--target", "0.2,0.3,0.5", "--num-drafts", "2")
    assert status == 1
    assert out.splitlines()[0] == ("claimed-exact on cli: FINDING, NOT as declared (declared exact; a check failed): "
                                   "exit 1")
    # each check's line says its outcome, and the worst strings are printed for a finding
    assert re.search(r"\[FAIL\] exact: .*above the tolerance", out)
    assert "worst strings (string: implied law vs target law)" in out


def test_unsupported_num_drafts_blames_the_option_and_gives_the_range(capsys):
    status, _, err = run_cli(capsys, "audit", "--verifier", "speculative", "--draft", "0.6,0.4", "--target",
                             "0.3,0.7", "--num-drafts", "3")
    assert status == 2
    assert "--num-drafts: verifier 'speculative' supports K = num_drafts in [1, 1]; got 3" in err
    assert "draft_tokens" not in err
    status, _, err = run_cli(capsys, "audit", "--verifier", "kseq", "--draft", "0.6,0.4", "--target", "0.3,0.7",
                             "--num-drafts", "2", "--draft-len", "2")
    assert status == 2 and "--draft-len: verifier 'kseq' supports L = draft_len in [1, 1]; got 2" in err


# ---------------------------------------------------------------------------------------------
# One list of suites
# ---------------------------------------------------------------------------------------------


def test_a_bad_suite_is_told_every_suite_that_list_shows(capsys):
    _, listed, _ = run_cli(capsys, "list", "--json")
    names = json.loads(listed)["suites"]
    assert "real-lm" in names and names == suite_names()
    _, text, _ = run_cli(capsys, "list")
    shown = [line.split()[0] for line in text.split("suites:\n", 1)[1].splitlines() if line.strip()]
    assert shown == names
    status, _, err = run_cli(capsys, "run", "--suite", "nosuch")
    assert status == 2
    assert err.strip().endswith("suites: " + ", ".join(names))
    status, _, err = run_cli(capsys, "run", "--suite", "real_lm")
    assert status == 2 and "(did you mean 'real-lm'?)" in err


# ---------------------------------------------------------------------------------------------
# audit and bound --help
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["audit", "bound"])
def test_help_says_what_the_command_does_with_examples_and_exit_codes(capsys, command):
    text = _help(capsys, command)
    description = text.split("\n\n")[1]
    assert len(description.split()) > 60  # a paragraph, not a line
    assert "examples:" in text and "exit codes:" in text
    for code in ("0", "2", "130"):
        assert re.search(rf"^  {code}  \S", text, re.M), code
    # every option has help
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    assert all(action.help for action in sub._actions), [a.dest for a in sub._actions if not a.help]


def _examples(text: str) -> list:
    """The example command lines of a help text (continuation lines joined, comments dropped)."""
    block = text.split("examples:\n", 1)[1].split("\n\n", 1)[0]
    joined = block.replace("\\\n", " ")
    return [shlex.split(line.split("#", 1)[0]) for line in joined.splitlines() if line.strip()]


@pytest.mark.parametrize("command", ["audit", "bound"])
def test_help_examples_run(capsys, command):
    examples = [argv for argv in _examples(_help(capsys, command)) if not any("my_pkg" in a for a in argv)]
    assert len(examples) >= 2
    for argv in examples:
        assert argv[:2] == ["spectr-audit", command]
        status, out, err = run_cli(capsys, *argv[1:])
        assert status == 0, (argv, err)
        assert out


def test_bound_example_value_is_the_one_printed(capsys):
    (first, *_) = _examples(_help(capsys, "bound"))
    _, out, _ = run_cli(capsys, *first[1:], "--json")
    assert json.loads(out)["optimal_acceptance"] == pytest.approx(0.94)


# ---------------------------------------------------------------------------------------------
# The pytest plugin: the session header and the failure traceback
# ---------------------------------------------------------------------------------------------

BAD_VERIFY = textwrap.dedent('''
    import torch

    def bad_verify(draft_tokens, draft_probs, target_probs, generator):
        """Speculative sampling that resamples the target on rejection (inexact)."""
        token = draft_tokens[:, 0, 0]
        draft, target = draft_probs[:, 0, 0].double(), target_probs[:, 0, 0].double()
        ratio = target.gather(1, token[:, None])[:, 0] / draft.gather(1, token[:, None])[:, 0]
        accept = torch.rand(token.shape, generator=generator, dtype=torch.float64) < ratio.clamp(max=1)
        fresh = torch.multinomial(target, 1, generator=generator)[:, 0]
        bonus = torch.multinomial(target_probs[:, 0, 1].double(), 1, generator=generator)[:, 0]
        return accept.long(), torch.zeros_like(token), torch.where(accept, bonus, fresh)
''')


@pytest.fixture(scope="module")
def failing_session(tmp_path_factory):
    """One pytest run (a subprocess) of a test whose check_verifier finds the broken verifier."""
    import subprocess
    import sys

    where = tmp_path_factory.mktemp("plugin")
    (where / "my_verifiers.py").write_text(BAD_VERIFY)
    (where / "test_bad.py").write_text(textwrap.dedent("""
        from my_verifiers import bad_verify

        def test_bad(spectr_audit):
            spectr_audit.check(bad_verify, num_drafts=1)
    """))
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--spectr-samples", "2000",
                          "test_bad.py"], cwd=where, capture_output=True, text=True, timeout=600)
    return run.stdout


def test_failure_shows_the_tests_line_then_the_findings_without_the_plugins_source(failing_session):
    failures = failing_session.split(" FAILURES ", 1)[1].split(" spectr-audit ", 1)[0]
    lines = failures.splitlines()
    test_line = next(i for i, line in enumerate(lines) if "spectr_audit.check(bad_verify" in line)
    # right after the test's own line comes the message: no frame of the plugin or of conformance
    assert lines[test_line + 1].startswith("E       spectr_audit.run.conformance.ConformanceFailure: check_verifier(")
    for hidden in ("def check(self", "def check_verifier(", "plugin.py:", "conformance.py:"):
        assert hidden not in failures, hidden
    assert len(lines) < 30


def test_failure_message_explains_the_threshold_below_alpha(failing_session):
    # five cases, one statistical audit each: alpha 0.001 split five ways
    assert "threshold 0.0002" in failing_session
    assert ("alpha = 0.001 is the false-alarm rate of the whole check, split over its 5 statistical tests "
            "(Bonferroni): each runs at 0.001 / 5 = 0.0002") in failing_session


def test_session_header_says_the_samples_drawn_and_the_level_each_audit_ran_at(failing_session):
    summary = failing_session.split(" spectr-audit ", 1)[1]
    header = summary.splitlines()[1:4]
    assert header[0] == "seed 0, gate: none"
    drawn = [int(n) for n in re.findall(r" n=(\d+) ", summary)]
    assert len(drawn) == 5
    low, high = min(drawn), max(drawn)
    span = f"{low}" if low == high else f"{low} to {high}"
    assert header[1].startswith("samples: at most 2000 per statistical audit's main design")
    assert header[1].endswith(f"drawn: {span} per audit (n= below)")
    assert header[2] == ("alpha 0.001 per check, split over the check's statistical tests (Bonferroni): each audit "
                         "ran at 0.0002 = 0.001 / 5")
    # each line: the p-value with the level it is compared with, and a sampled ratio's interval
    for line in summary.splitlines()[4:9]:
        assert re.search(r"p=\S+ \(alpha 0\.0002\) n=\d+ acc=\S+ \[\S+, \S+\] acc/alpha\*=\S+ \[\S+, \S+\]", line), line
