"""The command line: commands, JSON output, exit codes."""

from __future__ import annotations

import json
import math

import pytest

from spectr_audit.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_audit_json_for_the_seed_case(capsys):
    code, out, _ = run_cli(capsys, "audit", "--verifier", "kseq", "--draft", "0.6,0.4", "--target", "0.3,0.7",
                           "--num-drafts", "2", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["passed"] is True
    (result,) = report["results"]
    assert result["verifier"] == "kseq" and result["passed"] is True
    metrics = result["metrics"]
    assert metrics["optimal_acceptance"] == pytest.approx(0.94, abs=1e-9)
    assert metrics["acceptance"] == pytest.approx(0.62 + 0.4 * math.sqrt(0.34), abs=1e-12)
    assert metrics["tv_distance"] <= 1e-12
    assert {c["name"] for c in result["checks"]} >= {"exact", "acceptance<=optimal", "spectr-guarantee"}
    for check in result["checks"]:
        assert set(check) >= {"name", "passed", "value", "threshold"}


def test_audit_of_a_markov_sequence_case(capsys):
    code, out, _ = run_cli(capsys, "audit", "--verifier", "spectr-tree", "--draft", "markov:vocab_size=3,seed=1",
                           "--target", "markov:vocab_size=3,seed=2", "--num-drafts", "2", "--draft-len", "2",
                           "--prefix", "1", "--json")
    assert code == 0
    metrics = json.loads(out)["results"][0]["metrics"]
    assert metrics["tv_distance"] <= 1e-12 and 1 <= metrics["block_efficiency"] <= 3


def test_audit_of_a_broken_third_party_verifier_exits_1(capsys, tmp_path):
    path = tmp_path / "naive.py"
    path.write_text(
        "import torch\n"
        "from spectr_audit.verifiers._walk import NodeRule, ChainWalkVerifier, gather_tokens, normalise\n"
        "class Rule(NodeRule):\n"
        "    def __call__(self, tokens, survivors, d, t):\n"
        "        a = (gather_tokens(t, tokens) / gather_tokens(d, tokens)).clamp(max=1.0)\n"
        "        return a, normalise((t - d).clamp(min=0), t)\n"
        "class Naive(ChainWalkVerifier):\n"
        "    name = 'naive'\n"
        "    max_draft_len = 1\n"
        "    rule = Rule()\n"
    )
    code, out, _ = run_cli(capsys, "audit", "--verifier", f"{path}:Naive", "--draft", "1,0", "--target", "0.5,0.5",
                           "--num-drafts", "2", "--json")
    assert code == 1
    result = json.loads(out)["results"][0]
    assert result["passed"] is False
    assert result["metrics"]["token_tv_distance"] == pytest.approx(0.25, abs=1e-12)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["audit", "--verifier", "kseq", "--draft", "0.6,0.5", "--target", "0.3,0.7", "--num-drafts", "2"], "--draft: probabilities must sum to 1"),
        (["audit", "--verifier", "kseq", "--draft", "0.6,0.4", "--target", "0.2,0.3,0.5", "--num-drafts", "2"], "vocab sizes differ"),
        (["audit", "--verifier", "kseq", "--draft", "a,b", "--target", "0.3,0.7", "--num-drafts", "2"], "--draft: expected comma-separated"),
        (["audit", "--verifier", "kseq", "--draft", "0.6,0.4", "--target", "0.3,0.7", "--num-drafts", "0"], "--num-drafts: must be >= 1"),
        (["audit", "--verifier", "nope", "--draft", "0.6,0.4", "--target", "0.3,0.7", "--num-drafts", "2"], "is neither a built-in name"),
        (["audit", "--verifier", "speculative", "--draft", "0.6,0.4", "--target", "0.3,0.7", "--num-drafts", "2"], "--num-drafts: verifier 'speculative' supports"),
        (["audit", "--verifier", "kseq", "--draft=-0.1,1.1", "--target", "0.3,0.7", "--num-drafts", "2"], "non-negative"),
        (["audit", "--verifier", "kseq", "--draft", "markov:vocab_size=3,bogus=1", "--target", "0.3,0.7", "--num-drafts", "2"], "unknown key"),
        (["bound", "--draft", "0.6,0.4", "--target", "0.3,0.7", "--num-drafts", "-1"], "--num-drafts: must be >= 1"),
        (["run", "--suite", "no-such-suite"], "--suite: 'no-such-suite' is neither a suite name"),
    ],
)
def test_usage_errors_exit_2_with_a_named_argument(capsys, argv, message):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["audit", "--verifier", "kseq"])
    assert info.value.code == 2


def test_bound_json_closed_form_and_lp_agree(capsys):
    code, out, _ = run_cli(capsys, "bound", "--draft", "0.6,0.4", "--target", "0.3,0.7", "--num-drafts", "2", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["optimal_acceptance"] == pytest.approx(0.94, abs=1e-12)
    assert data["lp_value"] == pytest.approx(0.94, abs=1e-6)
    assert data["minimising_set"] == [0]


def test_list_names_every_verifier_of_every_namespace(capsys):
    from spectr_audit.registry import broken_names, builtin_names, engine_names, historic_names

    code, out, _ = run_cli(capsys, "list", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["namespaces"][:4] == ["builtin", "broken", "historic", "engine"]
    by_namespace = {ns: [v["name"] for v in data["verifiers"] if v["namespace"] == ns] for ns in data["namespaces"]}
    assert by_namespace["builtin"] == builtin_names()
    assert by_namespace["broken"][: len(broken_names())] == broken_names()
    assert by_namespace["historic"] == historic_names()
    assert by_namespace["engine"] == engine_names()
    kseq = next(v for v in data["verifiers"] if v["name"] == "kseq")
    assert (kseq["num_drafts"], kseq["draft_len"], kseq["draft_scheme"], kseq["exact_law"]) == ("[1, inf)", "[1, 1]", "iid", True)
    vllm = next(v for v in data["verifiers"] if v["name"] == "vllm")
    assert vllm["exact_law"] is False and vllm["extra"] == "vllm"
    assert "default" in data["suites"]


def test_list_text_aligns_columns_on_the_longest_name(capsys):
    code, out, _ = run_cli(capsys, "list")
    assert code == 0
    lines = out.splitlines()
    for namespace in ("builtin:", "broken:", "historic:", "engine:"):
        assert namespace in lines
    rows = [line for line in lines if line.startswith("  ") and ("[1, " in line or "[2, " in line)]
    assert len(rows) >= 40
    # the K column starts at one offset in every row of every namespace
    offsets = {line.index(" [", 2) for line in rows}
    assert len(offsets) == 1, offsets
    longest = max(len(line[2:].split()[0]) for line in rows)
    assert offsets == {2 + longest + 1}


def test_run_writes_reports_and_exits_by_verdict(capsys, tmp_path):
    suite = tmp_path / "tiny.toml"
    suite.write_text(
        '[suite]\nname = "tiny"\n'
        '[[case]]\nname = "seed"\ndraft = [0.6, 0.4]\ntarget = [0.3, 0.7]\nnum_drafts = [1, 2]\n'
    )
    code, out, _ = run_cli(capsys, "run", "--suite", str(suite), "--out", str(tmp_path / "out"))
    assert code == 0, out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["passed"] is True and report["suite"] == "tiny"
    assert {(r["verifier"], r["case"]) for r in report["results"]} >= {("kseq", "seed/K=2"), ("speculative", "seed/K=1")}
    assert "| kseq | seed/K=2 |" in (tmp_path / "out" / "report.md").read_text()


BLACK_BOX = (
    "from spectr_audit.verifiers.speculative import SpeculativeSampling\n"
    "_inner = SpeculativeSampling()\n"
    "def verify(draft_tokens, draft_probs, target_probs, generator):\n"
    "    out = _inner.verify(draft_tokens, draft_probs, target_probs, generator)\n"
    "    return out.num_accepted, out.draft_index, out.next_token\n"
)


def _black_box(tmp_path, *extra):
    path = tmp_path / "black_box.py"
    path.write_text(BLACK_BOX)
    return ("audit", "--verifier", f"{path}:verify", "--draft", "0.6,0.4", "--target", "0.3,0.7", "--num-drafts", "1",
            "--json", *extra)


def test_a_budget_cut_black_box_is_inconclusive_and_fails_only_on_request(capsys, tmp_path):
    code, out, _ = run_cli(capsys, *_black_box(tmp_path, "--max-samples", "5000"))
    assert code == 0  # not a finding: the run passes, the verdict says the power was missing
    result = json.loads(out)["results"][0]
    assert result["verdict"] == "INCONCLUSIVE" and result["inconclusive"] is True and result["passed"] is True
    metrics = result["metrics"]
    assert metrics["min_detectable_tv"] > metrics["requested_tv"] == 0.005
    assert 0 <= metrics["tv_lower"] <= metrics["tv_estimate"] <= metrics["tv_upper"] <= 1
    assert metrics["tv_confidence"] == pytest.approx(0.999) and metrics["stop_reason"] == "max_samples"
    assert metrics["power_at_requested_tv"] < 0.99 and metrics["planned_samples"] > 5000
    statistical = next(c for c in result["checks"] if c["name"] == "statistical")
    assert statistical["inconclusive"] is True and "INCONCLUSIVE" in statistical["detail"]
    code, _, _ = run_cli(capsys, *_black_box(tmp_path, "--max-samples", "5000", "--fail-on-inconclusive"))
    assert code == 3
    code, out, _ = run_cli(capsys, *_black_box(tmp_path, "--max-seconds", "1e-6"))
    metrics = json.loads(out)["results"][0]["metrics"]
    assert code == 0 and metrics["stop_reason"] == "max_seconds" and metrics["num_samples"] < metrics["planned_samples"]


def test_certify_tv_certifies_a_correct_black_box_and_fails_without_a_certificate(capsys, tmp_path):
    code, out, _ = run_cli(capsys, *_black_box(tmp_path, "--certify-tv", "0.05"))
    result = json.loads(out)["results"][0]
    assert code == 0 and result["verdict"] == "CERTIFIED"
    check = next(c for c in result["checks"] if c["name"] == "certified-tv")
    assert check["passed"] and check["value"] <= check["threshold"] == 0.05
    assert result["metrics"]["stop_reason"] == "certified"
    # a budget too small for the certificate: inconclusive, and a certification that is not reached fails (3)
    code, out, _ = run_cli(capsys, *_black_box(tmp_path, "--certify-tv", "0.01", "--max-samples", "4096"))
    result = json.loads(out)["results"][0]
    assert code == 3 and result["verdict"] == "INCONCLUSIVE"
    assert result["details"]["statistical"]["certification"] == "uncertified"


def test_certify_tv_of_a_verifier_with_an_exact_law_uses_its_exact_tv(capsys):
    argv = ("audit", "--verifier", "kseq", "--draft", "0.6,0.4", "--target", "0.3,0.7", "--num-drafts", "2", "--json")
    code, out, _ = run_cli(capsys, *argv, "--certify-tv", "0.001")
    result = json.loads(out)["results"][0]
    assert code == 0 and result["verdict"] == "CERTIFIED"
    check = next(c for c in result["checks"] if c["name"] == "certified-tv")
    assert check["value"] == result["metrics"]["tv_distance"] <= 1e-12


_COUNTING = '''
import torch
from spectr_audit.registry import load_verifier

_rules = {1: load_verifier("speculative"), 2: load_verifier("kseq")}
ROWS = []


def verify(draft_tokens, draft_probs, target_probs, generator):
    ROWS.append(draft_tokens.shape[0])
    return _rules[draft_tokens.shape[1]].verify(draft_tokens, draft_probs, target_probs, generator)
'''


@pytest.mark.parametrize("num_drafts,budget", [(1, 20_000), (2, 100_000), (1, 300)])
def test_max_samples_bounds_every_verification_of_the_audit(capsys, tmp_path, num_drafts, budget):
    # counted inside the verifier: the contract probe, every test and the acceptance all share one budget
    import sys

    path = tmp_path / f"counting_{num_drafts}_{budget}.py"
    path.write_text(_COUNTING)
    code, out, _ = run_cli(capsys, "audit", "--verifier", f"{path}:verify", "--draft", "0.6,0.4", "--target", "0.3,0.7",
                           "--num-drafts", str(num_drafts), "--max-samples", str(budget), "--json")
    assert code == 0
    module = next(m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(path))
    verified = sum(module.ROWS)
    metrics = json.loads(out)["results"][0]["metrics"]
    assert verified <= budget and verified >= 0.99 * budget
    assert metrics["num_samples"] + 4 * min(16, max(1, budget // 32)) == verified
    assert "acceptance" in metrics
