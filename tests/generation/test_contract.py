"""The generation contract: bad generators and scorers are named errors, and the audit keeps the other jobs.

Every misbehaviour (raising, the wrong number of continuations, too many tokens, ids outside the
vocabulary, non-integers, laws of the wrong shape or not summing to 1, a hang past ``timeout``) is
planted in one arm only (the ``repeated`` arm: the calls whose prompts are all the same), so each
case checks three things: the failing jobs are listed in ``result.failures`` with a message that
names the component and the case, the other arms still give a result, and the failing arm gives no
tokens.  Bad arguments of :func:`audit_generation` are :class:`InvalidArgument` naming the argument.
"""

from __future__ import annotations

import math
import re
import time

import numpy as np
import pytest
import torch

from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation import (
    GenerationContractError,
    GenerationOutput,
    ScoredLogits,
    as_generator,
    as_scorer,
    audit_generation,
)
from spectr_audit.generation.library import ToyPair, correct_engine

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 8
PAIR = ToyPair(vocab_size=VOCAB, seed=3)
ENGINE = correct_engine(PAIR)
SCORE = PAIR.scorer()
PROMPTS = [[1, 2, 3], [4, 5]]
#: A small audit: 2 prompts, every arm, 8 tokens per row.  Jobs 0-1 single, 2 equal, 3 ragged, 4-5 repeated.
#: The failing arm's two jobs are allowed, so the other arms' verdict stands (tests/generation/test_failed_calls.py
#: checks the default: no failed call allowed).
SMALL = dict(vocab_size=VOCAB, max_new_tokens=8, batch_size=2, progress=False, seed=5, allow_failed_calls=2)
REPEATED_JOBS = 2


def _is_repeated(prompts) -> bool:
    return len(prompts) > 1 and all(list(p) == list(prompts[0]) for p in prompts)


def _hang(*_):
    while True:  # a pure-Python loop: the time limit stops it
        time.sleep(0.01)


def _generator_with(bad):
    """The correct engine, with ``bad(prompts, output)`` returning what the repeated arm's calls get instead."""
    def generate(prompts, max_new_tokens, seed):
        output = ENGINE.generate(prompts, max_new_tokens, seed)
        return bad(prompts, output) if _is_repeated(prompts) else output

    generate.per_row_max_new_tokens = True
    return generate


def _scorer_with(bad):
    def score(prompts, continuations):
        laws = SCORE(prompts, continuations)
        return bad(prompts, continuations, laws) if _is_repeated(prompts) else laws

    return score


def _raise(*_):
    raise RuntimeError("engine blew up")


def _rows(fn):
    """Apply ``fn`` to the first continuation of a GenerationOutput."""
    def bad(prompts, output):
        rows = [list(r) for r in output.continuations]
        rows[0] = fn(rows[0])
        return rows

    return bad


GENERATOR_CASES = {
    "raises": (_raise, "generator raised on arm repeated, round 0, job 4 (2 rows): RuntimeError: engine blew up"),
    "too few continuations": (lambda p, o: o.continuations[:-1], "expected 2 continuations (one per prompt), got 1"),
    "too many continuations": (lambda p, o: o.continuations + [[1]],
                               "expected 2 continuations (one per prompt), got 3"),
    "not a list": (lambda p, o: 7, "expected 2 continuations (one per prompt), got int"),
    "too many tokens": (_rows(lambda r: r + [1, 2]), "row 0: 10 tokens, more than max_new_tokens = 8"),
    "id past the vocabulary": (_rows(lambda r: r[:-1] + [VOCAB]), f"row 0: token {VOCAB} is not an id in [0, {VOCAB})"),
    "negative id": (_rows(lambda r: [-1] + r[1:]), f"row 0: token -1 is not an id in [0, {VOCAB})"),
    "float id": (_rows(lambda r: [1.0] + r[1:]), "row 0: token 1.0 is not an id"),
    "string id": (_rows(lambda r: ["3"] + r[1:]), "row 0: token '3' is not an id"),
    "boolean id": (_rows(lambda r: [True] + r[1:]), "row 0: token True is not an id"),
    "row not a list": (_rows(lambda r: 3), "row 0: expected a list of token ids, got int"),
    "counters of the wrong length": (lambda p, o: GenerationOutput(o.continuations, accepted=[0]),
                                     "accepted has 1 entries for 2 prompts"),
    "negative counters": (lambda p, o: GenerationOutput(o.continuations, target_calls=[-1, 2]),
                          "target_calls must be non-negative integers"),
    "hangs": (lambda p, o: _hang(), "generator did not return within 0.5 s on arm repeated, round 0, job 4"),
}


def _laws_case(fn):
    def bad(prompts, continuations, laws):
        laws = [law.clone() for law in laws]
        laws[0] = fn(laws[0])
        return laws

    return bad


SCORER_CASES = {
    "raises": (lambda p, c, laws: _raise(), "scorer raised on arm repeated, round 0, job 4 (2 rows): RuntimeError"),
    "too few laws": (lambda p, c, laws: laws[:1], "expected 2 laws tensors (one per continuation), got 1"),
    "not a list": (lambda p, c, laws: 3.0, "expected 2 laws tensors (one per continuation), got float"),
    "a row too short": (_laws_case(lambda law: law[1:]), "row 0: expected laws of shape [8, 8], got [7, 8]"),
    "the wrong vocabulary": (_laws_case(lambda law: law[:, :-1]), "row 0: expected laws of shape [8, 8], got [8, 7]"),
    "one-dimensional": (_laws_case(lambda law: law[0]), "row 0: expected laws of shape [8, 8], got [8]"),
    "not numbers": (_laws_case(lambda law: "laws"), "row 0: expected a [8, 8] tensor of laws, got str"),
    "not summing to 1": (_laws_case(lambda law: law * 1.5), "row 0: a law sums to 1.5, not 1"),
    "negative": (_laws_case(lambda law: torch.cat([torch.tensor([[-0.5, 1.5] + [0.0] * (VOCAB - 2)],
                                                               dtype=law.dtype), law[1:]])),
                 "row 0: laws must be finite and non-negative"),
    "NaN": (_laws_case(lambda law: torch.where(torch.arange(VOCAB) == 0, math.nan, law)),
            "row 0: laws must be finite and non-negative"),
    "logits with NaN": (lambda p, c, laws: ScoredLogits([torch.full((len(r), VOCAB), math.nan) for r in c]),
                        "row 0: logits must be finite or -inf"),
    "logits with one NaN": (lambda p, c, laws: ScoredLogits([torch.zeros(len(r), VOCAB).index_fill(1, torch.tensor(
        [3]), math.nan) for r in c]), "row 0: logits must be finite or -inf"),
    "logits with one +inf": (lambda p, c, laws: ScoredLogits([torch.zeros(len(r), VOCAB).index_fill(1, torch.tensor(
        [5]), math.inf) for r in c]), "row 0: logits must be finite or -inf"),
    "logits of the wrong shape": (lambda p, c, laws: ScoredLogits([torch.zeros(len(r), VOCAB + 1) for r in c]),
                                  "row 0: expected logits of shape [8, 8], got [8, 9]"),
    "logits its parameters cannot process": (
        lambda p, c, laws: ScoredLogits([torch.zeros(len(r), VOCAB) for r in c],
                                        SamplingParams(temperature=torch.tensor([1.0, 1.0, 1.0]))),
        "row 0: its logits could not be processed"),
    "hangs": (lambda p, c, laws: _hang(), "scorer did not return within 0.5 s on arm repeated, round 0, job 4"),
}


def _check_one_arm_failed(result, message: str, component: str) -> None:
    assert len(result.failures) == REPEATED_JOBS, result.failures
    for failure in result.failures:
        assert failure.startswith("job 4 (repeated): ") or failure.startswith("job 5 (repeated): "), failure
        assert f"{component} " in failure and "arm repeated, round 0, job " in failure, failure
    assert message in result.failures[0], (message, result.failures[0])
    # the other arms went on: a verdict from them, and none of the failing arm's tokens
    assert result.verdict != "ERROR" and result.num_jobs == 4
    assert result.tokens_by_arm["repeated"] == 0
    assert all(result.tokens_by_arm[arm] > 0 for arm in ("single", "equal", "ragged"))


@pytest.mark.parametrize("case", sorted(GENERATOR_CASES))
def test_a_bad_generator_fails_its_jobs_only(case):
    bad, message = GENERATOR_CASES[case]
    result = audit_generation(_generator_with(bad), SCORE, PROMPTS, timeout=0.5, **SMALL)
    _check_one_arm_failed(result, message, "generator")


@pytest.mark.parametrize("case", sorted(SCORER_CASES))
def test_a_bad_scorer_fails_its_jobs_only(case):
    bad, message = SCORER_CASES[case]
    result = audit_generation(ENGINE, _scorer_with(bad), PROMPTS, timeout=0.5, **SMALL)
    _check_one_arm_failed(result, message, "scorer")


def test_a_bad_draft_scorer_and_reference_are_named():
    draft = PAIR.draft_scorer()

    def bad_draft(prompts, continuations):
        if _is_repeated(prompts):
            raise ValueError("draft down")
        return draft(prompts, continuations)

    result = audit_generation(ENGINE, SCORE, PROMPTS, draft_score=bad_draft, **SMALL)
    _check_one_arm_failed(result, "draft scorer raised on arm repeated, round 0, job 4 (2 rows): ValueError: "
                                  "draft down", "draft scorer")
    reference = PAIR.reference()

    def bad_reference(prompts, max_new_tokens, seed):
        out = reference(prompts, max_new_tokens, seed)
        return out + [[0]] if _is_repeated(prompts) else out

    bad_reference.per_row_max_new_tokens = True
    result = audit_generation(ENGINE, SCORE, PROMPTS, reference=bad_reference, **SMALL)
    _check_one_arm_failed(result, "reference on arm repeated, round 0, job 4 (2 rows): expected 2 continuations",
                          "reference")


def test_a_generator_that_always_fails_gives_an_error_verdict_listing_every_job():
    result = audit_generation(lambda prompts, n, seed: _raise(), SCORE, PROMPTS, **SMALL)
    assert result.verdict == "ERROR" and result.num_tokens == 0 and result.num_jobs == 0
    assert len(result.failures) == 6 and all("generator raised" in f for f in result.failures)


def test_the_timeout_stops_a_hang_promptly_and_the_audit_goes_on():
    calls = {"n": 0}

    def generate(prompts, max_new_tokens, seed):
        calls["n"] += 1
        if calls["n"] == 2:
            _hang()
        return ENGINE.generate(prompts, max_new_tokens, seed)

    generate.per_row_max_new_tokens = True
    start = time.perf_counter()
    result = audit_generation(generate, SCORE, PROMPTS, timeout=0.3, **SMALL)
    assert time.perf_counter() - start < 10
    assert len(result.failures) == 1 and result.failures[0].startswith("job 1 (single): generator did not return "
                                                                       "within 0.3 s on arm single, round 0, job 1")
    assert result.num_jobs == 5


def test_the_wrapped_calls_accept_numpy_and_tensor_outputs():
    generator = as_generator(lambda prompts, n, seed: np.array([[1, 2], [3, 4]], dtype=np.int64))
    out = generator([[1], [2]], 2, 0, vocab_size=VOCAB, case="a case")
    assert out.continuations == [[1, 2], [3, 4]] and all(type(t) is int for r in out.continuations for t in r)
    generator = as_generator(lambda prompts, n, seed: [torch.tensor([1, 2]), [np.int32(3)]])
    assert generator([[1], [2]], 2, 0, vocab_size=VOCAB, case="a case").continuations == [[1, 2], [3]]
    scorer = as_scorer(lambda prompts, conts: torch.full((2, 1, VOCAB), 1.0 / VOCAB), VOCAB)
    laws, logits, _, _ = scorer([[1], [2]], [[1], [2]], case="a case")
    assert logits is None and [law.shape for law in laws] == [(1, VOCAB), (1, VOCAB)]
    with pytest.raises(GenerationContractError, match=re.escape("generator on a case, row 1: token 9")):
        as_generator(lambda prompts, n, seed: [[1], [9]])([[1], [2]], 2, 0, vocab_size=VOCAB, case="a case")


GOOD = dict(generate=ENGINE, score=SCORE, prompts=PROMPTS, vocab_size=VOCAB, max_new_tokens=4, progress=False)

BAD_ARGUMENTS = [
    ("prompts", dict(prompts=[])),
    ("prompts", dict(prompts="abc")),
    ("prompts[0]", dict(prompts=[[]])),
    ("prompts[1]", dict(prompts=[[1], [2, VOCAB]])),
    ("prompts[0]", dict(prompts=[[1.5]])),
    ("vocab_size", dict(vocab_size=1)),
    ("vocab_size", dict(vocab_size="8")),
    ("vocab_size", dict(vocab_size=True)),
    ("max_new_tokens", dict(max_new_tokens=0)),
    ("max_new_tokens", dict(max_new_tokens=2.5)),
    ("max_new_tokens", dict(max_new_tokens="8")),
    ("batch_size", dict(batch_size=1)),
    ("batch_size", dict(batch_size=2.0)),
    ("rounds", dict(rounds=0)),
    ("arms", dict(arms=("single", "bogus"))),
    ("arms", dict(arms=())),
    ("arms", dict(arms="bogus")),
    ("arms", dict(arms=("single", "single"))),
    ("seed", dict(seed=1.5)),
    ("alpha", dict(alpha=0)),
    ("alpha", dict(alpha=1.5)),
    ("power", dict(power=1.0)),
    ("min_detectable_tv", dict(min_detectable_tv=0)),
    ("min_detectable_tv", dict(min_detectable_tv="0.1")),
    ("orderings", dict(orderings=("ratio",))),
    ("orderings", dict(orderings=("by-magic",))),
    ("orderings", dict(orderings=())),
    ("orderings", dict(orderings=("token-id", "token-id"))),
    ("orderings", dict(orderings=5)),
    ("orderings", dict(orderings={"probability", "token-id"})),
    ("position_buckets", dict(position_buckets=(64, 16))),
    ("position_buckets", dict(position_buckets="16")),
    ("position_buckets", dict(position_buckets=(0,))),
    ("zero_mass_tol", dict(zero_mass_tol=-1.0)),
    ("zero_mass_tol", dict(zero_mass_tol="0")),
    ("logit_tol", dict(logit_tol=-1.0)),
    ("logit_tol", dict(logit_tol=math.inf)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_seconds", dict(max_seconds=-1)),
    ("timeout", dict(timeout=0)),
    ("timeout", dict(timeout="1")),
    ("store", dict(store=5)),
    ("resume", dict(resume=True)),
    ("resume", dict(resume="yes")),
    ("distributed", dict(distributed=True)),
    ("distributed", dict(distributed="yes")),
    ("eos_token_id", dict(eos_token_id=VOCAB)),
    ("eos_token_id", dict(eos_token_id=1.0)),
    ("greedy", dict(greedy="yes")),
    ("progress", dict(progress=1)),
    ("per_row_max_new_tokens", dict(per_row_max_new_tokens="no")),
    ("name", dict(name=3)),
    ("generate", dict(generate=5)),
    ("score", dict(score=5)),
    ("reference", dict(reference="engine")),
    ("draft_score", dict(draft_score=5)),
]


@pytest.mark.parametrize("argument, change", BAD_ARGUMENTS, ids=[f"{a}-{i}" for i, (a, _) in enumerate(BAD_ARGUMENTS)])
def test_bad_arguments_are_named(argument, change):
    kwargs = {**GOOD, **change}
    with pytest.raises(InvalidArgument) as caught:
        audit_generation(kwargs.pop("generate"), kwargs.pop("score"), kwargs.pop("prompts"), **kwargs)
    assert str(caught.value).startswith(f"{argument}:"), str(caught.value)


def test_the_good_arguments_run():
    result = audit_generation(**{k: v for k, v in GOOD.items()})
    assert result.num_tokens > 0 and result.failures == ()
