"""``spectr-audit generation --requests FILE --logprob-tolerance X``: whole requests from a JSON file, the
``toy-requests`` engines, and each bad file a one-line usage error (exit 2) naming the file, the index and the
field."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from spectr_audit.cli import main

PENALISED = [{"temperature": 0.0, "repetition_penalty": 1.8, "frequency_penalty": 0.5},
             {"temperature": 0.9, "repetition_penalty": 1.6, "presence_penalty": 0.6, "logprobs": 2}]
PLAIN = [{"temperature": 0.0, "logprobs": 1, "logit_bias": {"5": -1.5}},
         {"temperature": 0.8, "top_k": 5, "stop_token_ids": [3], "bad_words": [[4, 4]]}]


def run_cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_a_requests_file_is_audited_as_written(capsys, tmp_path):
    path = _write(tmp_path, "plain.json", PLAIN)
    code, out, err = run_cli(capsys, "generation", "--engine", "toy-requests", "--requests", path,
                             "--max-new-tokens", "12", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["verdict"] in ("PASS", "INCONCLUSIVE")
    assert [{k: v for k, v in r.items() if k != "kind"} for r in result["requests"]] == PLAIN
    assert err.splitlines()[0].startswith(("PASS: toy speculative (requests)", "INCONCLUSIVE: toy speculative"))


def test_a_request_slip_is_found_on_the_requests_of_the_file(capsys, tmp_path):
    path = _write(tmp_path, "penalised.json", PENALISED)
    code, out, _ = run_cli(capsys, "generation", "--engine", "toy-requests:penalties-ignored", "--requests", path)
    assert code == 1 and out.startswith("FINDING: penalties-ignored against toy target logits: test 'support'")
    # on requests without penalties the slip changes nothing
    path = _write(tmp_path, "plain.json", PLAIN)
    code, out, _ = run_cli(capsys, "generation", "--engine", "toy-requests:penalties-ignored", "--requests", path,
                           "--max-new-tokens", "12")
    assert code == 0 and out.startswith(("PASS: ", "INCONCLUSIVE: "))


def test_the_logprob_tolerance_reaches_the_logprobs_check(capsys):
    common = ["generation", "--engine", "toy-requests:draft-logprobs", "--max-new-tokens", "12"]
    code, out, _ = run_cli(capsys, *common)
    assert code == 1 and "test 'logprobs'" in out.splitlines()[0]
    code, out, _ = run_cli(capsys, *common, "--logprob-tolerance", "100")
    assert code == 0, out


@pytest.mark.parametrize("content, message", [
    (None, "--requests: cannot read '{path}': No such file or directory"),
    ("[{\"temperature\": 0.0},", "--requests: '{path}' is not valid JSON: "),
    ({"temperature": 0.0}, "--requests: '{path}': requests: expected a non-empty list of tables of Request fields"),
    ([], "--requests: '{path}': requests: expected a non-empty list of tables of Request fields"),
    ([{"temperature": 0.0}, {"top_q": 0.9}],
     "--requests: '{path}': requests[1].top_q: unknown field (did you mean 'top_p'?); expected one of temperature, "),
    ([{"temperature": 0.0}, {"temperature": 0.5}, {"logprobs": -1}],
     "--requests: '{path}': requests[2].logprobs: must be an integer >= 0 or None; got -1"),
    ([{"stop_token_ids": [99]}], "requests[0].stop_token_ids: token id 99 outside [0, 12)"),
    ([["temperature", 0.0]], "--requests: '{path}': requests[0]: expected a table of Request fields"),
])
def test_a_bad_requests_file_is_one_line_exit_2(capsys, tmp_path, content, message):
    path = str(tmp_path / "requests.json") if content is None else _write(tmp_path, "requests.json", content)
    code, out, err = run_cli(capsys, "generation", "--engine", "toy-requests", "--requests", path)
    assert code == 2
    assert err.startswith(f"spectr-audit generation: error: {message.format(path=path)}"), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and out == ""


FACTORY = textwrap.dedent('''
    from spectr_audit.generation.library.request_slips import request_pair
    from spectr_audit.generation.library.toy import SpecEngine

    PAIR = request_pair()

    def plain():
        """A loop that takes no requests, scored with raw logits."""
        return {"generate": SpecEngine(PAIR), "score": PAIR.logits_scorer(), "vocab_size": 12,
                "prompts": [[1, 2], [3, 4]]}
''')


@pytest.mark.parametrize("argv, message", [
    (["--engine", "toy", "--requests", "{plain}"],
     "--requests: the engine 'toy' does not take requests (its generator does not declare accepts_requests and its "
     "scorer returns laws, not raw logits); the toy loop over whole requests is --engine toy-requests"),
    (["--engine", "toy:shared-stream", "--requests", "{plain}"], "--requests: the engine 'toy:shared-stream' does"),
    (["--engine", "{factory}:plain", "--requests", "{plain}"],
     "requests: the generator 'toy speculative' does not take per-row requests (it does not declare "
     "accepts_requests); give the one request it runs"),
    (["--engine", "toy-requests", "--temperature", "0.5"],
     "--temperature: not with --engine toy-requests: its requests carry the sampling parameters"),
    (["--engine", "toy-requests:seed-ignored", "--top-k", "3", "--top-p", "0.9"], "--top-k, --top-p: not with"),
    (["--engine", "toy-requests:nope"], "--engine: 'toy-requests:nope': no request slip 'nope'"),
    (["--engine", "toy-requests", "--logprob-tolerance", "0"], "argument --logprob-tolerance: expected a number > 0"),
    (["--suite", "generation", "--requests", "{plain}"], "--requests: not with --suite"),
    (["--suite", "generation", "--logprob-tolerance", "0.2"], "--logprob-tolerance: not with --suite"),
])
def test_requests_where_they_do_not_apply_are_usage_errors(capsys, tmp_path, argv, message):
    plain = _write(tmp_path, "plain.json", PLAIN)
    factory = _write(tmp_path, "engines.py", FACTORY)
    argv = [a.replace("{plain}", plain).replace("{factory}", factory) for a in argv]
    code, _, err = run_cli(capsys, "generation", *argv)
    assert code == 2
    assert message in err, err
    assert "Traceback" not in err and "internal error" not in err


def test_the_command_reads_a_requests_file_in_a_process_of_its_own(tmp_path):
    path = _write(tmp_path, "requests.json", [{"temperature": 0.0, "repetition_penalty": 1.3, "logprobs": 2},
                                              {"temperature": 0.7, "seed": 5}, {"tmperature": 1.0}])
    proc = subprocess.run([sys.executable, "-m", "spectr_audit", "generation", "--engine", "toy-requests",
                           "--requests", path], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2
    assert proc.stderr == (f"spectr-audit generation: error: --requests: {path!r}: requests[2].tmperature: unknown "
                           "field (did you mean 'temperature'?); expected one of temperature, top_k, top_p, min_p, "
                           "repetition_penalty, presence_penalty, frequency_penalty, logit_bias, bad_words, "
                           "min_tokens, stop_token_ids, stop, max_tokens, seed, logprobs, constraint\n")


def test_help_says_what_the_flags_do(capsys):
    code, out, _ = run_cli(capsys, "generation", "--help")
    assert code == 0
    text = " ".join(out.split())
    for needle in ("--requests FILE", "a JSON list of objects of Request's fields", "given to the rows in turn",
                   "--logprob-tolerance X", "probability and the scorer's that is not a finding",
                   "toy-requests:SLIP", "each is checked before any engine runs"):
        assert needle in text, needle
