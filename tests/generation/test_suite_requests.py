"""Whole requests in ``[[generation]]`` suite cases: the ``requests`` and ``logprob_tolerance`` keys, the
``toy-requests`` and ``toy-requests:SLIP`` engines, and each bad request named by its case, index and field
when the suite is read, before any engine runs."""

from __future__ import annotations

import textwrap

import pytest

from spectr_audit.contract.requests import Request
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation import checks as gen
from spectr_audit.generation.library.request_slips import REQUEST_SLIPS
from spectr_audit.generation.suite import run_generation_case
from spectr_audit.run.generation_suite import run_generation_suite
from spectr_audit.run.suite import load_suite, parse_suite

SOURCE = "suite file 'x.toml'"


def _suite(**case):
    return {"generation": [{"name": "c", "engine": "toy-requests", **case}]}


def _case(**case):
    (parsed,) = parse_suite(_suite(**case), source=SOURCE).generation
    return parsed


# ---------------------------------------------------------------------------------------------
# Reading the tables
# ---------------------------------------------------------------------------------------------


def test_each_table_becomes_the_request_it_writes():
    case = _case(requests=[
        {"temperature": 0.0, "repetition_penalty": 1.3, "stop_token_ids": [3], "logprobs": 2},
        {"temperature": 0.7, "seed": 5, "logit_bias": {"7": -1.5, "2": 0.5}, "bad_words": [[4, 4], [9]]},
        {"min_tokens": 2, "max_tokens": 8.0, "top_k": 3, "top_p": 0.9, "min_p": 0.05},
    ], logprob_tolerance=0.05)
    assert case.requests == (
        Request(temperature=0.0, repetition_penalty=1.3, stop_token_ids=(3,), logprobs=2),
        Request(temperature=0.7, seed=5, logit_bias=((2, 0.5), (7, -1.5)), bad_words=((4, 4), (9,))),
        Request(min_tokens=2, max_tokens=8, top_k=3, top_p=0.9, min_p=0.05),
    )
    # the string keys of the bias are token ids, the float 8.0 an integer
    assert case.requests[1].logit_bias == ((2, 0.5), (7, -1.5)) and case.requests[2].max_tokens == 8
    assert case.audit_options == {"logprob_tolerance": 0.05}
    assert case.to_dict()["requests"][0] == {"temperature": 0.0, "repetition_penalty": 1.3, "stop_token_ids": [3],
                                             "logprobs": 2}
    assert _case().requests is None


def test_an_automaton_constraint_is_written_as_its_transitions():
    case = _case(requests=[{"constraint": {"automaton": {
        "transitions": {"0": {"1": 1, "3": 1}, "1": {"2": 0}}, "accepting": [1], "end_tokens": [0],
        "name": "odd-even"}}}])
    constraint = case.requests[0].constraint
    # odd first (1 or 3), then 2, and the end of sequence 0 once an odd token stands last
    assert constraint.allowed(constraint.start(), 5).tolist() == [False, True, False, True, False]
    assert constraint.allowed(constraint.state_after([3]), 5).tolist() == [True, False, True, False, False]
    assert constraint.allowed(constraint.state_after([3, 2]), 5).tolist() == [False, True, False, True, False]
    assert case.requests[0].kind == "sampled+constraint"


WHERE = f"{SOURCE} generation[0] ('c')"
REQUEST_FIELDS = ("temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty, "
                  "logit_bias, bad_words, min_tokens, stop_token_ids, stop, max_tokens, seed, logprobs, constraint")


@pytest.mark.parametrize("case, message", [
    (dict(requests=[{"temperature": 0.0}, {"top_q": 0.9}]),
     f"{WHERE}: requests[1].top_q: unknown field (did you mean 'top_p'?); expected one of {REQUEST_FIELDS}"),
    (dict(requests=[{"temperature": -1}]), f"{WHERE}: requests[0].temperature: must be finite and >= 0; got -1"),
    (dict(requests=[{}, {}, {"top_p": 0.0}]), f"{WHERE}: requests[2].top_p: must lie in (0, 1]; got 0.0"),
    (dict(requests=[{"seed": True}]), f"{WHERE}: requests[0].seed: must be an integer or None; got True"),
    (dict(requests=[{"logit_bias": {"x": 1.0}}]),
     f"{WHERE}: requests[0].logit_bias: token ids must be integers >= 0, got 'x'"),
    (dict(requests=[{"bad_words": [[4], []]}]),
     f"{WHERE}: requests[0].bad_words[1]: a bad word needs at least one token"),
    (dict(requests=[{"min_tokens": 9, "max_tokens": 4}]),
     f"{WHERE}: requests[0].min_tokens: 9 is above max_tokens = 4"),
    (dict(requests=[3]), f"{WHERE}: requests[0]: expected a table of Request fields ({REQUEST_FIELDS}), got int"),
    (dict(requests=[]), f"{WHERE}: requests: expected a non-empty list of tables of Request fields"),
    (dict(requests={"temperature": 0.0}), f"{WHERE}: requests: expected a non-empty list of tables of Request fields"),
    (dict(requests=[{"constraint": {"regex": "[0-9]+"}}]),
     f"{WHERE}: requests[0].constraint: only {{automaton = {{...}}}} (a TokenAutomaton over token ids) can be written "
     "here, got ['regex']; a regex or JSON-schema constraint needs the vocabulary's token strings: build that "
     "Request in Python"),
    (dict(requests=[{"constraint": {"automaton": {"transitions": {"0": {"one": 1}}}}}]),
     f"{WHERE}: requests[0].constraint.automaton.transitions['0']: token ids must be integers >= 0, got 'one'"),
    (dict(requests=[{"constraint": {"automaton": {"transitions": {"0": {"1": 0}}, "stat": 0}}}]),
     f"{WHERE}: requests[0].constraint.automaton: unknown key(s) ['stat']"),
    (dict(logprob_tolerance=0), f"{WHERE}: logprob_tolerance: expected a number in (0, inf), got 0"),
    (dict(temperature=0.5),
     f"{WHERE}: temperature: not for 'toy-requests': its requests carry the sampling parameters"),
    (dict(engine="toy-requests:seed-ignored", top_k=3), f"{WHERE}: top_k: not for 'toy-requests:seed-ignored'"),
    (dict(engine="toy", requests=[{"temperature": 0.5}]),
     f"{WHERE}: requests: the engine 'toy' does not take requests"),
    (dict(engine="toy:shared-stream", requests=[{}]), f"{WHERE}: requests: the engine 'toy:shared-stream' does not"),
    (dict(engine="toy-requests:penalties-ignord"),
     f"{WHERE}: engine: no request slip 'penalties-ignord' (did you mean 'penalties-ignored'?); the request slips: "
     "rows-params-swapped, "),
])
def test_a_bad_request_names_the_case_the_index_and_the_field(case, message):
    with pytest.raises(InvalidArgument) as info:
        parse_suite(_suite(**case), source=SOURCE)
    assert str(info.value).startswith(message), str(info.value)


def test_a_bad_request_stops_the_suite_before_any_engine_runs(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(textwrap.dedent('''
        [[generation]]
        name = "first"
        engine = "toy-requests"

        [[generation]]
        name = "second"
        engine = "toy-requests"
        requests = [{temperature = 0.0}, {temperature = 0.7, top_q = 0.9}]
    '''))
    started = []
    with pytest.raises(InvalidArgument, match=r"generation\[1\] \('second'\): requests\[1\]\.top_q: unknown field"):
        run_generation_suite(str(path), on_start=lambda case: started.append(case.name))
    assert started == []


def test_the_default_expectation_of_a_request_slip():
    suite = parse_suite({"generation": [{"name": "a", "engine": "toy-requests"},
                                        {"name": "b", "engine": "toy-requests:keeps-after-stop"},
                                        {"name": "c", "engine": "toy-requests:seed-ignored"}]}, source=SOURCE)
    # seed-ignored changes no row's law: the determinism line shows it, the verdict cannot
    assert [c.expected for c in suite.generation] == ["pass", "finding", "pass"]


# ---------------------------------------------------------------------------------------------
# Engines by spec
# ---------------------------------------------------------------------------------------------


def test_toy_requests_specs_resolve_to_the_request_loop_and_its_slips():
    engine = gen.load_generation_engine("toy-requests")
    assert engine.generate.accepts_requests and engine.vocab_size == 12 and engine.eos_token_id == 0
    assert engine.max_new_tokens == 24 and engine.reference is None
    assert engine.prompts == [[1, 2], [2, 5], [3, 8], [4, 11], [5, 4], [6, 7]]
    # every feature on: greedy and sampled rows, penalties, bias, bad words, min_tokens, a constraint, seeds, logprobs
    kinds = {r.kind for r in engine.requests}
    assert {"greedy+penalties", "sampled+penalties", "sampled+bias+bad-words", "sampled+min-tokens",
            "sampled+constraint"} <= kinds
    assert any(r.seed is not None for r in engine.requests) and any(r.max_tokens for r in engine.requests)
    slip = gen.load_generation_engine("toy-requests:penalties-ignored", toy_seed=3)
    assert type(slip.generate) is REQUEST_SLIPS["penalties-ignored"].engine and slip.expected == "finding"
    assert all(r.penalised for r in slip.requests)  # the mix that exercises it
    assert gen.load_generation_engine("toy-requests:seed-ignored").expected == "pass"


@pytest.mark.parametrize("spec, kwargs, message", [
    ("toy-requests:nope", {}, "--engine: 'toy-requests:nope': no request slip 'nope'; the request slips: "),
    ("toy-requests:", {}, "--engine: 'toy-requests:' names no slip; the request slips: rows-params-swapped"),
    ("toy-requests", {"temperature": 0.5, "top_p": 0.9}, "temperature, top_p: not for 'toy-requests'"),
    ("toy-requests", {"vocab_size": 6}, "vocab_size: 6 is too small for 'toy-requests'"),
    ("toy-requests", {"eos_token_id": 12}, "eos_token_id: 12 is not a token id of the vocabulary [0, 12)"),
    ("toy-requests", {"options": {"a": 1}}, "options: only for a factory engine"),
])
def test_bad_toy_requests_specs_are_named(spec, kwargs, message):
    with pytest.raises(InvalidArgument) as info:
        gen.load_generation_engine(spec, argument="--engine", **kwargs)
    assert str(info.value).startswith(message), str(info.value)


def test_requests_given_to_the_toy_engine_name_it():
    with pytest.raises(InvalidArgument, match="requests: the engine 'toy' does not take requests .* 'toy-requests'"):
        gen.audit_engine(gen.load_generation_engine("toy"), requests=[Request(temperature=0.5)])


# ---------------------------------------------------------------------------------------------
# Running the cases
# ---------------------------------------------------------------------------------------------

PENALISED = [{"temperature": 0.0, "repetition_penalty": 1.8, "frequency_penalty": 0.5},
             {"temperature": 0.9, "repetition_penalty": 1.6, "presence_penalty": 0.6, "logprobs": 2}]
PLAIN = [{"temperature": 0.0, "logprobs": 1}, {"temperature": 0.8, "top_k": 5, "stop_token_ids": [3]}]


def test_the_correct_loop_passes_on_its_own_requests():
    result = run_generation_case(_case(min_detectable_tv=0.3))
    assert result.verdict in ("PASS", "INCONCLUSIVE") and result.request_findings == ()
    # its own requests, every feature on: the constraint check runs (a request carries one)
    assert {"logprobs", "stopping", "constraint"} <= {t.name for t in result.subtests}


def test_the_requests_written_in_a_case_are_the_ones_audited():
    result = run_generation_case(_case(requests=PLAIN, max_new_tokens=12))
    assert result.verdict in ("PASS", "INCONCLUSIVE")
    assert [{k: v for k, v in r.items() if k != "kind"} for r in result.requests] == PLAIN
    assert "constraint" not in {t.name for t in result.subtests}


def test_a_request_slip_case_is_found_on_the_requests_that_exercise_it():
    found = run_generation_case(_case(engine="toy-requests:penalties-ignored", requests=PENALISED))
    assert found.verdict == "FINDING" and found.generator == "penalties-ignored"
    # the same slip on requests without penalties is the correct loop: nothing to find
    missed = run_generation_case(_case(engine="toy-requests:penalties-ignored", requests=PLAIN, max_new_tokens=12))
    assert missed.verdict in ("PASS", "INCONCLUSIVE")


def test_the_logprob_tolerance_of_a_case_reaches_the_logprobs_check():
    strict = run_generation_case(_case(engine="toy-requests:draft-logprobs", max_new_tokens=12))
    assert strict.verdict == "FINDING" and strict.test == "logprobs"
    # the draft's log-probabilities lie within 100 nats of the target's: no longer a finding
    loose = run_generation_case(_case(engine="toy-requests:draft-logprobs", max_new_tokens=12, logprob_tolerance=100.0))
    assert loose.verdict in ("PASS", "INCONCLUSIVE")


def test_the_builtin_suite_holds_the_request_loop_and_request_slips():
    cases = {c.name: c for c in load_suite("generation").generation}
    assert cases["toy-requests-correct"].engine == "toy-requests" and cases["toy-requests-correct"].expected == "pass"
    slips = {c.engine.partition(":")[2] for c in cases.values() if c.engine.startswith("toy-requests:")}
    assert slips and slips <= set(REQUEST_SLIPS)
    assert all(cases[name].expected == "finding" for name in slips)
    assert cases["penalties-ignored"].requests is not None  # one case writes its requests


def test_stop_strings_in_a_case_are_matched_in_the_toy_engine_s_text():
    """The toy request loop carries its detokenizer, so a case's stop strings are audited; the slip that keeps a
    block's tokens after a completed stop string is found on them, the correct loop is not."""
    stop = [{"temperature": 1.2, "stop": ["ji", "lk"]}, {"temperature": 1.0, "stop": ["e"], "min_tokens": 3}]
    correct = run_generation_case(_case(requests=stop, max_new_tokens=16))
    assert correct.verdict in ("PASS", "INCONCLUSIVE") and correct.request_findings == ()
    slip = run_generation_case(_case(engine="toy-requests:keeps-after-stop-string", requests=stop, max_new_tokens=16))
    assert slip.verdict == "FINDING" and {f["check"] for f in slip.request_findings} == {"stopping"}


def test_a_reference_asked_of_an_engine_without_one_is_refused():
    from spectr_audit.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="reference: the engine 'toy-requests' has no reference generator"):
        run_generation_case(_case(reference=True, max_new_tokens=8))
