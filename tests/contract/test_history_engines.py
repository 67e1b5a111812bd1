"""The history-dependent processors against each engine's own code, where it is installed.

vLLM 0.32's ``apply_penalties`` (repetition over prompt and output, then frequency and presence over the
output) and ``apply_bad_words`` (over the output); transformers' ``SequenceBiasLogitsProcessor``,
``RepetitionPenaltyLogitsProcessor``, ``NoBadWordsLogitsProcessor`` and ``MinNewTokensLengthLogitsProcessor``
chained in ``_get_logits_processor``'s order; SGLang 0.5.23's four penalizers under their orchestrator.  Each
engine's function is applied to one position's logits with the row's history; process_request's processed logits
at that position must agree.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from spectr_audit.contract.history import process_request
from spectr_audit.contract.requests import Request
from spectr_audit.errors import InvalidArgument


@st.composite
def histories(draw):
    vocab = draw(st.integers(2, 8))
    token = st.integers(0, vocab - 1)
    prompt = draw(st.lists(token, min_size=1, max_size=5))
    emitted = draw(st.lists(token, max_size=6))
    logits = draw(st.lists(st.floats(-6, 6, allow_subnormal=False), min_size=vocab, max_size=vocab))
    return vocab, prompt, emitted, logits


def _rows(logits, emitted):
    """Teacher-forced rows: zeros before the last position, ``logits`` at it."""
    rows = torch.zeros(len(emitted) + 1, len(logits), dtype=torch.float64)
    rows[-1] = torch.tensor(logits, dtype=torch.float64)
    return rows


def _ours(logits, prompt, emitted, request, order, eos=None):
    try:
        laws = process_request(_rows(logits, emitted), prompt, emitted + [0], request, order, eos_token_id=eos)
    except InvalidArgument as exc:  # every token masked at some position: no law to compare
        assume("masks every token" not in str(exc))
        raise
    return laws.processed_logits[-1]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=histories(), rep=st.sampled_from([1.0, 0.7, 1.5]), freq=st.sampled_from([0.0, 0.4, -0.3]),
       pres=st.sampled_from([0.0, 0.6, -0.2]))
def test_vllm_apply_penalties(history, rep, freq, pres):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.utils import apply_penalties

    vocab, prompt, emitted, logits = history
    pad = lambda ids: torch.tensor([ids if ids else [vocab]], dtype=torch.int64)  # noqa: E731 (vLLM pads with V)
    engine = apply_penalties(torch.tensor([logits], dtype=torch.float64), pad(prompt), pad(emitted),
                             torch.tensor([pres], dtype=torch.float64), torch.tensor([freq], dtype=torch.float64),
                             torch.tensor([rep], dtype=torch.float64))[0]
    request = Request(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    assert torch.allclose(_ours(logits, prompt, emitted, request, "vllm"), engine, rtol=0, atol=1e-12)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=histories(), data=st.data())
def test_vllm_apply_bad_words(history, data):
    pytest.importorskip("vllm")
    from vllm.v1.sample.ops.bad_words import apply_bad_words

    vocab, prompt, emitted, logits = history
    words = data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3), min_size=1, max_size=3))
    engine = torch.tensor([logits], dtype=torch.float64)
    apply_bad_words(engine, {0: [list(w) for w in words]}, [list(emitted)])
    ours = _ours(logits, prompt, emitted, Request(bad_words=words), "vllm")
    assert torch.equal(ours, engine[0])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=histories(), data=st.data())
def test_transformers_processors_in_generate_order(history, data):
    pytest.importorskip("transformers")
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinNewTokensLengthLogitsProcessor,
        NoBadWordsLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    vocab, prompt, emitted, logits = history
    token = st.integers(0, vocab - 1)
    rep = data.draw(st.sampled_from([1.0, 0.8, 1.4]))
    bias = data.draw(st.dictionaries(token, st.floats(-3, 3, allow_subnormal=False), max_size=2))
    words = data.draw(st.lists(st.lists(token, min_size=1, max_size=3), max_size=2))
    min_tokens = data.draw(st.integers(0, 4))
    eos = data.draw(token)
    chain = []
    if bias:
        chain.append(SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in bias.items()]))
    if rep != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(penalty=rep))
    if words:
        chain.append(NoBadWordsLogitsProcessor(bad_words_ids=[list(w) for w in words], eos_token_id=[eos]))  # as generate
    if min_tokens:
        chain.append(MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=len(prompt), min_new_tokens=min_tokens,
                                                       eos_token_id=eos))
    input_ids = torch.tensor([prompt + emitted], dtype=torch.int64)
    engine = LogitsProcessorList(chain)(input_ids, torch.tensor([logits], dtype=torch.float64))[0]
    request = Request(repetition_penalty=rep, logit_bias=bias, bad_words=words, min_tokens=min_tokens)
    ours = _ours(logits, prompt, emitted, request, "transformers", eos=eos)
    # transformers holds the sequence bias in float32: agreement to float32's precision, -inf where masked
    engine = engine.double()
    assert torch.equal(ours == -float("inf"), engine == -float("inf"))
    finite = ours != -float("inf")
    assert torch.allclose(ours[finite], engine[finite], rtol=1e-6, atol=1e-6)


class _Batch:
    """The part of SGLang's ``ScheduleBatch`` its penalizers read: the requests and the device."""

    def __init__(self, reqs):
        self.reqs, self.device = reqs, "cpu"


def _sglang_request(rep, freq, pres, min_tokens, stop_ids, eos):
    from types import SimpleNamespace

    params = SimpleNamespace(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                             min_new_tokens=min_tokens, stop_token_ids=set(stop_ids))
    tokenizer = SimpleNamespace(additional_stop_token_ids=None, eos_token_id=None)
    return SimpleNamespace(sampling_params=params, eos_token_ids=set() if eos is None else {eos}, tokenizer=tokenizer)


# the monkeypatch sets the same eager function at every example: nothing to reset between them
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(history=histories(), rep=st.sampled_from([1.0, 0.7, 1.5]), freq=st.sampled_from([0.0, 0.5, -0.3]),
       pres=st.sampled_from([0.0, 0.25, -1.0]), data=st.data())
def test_sglang_penalizers(history, rep, freq, pres, data, monkeypatch):
    """SGLang 0.5.23's four penalizers, fed the output tokens one by one as its scheduler does
    (``cumulate_output_tokens``) and applied as its speculative and overlap paths do: the additive penalties
    first, the repetition scaling after (``BatchedPenalizerOrchestrator.apply(logits, repeat=1)``).  Float32 on
    SGLang's side: compared to 1e-5."""
    pytest.importorskip("sglang.srt.sampling.penaltylib")
    from sglang.srt.sampling.penaltylib import repetition_penalty as sglang_repetition
    from sglang.srt.sampling.penaltylib.frequency_penalty import BatchedFrequencyPenalizer
    from sglang.srt.sampling.penaltylib.min_new_tokens import BatchedMinNewTokensPenalizer
    from sglang.srt.sampling.penaltylib.orchestrator import BatchedPenalizerOrchestrator
    from sglang.srt.sampling.penaltylib.presence_penalty import BatchedPresencePenalizer

    # the scaling rule is torch.compile'd; run its own Python body eagerly (no C++ toolchain needed on CPU)
    eager = getattr(sglang_repetition.apply_scaling_penalties, "_torchdynamo_orig_callable", None)
    if eager is not None:
        monkeypatch.setattr(sglang_repetition, "apply_scaling_penalties", eager)
    vocab, prompt, emitted, logits = history
    min_tokens = data.draw(st.integers(0, 4))
    stop_ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=2, unique=True))
    eos = data.draw(st.one_of(st.none(), st.integers(0, vocab - 1)))
    batch = _Batch([_sglang_request(rep, freq, pres, min_tokens, stop_ids, eos)])
    orchestrator = BatchedPenalizerOrchestrator(
        vocab, batch, {BatchedFrequencyPenalizer, BatchedMinNewTokensPenalizer, BatchedPresencePenalizer,
                       sglang_repetition.BatchedRepetitionPenalizer})
    for token in emitted:
        orchestrator.cumulate_output_tokens(torch.tensor([token]))
    theirs = torch.tensor([logits], dtype=torch.float32)
    if orchestrator.is_required:
        orchestrator.apply(theirs, repeat=1)
    request = Request(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres, min_tokens=min_tokens,
                      stop_token_ids=stop_ids)
    ours = _ours(logits, prompt, emitted, request, "sglang", eos)
    theirs = theirs[0].double()
    assert torch.equal(torch.isinf(theirs), torch.isinf(ours))
    finite = ~torch.isinf(ours)
    assert torch.allclose(theirs[finite], ours[finite], rtol=1e-5, atol=1e-5)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=histories(), data=st.data())
def test_vllm_grammar_mask_min_tokens_and_logit_bias(history, data):
    """vLLM 0.32: the grammar's bitmask (``gpu_model_runner.py:4335``, before the sampler), then its own
    ``MinTokensLogitsProcessor`` (which puts a structured request's stop tokens back when nothing else is left)
    and ``LogitBiasLogitsProcessor`` in ``BUILTIN_LOGITS_PROCESSORS``' order."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor
    from vllm.v1.sample.logits_processor.interface import BatchUpdate

    from spectr_audit.contract.requests import TokenAutomaton

    vocab, prompt, _, logits = history
    token = st.integers(0, vocab - 1)
    stop_ids = data.draw(st.lists(token, max_size=2, unique=True))
    eos = data.draw(st.one_of(st.none(), token))
    stop_list = sorted(set(stop_ids) | ({eos} if eos is not None else set()))
    # often only stop tokens allowed: where vLLM puts them back
    only_stops = st.sets(st.sampled_from(stop_list), min_size=1) if stop_list else st.nothing()
    allowed = sorted(data.draw(st.one_of(st.sets(token, min_size=1, max_size=vocab), only_stops)))
    constrained = data.draw(st.booleans())
    emitted = data.draw(st.lists(st.sampled_from(allowed), max_size=5))
    min_tokens = data.draw(st.integers(0, 6))
    bias = data.draw(st.dictionaries(token, st.integers(-8, 8).map(lambda v: v / 4), max_size=3))
    automaton = TokenAutomaton({0: {t: 0 for t in allowed}}) if constrained else None

    stops = set(stop_ids) | ({eos} if eos is not None else set())
    params = SimpleNamespace(min_tokens=min_tokens, all_stop_token_ids=stops, logit_bias=bias or None,
                             structured_outputs=object() if constrained else None)
    update = BatchUpdate(batch_size=1, removed=[], added=[(0, params, list(prompt), list(emitted))], moved=[])
    min_proc = MinTokensLogitsProcessor(None, torch.device("cpu"), False)
    bias_proc = LogitBiasLogitsProcessor(None, torch.device("cpu"), False)
    min_proc.update_state(update)
    bias_proc.update_state(update)
    theirs = torch.tensor([logits], dtype=torch.float32)
    if constrained:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[allowed] = True
        theirs = theirs.masked_fill(~keep, float("-inf"))
    theirs = bias_proc.apply(min_proc.apply(theirs))[0].double()

    request = Request(min_tokens=min_tokens, stop_token_ids=stop_ids, logit_bias=bias, constraint=automaton)
    rows = _rows(logits, emitted)
    if bool(torch.isinf(theirs).all()):  # vLLM is left with nothing to draw: so is the reference
        with pytest.raises(InvalidArgument, match="masks every token"):
            process_request(rows, prompt, emitted + [0], request, "vllm", eos_token_id=eos)
        return
    try:
        ours = process_request(rows, prompt, emitted + [0], request, "vllm", eos_token_id=eos).processed_logits[-1]
    except InvalidArgument as exc:  # every token a stop token under min_tokens, no constraint: no law to compare
        assume("masks every token" not in str(exc) or constrained)
        raise
    assert torch.equal(torch.isinf(theirs), torch.isinf(ours))
    finite = ~torch.isinf(ours)
    assert torch.allclose(theirs[finite], ours[finite], rtol=1e-6, atol=1e-6)
