"""process_request / process_request_step against the plain-Python oracle (tests/oracles/history.py), hand-derived
cases, and bad input.

The processed logits are compared exactly (both sides do the same IEEE operations in the same order); the laws,
which go through exponentials computed differently, to 1e-12.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spectr_audit.contract.history import (
    HISTORY_ENGINES,
    LLAMA_CPP_SAMPLING,
    process_request,
    process_request_step,
)
from spectr_audit.contract.requests import Request, TokenAutomaton
from spectr_audit.contract.sampling import SamplingParams, process_logits
from spectr_audit.errors import InvalidArgument
from tests.oracles import history as oracle

INF = -math.inf


@st.composite
def cases(draw, engine=None):
    engine = engine or draw(st.sampled_from(HISTORY_ENGINES))
    vocab = draw(st.integers(2, 6))
    length = draw(st.integers(0, 6))
    # quarters: exact, and ties (which the greedy lowest-index rule settles) are common
    value = st.one_of(st.integers(-12, 12).map(lambda v: v / 4), st.just(INF))
    rows = [draw(st.lists(value, min_size=vocab, max_size=vocab)) for _ in range(length)]
    rows = [r if any(v != INF for v in r) else [0.0] + r[1:] for r in rows]
    token = st.integers(0, vocab - 1)
    prompt = draw(st.lists(token, min_size=1, max_size=4))
    continuation = draw(st.lists(token, min_size=length, max_size=length))
    fields = {"temperature": draw(st.sampled_from([0.0, 0.5, 1.0, 1.7]))}
    fields.update(draw(st.fixed_dictionaries({}, optional={
        "repetition_penalty": st.sampled_from([0.5, 1.3, 2.0]),
        "logit_bias": st.dictionaries(token, st.integers(-8, 8).map(lambda v: v / 4), max_size=2),
        "stop_token_ids": st.lists(token, max_size=2, unique=True),
    })))
    if engine != "llama.cpp":
        fields.update(draw(st.fixed_dictionaries({}, optional={"min_tokens": st.integers(0, 4)})))
    if engine == "llama.cpp" and "temperature" in fields and fields["temperature"] > 0:
        fields.update(draw(st.fixed_dictionaries({}, optional={
            "top_k": st.integers(0, vocab), "top_p": st.sampled_from([1.0, 0.9, 0.5]),
            "min_p": st.sampled_from([0.0, 0.3])})))
    if engine != "transformers":
        fields.update(draw(st.fixed_dictionaries({}, optional={
            "presence_penalty": st.sampled_from([-0.5, 0.25, 1.0]),
            "frequency_penalty": st.sampled_from([-0.25, 0.5, 1.5])})))
    if engine not in ("sglang", "llama.cpp"):
        fields.update(draw(st.fixed_dictionaries({}, optional={
            "bad_words": st.lists(st.lists(token, min_size=1, max_size=3), max_size=3)})))
    eos = draw(st.one_of(st.none(), token))
    return engine, rows, prompt, continuation, fields, eos


def _request(fields):
    return Request(**fields)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_process_request_matches_the_oracle(case):
    engine, rows, prompt, continuation, fields, eos = case
    expected = oracle.laws(rows, prompt, continuation, fields, engine, eos)
    logits = torch.tensor(rows, dtype=torch.float64).reshape(len(rows), -1) if rows else torch.zeros(0, 2)
    if any(law is None for _, law in expected):
        with pytest.raises(InvalidArgument, match="masks every token"):
            process_request(logits, prompt, continuation, _request(fields), engine, eos_token_id=eos)
        return
    if not rows:
        return
    got = process_request(logits, prompt, continuation, _request(fields), engine, eos_token_id=eos)
    assert got.processed_logits.tolist() == [x for x, _ in expected]
    assert torch.allclose(got.probs, torch.tensor([law for _, law in expected], dtype=torch.float64), rtol=0,
                          atol=1e-12)
    assert torch.allclose(got.raw_logprobs, torch.log_softmax(logits, -1), rtol=0, atol=1e-12)
    assert got.constraint_violation is None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_one_step_is_one_row_of_the_whole_row(case):
    engine, rows, prompt, continuation, fields, eos = case
    if not rows or any(law is None for _, law in oracle.laws(rows, prompt, continuation, fields, engine, eos)):
        return
    logits = torch.tensor(rows, dtype=torch.float64)
    whole = process_request(logits, prompt, continuation, _request(fields), engine, eos_token_id=eos)
    for t in range(len(rows)):
        step = process_request_step(logits[t], prompt, continuation[:t], _request(fields), engine, eos_token_id=eos)
        assert torch.equal(step, whole.probs[t])


@settings(max_examples=150, deadline=None)
@given(data=st.data(), engine=st.sampled_from(HISTORY_ENGINES))
def test_a_request_without_history_is_process_logits(data, engine):
    vocab = data.draw(st.integers(2, 8))
    length = data.draw(st.integers(1, 5))
    logits = torch.tensor(data.draw(st.lists(st.lists(st.floats(-5, 5), min_size=vocab, max_size=vocab),
                                             min_size=length, max_size=length)), dtype=torch.float64)
    params = dict(temperature=data.draw(st.sampled_from([0.0, 0.3, 1.0, 2.0])), top_k=data.draw(st.integers(0, vocab)),
                  top_p=data.draw(st.sampled_from([1.0, 0.9, 0.5])), min_p=data.draw(st.sampled_from([0.0, 0.1])))
    continuation = data.draw(st.lists(st.integers(0, vocab - 1), min_size=length, max_size=length))
    request = Request(**params, max_tokens=9, seed=3, logprobs=2)
    got = process_request(logits, [0], continuation, request, engine, eos_token_id=1)
    order = LLAMA_CPP_SAMPLING if engine == "llama.cpp" else engine
    assert torch.equal(got.probs, process_logits(logits, SamplingParams(**params), order))


# Hand-derived: logits [1, -1, 2], prompt [0], emitted [2, 2] before the position; repetition 2, frequency 0.5,
# presence 0.25.  vLLM: token 0 (prompt, > 0) 1 / 2; token 2 (emitted, > 0) 2 / 2 - 0.5 * 2 - 0.25.
# SGLang: repetition on the output only, after the additive penalties: (2 - 1 - 0.25) / 2; token 0 untouched.
HAND = [
    ("vllm", dict(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25), None, [0.5, -1.0, -0.25]),
    ("sglang", dict(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25), None, [1.0, -1.0, 0.375]),
    ("transformers", dict(repetition_penalty=2.0), None, [0.5, -1.0, 1.0]),
    ("vllm", dict(repetition_penalty=0.5), None, [2.0, -1.0, 4.0]),
    # bias before the repetition penalty: token 1's -1 + 3 = 2 (not in the history) stays 2
    ("vllm", dict(logit_bias={1: 3.0, 0: -2.0}, repetition_penalty=2.0), None, [-2.0, 2.0, 1.0]),
    ("sglang", dict(logit_bias={2: 1.0}, repetition_penalty=2.0), None, [1.0, -1.0, 2.0]),
    # min_tokens 3 with two tokens emitted: the stop tokens (eos 1 and stop id 0) masked
    ("vllm", dict(min_tokens=3, stop_token_ids=[0]), 1, [INF, INF, 2.0]),
    ("vllm", dict(min_tokens=2, stop_token_ids=[0]), 1, [1.0, -1.0, 2.0]),
    ("transformers", dict(min_tokens=3), 1, [1.0, INF, 2.0]),
    ("sglang", dict(min_tokens=3), 1, [1.0, INF, 2.0]),
    # bad words: [2, 1] bans 1 after a 2; [0, 1] bans 1 only where the history ends with 0 (vLLM reads the output
    # only, transformers the prompt too: prompt [0] then [2, 2] ends with 2 either way); [2, 2, 0] bans 0
    ("vllm", dict(bad_words=[[2, 1], [0, 1], [2, 2, 0]]), None, [INF, INF, 2.0]),
    ("transformers", dict(bad_words=[[0, 2, 2, 1]]), None, [1.0, INF, 2.0]),
    # generate drops a one-token bad word that is a stop token (eos 1 here); vLLM bans it
    ("transformers", dict(bad_words=[[1], [0]]), 1, [INF, -1.0, 2.0]),
    ("vllm", dict(bad_words=[[1], [0]]), 1, [INF, INF, 2.0]),
    ("vllm", dict(bad_words=[[0, 2, 2, 1]]), None, [1.0, -1.0, 2.0]),
    # llama.cpp: bias first, then one pass over the emitted tokens (the prompt's 0 untouched): token 2 (count 2,
    # > 0) 2 / 2 - (0.5 * 2 + 0.25); a bias of -3 on token 2 makes it -1 * 2 - 1.25 = -3.25
    ("llama.cpp", dict(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25), None,
     [1.0, -1.0, -0.25]),
    ("llama.cpp", dict(logit_bias={2: -3.0, 1: 1.0}, repetition_penalty=2.0, frequency_penalty=0.5,
                       presence_penalty=0.25), None, [1.0, 0.0, -3.25]),
]


@pytest.mark.parametrize("engine, fields, eos, expected", HAND)
def test_hand_derived_processed_logits(engine, fields, eos, expected):
    logits = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, -1.0, 2.0]], dtype=torch.float64)
    laws = process_request(logits, [0], [2, 2, 2], Request(**fields), engine, eos_token_id=eos)
    assert laws.processed_logits[2].tolist() == expected


def test_vllm_puts_the_stop_tokens_back_when_a_constraint_leaves_nothing_else():
    # the automaton allows only eos 2 at its start; min_tokens 2 masks it.  vLLM's MinTokensLogitsProcessor restores
    # a structured request's stop tokens when the row would be -inf everywhere (then the bias applies to them);
    # transformers and SGLang have no such rule: nothing is left to draw
    automaton = TokenAutomaton({0: {}}, accepting=[0], end_tokens=[2])
    logits = torch.tensor([[1.0, 2.0, 0.5]], dtype=torch.float64)
    request = Request(temperature=0.0, min_tokens=2, constraint=automaton, logit_bias={2: 0.25})
    laws = process_request(logits, [0], [2], request, "vllm", eos_token_id=2)
    assert laws.processed_logits[0].tolist() == [INF, INF, 0.75]
    assert laws.probs[0].tolist() == [0.0, 0.0, 1.0]
    # without the constraint nothing is restored: min_tokens masks eos and the others stay
    plain = process_request(logits, [0], [1], Request(temperature=0.0, min_tokens=2), "vllm", eos_token_id=2)
    assert plain.processed_logits[0].tolist() == [1.0, 2.0, INF]
    for engine in ("transformers", "sglang"):
        with pytest.raises(InvalidArgument, match="masks every token"):
            process_request(logits, [0], [2], request, engine, eos_token_id=2)


def test_llama_cpp_penalties_read_the_last_64_emitted_tokens():
    # 66 emitted tokens: token 1 first and 65 times token 2 after it; at the last position the window of 64 holds
    # only 2s (64 of them), so token 1 (emitted at position 0, outside the window) is untouched
    continuation = [1] + [2] * 65
    logits = torch.tensor([[1.0, 1.0, 1.0]] * len(continuation), dtype=torch.float64)
    request = Request(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.01, presence_penalty=0.5)
    laws = process_request(logits, [0], continuation, request, "llama.cpp")
    assert laws.processed_logits[-1].tolist() == [1.0, 1.0, 0.5 - (0.01 * 64 + 0.5)]
    # at position 64 the window is continuation[0:64]: token 1 once, token 2 63 times
    assert laws.processed_logits[64].tolist() == [1.0, 0.5 - (0.01 + 0.5), 0.5 - (0.01 * 63 + 0.5)]


def test_llama_cpp_applies_temperature_after_the_filters():
    # logits log(0.5), log(0.3), log(0.2); top-p 0.6 on the unscaled law keeps tokens 0 and 1 (mass ahead 0, 0.5);
    # after temperature 0.5 the law of the two is 0.25 : 0.09 (vLLM, temperature first, would keep token 0 alone:
    # the scaled law 25/38, 9/38, 4/38 has 25/38 > 0.6 ahead of token 1)
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]], dtype=torch.float64)
    request = Request(temperature=0.5, top_p=0.6)
    got = process_request(logits, [0], [0], request, "llama.cpp").probs[0]
    assert torch.allclose(got, torch.tensor([25 / 34, 9 / 34, 0.0], dtype=torch.float64), rtol=0, atol=1e-12)
    assert process_request(logits, [0], [0], request, "vllm").probs[0].tolist() == [1.0, 0.0, 0.0]


def test_a_constraint_masks_each_position_and_the_first_violation_is_named():
    # allowed: 1 then 2 then anything of {0, 1}; eos 0 in the accepting state 2
    automaton = TokenAutomaton({0: {1: 1}, 1: {2: 2}, 2: {1: 2}}, accepting=[2], end_tokens=[0])
    logits = torch.zeros(4, 3, dtype=torch.float64)
    good = process_request(logits, [0], [1, 2, 1, 0], Request(constraint=automaton), "vllm")
    assert good.constraint_violation is None
    assert good.probs.tolist() == [[0, 1, 0], [0, 0, 1], [0.5, 0.5, 0], [0.5, 0.5, 0]]
    bad = process_request(logits, [0], [1, 1, 2, 0], Request(constraint=automaton), "vllm")
    assert bad.constraint_violation == 1
    assert bad.probs[2].tolist() == [1 / 3] * 3  # not applied after the violation


def test_the_masked_raw_logprobs_are_the_raw_ones_over_the_allowed_tokens():
    # the same automaton; raw logits log(1), log(2), log(5): over {0, 1} the masked logprobs are log(1/3), log(2/3)
    automaton = TokenAutomaton({0: {1: 1}, 1: {2: 2}, 2: {1: 2}}, accepting=[2], end_tokens=[0])
    logits = torch.log(torch.tensor([[1.0, 2.0, 5.0]] * 3, dtype=torch.float64))
    laws = process_request(logits, [0], [1, 2, 1], Request(temperature=0.5, repetition_penalty=2.0,
                                                             constraint=automaton), "vllm")
    inf = float("inf")
    expected = [[-inf, 0.0, -inf], [-inf, -inf, 0.0], [math.log(1 / 3), math.log(2 / 3), -inf]]
    assert torch.allclose(laws.raw_masked_logprobs, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.allclose(laws.raw_logprobs, torch.log(torch.tensor([[1 / 8, 2 / 8, 5 / 8]] * 3, dtype=torch.float64)))
    # without a constraint they are the raw ones
    plain = process_request(logits, [0], [1, 2, 1], Request(temperature=0.5), "vllm")
    assert plain.masked_logprobs is None and plain.raw_masked_logprobs is plain.raw_logprobs


BAD = [
    (dict(order="llama"), "order"),
    (dict(order="transformers", request=Request(presence_penalty=0.5)), "presence_penalty"),
    (dict(order="sglang", request=Request(bad_words=[[1]])), "bad_words"),
    (dict(order="llama.cpp", request=Request(bad_words=[[1]])), "bad_words"),
    (dict(order="llama.cpp", request=Request(min_tokens=1)), "min_tokens"),
    (dict(logits=torch.zeros(3, 3)), "3 rows for a continuation of 2"),
    (dict(logits=torch.tensor([[0.0, float("nan"), 0.0]] * 2)), "NaN"),
    (dict(continuation=[0, 5]), "continuation"),
    (dict(prompt=[7]), "prompt"),
    (dict(request=Request(logit_bias={9: 1.0})), "request.logit_bias: token id 9"),
    (dict(request=Request(bad_words=[[0], [1], [2]])), "masks every token"),
    (dict(request="greedy"), "request"),
]


@pytest.mark.parametrize("change, message", BAD)
def test_bad_input_is_named(change, message):
    args = dict(logits=torch.zeros(2, 3), prompt=[0], continuation=[0, 1], request=Request(), order="vllm")
    args.update(change)
    with pytest.raises(InvalidArgument, match=message):
        process_request(args["logits"], args["prompt"], args["continuation"], args["request"], args["order"])
