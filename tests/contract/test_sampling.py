"""The reference processing of logits and sampling parameters (spectr_audit/contract/sampling.py).

* against the plain-Python oracle (:mod:`tests.oracles.sampling`) for every engine's conventions;
* against the engines that install here: vLLM's own ``Sampler`` (temperature, the min-p logits
  processor, ``apply_top_k_top_p``; the processed logits it returns with
  ``logprobs_mode="processed_logits"``, and its greedy tokens) and transformers' logits warpers
  (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``) in
  transformers' order and in EAGLE's;
* a case table of hand-derived laws where the engines' conventions differ; a bad-input table.

Random cases use logits on a coarse grid (so ties, exact boundaries and ``-inf`` are common) and
vocabularies of at most 12 tokens, where ``torch.sort`` is stable on CPU and the engines' choice
among tied tokens is reproducible.  A case whose kept set would change if top-p or min-p moved by
1e-9 is skipped: there the result depends on the rounding of a cumulative sum, and the
reference and the engine are both exact only away from it.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from spectr_audit.contract.sampling import (
    PROCESSING_ORDERS,
    ProcessingOrder,
    SamplingParams,
    logits_from_probs,
    order_names,
    process_logits,
    processing_order,
)
from spectr_audit.errors import InvalidArgument

from tests.oracles import sampling as oracle

LN = math.log
INF = math.inf

GRID = [-INF, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0]


@st.composite
def logits_rows(draw, min_vocab=2, max_vocab=12, max_rows=3):
    vocab_size = draw(st.integers(min_vocab, max_vocab))
    rows = draw(st.integers(1, max_rows))
    out = []
    for _ in range(rows):
        row = draw(st.lists(st.sampled_from(GRID), min_size=vocab_size, max_size=vocab_size))
        assume(any(x > -INF for x in row))
        out.append(row)
    return out


@st.composite
def row_params(draw, vocab_size, greedy=False, min_p=True):
    temperature = draw(st.sampled_from([0.0, 1e-6, 5e-6]) if greedy else st.sampled_from([0.3, 0.5, 0.7, 1.0, 1.3, 2.0]))
    return dict(
        temperature=temperature,
        top_k=draw(st.sampled_from([0, 1, 2, 3, 5, vocab_size, vocab_size + 2])),
        top_p=draw(st.sampled_from([1.0, 0.95, 0.9, 0.75, 0.6, 0.5, 0.3, 0.1])),
        min_p=draw(st.sampled_from([0.0, 0.05, 0.1, 0.3, 0.6])) if min_p else 0.0,
    )


def _params_tensor(rows_params):
    return SamplingParams(
        temperature=[p["temperature"] for p in rows_params],
        top_k=[p["top_k"] for p in rows_params],
        top_p=[p["top_p"] for p in rows_params],
        min_p=[p["min_p"] for p in rows_params],
    )


def _stable(row, params, engine):
    """Whether the oracle's kept set survives moving top-p and min-p by 1e-9."""
    base = [x > 0 for x in oracle.process_engine(row, engine, **params)]
    for dp, dm in ((1e-9, 0), (-1e-9, 0), (0, 1e-9), (0, -1e-9)):
        moved = dict(params)
        moved["top_p"] = min(1.0, max(1e-12, params["top_p"] + dp)) if params["top_p"] < 1 else 1.0
        moved["min_p"] = min(1.0, max(0.0, params["min_p"] + dm)) if params["min_p"] > 0 else 0.0
        if [x > 0 for x in oracle.process_engine(row, engine, **moved)] != base:
            return False
    return True


def _close(actual, expected, atol=1e-12):
    return torch.allclose(torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------
# Against the oracle
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", list(oracle.ENGINES))
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_matches_oracle(engine, data):
    rows = data.draw(logits_rows())
    vocab_size = len(rows[0])
    greedy = data.draw(st.booleans())
    rows_params = [data.draw(row_params(vocab_size, greedy=greedy, min_p=engine != "eagle")) for _ in rows]
    for row, params in zip(rows, rows_params):
        assume(_stable(row, params, engine))
    got = process_logits(torch.tensor(rows, dtype=torch.float64), _params_tensor(rows_params), engine)
    expected = [oracle.process_engine(row, engine, **params) for row, params in zip(rows, rows_params)]
    assert _close(got, expected)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_orders_of_steps_match_oracle(data):
    """Any permutation of the steps (the wrong orders the sampling-bug library models)."""
    rows = data.draw(logits_rows(max_rows=1))
    steps = tuple(data.draw(st.permutations(["temperature", "top_k", "top_p", "min_p"])))
    params = data.draw(row_params(len(rows[0])))
    assume(_stable(rows[0], params, "vllm"))
    conventions = {**oracle.ENGINES["vllm"], "steps": steps, "greedy_below": 0.0}
    moved_ok = all(
        [x > 0 for x in oracle.process(rows[0], **{**params, "top_p": min(1.0, params["top_p"] + d) if params["top_p"] < 1 else 1.0}, **conventions)]
        == [x > 0 for x in oracle.process(rows[0], **params, **conventions)]
        for d in (1e-9, -1e-9)
    )
    assume(moved_ok)
    got = process_logits(torch.tensor(rows, dtype=torch.float64), SamplingParams(**params), list(steps))
    assert _close(got[0], oracle.process(rows[0], **params, **conventions))


def test_broadcast_over_drafts_and_positions():
    """Rows of the parameters align with the first dimension; the others share them."""
    logits = torch.randn(2, 3, 4, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    params = SamplingParams(temperature=[0.5, 2.0], top_k=[2, 0])
    got = process_logits(logits, params)
    for b in range(2):
        alone = process_logits(logits[b].reshape(1, -1, 7), params.select([b]))
        assert torch.equal(got[b], alone.reshape(3, 4, 7))
    assert got.dtype == torch.float64 and got.shape == logits.shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_half_precision_logits_are_widened(dtype):
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0]], dtype=dtype)
    got = process_logits(logits, SamplingParams(temperature=0.7, top_p=0.9))
    expected = oracle.process_engine([float(x) for x in logits[0].double()], "vllm", temperature=0.7, top_p=0.9)
    assert _close(got[0], expected)


# ---------------------------------------------------------------------------------------------
# Against vLLM's own sampler
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _vllm_modules():
    """Import vLLM's sampler once (registering the CPU kernel overrides first)."""
    from vllm.platforms import current_platform

    register = getattr(current_platform, "register_triton_kernel_overrides", None)
    if register is not None:
        register()
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    return Sampler, SamplingMetadata, LogitsProcessors, MinPLogitsProcessor


def _vllm():
    pytest.importorskip("vllm")
    return _vllm_modules()


@functools.lru_cache(maxsize=None)
def _vllm_sampler(logprobs_mode):
    return _vllm()[0](logprobs_mode=logprobs_mode)


def _vllm_metadata(rows_params, vocab_size, dtype, all_random):
    _, SamplingMetadata, LogitsProcessors, MinPLogitsProcessor = _vllm()
    batch_size = len(rows_params)
    min_p = torch.tensor([p["min_p"] for p in rows_params], dtype=dtype)
    processors = []
    if bool((min_p > 0).any()):
        # vLLM's own min-p processor; its per-request state is normally filled by the input batch
        min_p_processor = MinPLogitsProcessor.__new__(MinPLogitsProcessor)
        min_p_processor.min_p = min_p.unsqueeze(1)
        min_p_processor.min_p_count = int((min_p > 0).sum())
        processors.append(min_p_processor)
    top_k = torch.tensor([p["top_k"] if 0 < p["top_k"] < vocab_size else vocab_size for p in rows_params])
    top_p = torch.tensor([p["top_p"] for p in rows_params], dtype=dtype)
    return SamplingMetadata(
        temperature=torch.tensor([p["temperature"] for p in rows_params], dtype=dtype),
        all_greedy=False, all_random=all_random,
        top_p=top_p if bool((top_p < 1).any()) else None,
        top_k=top_k if bool((top_k < vocab_size).any()) else None,
        generators={}, max_num_logprobs=0, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch_size), presence_penalties=torch.zeros(batch_size),
        repetition_penalties=torch.ones(batch_size), output_token_ids=[[] for _ in range(batch_size)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(processors),
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_matches_vllm_sampler(data):
    """The law of vLLM's non-speculative sampler: softmax of the processed logits it returns."""
    _vllm()
    rows = data.draw(logits_rows())
    vocab_size = len(rows[0])
    rows_params = [data.draw(row_params(vocab_size)) for _ in rows]
    for row, params in zip(rows, rows_params):
        assume(_stable(row, params, "vllm"))
    logits = torch.tensor(rows, dtype=torch.float64)
    metadata = _vllm_metadata(rows_params, vocab_size, torch.float64, all_random=True)
    _, processed = _vllm_sampler("processed_logits").sample(logits.clone(), metadata)
    engine_law = torch.softmax(processed.double(), dim=-1)
    assert _close(process_logits(logits, _params_tensor(rows_params), "vllm"), engine_law)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_matches_vllm_greedy(data):
    """Greedy rows (temperature 0 or below 1e-5): vLLM's token is the reference's one-hot."""
    _vllm()
    rows = data.draw(logits_rows())
    vocab_size = len(rows[0])
    rows_params = [data.draw(row_params(vocab_size, greedy=True)) for _ in rows]
    logits = torch.tensor(rows, dtype=torch.float32)  # vLLM's CPU argmax kernel takes float32
    metadata = _vllm_metadata(rows_params, vocab_size, torch.float32, all_random=False)
    tokens, _ = _vllm_sampler("raw_logprobs").sample(logits.clone(), metadata)
    law = process_logits(logits, _params_tensor(rows_params), "vllm")
    assert bool((law.max(-1).values == 1).all())
    assert law.argmax(-1).tolist() == tokens.tolist()


# ---------------------------------------------------------------------------------------------
# Against transformers' logits warpers (transformers' order, and EAGLE's)
# ---------------------------------------------------------------------------------------------


def _hf_law(row, params, engine):
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = torch.tensor([row], dtype=torch.float64)
    temperature = params["temperature"]
    if engine == "eagle" and temperature <= 1e-5:
        return torch.zeros_like(scores[0]).scatter_(0, scores[0].argmax().view(1), 1.0)
    warpers = []
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(temperature)))
    top_k = [TopKLogitsWarper(params["top_k"])] if params["top_k"] > 0 else []
    top_p = [TopPLogitsWarper(params["top_p"])] if params["top_p"] < 1 else []
    if engine == "transformers":
        warpers += top_k + top_p
        if params["min_p"] > 0:
            warpers.append(MinPLogitsWarper(params["min_p"]))
    else:  # EAGLE's prepare_logits_processor: temperature, top-p, top-k
        warpers += top_p + top_k
    for warper in warpers:
        scores = warper(None, scores)
    return torch.softmax(scores[0], dim=-1)


@pytest.mark.parametrize("engine", ["transformers", "eagle"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_matches_transformers_warpers(engine, data):
    pytest.importorskip("transformers")
    rows = data.draw(logits_rows(max_rows=1))
    row = rows[0]
    params = data.draw(row_params(len(row), greedy=engine == "eagle" and data.draw(st.booleans()), min_p=engine != "eagle"))
    if engine == "transformers" and params["temperature"] < 1e-3:
        params["temperature"] = 1.0  # transformers' greedy is do_sample=False, not a temperature
    assume(_stable(row, params, engine))
    got = process_logits(torch.tensor(rows, dtype=torch.float64), SamplingParams(**params), engine)[0]
    assert _close(got, _hf_law(row, params, engine))


# ---------------------------------------------------------------------------------------------
# Hand-derived cases where the engines differ
# ---------------------------------------------------------------------------------------------

P442 = [0.0, 0.0, -LN(2)]  # probabilities 0.4, 0.4, 0.2
P211 = [0.0, -LN(2), -LN(2)]  # 0.5, 0.25, 0.25
P4321 = [LN(0.4), LN(0.3), LN(0.2), LN(0.1)]
P_MIN = [LN(0.5), LN(0.3), LN(0.15), LN(0.05)]

CASES = [
    # (logits, params, {engine: expected law}), each derived by hand in the comment
    # top-p tie at the boundary: vLLM/transformers rank the higher index first, SGLang the lower
    pytest.param(P442, dict(top_p=0.3), {"vllm": [0, 1, 0], "transformers": [0, 1, 0], "eagle": [0, 1, 0], "sglang": [1, 0, 0]}, id="top-p-tie"),
    # mass ahead exactly p: excluded by "ahead < p" (vLLM), included by "ahead <= p" (SGLang)
    pytest.param(P211, dict(top_p=0.5), {"vllm": [1, 0, 0], "transformers": [1, 0, 0], "sglang": [2 / 3, 1 / 3, 0]}, id="top-p-exact-boundary"),
    # top-k ties: all kept (vLLM, transformers) or exactly k by rank (SGLang)
    pytest.param([1.0, 1.0, 1.0, 0.0], dict(top_k=2), {"vllm": [1 / 3, 1 / 3, 1 / 3, 0], "transformers": [1 / 3, 1 / 3, 1 / 3, 0], "sglang": [0.5, 0.5, 0, 0]}, id="top-k-ties"),
    # top-k 2 then top-p 0.5: renormalised (4/7, 3/7) puts 4/7 >= 0.5 ahead of token 1; SGLang's
    # unfiltered mass ahead of token 1 is 0.4 <= 0.5; EAGLE applies top-p first (0.4 < 0.5 keeps it)
    pytest.param(P4321, dict(top_k=2, top_p=0.5), {"vllm": [1, 0, 0, 0], "transformers": [1, 0, 0, 0], "sglang": [4 / 7, 3 / 7, 0, 0], "eagle": [4 / 7, 3 / 7, 0, 0]}, id="top-k-then-top-p"),
    # min-p 0.2 (threshold 0.1) drops token 3 first in vLLM, so top-p 0.83 sees 0.8/0.95 = 0.842
    # ahead of token 2 and drops it; transformers' top-p sees 0.8 < 0.83 and keeps it
    pytest.param(P_MIN, dict(min_p=0.2, top_p=0.83), {"vllm": [0.625, 0.375, 0, 0], "transformers": [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], "sglang": [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]}, id="min-p-before-top-p"),
    # min-p tie at the threshold is kept: 0.25 >= 0.5 * 0.5
    pytest.param(P211, dict(min_p=0.5), {"vllm": [0.5, 0.25, 0.25], "transformers": [0.5, 0.25, 0.25], "sglang": [0.5, 0.25, 0.25]}, id="min-p-tie-kept"),
    # greedy: lowest index among tied maxima
    pytest.param([1.0, 3.0, 3.0, 0.0], dict(temperature=0.0), {e: [0, 1, 0, 0] for e in ("vllm", "sglang", "transformers", "eagle")}, id="greedy-tie"),
    # temperature 1e-6: greedy below vLLM's 1e-5 and at or below EAGLE's; sampled by SGLang (1e-6
    # is not below its 1e-6) and transformers, where the two tied maxima share the mass
    pytest.param([1.0, 3.0, 3.0, 0.0], dict(temperature=1e-6), {"vllm": [0, 1, 0, 0], "eagle": [0, 1, 0, 0], "sglang": [0, 0.5, 0.5, 0], "transformers": [0, 0.5, 0.5, 0]}, id="greedy-threshold"),
    # temperature 0.5 squares the ratio: (1, 2) -> (1, 4)
    pytest.param([0.0, LN(2)], dict(temperature=0.5), {e: [0.2, 0.8] for e in ("vllm", "sglang", "transformers", "eagle")}, id="temperature"),
    # -inf logits never come back, whatever the temperature
    pytest.param([-INF, 0.0, 0.0], dict(temperature=3.0, top_k=3), {e: [0, 0.5, 0.5] for e in ("vllm", "sglang", "transformers", "eagle")}, id="minus-inf"),
]


@pytest.mark.parametrize("logits, params, expected", CASES)
def test_case_table(logits, params, expected):
    for engine, law in expected.items():
        got = process_logits(torch.tensor([logits], dtype=torch.float64), SamplingParams(**params), engine)[0]
        assert _close(got, law, atol=1e-12), (engine, got.tolist(), law)
        assert _close(oracle.process_engine(logits, engine, **params), law, atol=1e-12), engine


def test_named_orders():
    assert order_names() == ["vllm", "sglang", "transformers", "eagle"]
    assert processing_order("vllm").steps == ("temperature", "min_p", "top_k", "top_p")
    assert processing_order(("top_p", "temperature")).steps == ("top_p", "temperature")
    custom = ProcessingOrder("mine", ("temperature",))
    assert processing_order(custom) is custom
    for name, order in PROCESSING_ORDERS.items():
        assert order.name == name and order.description


def test_logits_from_probs_round_trip():
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3]], dtype=torch.float64)
    logits = logits_from_probs(probs)
    assert logits[0, 1] == -INF
    assert _close(process_logits(logits), probs)


def test_params_helpers():
    params = SamplingParams(temperature=[0.5, 1.0, 0.0], top_k=2)
    assert params.batch_size == 3
    assert params.column("top_k", 3).tolist() == [2, 2, 2]
    assert params.select([2]).temperature.tolist() == [0.0]
    assert params.repeat_interleave([1, 0, 2]).temperature.tolist() == [0.5, 0.0, 0.0]
    assert params.describe() == {"temperature": [0.5, 1.0, 0.0], "top_k": 2}
    assert SamplingParams() == SamplingParams(temperature=1.0, top_k=0)
    assert SamplingParams(top_k=[2, 2]) == SamplingParams(top_k=2)
    assert SamplingParams(top_k=[2, 3]) != SamplingParams(top_k=2)
    assert SamplingParams().is_neutral() and SamplingParams(top_k=9).is_neutral(vocab_size=9)
    assert not SamplingParams(top_p=0.9).is_neutral()
    assert SamplingParams.greedy().temperature == 0.0


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------

BAD_PARAMS = [
    (dict(temperature=-0.5), "temperature: must be finite and >= 0"),
    (dict(temperature=math.nan), "temperature: must be finite"),
    (dict(temperature=[1.0, math.inf]), "temperature: must be finite and >= 0; got inf at row 1"),
    (dict(top_k=-1), "top_k: must be >= 0"),
    (dict(top_k=1.5), "top_k: expected an integer"),
    (dict(top_k=torch.tensor([1.0, 2.0])), "top_k: expected an integer tensor"),
    (dict(top_k=True), "top_k: expected a number"),
    (dict(top_p=0.0), r"top_p: must lie in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p: must lie in \(0, 1\]"),
    (dict(min_p=-0.1), r"min_p: must lie in \[0, 1\]"),
    (dict(min_p=torch.zeros(2, 2)), "min_p: expected a scalar or a \\[batch_size\\] tensor"),
    (dict(temperature=[1.0, 1.0], top_p=[0.5, 0.5, 0.5]), "per-row tensors must have one length"),
    (dict(temperature="hot"), "temperature: expected a number"),
]


@pytest.mark.parametrize("kwargs, message", BAD_PARAMS)
def test_bad_params(kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        SamplingParams(**kwargs)


BAD_PROCESS = [
    (torch.tensor([[0.0, math.nan]]), None, "vllm", "logits: logits must be finite or -inf; found nan"),
    (torch.tensor([[0.0, math.inf]]), None, "vllm", "logits: logits must be finite or -inf; found inf"),
    (torch.tensor([[-math.inf, -math.inf]]), None, "vllm", "-inf everywhere"),
    (torch.tensor([[1, 2]]), None, "vllm", "logits: expected a floating-point tensor"),
    (torch.tensor([0.0, 1.0]), None, "vllm", r"logits: expected shape \[batch_size, ..., vocab_size\]"),
    ([[0.0, 1.0]], None, "vllm", "logits: expected a torch.Tensor"),
    (torch.zeros(2, 3), SamplingParams(temperature=[1.0, 1.0, 1.0]), "vllm", "sampling parameters have 3 rows, the batch has 2"),
    (torch.zeros(1, 3), SamplingParams(min_p=0.1), "eagle", "min_p is set but processing order 'eagle' has no min_p step"),
    (torch.zeros(1, 3), SamplingParams(top_k=2), ("temperature",), "top_k is set but processing order"),
    (torch.zeros(1, 3), None, "nope", "order: unknown processing order 'nope'"),
    (torch.zeros(1, 3), None, ("temperature", "temperature"), "order: steps must be distinct"),
    (torch.zeros(1, 3), None, ("top_q",), "order: steps must be distinct names"),
    (torch.zeros(1, 3), {"temperature": 1.0}, "vllm", "params: expected SamplingParams"),
]


@pytest.mark.parametrize("logits, params, order, message", BAD_PROCESS)
def test_bad_process_inputs(logits, params, order, message):
    with pytest.raises(InvalidArgument, match=message):
        process_logits(logits, params, order)


def test_bad_processing_order_fields():
    with pytest.raises(InvalidArgument, match="top_p_boundary must be one of"):
        ProcessingOrder("x", ("top_p",), top_p_boundary="sometimes")
    with pytest.raises(InvalidArgument, match="greedy_below must be finite"):
        ProcessingOrder("x", ("temperature",), greedy_below=-1.0)
