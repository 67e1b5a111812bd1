"""Whole requests through real engines: the translations into each engine's terms, and transformers' assisted
decoding audited under per-row requests (penalties, bad words, min_new_tokens, a logit bias, stop tokens,
logprobs, seeds) against its teacher-forced logits, and token for token against plain greedy decoding."""

from __future__ import annotations

import pytest

from spectr_audit.contract.requests import Request, TokenAutomaton
from spectr_audit.engine_adapters.requests import transformers_generate_kwargs, vllm_sampling_fields
from spectr_audit.errors import InvalidArgument

pytestmark = pytest.mark.usefixtures("single_thread")

TRANSFORMERS = [
    (Request(temperature=0.0), dict(max_new_tokens=8, do_sample=False, eos_token_id=[2])),
    (Request(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, max_tokens=4),
     dict(max_new_tokens=4, do_sample=True, temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, eos_token_id=[2])),
    (Request(temperature=0.0, repetition_penalty=1.3, bad_words=[[4, 5]], logit_bias={7: -1.5}, min_tokens=3,
             stop_token_ids=[9]),
     dict(max_new_tokens=8, do_sample=False, repetition_penalty=1.3, bad_words_ids=[[4, 5]],
          sequence_bias=[[[7], -1.5]], eos_token_id=[2, 9], min_new_tokens=3)),
]


@pytest.mark.parametrize("request_, expected", TRANSFORMERS)
def test_transformers_keywords(request_, expected):
    assert transformers_generate_kwargs(request_, 8, eos_token_id=2) == expected


def test_vllm_fields():
    fields = vllm_sampling_fields(Request(temperature=0.0, frequency_penalty=0.5, min_tokens=2, stop_token_ids=[3],
                                          logit_bias={4: 1.0}, seed=7, logprobs=2, max_tokens=30), 16)
    assert fields == dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                          presence_penalty=0.0, frequency_penalty=0.5, min_tokens=2, max_tokens=16,
                          logit_bias={4: 1.0}, stop_token_ids=[3], seed=7, logprobs=2)


@pytest.mark.parametrize("call, message", [
    (lambda: transformers_generate_kwargs(Request(presence_penalty=0.2), 8), "presence_penalty"),
    (lambda: transformers_generate_kwargs(Request(stop=["x"]), 8), "request.stop"),
    (lambda: vllm_sampling_fields(Request(bad_words=[[1]]), 8), "request.bad_words"),
    (lambda: vllm_sampling_fields(Request(constraint=TokenAutomaton({0: {1: 0}})), 8), "request.constraint"),
    (lambda: vllm_sampling_fields("greedy", 8), "request: expected a Request"),
])
def test_what_an_engine_cannot_take_is_named(call, message):
    with pytest.raises(InvalidArgument, match=message):
        call()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("transformers", reason="the transformers extra (pip install -e '.[transformers]')")
    from spectr_audit.engine_adapters.checkpoints import write_llama
    from spectr_audit.engine_adapters.hf import load_causal_lm

    folder = tmp_path_factory.mktemp("llama-requests")
    target = write_llama(folder / "target", seed=0, vocab_size=64)
    draft = write_llama(folder / "draft", seed=1, base=target, noise=0.3, vocab_size=64)
    return load_causal_lm(target), load_causal_lm(draft)


GREEDY = [Request(temperature=0.0, repetition_penalty=1.6, bad_words=[[5, 6]], min_tokens=3, logprobs=2),
          Request(temperature=0.0, logit_bias={7: 2.0}, stop_token_ids=[3], logprobs=0)]
PROMPTS = [[1, 2, 3], [4, 5], [9, 10, 11, 12]]


def test_assisted_greedy_with_processors_equals_plain_greedy(models):
    from spectr_audit.engine_adapters.hf import TransformersGenerator

    target, draft = models
    assisted = TransformersGenerator(target, assistant_model=draft, num_assistant_tokens=3)
    lookup = TransformersGenerator(target, prompt_lookup_num_tokens=2)
    plain = TransformersGenerator(target)
    requests = [GREEDY[i % 2] for i in range(len(PROMPTS))]
    expected = plain.generate(PROMPTS, 10, 0, requests=requests)
    for engine in (assisted, lookup):
        got = engine.generate(PROMPTS, 10, 0, requests=requests)
        assert got.continuations == expected.continuations
        assert got.finish_reasons == expected.finish_reasons
        for a, b in zip(got.logprobs, expected.logprobs):
            assert a == pytest.approx(b, abs=1e-4)


def test_assisted_decoding_under_mixed_requests_passes_the_audit(models):
    from spectr_audit.engine_adapters.hf import TransformersGenerator, TransformersScorer
    from spectr_audit.generation import audit_generation

    target, draft = models
    requests = GREEDY + [Request(temperature=0.9, repetition_penalty=1.3, logit_bias={7: 2.0}, logprobs=1, seed=4),
                         Request(temperature=1.0, top_k=20, min_tokens=4, stop_token_ids=[3])]
    result = audit_generation(TransformersGenerator(target, assistant_model=draft, num_assistant_tokens=3),
                              TransformersScorer(target, order="transformers"), PROMPTS, vocab_size=64,
                              requests=requests, max_new_tokens=8, progress=False, arms=("single", "equal"),
                              eos_token_id=target.generation_config.eos_token_id)
    assert result.verdict != "FINDING", result.test
    assert result.request_findings == () and result.determinism["differing"] == 0
    assert {t.name for t in result.subtests} >= {"logprobs", "stopping"}
