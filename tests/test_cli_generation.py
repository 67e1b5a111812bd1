"""``spectr-audit generation``: the toy loop and its slips, user factories, prompts files, the store,
reports, JSON, suites, and the exit codes (0 PASS, 1 FINDING, 2 usage, 3 INCONCLUSIVE with the flag, 130)."""

from __future__ import annotations

import json
import textwrap

import pytest

from spectr_audit.cli import main

#: Small and fast: twelve tokens per continuation, one round.
FAST = ["--max-new-tokens", "12", "--rounds", "1"]


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _verdict(data: dict) -> str:
    """The verdict of a generation report's JSON (at the top, or under ``result``)."""
    return data["verdict"] if "verdict" in data else data["result"]["verdict"]


FACTORY = textwrap.dedent('''
    from pathlib import Path

    from spectr_audit.generation.library import ToyPair, correct_engine, slip_engine

    PAIR = ToyPair(vocab_size=12, seed=0)

    def make_engine():
        return {"generate": correct_engine(PAIR), "score": PAIR.scorer(), "vocab_size": 12}

    def make_broken():
        return {"generate": slip_engine("positions-by-block", PAIR), "score": PAIR.scorer(), "vocab_size": 12,
                "prompts": [[1, 2, 3], [4, 5]]}

    def make_interrupting():
        """The correct loop, but Ctrl-C on its third call while the file 'interrupt' lies beside this one."""
        engine = correct_engine(PAIR)
        flag = Path(__file__).with_name("interrupt")
        calls = []

        def generate(prompts, max_new_tokens, seed):
            calls.append(1)
            if len(calls) == 3 and flag.exists():
                flag.unlink()
                raise KeyboardInterrupt
            return engine.generate(prompts, max_new_tokens, seed)

        generate.per_row_max_new_tokens = True
        return {"generate": generate, "score": PAIR.scorer(), "vocab_size": 12, "prompts": [[1, 2, 3], [4, 5]]}
''')


@pytest.fixture
def factory(tmp_path):
    path = tmp_path / "engines.py"
    path.write_text(FACTORY)
    (tmp_path / "prompts.txt").write_text("1 2 3\n4 5\n# a comment\n6 7 8 9\n")
    return path


def test_the_correct_toy_loop_passes_and_the_first_line_is_the_verdict(capsys):
    code, out, _ = run_cli(capsys, "generation", "--engine", "toy", *FAST, "--min-detectable-tv", "0.3")
    assert code == 0
    first = out.splitlines()[0]
    assert first.startswith("PASS: toy speculative against toy target: test '") and "p = " in first
    assert first.endswith(": exit 0")
    assert "  decided by: one-sample" in out and "tokens by arm: single" in out


def test_inconclusive_exits_0_or_3_with_the_flag(capsys):
    code, out, _ = run_cli(capsys, "generation", "--engine", "toy", *FAST, "--arms", "single")
    assert code == 0 and out.startswith("INCONCLUSIVE: ") and "above the planned 0.02" in out.splitlines()[0]
    code, out, _ = run_cli(capsys, "generation", "--engine", "toy", *FAST, "--arms", "single",
                           "--fail-on-inconclusive")
    assert code == 3 and out.splitlines()[0].endswith(": exit 3")


def test_a_planted_slip_exits_1_naming_the_deciding_test(capsys):
    code, out, _ = run_cli(capsys, "generation", "--engine", "toy:shared-stream", *FAST)
    assert code == 1
    first = out.splitlines()[0]
    assert first.startswith("FINDING: shared-stream against toy target: test 'independence / within a batch', p = ")
    assert "rejected: independence / within a batch" in out


def test_json_output_parses_and_the_verdict_line_goes_to_stderr(capsys):
    code, out, err = run_cli(capsys, "generation", "--engine", "toy:positions-by-block", *FAST, "--json")
    assert code == 1
    data = json.loads(out)
    assert _verdict(data) == "FINDING"
    assert err.splitlines()[0].startswith("FINDING: positions-by-block against toy target")


@pytest.mark.parametrize("argv, message", [
    ([], "one of the arguments --engine --suite is required"),
    (["--engine", "toy:shared-strem"], "--engine: 'toy:shared-strem': no toy slip 'shared-strem' (did you mean "
                                       "'shared-stream'?)"),
    (["--engine", "nosuch"], "--engine: 'nosuch' is neither 'toy', 'toy:SLIP' nor an import string"),
    (["--engine", "{tmp}/missing.py:make"], "--engine: file "),
    (["--engine", "toy", "--suite", "generation"], "argument --suite: not allowed with argument --engine"),
    (["--engine", "toy", "--prompts", "{tmp}/missing.txt"], "--prompts: cannot read"),
    (["--engine", "toy", "--prompts", "{tmp}/bad.txt"], "--prompts: "),
    (["--engine", "toy", "--resume"], "--resume: needs --store PATH"),
    (["--engine", "toy", "--store", "{tmp}/none.sqlite", "--resume"], "--resume: there is no store at"),
    (["--engine", "toy", "--store", "{tmp}"], "--store: "),
    (["--engine", "toy", "--arms", "single,bogus"], "--arms: expected comma-separated arms from"),
    (["--engine", "toy", "--max-new-tokens", "0"], "argument --max-new-tokens: expected a positive integer"),
    (["--engine", "toy", "--alpha", "2"], "argument --alpha: expected a number in (0, 1)"),
    (["--engine", "toy", "--vocab-size", "1"], "argument --vocab-size: expected an integer >= 2"),
    (["--engine", "toy", "--eos-token-id", "99"], "eos_token_id: 99 is not a token id"),
    (["--engine", "toy", "--out", "{tmp}/afile"], "--out: "),
    (["--engine", "{factory}:make_engine", "--temperature", "0.5"], "--temperature: only with --engine toy"),
    (["--engine", "{factory}:make_engine"], "--prompts: required: the engine"),
    (["--engine", "{factory}:nothing"], "--engine: "),
    (["--suite", "generation", "--rounds", "2"], "--rounds: not with --suite"),
    (["--suite", "default"], "--suite: suite 'default' has no [[generation]] cases"),
    (["--suite", "nosuch"], "--suite: 'nosuch' is neither a suite name"),
])
def test_usage_errors_exit_2_naming_the_argument(capsys, tmp_path, factory, argv, message):
    (tmp_path / "afile").write_text("a file, not a folder")
    (tmp_path / "bad.txt").write_text("1 2\nx y\n")
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{factory}", str(factory)) for a in argv]
    try:
        code, out, err = run_cli(capsys, "generation", *argv)
    except SystemExit as exc:  # argparse
        code, err = exc.code, capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err and "internal error" not in err


def test_a_factory_with_a_prompts_file(capsys, tmp_path, factory):
    code, out, _ = run_cli(capsys, "generation", "--engine", f"{factory}:make_engine", "--prompts",
                           str(tmp_path / "prompts.txt"), *FAST, "--min-detectable-tv", "0.5")
    assert code == 0 and out.startswith("PASS: ")
    code, out, _ = run_cli(capsys, "generation", "--engine", f"{factory}:make_broken", *FAST)
    assert code == 1 and out.startswith("FINDING: positions-by-block")


def test_out_writes_the_reports_and_a_manifest(capsys, tmp_path):
    out_dir = tmp_path / "report"
    code, out, _ = run_cli(capsys, "generation", "--engine", "toy:shared-stream", *FAST, "--out", str(out_dir))
    assert code == 1
    assert _verdict(json.loads((out_dir / "report.json").read_text())) == "FINDING"
    manifest = json.loads((out_dir / ".spectr-audit-run.json").read_text())
    assert "report.json" in manifest["files"] and manifest["complete"] is True
    assert all((out_dir / name).is_file() for name in manifest["files"])
    assert f"reports: {out_dir / 'report.json'}" in out or "reports: " in out
    # a second run replaces the first one's files, saying so
    code, _, err = run_cli(capsys, "generation", "--engine", "toy", *FAST, "--out", str(out_dir), "--arms", "single")
    assert code == 0 and "removed the report files of an earlier run" in err
    assert _verdict(json.loads((out_dir / "report.json").read_text())) == "INCONCLUSIVE"


def test_ctrl_c_writes_what_finished_and_resume_reaches_the_same_verdict(capsys, tmp_path, factory):
    spec = f"{factory}:make_interrupting"
    common = ["generation", "--engine", spec, *FAST, "--min-detectable-tv", "0.5"]
    code, fresh, _ = run_cli(capsys, *common, "--json")
    assert code == 0
    fresh = json.loads(fresh)
    store, out_dir = tmp_path / "audit.sqlite", tmp_path / "out"
    (tmp_path / "interrupt").write_text("")
    code, out, err = run_cli(capsys, *common, "--store", str(store), "--out", str(out_dir))
    assert code == 130
    assert out.splitlines()[0].startswith("INCONCLUSIVE (INCOMPLETE): ") and out.splitlines()[0].endswith("exit 130")
    assert "interrupted (Ctrl-C): INCOMPLETE: the result covers the 2 jobs that finished" in err
    assert "--resume" in err
    partial = json.loads((out_dir / "report.json").read_text())
    assert (partial.get("incomplete") or partial.get("result", {}).get("incomplete")) is True
    assert json.loads((out_dir / ".spectr-audit-run.json").read_text())["complete"] is False
    code, out, _ = run_cli(capsys, *common, "--store", str(store), "--resume", "--json")
    assert code == 0
    resumed = json.loads(out)
    for key in ("verdict", "pvalue", "test", "num_tokens", "num_jobs"):
        assert resumed[key] == fresh[key], key
    # another configuration cannot resume this store
    code, _, err = run_cli(capsys, "generation", "--engine", spec, "--max-new-tokens", "13", "--rounds", "1",
                           "--store", str(store), "--resume")
    assert code == 2 and "resume" in err and "max_new_tokens" in err


def test_a_suite_of_generation_cases(capsys, tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(textwrap.dedent('''
        [[generation]]
        name = "correct"
        engine = "toy"
        max_new_tokens = 12
        min_detectable_tv = 0.5

        [[generation]]
        name = "shared-stream"
        engine = "toy:shared-stream"
        max_new_tokens = 12
    '''))
    out_dir = tmp_path / "out"
    code, out, err = run_cli(capsys, "generation", "--suite", str(path), "--out", str(out_dir))
    assert code == 0, err
    first = out.splitlines()[0]
    assert first.startswith("spectr-audit generation: suite 'mine': 2 of 2 cases in ")
    assert "1 findings, 0 inconclusive, 0 not as expected -> PASS: exit 0" in first
    assert "  shared-stream: FINDING: shared-stream against toy target" in out and "(expected finding: as expected)" in out
    summary = json.loads((out_dir / "report.json").read_text())
    assert summary["kind"] == "generation-suite" and summary["passed"] is True
    assert _verdict(json.loads((out_dir / "shared-stream" / "report.json").read_text())) == "FINDING"
    code, out, _ = run_cli(capsys, "generation", "--suite", str(path), "--json", "--progress", "none")
    assert code == 0 and [r["as_expected"] for r in json.loads(out)["results"]] == [True, True]


def test_the_builtin_generation_suite_passes(capsys):
    code, out, err = run_cli(capsys, "generation", "--suite", "generation")
    assert code == 0, out + err
    assert "0 not as expected -> PASS" in out.splitlines()[0]
    assert "  auditing toy-correct (toy)" in err


def test_run_points_a_generation_suite_at_the_generation_command(capsys, tmp_path):
    code, _, err = run_cli(capsys, "run", "--suite", "generation", "--out", str(tmp_path / "out"))
    assert code == 2
    assert "--suite: suite 'generation' holds generation audits only" in err
    assert "spectr-audit generation --suite generation" in err


def test_list_shows_the_toy_engine_and_its_slips(capsys):
    from spectr_audit.generation.library import SLIPS
    from spectr_audit.generation.library.request_slips import REQUEST_SLIPS
    from spectr_audit.generation.library.serving import SERVING_SLIPS

    code, out, _ = run_cli(capsys, "list")
    assert code == 0
    section = out.split("generation engines", 1)[1].split("suites:", 1)[0]
    specs = [line.split()[0] for line in section.splitlines()[1:] if line.strip()]
    assert specs == (["toy"] + [f"toy:{name}" for name in SLIPS] + [f"toy:{name}" for name in SERVING_SLIPS]
                     + ["toy-requests"] + [f"toy-requests:{name}" for name in REQUEST_SLIPS])
    assert "generation     (generation audits: spectr-audit generation --suite generation)" in out
    code, out, _ = run_cli(capsys, "list", "--json")
    engines = {e["spec"]: e["expected"] for e in json.loads(out)["generation_engines"]}
    assert engines["toy"] == engines["toy-requests"] == "pass"
    assert {engines[f"toy:{name}"] for name in [*SLIPS, *SERVING_SLIPS]} == {"finding"}
    # a per-request seed ignored changes no row's law: only the determinism line shows it, not the verdict
    assert engines["toy-requests:seed-ignored"] == "pass"
    assert {engines[f"toy-requests:{name}"] for name in REQUEST_SLIPS if name != "seed-ignored"} == {"finding"}


def test_help_states_the_engines_the_suites_and_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generation", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for needle in ("toy:SLIP", "package.module:factory", "path/file.py:factory", "not under `spectr-audit run`",
                   "exit codes:", "130  interrupted (Ctrl-C)", "3  INCONCLUSIVE, with --fail-on-inconclusive"):
        assert needle in text, needle
