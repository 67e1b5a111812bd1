"""Request: validation naming the field, kinds, description; constraints (automaton, regex, JSON schema)."""

from __future__ import annotations

import pytest
import torch

from spectr_audit.contract.requests import (
    ConstraintViolation,
    JsonSchemaConstraint,
    RegexConstraint,
    Request,
    TokenAutomaton,
)
from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.errors import InvalidArgument

BAD = [
    (dict(temperature=-0.1), "request.temperature"),
    (dict(temperature=float("nan")), "request.temperature"),
    (dict(top_k=-1), "request.top_k"),
    (dict(top_k=1.5), "request.top_k"),
    (dict(top_p=0.0), "request.top_p"),
    (dict(min_p=1.5), "request.min_p"),
    (dict(repetition_penalty=0.0), "request.repetition_penalty"),
    (dict(presence_penalty=float("inf")), "request.presence_penalty"),
    (dict(frequency_penalty="1"), "request.frequency_penalty"),
    (dict(logit_bias={-1: 1.0}), "request.logit_bias"),
    (dict(logit_bias={1: float("nan")}), r"request.logit_bias\[1\]"),
    (dict(logit_bias=[1, 2]), "request.logit_bias"),
    (dict(bad_words=[[]]), r"request.bad_words\[0\]"),
    (dict(bad_words=[[1, -2]]), r"request.bad_words\[0\]"),
    (dict(bad_words="abc"), "request.bad_words"),
    (dict(min_tokens=-1), "request.min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "request.min_tokens: 5 is above max_tokens = 4"),
    (dict(max_tokens=0), "request.max_tokens"),
    (dict(stop_token_ids=[1.5]), "request.stop_token_ids"),
    (dict(stop=[""]), "request.stop"),
    (dict(seed=1.5), "request.seed"),
    (dict(logprobs=-1), "request.logprobs"),
    (dict(constraint="json"), "request.constraint"),
    (dict(temperature=True), "request.temperature"),
]


@pytest.mark.parametrize("fields, message", BAD)
def test_bad_fields_are_named(fields, message):
    with pytest.raises(InvalidArgument, match=message):
        Request(**fields)


KINDS = [
    (dict(), "sampled"),
    (dict(temperature=0.0), "greedy"),
    (dict(temperature=0.0, frequency_penalty=0.5), "greedy+penalties"),
    (dict(logit_bias={1: 2.0}, bad_words=[[1]]), "sampled+bias+bad-words"),
    (dict(min_tokens=2, repetition_penalty=1.1), "sampled+penalties+min-tokens"),
    (dict(top_k=3, top_p=0.9, seed=4, logprobs=2, max_tokens=5), "sampled"),
]


@pytest.mark.parametrize("fields, kind", KINDS)
def test_kind(fields, kind):
    assert Request(**fields).kind == kind


def test_history_dependence_and_the_fields_it_reads():
    assert not Request(temperature=0.3, top_k=5, logit_bias={1: 1.0}, seed=2).history_dependent
    for fields in (dict(repetition_penalty=1.2), dict(presence_penalty=0.1), dict(bad_words=[[1]]),
                   dict(min_tokens=1), dict(constraint=TokenAutomaton({0: {1: 0}}))):
        assert Request(**fields).history_dependent, fields


def test_describe_and_normal_forms():
    request = Request(logit_bias={"3": 1, 1: -2.5}, bad_words=[(1, 2)], stop="END", stop_token_ids=torch.tensor([4]))
    assert request.logit_bias == ((1, -2.5), (3, 1.0))
    assert request.describe() == {"logit_bias": {"1": -2.5, "3": 1.0}, "bad_words": [[1, 2]],
                                  "stop_token_ids": [4], "stop": ["END"]}
    assert Request() == Request(temperature=1, top_k=0)
    assert Request().describe() == {}


def test_from_params_and_back():
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.8, min_p=0.05)
    request = Request.from_params(params, min_tokens=2)
    assert request.sampling_params() == params and request.min_tokens == 2
    with pytest.raises(InvalidArgument, match="per-row"):
        Request.from_params(SamplingParams(temperature=[0.5, 1.0]))


def test_stop_ids_and_vocabulary_check():
    request = Request(stop_token_ids=[3], bad_words=[[1, 9]])
    assert request.stop_ids(0) == (0, 3) and request.stop_ids(3) == (3,) and request.stop_ids(None) == (3,)
    with pytest.raises(InvalidArgument, match=r"requests\[2\].bad_words\[0\]: token id 9 outside \[0, 5\)"):
        request.check_vocab(5, "requests[2]")


AUTOMATON = [  # (prefix, allowed next tokens of a vocabulary of 4)
    ((), [1]),
    ((1,), [2, 3]),
    ((1, 3), [0, 2, 3]),  # accepting: end token 0 allowed
    ((1, 3, 0), []),  # ended
]


@pytest.mark.parametrize("prefix, allowed", AUTOMATON)
def test_token_automaton(prefix, allowed):
    automaton = TokenAutomaton({0: {1: 1}, 1: {2: 1, 3: 2}, 2: {2: 1, 3: 2}}, accepting=[2], end_tokens=[0])
    mask = automaton.allowed(automaton.state_after(prefix), 4)
    assert mask.nonzero().flatten().tolist() == allowed


def test_token_automaton_refuses_what_it_does_not_allow():
    automaton = TokenAutomaton({0: {1: 1}})
    with pytest.raises(ConstraintViolation, match="token 2"):
        automaton.state_after([2])
    with pytest.raises(InvalidArgument, match="transitions"):
        TokenAutomaton({0: {-1: 0}})


VOCAB = ["a", "b", "{", "}", '"', "x", ":", "<eos>", "1", "ab", " "]


def test_regex_constraint_masks_by_the_pattern():
    pytest.importorskip("xgrammar")
    regex = RegexConstraint("ab*", VOCAB, eos_token_id=7)
    assert regex.allowed(regex.start(), 11).nonzero().flatten().tolist() == [0, 9]  # "a", "ab"
    state = regex.advance(regex.start(), 0)
    assert regex.allowed(state, 11).nonzero().flatten().tolist() == [1, 7]  # "b" or the end
    with pytest.raises(ConstraintViolation):
        regex.state_after([1])


def test_json_schema_constraint_opens_an_object():
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    constraint = JsonSchemaConstraint(schema, VOCAB, eos_token_id=7)
    assert constraint.allowed(constraint.start(), 11).nonzero().flatten().tolist() == [2]
    ids = [2, 4, 5, 4, 6, 10, 8, 3]  # {"x": 1} (xgrammar's compact separators keep the space after the colon)
    state = constraint.state_after(ids)
    assert constraint.allowed(state, 11).nonzero().flatten().tolist() == [7]
    with pytest.raises(ConstraintViolation):
        constraint.state_after([2, 4, 5, 4, 6, 8])


def test_a_grammar_xgrammar_refuses_is_named():
    pytest.importorskip("xgrammar")
    with pytest.raises(InvalidArgument, match="regex: xgrammar refused the regular expression"):
        RegexConstraint("a(b", VOCAB, eos_token_id=7)
    with pytest.raises(InvalidArgument, match="eos_token_id"):
        RegexConstraint("a", VOCAB, eos_token_id=99)
