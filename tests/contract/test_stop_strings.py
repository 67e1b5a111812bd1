"""Where a row ends under stop strings: :meth:`Request.stop_position` against a one-token-at-a-time oracle, and
hand-derived cases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spectr_audit.contract.requests import Request
from tests.oracles.history import stop_position as oracle

#: token i reads as these characters (multi-character tokens, an empty one, repeats)
PIECES = ["a", "b", "ab", "ba", "", "c", "bc", "abc"]


def text(ids):
    return "".join(PIECES[i] for i in ids)


# (tokens, stop strings, stop token ids, min_tokens, order, end position); derived by hand from PIECES
CASES = [
    ([0, 1, 5], ["ab"], [], 0, "vllm", 1),            # "a" + "b": completed by token 1
    ([2, 5], ["ab"], [], 0, "vllm", 0),               # one token holds the whole string
    ([5, 3, 1], ["ab"], [], 0, "vllm", 2),            # "c" + "ba" + "b": "ab" begins in token 1, ends in 2
    ([0, 4, 1], ["ab"], [], 0, "vllm", 2),            # an empty token in between: completed by token 2
    ([0, 1, 0, 1], ["ab"], [], 2, "vllm", 3),         # the first "ab" before min_tokens is not seen by vLLM
    ([0, 1, 0, 1], ["ab"], [], 2, "transformers", 1),  # transformers stops on it
    ([0, 1], ["ab"], [1], 0, "vllm", 1),              # the stop token and the string end together
    ([0, 7, 1], ["bc"], [7], 0, "vllm", 1),           # the stop token comes first
    ([6, 0], ["cb", "ca"], [], 0, "vllm", 1),         # "bc" + "a": "ca" across the boundary
    ([7], ["bc", "ab"], [], 0, "vllm", 0),
    ([5, 5, 5], ["cc"], [], 3, "vllm", -1),           # every completion before min_tokens
]


@pytest.mark.parametrize("tokens, strings, ids, min_tokens, order, expected", CASES)
def test_hand_derived_stops(tokens, strings, ids, min_tokens, order, expected):
    request = Request(stop=strings, stop_token_ids=ids, min_tokens=min_tokens)
    assert request.stop_position(tokens, None, text, order) == expected


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, len(PIECES) - 1), max_size=12),
       strings=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=3),
       ids=st.lists(st.integers(0, len(PIECES) - 1), max_size=2), min_tokens=st.integers(0, 5),
       eos=st.one_of(st.none(), st.integers(0, len(PIECES) - 1)), order=st.sampled_from(["vllm", "transformers"]))
def test_stop_position_agrees_with_the_oracle(tokens, strings, ids, min_tokens, eos, order):
    request = Request(stop=strings, stop_token_ids=ids, min_tokens=min_tokens)
    stops = set(ids) | ({eos} if eos is not None else set())
    assert request.stop_position(tokens, eos, text, order) == oracle(tokens, stops, strings, min_tokens, text, order)


def test_without_a_detokenizer_only_stop_tokens_count():
    assert Request(stop=["ab"], stop_token_ids=[5]).stop_position([0, 1, 5], None) == 2
