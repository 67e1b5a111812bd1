"""vLLM's serving counters as the offline adapter reads them: the rise of the engine's metrics over one call, each
request's cached tokens, and the prompts a step budget forces into chunks (an ``LLM`` stand-in, no vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace

from spectr_audit.engine_adapters.vllm_offline import VLLMGenerator


class FakeLLM:
    """``get_metrics`` returns the counters in turn; the scheduler config as given (None: no metrics kept)."""

    def __init__(self, snapshots, budget=None):
        self.snapshots = list(snapshots)
        config = None if budget is None else SimpleNamespace(enable_chunked_prefill=True,
                                                              max_num_batched_tokens=budget)
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(scheduler_config=config))

    def get_metrics(self):
        values = self.snapshots.pop(0)
        if values is None:
            raise RuntimeError("metrics are disabled")
        # two engines' label sets of each counter: the adapter sums them
        return [SimpleNamespace(name=name, value=value / 2) for name, value in values.items() for _ in range(2)] + [
            SimpleNamespace(name="vllm:prompt_tokens", value=999)]


def _outputs(cached):
    return [SimpleNamespace(num_cached_tokens=c) for c in cached]


def test_the_counters_are_the_rise_over_the_call():
    before = {"vllm:num_preemptions": 2, "vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_draft_tokens": 30}
    after = {"vllm:num_preemptions": 5, "vllm:spec_decode_num_drafts": 14, "vllm:spec_decode_num_draft_tokens": 41}
    generator = VLLMGenerator(FakeLLM([before, after], budget=32))
    stats = generator._stats(generator._snapshot(), [[1] * 40, [1] * 70, [1] * 10], _outputs([0, 32, 0]))
    # 11 draft tokens over 4 drafts: 2.75, rounded up; a prompt is chunked when its uncached part passes 32
    assert stats == {"cached_tokens": 32, "preemptions": 3, "draft_depth": 3, "chunked_prompts": 2}


def test_no_speculation_no_draft_depth_and_no_budget_no_chunked_count():
    generator = VLLMGenerator(FakeLLM([{"vllm:num_preemptions": 0}, {"vllm:num_preemptions": 0}]))
    stats = generator._stats(generator._snapshot(), [[1, 2]], _outputs([None]))
    assert stats == {"cached_tokens": 0, "preemptions": 0}


def test_an_engine_without_metrics_reports_no_counters():
    generator = VLLMGenerator(FakeLLM([None, None]))
    assert generator._snapshot() is None
    assert generator._stats(None, [[1]], _outputs([0])) is None
