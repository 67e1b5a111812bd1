"""Fuzz the command line and suite files: whatever a user types, no traceback reaches them.

Hypothesis builds argument lists for every command (valid values, invalid ones, huge sizes, garbage
text) and TOML suite files (valid cases, wrong types, unknown keys, huge sizes, broken TOML), runs
``spectr_audit.cli.main`` in-process, and asserts that it exits with a documented code (0, 1, 2, 3,
130) and that stderr holds neither "Traceback" nor an internal error.  The examples are derandomised
(the same every run): :data:`CLI_EXAMPLES` argument lists and :data:`SUITE_EXAMPLES` suite files in
the fast tests, :data:`SLOW_EXAMPLES` of each in the ``slow`` ones.  Cases are kept small
(``--max-samples 300``, vocabularies of at most 4 tokens where valid) so that an example takes
about a second; the huge ones are refused by the memory budget before they cost anything.
"""

from __future__ import annotations

import contextlib
import io
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spectr_audit.cli import main

#: Examples per fast test, and per slow test.
CLI_EXAMPLES = 100
SUITE_EXAMPLES = 60
SLOW_EXAMPLES = 400

EXIT_CODES = {0, 1, 2, 3, 4, 130}

GARBAGE = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)

#: Per option: values a user means (a valid command line comes from these), then mistakes and
#: hostile ones (bad syntax, huge sizes, paths that are files).
VALID = {
    "--verifier": ["kseq", "speculative", "rrs", "broken:always-accept"],
    "--draft": ["0.6,0.4", "0.5,0.5", "1,0", "markov:vocab_size=2,seed=1", "dirichlet:vocab_size=2,seed=2"],
    "--target": ["0.3,0.7", "0.5,0.5", "markov:vocab_size=2,seed=3", "dirichlet:vocab_size=2,seed=4"],
    "--num-drafts": ["1", "2", "3"],
    "--draft-len": ["1", "2"],
    "--prefix": ["", "0", "0,1"],
    "--seed": ["0", "1"],
    "--max-samples": ["300"],
    "--max-memory": ["1GiB", "4e9"],
    "--verifier-timeout": ["20"],
    "--alpha": ["0.01"],
    "--suite": ["{suite}"],
    "--out": ["{tmp}/out"],
    "--junit": ["{tmp}/junit.xml"],
    "--gate": ["max_tv<=1e-9", "acceptance_ratio>=2"],
}
INVALID = {
    "--verifier": ["nope", "", "x.py:y", "/no/such/file.py:v", "os:path", "spectr_audit:nothing", "kseq:"],
    "--draft": ["dirichlet:vocab_size=1e9", "dirichlet:vocab_size=-3", "markov:vocab_size=400", "a,b", "", "-0.1,1.1",
                "nan,0.5", "inf", "0.6,0.4,", "dirichlet:", "markov:vocab_size=2,bogus=1", "1e308,1e308",
                "markov:order=40,vocab_size=2", "dirichlet:vocab_size=2,concentration=0", "logits:1,2",
                "0.5,0.3,0.2"],
    "--target": ["x", "0,0", "1", "0.2,0.3,0.5"],
    "--num-drafts": ["0", "-1", "10000", "1000000000", "x", "1e3", "99999999999999999999"],
    "--draft-len": ["0", "1000000", "x"],
    "--prefix": ["7", "a", "-1"],
    "--seed": ["-5", "x", "99999999999999999999"],
    "--max-samples": ["0", "x", "-3"],
    "--max-memory": ["1k", "lots", "0", "1e400", "-2G"],
    "--verifier-timeout": ["0", "-1", "x", "inf", "nan"],
    "--alpha": ["0", "1", "2", "nan", "x"],
    "--tree": ["chains:1,2", "paths:[[0],[1],[0,0]]", "cartesian:2,0", "paths:[[", "bogus:1"],
    "--suite": ["no-such-suite", "{tmp}/missing.toml", "{tmp}"],
    "--out": ["{tmp}/afile", "{tmp}/afile/below", "/proc/spectr-audit-fuzz"],
    "--junit": ["{tmp}/afile/j.xml", "{tmp}"],
    "--gate": ["nonsense"],
}
PATHS = ("--suite", "--out", "--junit")
FLAGS = ["--json", "--html", "--help"]

COMMANDS = {
    "audit": ["--verifier", "--draft", "--target", "--num-drafts", "--draft-len", "--prefix", "--seed", "--max-samples",
              "--max-memory", "--verifier-timeout", "--alpha", "--tree"],
    "bound": ["--draft", "--target", "--num-drafts", "--max-memory"],
    "run": ["--suite", "--verifier", "--out", "--junit", "--seed", "--max-samples", "--max-memory",
            "--verifier-timeout", "--alpha", "--gate", "--num-drafts", "--draft-len"],
    "list": [],
}

#: Keeps valid examples fast: appended unless the example sets the option itself.
FAST = {"audit": ["--max-samples", "300", "--verifier-timeout", "20"],
        "run": ["--max-samples", "300", "--verifier-timeout", "20", "--verifier", "speculative", "--out", "{tmp}/out"]}

TINY_SUITE = '[[case]]\nname = "seed"\ndraft = [0.6, 0.4]\ntarget = [0.3, 0.7]\nnum_drafts = 1\n'


#: Valid values where a command takes fewer: bound takes context-free laws; an all-valid audit takes a
#: verifier of every K and L.
VALID_FOR = {("bound", "--draft"): ["0.6,0.4", "0.5,0.5", "1,0"], ("bound", "--target"): ["0.3,0.7", "0.5,0.5"],
             ("audit", "--verifier"): ["rrs", "broken:always-accept"]}
REQUIRED = {"audit": ["--verifier", "--draft", "--target", "--num-drafts"], "bound": ["--draft", "--target", "--num-drafts"]}


@st.composite
def argument_lists(draw):
    command = draw(st.sampled_from(sorted(COMMANDS)))
    argv = [command]
    options = COMMANDS[command]
    chosen = draw(st.lists(st.sampled_from(options), max_size=4, unique=True)) if options else []
    all_valid = draw(st.booleans())  # half the examples: a command line a user means, which must run
    if all_valid or draw(st.integers(0, 4)) > 0:  # else, most often a complete command line
        chosen = list(dict.fromkeys(REQUIRED.get(command, []) + chosen))
    for option in chosen:
        kind = 0 if all_valid else draw(st.integers(0, 9))  # else 5 in 10 valid, 4 a mistake, 1 garbage
        if kind < 5 and option not in VALID:  # no valid value beside the others (--tree takes no K, L)
            continue
        argv.append(option)
        pool = VALID_FOR.get((command, option), VALID[option]) if kind < 5 else INVALID[option]
        value = draw(GARBAGE) if kind == 9 else draw(st.sampled_from(pool))
        if kind == 9 and option in PATHS:  # garbage paths stay in the scratch folder
            value = "{tmp}/g-" + value.replace("/", "_")
        argv.append(value)
    if command != "list" and not all_valid and draw(st.integers(0, 9)) == 0:
        argv.append(draw(st.sampled_from(FLAGS)))
    if command in ("audit", "run") and draw(st.booleans()):
        argv.append("--json")
    if not all_valid and draw(st.integers(0, 14)) == 0:  # a stray word after the command
        argv.insert(draw(st.integers(1, len(argv))), draw(GARBAGE))
    for option, value in zip(FAST.get(command, [])[::2], FAST.get(command, [])[1::2]):
        if option not in argv:
            argv += [option, value]
    return argv


def run_main(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse: usage errors (2) and --help (0)
            code = exc.code if isinstance(exc.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def assert_clean(argv, code, err):
    assert code in EXIT_CODES, (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    assert "internal error" not in err, (argv, err)
    if code == 2:
        assert err.strip(), (argv, "exit 2 without a message")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "afile").write_text("a file, not a folder")
    (tmp / "tiny.toml").write_text(TINY_SUITE)
    return tmp


def _fill(argv, scratch):
    return [a.replace("{suite}", str(scratch / "tiny.toml")).replace("{tmp}", str(scratch)) for a in argv]


def _cli_fuzz(scratch, argv):
    argv = _fill(argv, scratch)
    code, _, err = run_main(argv)
    assert_clean(argv, code, err)


@settings(max_examples=CLI_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(argv=argument_lists())
def test_no_command_line_gets_a_traceback(scratch, argv):
    _cli_fuzz(scratch, argv)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(argv=argument_lists())
def test_no_command_line_gets_a_traceback_many(scratch, argv):
    _cli_fuzz(scratch, argv)


# ---------------------------------------------------------------------------------------------
# Suite files
# ---------------------------------------------------------------------------------------------


def _toml_value(value) -> str:
    """A TOML literal of ``value`` (the fuzz needs wrong types written correctly, so no TOML library)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value == math.inf else "-inf" if value == -math.inf
                                                 else repr(value))
    if isinstance(value, str):  # a basic string: backslash, quote and control characters escaped
        return '"' + "".join(c if c.isprintable() and c not in '"\\' else f"\\u{ord(c):04x}" if ord(c) < 0x10000
                             else f"\\U{ord(c):08x}" for c in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(value)


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() and key.isascii() else _toml_value(key)


SIZES = st.one_of(st.integers(1, 4), st.sampled_from([0, -1, 10_000, 1_000_000_000, 2**40]), st.floats(allow_nan=True))
MODELS = st.one_of(
    st.sampled_from([[0.6, 0.4], [0.3, 0.7], [0.5, 0.5], [1.0, 0.0], [0.5, 0.3, 0.2], [], [0.5], [-1.0, 2.0],
                     [0.5, "x"], "0.6,0.4"]),
    st.builds(lambda v, s: {"dirichlet": {"vocab_size": v, "seed": s}}, SIZES, st.integers(0, 5)),
    st.builds(lambda v, o: {"markov": {"vocab_size": v, "order": o}}, SIZES, st.sampled_from([0, 1, 2, 30, -1])),
    st.builds(lambda v: {"logits": v}, st.lists(st.floats(-5, 5), min_size=1, max_size=3)),
    st.just({"table": [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]], "order": 1}),
    st.just({"nope": 1}),
)
CASE_VALUES = {
    "name": st.one_of(st.sampled_from(["a", "b", "case/1", ""]), GARBAGE, st.integers()),
    "draft": MODELS,
    "target": MODELS,
    "num_drafts": st.one_of(SIZES, st.lists(st.integers(1, 3), max_size=3), st.just("2")),
    "draft_len": st.one_of(st.integers(0, 2), st.sampled_from([1_000_000, "1"]), st.lists(st.integers(1, 2), max_size=2)),
    "checks": st.one_of(st.lists(st.sampled_from(["exact", "optimality", "nope"]), max_size=3), st.just("exact")),
    "prefix": st.one_of(st.lists(st.integers(-1, 3), max_size=2), st.just(0)),
    "verifiers": st.one_of(st.lists(st.sampled_from(["speculative", "kseq", "nope", "x.py:y"]), max_size=2),
                           st.just("kseq")),
    "num_tokens": st.one_of(st.integers(-1, 3), st.just(10**9)),
    "description": GARBAGE,
    "tree": st.sampled_from(["chains:1,2", "paths:[[0]]", "bogus", [[0], [1]]]),
    "unknown_key": st.integers(),
}


@st.composite
def valid_case(draw, index: int) -> dict:
    """A case a user means: small, every key of the right type, draft and target of one vocabulary."""
    vocab_size = draw(st.integers(2, 3))
    laws = {2: [[0.6, 0.4], [0.3, 0.7], [1.0, 0.0]], 3: [[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]]}[vocab_size]
    model = st.one_of(st.sampled_from(laws), st.builds(lambda seed: {"dirichlet": {"vocab_size": vocab_size, "seed": seed}},
                                                        st.integers(0, 3)),
                      st.builds(lambda seed: {"markov": {"vocab_size": vocab_size, "seed": seed}}, st.integers(0, 3)))
    case = {"name": f"c{index}", "draft": draw(model), "target": draw(model),
            "num_drafts": draw(st.one_of(st.integers(1, 3), st.lists(st.integers(1, 2), min_size=1, max_size=2,
                                                                        unique=True)))}
    case.update(draw(st.fixed_dictionaries({}, optional={
        "draft_len": st.integers(1, 2), "checks": st.lists(st.sampled_from(["exact", "optimality"]), min_size=1,
                                                           unique=True),
        "prefix": st.lists(st.integers(0, vocab_size - 1), max_size=1),
        "verifiers": st.lists(st.sampled_from(["speculative", "kseq", "rrs"]), min_size=1, max_size=2, unique=True),
        "description": st.text(max_size=10)})))
    return case


@st.composite
def suite_texts(draw):
    """Half the files valid suites that must run; the others one mistake away (a wild value, an unknown key),
    or not TOML at all."""
    kind = draw(st.integers(0, 9))
    if kind == 0:  # not TOML at all, or not a suite
        return draw(st.sampled_from(["[[case]\nname = ", "case = 3\n", "", "[suite]\nname = 1\n", "\x00\x01"]) | GARBAGE)
    lines = []
    if draw(st.booleans()):
        header = draw(st.fixed_dictionaries({}, optional={
            "name": st.one_of(st.text(max_size=8), st.integers()) if kind >= 5 else st.text(max_size=8),
            "description": st.text(max_size=8),
            "verifiers": (st.one_of(st.lists(st.sampled_from(["speculative", "nope"]), max_size=2), st.just(3))
                          if kind >= 5 else st.lists(st.sampled_from(["speculative", "kseq"]), min_size=1, unique=True))}))
        lines.append("[suite]")
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in header.items()]
    cases = [draw(valid_case(i)) for i in range(draw(st.integers(1, 3)))]
    if kind >= 5:  # one mistake: a wild value, a missing key or an unknown one
        case = cases[draw(st.integers(0, len(cases) - 1))]
        key = draw(st.sampled_from(sorted(CASE_VALUES)))
        if draw(st.integers(0, 4)) == 0 and key in case:
            del case[key]
        else:
            case[key] = draw(CASE_VALUES[key])
    for case in cases:
        lines.append("[[case]]")
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in case.items()]
    return "\n".join(lines) + "\n"


def _suite_fuzz(scratch, text, verifier, index=[0]):
    index[0] += 1
    path = scratch / f"suite{index[0]}.toml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    argv = ["run", "--suite", str(path), "--out", str(scratch / f"out{index[0]}"), "--max-samples", "300",
            "--verifier-timeout", "20", "--json"] + (["--verifier", verifier] if verifier else [])
    code, _, err = run_main(argv)
    assert_clean(argv + [text], code, err)


@settings(max_examples=SUITE_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=suite_texts(), verifier=st.sampled_from(["speculative", "kseq", None]))
def test_no_suite_file_gets_a_traceback(scratch, text, verifier):
    _suite_fuzz(scratch, text, verifier)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=suite_texts(), verifier=st.sampled_from(["speculative", "kseq", None]))
def test_no_suite_file_gets_a_traceback_many(scratch, text, verifier):
    _suite_fuzz(scratch, text, verifier)
