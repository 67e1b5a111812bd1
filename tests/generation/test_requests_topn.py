"""The top-n lists an engine returns: each entry against the scorer's log-probability, the list the most
likely tokens, and as many entries as the request asked (fewer is a contract error naming row and position)."""

from __future__ import annotations

import pytest
import torch

from spectr_audit.contract.requests import Request
from spectr_audit.generation.audit import audit_generation
from spectr_audit.generation.contract import GenerationContractError, as_generator
from tests.generation import _request_engines as engines

PROMPTS = [[1, 2, 3], [4, 5]]
REQUESTS = [Request(temperature=0.7, logprobs=3, presence_penalty=0.4), Request(top_k=5, logprobs=2)]


class TopN(engines.RequestSampler):
    """Builds each top-n list with ``pick(raw logprobs, n) -> {token: logprob}``."""

    def __init__(self, pick):
        super().__init__()
        self.pick = pick

    def generate(self, prompts, max_new_tokens, seed, requests=None):
        out = super().generate(prompts, max_new_tokens, seed, requests)
        scored = self.score(prompts, out.continuations).logits
        top = [[self.pick(torch.log_softmax(x, -1), r.logprobs) for x in rows] for rows, r in zip(scored, requests)]
        return out.__class__(**{**out.__dict__, "top_logprobs": top})


def _right(lp, n):
    values, ids = lp.topk(n)
    return {int(i): float(v) for i, v in zip(ids, values)}


def _audit(engine):
    return audit_generation(engine, engines.RequestSampler(), PROMPTS, vocab_size=10, max_new_tokens=6,
                            eos_token_id=0, requests=REQUESTS, progress=False, rounds=1, arms=("single", "equal"))


@pytest.mark.parametrize("name, pick", [
    ("right", _right),
    ("values off by 0.3", lambda lp, n: {k: v - 0.3 for k, v in _right(lp, n).items()}),
    ("the second to the n+1-th", lambda lp, n: dict(list(_right(lp, n + 1).items())[1:])),
    ("a token outside the vocabulary", lambda lp, n: {**dict(list(_right(lp, n).items())[:-1]), 10: -1.0}),
])
def test_each_top_n_list_is_checked(name, pick):
    result = _audit(TopN(pick))
    check = next(t for t in result.subtests if t.name == "logprobs")
    if name == "right":
        assert check.pvalue == 1.0 and result.request_findings == ()
    else:
        assert check.pvalue == 0.0 and result.verdict == "FINDING"
        assert {f["check"] for f in result.request_findings} == {"logprobs"}


def test_a_shorter_list_than_asked_is_a_contract_error():
    engine = as_generator(TopN(lambda lp, n: _right(lp, n - 1)))
    with pytest.raises(GenerationContractError, match=r"row 0: top_logprobs at position 0 holds 2 entries; the "
                                                      r"request asked for the top 3"):
        engine([[1, 2]], 4, 0, vocab_size=10, case="test", requests=[Request(logprobs=3)])
