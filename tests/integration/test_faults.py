"""Faults and hostile input: each gets exit 2 or an error result with a clear message, no traceback,
and nothing already done is lost.

One test (or a few) per fault; docs/guide/faults.md lists what each now does.  Most call
``spectr_audit.cli.main`` in-process; the Ctrl-C, broken-pipe and "nothing allocated" tests run a
real ``spectr-audit`` subprocess, as a user would.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import torch
import pytest

from spectr_audit.cli import main

#: Third-party verifiers as a user writes them: each breaks one rule.
HOSTILE = textwrap.dedent(
    """
    import time
    import torch
    from spectr_audit.registry import load_verifier

    _speculative = load_verifier("speculative")


    def halve(draft_tokens, draft_probs, target_probs, generator):
        out = _speculative.verify(draft_tokens, draft_probs, target_probs, generator)
        target_probs[..., 0] *= 0.5  # in place: the engine's buffer is now wrong
        return out


    def ignores_generator(draft_tokens, draft_probs, target_probs, generator):
        return _speculative.verify(draft_tokens, draft_probs, target_probs, None)  # torch's global generator


    def never_returns(draft_tokens, draft_probs, target_probs, generator):
        while True:
            pass


    def never_returns_loud(draft_tokens, draft_probs, target_probs, generator):
        import sys
        print("looping", file=sys.stderr, flush=True)
        while True:
            pass


    def honest(draft_tokens, draft_probs, target_probs, generator):
        return _speculative.verify(draft_tokens, draft_probs, target_probs, generator)


    def slow(draft_tokens, draft_probs, target_probs, generator):
        time.sleep(0.05)
        return _speculative.verify(draft_tokens, draft_probs, target_probs, generator)
    """
)


def _interruptible() -> None:
    """In the child before it starts: Ctrl-C (SIGINT) at its default and not blocked.  A child inherits an ignored
    SIGINT and a blocked one from the test process (a shell that starts the tests in the background without job
    control ignores it; a library may block it in the thread that forks), and Python then leaves it so."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.fixture
def hostile(tmp_path) -> Path:
    path = tmp_path / "hostile.py"
    path.write_text(HOSTILE)
    return path


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "internal error" not in captured.err, captured.err
    return code, captured.out, captured.err


SEED_CASE = ("--draft", "0.6,0.4", "--target", "0.3,0.7")


def spectr_audit_cmd(*argv) -> list[str]:
    return [sys.executable, "-m", "spectr_audit", *map(str, argv)]


# ---------------------------------------------------------------------------------------------
# Sizes: the memory budget
# ---------------------------------------------------------------------------------------------


def test_a_dirichlet_vocabulary_of_a_billion_is_refused_before_it_is_allocated():
    # A subprocess, so that its peak memory can be read: an allocation of the 8 GB table would show.
    for spec in ("dirichlet:vocab_size=1000000000", "dirichlet:vocab_size=1e9"):
        done = subprocess.run(spectr_audit_cmd("audit", "--verifier", "kseq", "--draft", spec, "--target", "0.3,0.7",
                                               "--num-drafts", "2"), capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and "ArrayMemoryError" not in done.stderr
        assert "1,000,000,000 float64 probabilities" in done.stderr and "44.7 GiB" in done.stderr
        assert "above the memory budget of" in done.stderr and "--max-memory" in done.stderr
    peak_bytes = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    assert peak_bytes < 3 * 2**30  # torch and scipy loaded, no 8 GB table


def test_the_budget_is_the_one_given(capsys):
    # 2 GiB refuses the 7.5 GiB Dirichlet table as well, and names 2 GiB; a small model passes under it.
    code, _, err = run_cli(capsys, "audit", "--verifier", "kseq", "--draft", "dirichlet:vocab_size=200000000",
                           "--target", "0.3,0.7", "--num-drafts", "2", "--max-memory", "2GiB")
    assert code == 2 and "above the memory budget of 2.0 GiB" in err and "--draft.dirichlet" in err
    code, _, err = run_cli(capsys, "audit", "--verifier", "kseq", *SEED_CASE, "--num-drafts", "2",
                           "--max-memory", "2GiB")
    assert code == 0, err


def test_a_markov_table_over_the_budget_is_refused_at_the_model(capsys):
    # markov V = 5000: (V + 1) x V float64 rows, about 1.1 GiB with its copies: over a 1 GiB budget.
    code, _, err = run_cli(capsys, "audit", "--verifier", "speculative", "--draft", "markov:vocab_size=5000",
                           "--target", "markov:vocab_size=5000,seed=3", "--num-drafts", "1", "--draft-len", "3",
                           "--max-memory", "1GiB")
    assert code == 2
    assert "(5000 + 1)^1 = 5,001 rows of 5,000 float64 probabilities" in err and "1.0 GiB" in err


def test_an_enumeration_over_the_budget_is_refused_before_the_audit(capsys):
    # V = 300, L = 3: 300^3 draft sequences with their conditionals (the exact audit's grid), terabytes.
    code, _, err = run_cli(capsys, "audit", "--verifier", "speculative", "--draft", "markov:vocab_size=300",
                           "--target", "markov:vocab_size=300,seed=3", "--num-drafts", "1", "--draft-len", "3")
    assert code == 2
    assert "case 'cli', verifier 'speculative' (K=1, L=3, V=300)" in err and "TiB" in err
    assert "above the memory budget of" in err


@pytest.mark.slow
def test_the_markov_v5000_l3_case_of_the_report_is_refused(capsys):
    # The reported command, with the default budget: the model fits (about 1.1 GiB), the audit does not.
    code, _, err = run_cli(capsys, "audit", "--verifier", "speculative", "--draft", "markov:vocab_size=5000",
                           "--target", "markov:vocab_size=5000,seed=3", "--num-drafts", "1", "--draft-len", "3")
    assert code == 2 and "PiB" in err and "above the memory budget of" in err


def test_a_billion_drafts_are_refused_at_once(capsys):
    start = time.perf_counter()
    code, _, err = run_cli(capsys, "audit", "--verifier", "kseq", *SEED_CASE, "--num-drafts", "1000000000")
    assert code == 2 and time.perf_counter() - start < 30
    assert "K=1000000000" in err and "TiB" in err and "above the memory budget of" in err


@pytest.mark.parametrize("argv, message", [
    (("--verifier", "kseq", "--num-drafts", "10000"), "2^10000 draft tuples"),
    (("--verifier", "speculative", "--num-drafts", "1", "--draft-len", "1000000"), "bytes, above the memory budget"),
])
def test_huge_k_or_l_are_refused_without_overflow(capsys, argv, message):
    code, out, err = run_cli(capsys, "audit", *SEED_CASE, *argv)
    assert code == 2, out + err
    assert "OverflowError" not in out + err and message in err


def test_bound_with_ten_thousand_drafts_solves_its_lp_without_overflow(capsys):
    code, out, err = run_cli(capsys, "bound", *SEED_CASE, "--num-drafts", "10000", "--json")
    assert code == 0, err
    bound = json.loads(out)
    # q(T) + 1 - p(T)^K is smallest at T = {} for K this large: alpha* = 1, and the LP agrees.
    assert bound["optimal_acceptance"] == pytest.approx(1.0, abs=1e-12)
    assert bound["lp_value"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("support, num_drafts", [(2, 5), (3, 8), (4, 6), (2, 30), (3, 40), (5, 9)])
def test_large_k_set_law_matches_the_exact_multinomial_one(support, num_drafts):
    # The log-space path (used above K = 170, where K! overflows a float) against the exact integer one,
    # where both are defined.
    from spectr_audit.bounds import acceptance

    draft = np.random.default_rng(support * 100 + num_drafts).dirichlet(np.ones(support))
    exact = acceptance._iid_set_probs(draft, num_drafts)
    logs = acceptance._iid_set_probs_log(draft, list(range(support)), num_drafts)
    assert set(exact) == set(logs)
    assert max(abs(exact[s] - logs[s]) for s in exact) < 1e-12
    assert math.isclose(sum(logs.values()), 1.0, abs_tol=1e-12)


def test_a_suite_with_a_billion_drafts_is_a_suite_error_naming_the_case(capsys, tmp_path):
    suite = tmp_path / "huge.toml"
    suite.write_text('[[case]]\nname = "small"\ndraft = [0.6, 0.4]\ntarget = [0.3, 0.7]\nnum_drafts = 2\n\n'
                     '[[case]]\nname = "huge"\ndraft = [0.6, 0.4]\ntarget = [0.3, 0.7]\nnum_drafts = 1000000000\n')
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "run", "--suite", suite, "--verifier", "kseq", "--out", out)
    assert code == 2
    assert f"suite file {str(suite)!r}: case 'huge', verifier 'kseq' (K=1000000000" in err
    assert "above the memory budget of" in err
    assert not (out / "report.json").exists()  # refused before any audit: nothing written


def test_the_python_api_and_check_verifier_keep_the_budget():
    import spectr_audit
    from spectr_audit.run.budget import MemoryBudgetExceeded
    from spectr_audit.run.conformance import check_verifier
    from spectr_audit.run.suite import parse_suite

    huge = parse_suite({"case": [{"name": "huge", "draft": [0.6, 0.4], "target": [0.3, 0.7],
                                  "num_drafts": 1_000_000_000}]})
    with pytest.raises(MemoryBudgetExceeded, match="case 'huge'"):
        spectr_audit.audit("kseq", suite=huge)
    with pytest.raises(MemoryBudgetExceeded, match="K=1000000000"):
        check_verifier("kseq", num_drafts=1_000_000_000)
    with pytest.raises(MemoryBudgetExceeded, match="num_samples|rows"):
        check_verifier("kseq", num_drafts=2, num_samples=10**12)
    with pytest.raises(spectr_audit.InvalidArgument, match="max_memory"):
        spectr_audit.audit("kseq", suite=huge, max_memory="lots")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_the_estimate_bounds_the_memory_an_exact_audit_takes():
    # The budget refuses by an estimate: it must not be below what an audit really takes (the peak
    # resident memory of a fresh process during one exact audit of 10^4 draft tuples, over its start).
    code = textwrap.dedent(
        """
        import json, resource, torch
        torch.set_num_threads(1)
        from spectr_audit.drafting.models import ContextFreeModel
        from spectr_audit.registry import load_verifier
        from spectr_audit.run import budget
        from spectr_audit.run.runner import AuditOptions, audit_case
        from spectr_audit.run.suite import Case, model_from_spec
        case = Case(name="m", draft_model=model_from_spec({"dirichlet": {"vocab_size": 100, "seed": 1}}, "d"),
                    target_model=model_from_spec({"dirichlet": {"vocab_size": 100, "seed": 2}}, "t"),
                    num_drafts=2, checks=("exact",))
        verifier = load_verifier("kseq")
        needs = budget.audit_needs(verifier, case, AuditOptions())
        def status(key):
            with open("/proc/self/status") as handle:
                return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(key + ":"))
        before = status("VmRSS")
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets the peak (VmHWM) to the current RSS
        result = audit_case(verifier, case, AuditOptions())
        print(json.dumps({"error": result.error, "estimate": 2 ** budget._lgsum(*(n.log2_bytes for n in needs)),
                          "used": status("VmHWM") - before}))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["error"] is None
    assert measured["used"] > 20 * 2**20  # the audit did allocate (the comparison means something)
    assert measured["estimate"] >= measured["used"]


# ---------------------------------------------------------------------------------------------
# The output folder
# ---------------------------------------------------------------------------------------------


def test_out_that_is_a_file_or_lies_under_one_is_a_usage_error(capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    code, _, err = run_cli(capsys, "run", "--suite", "default", "--out", afile)
    assert code == 2 and f"--out: {str(afile)!r} is a file, not a folder" in err
    code, _, err = run_cli(capsys, "run", "--suite", "default", "--out", afile / "reports")
    assert code == 2 and f"lies under {str(afile)!r}, which is a file" in err
    assert afile.read_text() == "not a folder"


TINY_SUITE = '[[case]]\nname = "seed"\ndraft = [0.6, 0.4]\ntarget = [0.3, 0.7]\nnum_drafts = 1\n'


def test_a_folder_of_an_earlier_run_holds_only_this_runs_reports(capsys, tmp_path):
    suite = tmp_path / "tiny.toml"
    suite.write_text(TINY_SUITE)
    out = tmp_path / "out"
    args = ("run", "--suite", suite, "--verifier", "speculative", "--out", out, "--max-samples", "500")
    code, _, err = run_cli(capsys, *args, "--html")
    assert code == 0, err
    assert {p.name for p in out.iterdir()} == {"report.json", "report.md", "report.html", ".spectr-audit-run.json"}
    (out / "notes.txt").write_text("mine")  # not a report: never touched
    code, _, err = run_cli(capsys, *args)  # no --html this time
    assert code == 0, err
    assert "removed the report files of an earlier run" in err and "report.html" in err
    assert {p.name for p in out.iterdir()} == {"report.json", "report.md", "notes.txt", ".spectr-audit-run.json"}
    assert json.loads((out / ".spectr-audit-run.json").read_text())["files"] == ["report.json", "report.md"]
    # A file of a report's name that spectr-audit did not write: the run refuses and leaves it.
    (out / "report.html").write_text("<html>my own page</html>")
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and "'report.html', which spectr-audit did not write" in err
    assert (out / "report.html").read_text() == "<html>my own page</html>"


def test_reports_are_written_atomically(tmp_path, monkeypatch):
    from spectr_audit.reports.json_report import write_json
    from spectr_audit.results import AuditReport

    path = tmp_path / "report.json"
    write_json(AuditReport(results=(), suite="old"), path)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        write_json(AuditReport(results=(), suite="new"), path)
    assert json.loads(path.read_text())["suite"] == "old"  # the old report intact
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # and no temporary left


# ---------------------------------------------------------------------------------------------
# Ctrl-C and broken pipes
# ---------------------------------------------------------------------------------------------


def test_ctrl_c_during_a_run_writes_the_finished_results_marked_incomplete(tmp_path, hostile):
    # An earlier run's reports sit in --out: after the interrupted run none of them may look current.
    out = tmp_path / "out"
    out.mkdir()
    earlier = {"passed": True, "suite": "earlier", "spectr_audit_version": "0.1.0", "meta": {}, "results": []}
    (out / "report.json").write_text(json.dumps(earlier))
    (out / "report.html").write_text("<html>spectr-audit report: suite earlier</html>")
    suite = tmp_path / "many.toml"
    suite.write_text("".join(f'[[case]]\nname = "case{i}"\ndraft = [0.6, 0.4]\ntarget = [0.3, 0.7]\nnum_drafts = 1\n\n'
                             for i in range(12)))
    proc = subprocess.Popen(spectr_audit_cmd("run", "--suite", suite, "--verifier", f"{hostile}:slow", "--out", out,
                                             "--progress", "lines", "--max-samples", "500"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while sum("auditing" in line for line in lines) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert proc.poll() is None, "".join(lines)
    proc.send_signal(signal.SIGINT)  # two audits finished, the third under way
    proc.wait(timeout=120)
    reader.join(timeout=10)
    stderr = "".join(lines)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert "interrupted (Ctrl-C)" in stderr and "INCOMPLETE" in stderr
    report = json.loads((out / "report.json").read_text())
    info = report["meta"]["incomplete"]
    assert report["suite"] != "earlier" and report["passed"] is False
    assert info["planned"] == 12 and 2 <= info["completed"] == len(report["results"]) < 12
    assert all("error" not in r and r["checks"] for r in report["results"])  # each finished result whole
    assert "INCOMPLETE" in (out / "report.md").read_text()
    assert not (out / "report.html").exists()  # the earlier run's page is gone, not left looking current
    assert json.loads((out / ".spectr-audit-run.json").read_text()) == {"files": ["report.json", "report.md"],
                                                                         "complete": False}


def test_a_fatal_error_during_a_run_writes_the_finished_results_marked_incomplete(capsys, tmp_path, monkeypatch):
    # An error outside any one audit (here: the runner's own call of the second audit fails).
    from spectr_audit.run import runner

    real_audit_case, calls = runner.audit_case, []

    def failing(verifier, case, options):
        calls.append(case.name)
        if len(calls) == 2:
            raise RuntimeError("disk on fire")
        return real_audit_case(verifier, case, options)

    monkeypatch.setattr(runner, "audit_case", failing)
    suite = tmp_path / "three.toml"
    suite.write_text("".join(f'[[case]]\nname = "case{i}"\ndraft = [0.6, 0.4]\ntarget = [0.3, 0.7]\nnum_drafts = 1\n\n'
                             for i in range(3)))
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "run", "--suite", suite, "--verifier", "speculative", "--out", out, "--html")
    assert code == 2 and "error: RuntimeError: disk on fire" in err and "INCOMPLETE" in err
    report = json.loads((out / "report.json").read_text())
    assert report["meta"]["incomplete"] == {"reason": "stopped by RuntimeError: disk on fire", "completed": 1,
                                            "planned": 3}
    assert [r["case"] for r in report["results"]] == ["case0"] and report["passed"] is False
    for name in ("report.md", "report.html"):
        assert "INCOMPLETE: the run was stopped by RuntimeError: disk on fire; this report holds the 1 of 3" in (
            out / name).read_text()


def test_ctrl_c_during_an_audit_exits_130_without_a_traceback(hostile):
    proc = subprocess.Popen(spectr_audit_cmd("audit", "--verifier", f"{hostile}:never_returns_loud", *SEED_CASE,
                                             "--num-drafts", "1", "--verifier-timeout", "0"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible)
    first = proc.stderr.readline()  # the verifier's own line: inside its endless loop
    assert first.strip() == "looping"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in stderr and "interrupted (Ctrl-C)" in stderr


def test_a_closed_pipe_is_no_traceback():
    # `spectr-audit audit ... --json | head`: the reader goes away; the command's exit code stands.
    proc = subprocess.Popen(spectr_audit_cmd("audit", "--verifier", "kseq", *SEED_CASE, "--num-drafts", "2", "--json"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # no reader at all: the first write gets EPIPE
    stderr = proc.stderr.read().decode()
    proc.wait(timeout=300)
    assert "BrokenPipeError" not in stderr and "Traceback" not in stderr, stderr
    assert proc.returncode == 0
    done = subprocess.run(f"{' '.join(spectr_audit_cmd('list'))} | head -n 1", shell=True, capture_output=True,
                          text=True, timeout=300)
    assert done.stdout.startswith("verifiers") and "Traceback" not in done.stderr


# ---------------------------------------------------------------------------------------------
# Verifiers that break the contract: in-place mutation, ignoring the generator, never returning
# ---------------------------------------------------------------------------------------------


def test_why_an_in_place_halving_was_missed_and_is_caught_now():
    # The contract inputs forbid token 0 (target probability 0), so halving target_probs[..., 0] leaves
    # them unchanged: the old comparison could not see it.  Inputs with every probability positive can.
    import torch

    from spectr_audit.contract.verifier import FunctionVerifier
    from spectr_audit.drafting.harness import draft
    from spectr_audit.registry import load_verifier
    from spectr_audit.run import conformance, guard

    speculative = load_verifier("speculative")

    def halve(draft_tokens, draft_probs, target_probs, generator):
        out = speculative.verify(draft_tokens, draft_probs, target_probs, generator)
        target_probs[..., 0] *= 0.5
        return out

    verifier = FunctionVerifier(halve, name="halve")
    draft_model, target_model = conformance._contract_models(1, "iid")
    batch = draft(draft_model, target_model, torch.zeros(64, 0, dtype=torch.int64), 1, 1, torch.Generator())
    before = batch.target_probs.clone()
    verifier.verify(batch.draft_tokens, batch.draft_probs, batch.target_probs, torch.Generator())
    assert torch.equal(before, batch.target_probs) and bool((before[..., 0] == 0).all())  # invisible there
    assert guard.dense_mutations(verifier, 5, 1, 1) == [
        "verify modified target_probs in place (on drafts with every probability positive)"]
    report = conformance.check_verifier(halve, num_drafts=1, num_samples=2000, raise_on_failure=False)
    assert not report.passed
    assert any(c.name == "inputs unchanged" and not c.passed for c in report.checks)


@pytest.mark.parametrize("name, check", [("halve", "inputs-unchanged"), ("ignores_generator", "deterministic")])
def test_audit_and_run_flag_a_verifier_that_breaks_the_contract(capsys, tmp_path, hostile, name, check):
    code, out, err = run_cli(capsys, "audit", "--verifier", f"{hostile}:{name}", *SEED_CASE, "--num-drafts", "1",
                             "--max-samples", "500", "--json")
    assert code == 1, err
    (result,) = json.loads(out)["results"]
    failed = {c["name"]: c for c in result["checks"] if not c["passed"]}
    assert check in failed, result
    assert ("in place" if check == "inputs-unchanged" else "global generator") in failed[check]["detail"]
    suite = tmp_path / "tiny.toml"
    suite.write_text(TINY_SUITE)
    code, out, err = run_cli(capsys, "run", "--suite", suite, "--verifier", f"{hostile}:{name}",
                             "--out", tmp_path / "out", "--max-samples", "500", "--json")
    assert code == 1
    assert check in {c["name"] for c in json.loads(out)["results"][0]["checks"] if not c["passed"]}


def test_an_honest_verifier_and_every_builtin_pass_the_probe():
    from spectr_audit.registry import entries, load_verifier
    from spectr_audit.run.guard import probe_checks
    from spectr_audit.run.suite import parse_suite

    suite = parse_suite({"case": [
        {"name": "tok", "draft": [0.5, 0.3, 0.2, 0.0], "target": [0.0, 0.3, 0.3, 0.4], "num_drafts": [1, 2, 3]},
        {"name": "seq", "draft": {"markov": {"vocab_size": 3, "seed": 1}}, "target": {"markov": {"vocab_size": 3, "seed": 2}},
         "num_drafts": [1, 2], "draft_len": 2},
    ]})
    probed = 0
    for entry in entries():
        if entry.namespace not in ("builtin", "broken", "historic"):  # engines: their own tests
            continue
        try:
            verifier = load_verifier(f"{entry.namespace}:{entry.name}")
        except Exception:  # an optional extra that is not installed
            continue
        for case in suite.cases:
            if not verifier.supports(case.num_drafts, case.draft_len):
                continue
            if verifier.draft_scheme == "without_replacement" and case.draft_len > 1:
                continue
            checks = probe_checks(verifier, case, seed=3)
            assert all(c.passed for c in checks), (verifier.name, case.name, [c.detail for c in checks])
            probed += len(checks) > 0
    assert probed > 40


def test_a_verifier_that_never_returns_is_stopped_and_the_other_results_kept(capsys, tmp_path, hostile):
    suite = tmp_path / "tiny.toml"
    suite.write_text(TINY_SUITE)
    start = time.perf_counter()
    code, out, err = run_cli(capsys, "run", "--suite", suite, "--verifier", f"{hostile}:never_returns",
                             "--verifier", f"{hostile}:honest", "--out", tmp_path / "out", "--max-samples", "500",
                             "--verifier-timeout", "1", "--json")
    assert time.perf_counter() - start < 120
    assert code == 4, err  # an error, not a finding: its own exit status
    results = {r["verifier"]: r for r in json.loads(out)["results"]}
    stuck = results["never_returns"]
    assert stuck["case"] == "seed"
    assert stuck["error"].startswith("VerifierTimeout: verifier 'never_returns': verify did not return within 1 s")
    assert results["honest"]["passed"] is True  # kept, and audited in full


def test_check_verifier_stops_a_verifier_that_never_returns(hostile):
    import importlib.util

    from spectr_audit.run.conformance import check_verifier

    spec = importlib.util.spec_from_file_location("hostile_mod", hostile)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = check_verifier(module.never_returns, num_drafts=1, num_samples=500, verifier_timeout=0.5,
                            raise_on_failure=False)
    assert not report.passed
    assert "did not return within 0.5 s" in report.message()


def test_the_time_limit_stops_pure_python_outside_the_main_thread():
    # The fallback where SIGALRM cannot be used: a watchdog raising in the calling thread.
    from spectr_audit.run.guard import VerifierTimeout, call_limit

    outcome: dict = {}

    def spin():
        start = time.monotonic()
        try:
            with call_limit(0.3, "stuck"):
                for _ in itertools.count():
                    pass
        except VerifierTimeout as exc:
            outcome["error"] = str(exc)
        outcome["seconds"] = time.monotonic() - start
        # after the limit, nothing more is delivered
        total = sum(range(10**6))
        outcome["after"] = total

    thread = threading.Thread(target=spin)
    thread.start()
    thread.join(timeout=30)
    assert outcome.get("error") == "stuck" and outcome["seconds"] < 5 and outcome["after"] == sum(range(10**6))


def test_the_time_limit_leaves_a_fast_call_alone_and_restores_an_outer_timer():
    from spectr_audit.run.guard import call_limit

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with call_limit(5, "never"):
            sum(range(1000))
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < remaining <= 0.5  # the outer timer re-armed
        time.sleep(0.7)
        assert fired == [True]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------------------------------------
# The one-call API, and the pytest plugin's own options
# ---------------------------------------------------------------------------------------------


def test_the_one_call_api_exists_at_the_top_level():
    import spectr_audit
    from spectr_audit.run.suite import parse_suite

    suite = parse_suite({"case": [{"name": "seed", "draft": [0.6, 0.4], "target": [0.3, 0.7], "num_drafts": 2}]})
    report = spectr_audit.audit("kseq", suite=suite)
    spectr_audit.assert_passed(report)
    assert report.passed and report.results[0].verifier == "kseq"


pytest_plugins = ["pytester"]


@pytest.mark.parametrize("option, message", [
    (("--spectr-samples", "-1"), "--spectr-samples: expected an integer >= 100, got '-1'"),
    (("--spectr-alpha", "2"), "--spectr-alpha: expected a number in (0, 1), got '2'"),
    (("--spectr-report", "{afile}/report.json"), "lies under '{afile}', which is a file"),
    (("--spectr-report", "{tmp}"), "is a folder; give the path of the report file"),
])
def test_the_plugins_own_bad_options_are_usage_errors(pytester, option, message):
    afile = pytester.path / "afile"
    afile.write_text("x")
    fill = {"afile": str(afile), "tmp": str(pytester.path)}
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *(o.format(**fill) for o in option))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message.format(**fill) in result.stderr.str()
    assert "Traceback" not in result.stderr.str()


def test_an_unwritable_ini_report_is_a_usage_error(pytester):
    (pytester.path / "afile").write_text("x")
    pytester.makeini("[pytest]\nspectr_audit_report = afile/report.md\n")
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "ini option spectr_audit_report" in result.stderr.str() and "which is a file" in result.stderr.str()


def test_the_time_limit_leaves_the_verifiers_object_as_it_was():
    # An adapter of the contract limits the calls: the verifier's own object gains no attributes, and a class
    # with __slots__ (whose instances take no new attributes) is limited as well as any other.  The adapter is
    # a Verifier that declares what the verifier declares; it does not pass for the verifier's class.
    from spectr_audit.contract.limited import TimeLimitedVerifier
    from spectr_audit.run.guard import VerifierTimeout, time_limited
    from spectr_audit.verifiers.speculative import SpeculativeSampling

    class Slotted(SpeculativeSampling):
        __slots__ = ()

        def verify(self, *args, **kwargs):
            time.sleep(5)

    verifier = Slotted()
    before = dict(getattr(verifier, "__dict__", {}))
    with time_limited(verifier, 0.3) as limited:
        assert isinstance(limited, TimeLimitedVerifier) and not isinstance(limited, Slotted)
        assert limited.name == verifier.name and limited.wrapped is verifier
        assert limited.has_exact_law and limited.guarantees == verifier.guarantees
        # the overridden verify is not the contract's entry point, so no audit skips its checks through the adapter
        assert not limited.standard_entry("verify") and limited.standard_entry("output_probs")
        start = time.monotonic()
        with pytest.raises(VerifierTimeout, match="verify did not return within 0.3 s"):
            limited.verify(None, None, None, None)
        assert time.monotonic() - start < 3
        assert dict(getattr(verifier, "__dict__", {})) == before  # nothing patched in
    with time_limited(verifier, None) as unlimited:
        assert unlimited is verifier


def test_the_time_limit_holds_on_every_path_the_audits_call():
    # the audits call the contract's private entry point after checking inputs once (the statistical harness),
    # and a tree verifier run on chains is reached through its chain adapter: both stay limited
    from spectr_audit.contract.chain_trees import TreeVerifierAsChain
    from spectr_audit.contract.convert import as_tree_verifier
    from spectr_audit.contract.tree import DraftTree
    from spectr_audit.run.guard import VerifierTimeout, time_limited
    from spectr_audit.verifiers.speculative import SpeculativeSampling
    from spectr_audit.verifiers.tree import TreeRecursiveRejection

    class SlowInside(SpeculativeSampling):
        def _verify(self, *args):
            time.sleep(5)

    class SlowTree(TreeRecursiveRejection):
        def _tree_output_probs(self, *args):
            time.sleep(5)

    with time_limited(SlowInside(), 0.3) as limited:
        assert limited.standard_entry("verify")
        with pytest.raises(VerifierTimeout, match="verify did not return within 0.3 s"):
            limited._verify(None, None, None, None)
    with time_limited(TreeVerifierAsChain(SlowTree()), 0.3) as limited:
        tree_verifier = as_tree_verifier(limited)  # the chain adapter's tree verifier, reached through the limit
        tree = DraftTree.chains(1, 1)
        start = time.monotonic()
        with pytest.raises(VerifierTimeout, match="did not return within 0.3 s"):
            tree_verifier.tree_output_probs(tree, torch.zeros(1, 2, dtype=torch.int64),
                                            torch.tensor([[[0.5, 0.5], [0.0, 0.0]]]),
                                            torch.tensor([[[0.5, 0.5], [0.5, 0.5]]]))
        assert time.monotonic() - start < 3


def test_the_audit_runs_the_verifier_through_the_limit_without_patching_it():
    from spectr_audit.drafting.models import ContextFreeModel
    from spectr_audit.run.runner import AuditOptions, Case, audit_case
    from spectr_audit.verifiers.speculative import SpeculativeSampling

    seen = []

    class Watching(SpeculativeSampling):
        def verify(self, *args, **kwargs):
            seen.append(sorted(vars(self)))
            return super().verify(*args, **kwargs)

    verifier = Watching()
    case = Case("tiny", ContextFreeModel(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)),
                ContextFreeModel(torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)), num_drafts=1, draft_len=1)
    result = audit_case(verifier, case, AuditOptions(verifier_timeout=30))
    assert result.error is None and result.passed
    assert seen and all(not set(names) & {"verify", "output_probs"} for names in seen)


def test_a_tree_verifier_that_never_returns_is_stopped_on_a_tree_case():
    from spectr_audit.run.runner import AuditOptions, audit_case
    from spectr_audit.run.suite import load_suite
    from spectr_audit.verifiers.tree import TreeRecursiveRejection

    class Stuck(TreeRecursiveRejection):
        name = "stuck-tree"

        def verify_tree(self, *args, **kwargs):
            time.sleep(30)

        def tree_output_probs(self, *args, **kwargs):
            time.sleep(30)

    case = next(c for c in load_suite("default").cases if c.name.startswith("tree-chains-2-2"))
    start = time.monotonic()
    result = audit_case(Stuck(), case, AuditOptions(verifier_timeout=0.5, max_samples=1_000))
    assert time.monotonic() - start < 10
    assert result.error is not None and result.error.startswith("VerifierTimeout: verifier 'stuck-tree': "), result.error
    assert "did not return within 0.5 s" in result.error


def test_check_verifier_stops_a_tree_verifier_that_never_returns():
    from spectr_audit.run.conformance import check_verifier
    from spectr_audit.verifiers.tree import TreeRecursiveRejection

    class Stuck(TreeRecursiveRejection):
        name = "stuck-tree"

        def verify_tree(self, *args, **kwargs):
            time.sleep(30)

    start = time.monotonic()
    report = check_verifier(Stuck(), tree="chains:2,2", num_samples=500, verifier_timeout=0.5, raise_on_failure=False)
    assert time.monotonic() - start < 25
    assert not report.passed
    assert "did not return within 0.5 s" in report.message()


def test_a_tree_check_refuses_a_memory_budget_it_would_not_hold():
    from spectr_audit.errors import InvalidArgument
    from spectr_audit.run.conformance import check_verifier

    with pytest.raises(InvalidArgument, match="^max_memory: a tree check is not sized by the memory budget"):
        check_verifier("tree-rrs", tree="chains:2,2", max_memory="1GiB")
