"""transformers' serving counters as the adapter reads them from the target's forward passes.

``TransformersGenerator`` reports ``chunked_prompts`` (rows whose first target pass did not cover the whole prompt)
and ``draft_depth`` (the most tokens one verification pass checked beyond the committed ones) from a forward hook,
not from its settings: the counting rule against hand-derived pass sequences, then on a random Llama what each
setting reaches.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("single_thread")

transformers = pytest.importorskip("transformers", reason="the transformers extra (pip install -e '.[transformers]')")

# (input lengths of the target's passes, prompt length) -> (chunked, draft depth)
PASSES = [
    ([7, 1, 1, 1], 7, False, 0),        # plain decoding: the prompt in one pass, then one token a pass
    ([4, 4, 1, 1], 7, True, 1),         # chunked prefill: the second chunk crosses the prompt's end by one token
    ([8, 4, 4, 2], 5, False, 3),        # assisted: the prompt and 3 drafts, then the committed token and 3 drafts
    ([16, 16, 16, 16, 1], 64, True, 0),  # chunks of 16 exactly, then plain decoding
    ([6, 6, 6, 5, 1], 1, False, 5),     # a one-token prompt and 5 drafts a step
]


@pytest.mark.parametrize("lengths, prompt, chunked, depth", PASSES)
def test_the_counters_read_the_passes(lengths, prompt, chunked, depth):
    from spectr_audit.engine_adapters.hf import _Counters

    counters = _Counters()
    counters.add(lengths, prompt)
    assert counters.stats() == {"chunked_prompts": int(chunked), "draft_depth": depth}


PROMPTS = [[5, 6, 7, 8] * 16, [9, 10, 11]]


def test_what_each_setting_reaches_on_a_random_llama(checkpoints):
    from spectr_audit.contract.sampling import SamplingParams
    from spectr_audit.engine_adapters.hf import TransformersGenerator

    target, draft = checkpoints
    params = SamplingParams(temperature=0.7)
    plain = TransformersGenerator(target, params, prefill_chunk_size=16).generate(PROMPTS, 8, 0)
    assert plain.stats == {"chunked_prompts": 1, "draft_depth": 0}  # the 64-token prompt in four chunks
    lookup = TransformersGenerator(target, params, prompt_lookup_num_tokens=4).generate(PROMPTS, 8, 0)
    assert lookup.stats["chunked_prompts"] == 0 and 1 <= lookup.stats["draft_depth"] <= 4
    deep = TransformersGenerator(target, params, assistant_model=draft, num_assistant_tokens=5,
                                 assistant_confidence_threshold=0.0).generate(PROMPTS, 12, 0)
    assert deep.stats["draft_depth"] == 5  # every step drafts 5 with the confidence stop off


def test_the_conditions_the_factory_offers():
    from spectr_audit.engine_adapters.factories import transformers_engine
    from spectr_audit.errors import InvalidArgument

    made = transformers_engine("assisted", temperature=0.7, prompts=4)
    conditions = made["conditions"]
    assert conditions.names == ("chunked-prefill",) + tuple(f"draft-depth={d}" for d in range(1, 6)) + (
        "long-context",)
    assert conditions("draft-depth=4").num_assistant_tokens == 4
    assert conditions("draft-depth=4").assistant_confidence_threshold == 0.0
    assert conditions("chunked-prefill").prefill_chunk_size == 16
    with pytest.raises(InvalidArgument, match="does not offer 'preemption'"):
        conditions("preemption")
    assert "draft-depth=1" not in transformers_engine("plain", prompts=4)["conditions"].names
