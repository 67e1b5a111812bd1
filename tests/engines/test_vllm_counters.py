"""vLLM's serving counters as the offline adapter reads them: the rise of the engine's own Prometheus counters over
one call, each request's cached tokens, and the prompts a step budget forces into chunks (an ``LLM`` stand-in, no
vLLM needed)."""

from __future__ import annotations

from types import SimpleNamespace

from spectr_audit.engine_adapters.vllm_offline import VLLMGenerator


class _Child:
    def __init__(self, value):
        self._value = SimpleNamespace(get=lambda: value)


class FakeLLM:
    """Its Prometheus stat logger's counters in turn (two engines' children each: the adapter sums them), the
    scheduler config as given; ``None`` snapshots: an ``LLM`` that keeps no metrics."""

    def __init__(self, snapshots, budget=None):
        self.snapshots = list(snapshots)
        config = None if budget is None else SimpleNamespace(enable_chunked_prefill=True,
                                                              max_num_batched_tokens=budget)
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(scheduler_config=config), logger_manager=self)

    @property
    def stat_loggers(self):
        values = self.snapshots.pop(0)
        if values is None:
            return [SimpleNamespace()]  # a logging-only stat logger
        halves = {k: {0: _Child(v / 2), 1: _Child(v / 2)} for k, v in values.items()}
        spec = SimpleNamespace(**{k: halves[k] for k in halves if k.startswith("counter_spec")})
        prom = SimpleNamespace(counter_num_preempted_reqs=halves["counter_num_preempted_reqs"],
                               spec_decoding_prom=spec if vars(spec) else None)
        return [SimpleNamespace(), prom]


def _outputs(cached):
    return [SimpleNamespace(num_cached_tokens=c) for c in cached]


def test_the_counters_are_the_rise_over_the_call():
    before = {"counter_num_preempted_reqs": 2, "counter_spec_decode_num_drafts": 10,
              "counter_spec_decode_num_draft_tokens": 30}
    after = {"counter_num_preempted_reqs": 5, "counter_spec_decode_num_drafts": 14,
             "counter_spec_decode_num_draft_tokens": 41}
    generator = VLLMGenerator(FakeLLM([before, after], budget=32))
    stats = generator._stats(generator._snapshot(), [[1] * 40, [1] * 70, [1] * 10], _outputs([0, 32, 0]))
    # 11 draft tokens over 4 drafts: 2.75, rounded up; a prompt is chunked when its uncached part passes 32
    assert stats == {"cached_tokens": 32, "preemptions": 3, "draft_depth": 3, "chunked_prompts": 2}


def test_no_speculation_no_draft_depth_and_no_budget_no_chunked_count():
    generator = VLLMGenerator(FakeLLM([{"counter_num_preempted_reqs": 0}, {"counter_num_preempted_reqs": 0}]))
    stats = generator._stats(generator._snapshot(), [[1, 2]], _outputs([None]))
    assert stats == {"cached_tokens": 0, "preemptions": 0}


def test_an_engine_without_metrics_reports_no_counters():
    generator = VLLMGenerator(FakeLLM([None, None]))
    assert generator._snapshot() is None
    assert generator._stats(None, [[1]], _outputs([0])) is None
