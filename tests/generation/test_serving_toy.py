"""The serving loop over the toy pair: every feature changes only the schedule and the cache reuse, so the loop
returns exactly the tokens (and counters) of the plain :class:`SpecEngine`; its serving counters say what it
did; each planted serving slip differs from the correct loop in its condition and nowhere else.
"""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import given, settings, strategies as st

from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.library import (
    PREEMPTION_KV_BUDGET,
    SERVING_SLIPS,
    SERVING_STATS,
    ServingSlip,
    ServingSpecEngine,
    SpecEngine,
    ToyPair,
    serving_engine,
)

pytestmark = pytest.mark.usefixtures("single_thread")

FEATURES = {
    "prefix_cache": st.fixed_dictionaries({"prefix_cache": st.just(True), "block_size": st.integers(1, 5)}),
    "chunk_tokens": st.fixed_dictionaries({"chunk_tokens": st.integers(1, 6)}),
    "kv_budget": st.fixed_dictionaries({"kv_budget": st.integers(4, 70)}),
    "arrival_gap": st.fixed_dictionaries({"arrival_gap": st.integers(1, 3)}),
    "draft_len": st.fixed_dictionaries({"draft_len": st.integers(1, 6)}),
    "all": st.fixed_dictionaries({
        "prefix_cache": st.booleans(), "block_size": st.integers(1, 5), "chunk_tokens": st.none() | st.integers(1, 6),
        "kv_budget": st.none() | st.integers(4, 70), "arrival_gap": st.none() | st.integers(1, 3),
        "draft_len": st.integers(1, 5)}),
}


@functools.lru_cache(maxsize=None)
def toy_pair(vocab_size: int = 12, agreeing: bool = True, eos: bool = False) -> ToyPair:
    return ToyPair(vocab_size, seed=vocab_size, draft_noise=0.3 if agreeing else None,
                   eos_token_id=vocab_size - 1 if eos else None)


@st.composite
def workloads(draw, max_rows: int = 4, max_prompt: int = 12):
    """A pair, prompts, limits (one for all or one per row) and a seed."""
    vocab_size = draw(st.integers(12, 16))
    pair = toy_pair(vocab_size, draw(st.booleans()), draw(st.booleans()))
    prompts = draw(st.lists(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=max_prompt),
                            min_size=1, max_size=max_rows))
    limits = draw(st.integers(0, 16) | st.lists(st.integers(0, 16), min_size=len(prompts), max_size=len(prompts)))
    return pair, prompts, limits, draw(st.integers(0, 2**31))


def same_as_plain(engine: ServingSpecEngine, prompts, limits, seed):
    """The serving loop's output, checked token for token (and counter for counter) against the plain loop's."""
    out = engine.generate(prompts, limits, seed)
    plain = SpecEngine(engine.pair, engine.draft_len).generate(prompts, limits, seed)
    assert out.continuations == plain.continuations
    assert out.accepted == plain.accepted and out.target_calls == plain.target_calls
    assert set(out.stats) == set(SERVING_STATS)
    assert all(isinstance(v, int) and v >= 0 for v in out.stats.values())
    assert out.stats["draft_depth"] == engine.draft_len
    return out


def random_prompts(rows: int, length: int, vocab_size: int = 12, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(rows)]


# --- the oracle: the same tokens as the plain loop --------------------------------------------------


@pytest.mark.parametrize("feature", sorted(FEATURES))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_feature_returns_the_plain_loops_tokens(feature, data):
    pair, prompts, limits, seed = data.draw(workloads())
    same_as_plain(ServingSpecEngine(pair, **data.draw(FEATURES[feature])), prompts, limits, seed)


@settings(max_examples=60, deadline=None)
@given(first=workloads(max_prompt=8), options=FEATURES["all"], extra=st.lists(st.integers(0, 11), max_size=3),
       seed=st.integers(0, 2**31), cache_only=st.booleans())
def test_a_follow_up_call_hits_the_blocks_written_while_decoding(first, options, extra, seed, cache_only):
    pair, prompts, limits, first_seed = first
    options = dict(options, prefix_cache=True)
    if cache_only:
        options.update(chunk_tokens=None, kv_budget=None, arrival_gap=None)
    engine = ServingSpecEngine(pair, **options)
    out = same_as_plain(engine, prompts, limits, first_seed)
    follow_ups = [p + c + extra for p, c in zip(prompts, out.continuations)]
    again = same_as_plain(engine, follow_ups, 6, seed)
    size = engine.block_size
    # every block-aligned prefix of a first call's prompt and continuation is in the cache
    written = {tuple(p + c)[:k * size] for p, c in zip(prompts, out.continuations)
               for k in range(1, len(p + c) // size + 1)}
    hits = sum(max([k * size for k in range(1, (len(f) - 1) // size + 1) if tuple(f[:k * size]) in written],
                   default=0) for f in follow_ups)
    assert hits >= sum(min((len(f) - 1) // size, len(p + c) // size) * size
                       for f, p, c in zip(follow_ups, prompts, out.continuations))
    if cache_only:  # every row looks up before any row of the call writes
        assert again.stats["cached_tokens"] == hits
    else:  # preempted rows may read the cache again
        assert again.stats["cached_tokens"] >= hits


def test_a_multi_turn_follow_up_reads_the_cache():
    pair = toy_pair(12)
    engine = serving_engine(pair, "prefix-cache")
    prompts = random_prompts(4, 6, seed=1)
    first = same_as_plain(engine, prompts, 16, 3)
    assert first.stats["cached_tokens"] == 0
    follow_ups = [p + c + [5, 6] for p, c in zip(prompts, first.continuations)]
    second = same_as_plain(engine, follow_ups, 16, 4)
    assert second.stats["cached_tokens"] == sum((len(f) - 1) // 4 * 4 for f in follow_ups) > 0
    assert engine.cached_blocks > 0
    engine.clear_prefix_cache()
    assert engine.cached_blocks == 0
    assert same_as_plain(engine, follow_ups, 16, 4).stats["cached_tokens"] == 0


def test_a_full_prefix_cache_evicts_the_least_recently_used_blocks():
    engine = serving_engine(toy_pair(12), "prefix-cache")
    engine.cache_capacity = 5
    prompts = random_prompts(4, 9, seed=6)
    first = same_as_plain(engine, prompts, 16, 0)
    assert engine.cached_blocks == 5
    follow_ups = [p + c + [2] for p, c in zip(prompts, first.continuations)]
    assert 0 < same_as_plain(engine, follow_ups, 16, 1).stats["cached_tokens"] < sum(
        (len(f) - 1) // 4 * 4 for f in follow_ups)
    assert engine.cached_blocks == 5


# --- the counters -----------------------------------------------------------------------------------


def test_the_counters_are_zero_with_every_feature_off():
    out = same_as_plain(ServingSpecEngine(toy_pair(12)), random_prompts(4, 10), 24, 0)
    assert out.stats == {"cached_tokens": 0, "chunked_prompts": 0, "preemptions": 0, "joined_running": 0,
                         "draft_depth": 3}


@pytest.mark.parametrize("seed", range(3))
def test_the_preemption_condition_preempts_a_batch_of_four(seed):
    engine = serving_engine(toy_pair(12), "preemption")
    assert engine.kv_budget == PREEMPTION_KV_BUDGET
    out = same_as_plain(engine, random_prompts(4, 10, seed=seed), 24, seed)
    assert out.stats["preemptions"] > 0
    alone = same_as_plain(engine, random_prompts(1, 10, seed=seed), 64, seed)
    assert alone.stats["preemptions"] == 0


def test_rows_over_the_budget_alone_are_served_one_at_a_time():
    out = same_as_plain(ServingSpecEngine(toy_pair(12), kv_budget=5), random_prompts(3, 10), 12, 0)
    assert out.stats["preemptions"] == 0 and all(len(c) == 12 for c in out.continuations)


def test_long_prompts_are_chunked():
    prompts = random_prompts(2, 20) + random_prompts(2, 5, seed=1)
    out = same_as_plain(serving_engine(toy_pair(12), "chunked-prefill"), prompts, 12, 0)
    assert out.stats["chunked_prompts"] == 2


def test_staggered_arrivals_join_the_running_batch():
    out = same_as_plain(serving_engine(toy_pair(12), "concurrency"), random_prompts(4, 6), 24, 0)
    assert out.stats["joined_running"] >= 2


@pytest.mark.parametrize("depth", [1, 4, 6])
def test_the_draft_depth_condition_sets_the_depth(depth):
    engine = serving_engine(toy_pair(12), f"draft-depth={depth}")
    assert engine.draft_len == depth
    assert same_as_plain(engine, random_prompts(2, 4), 8, 0).stats["draft_depth"] == depth


# --- the planted slips ------------------------------------------------------------------------------


def differs(engine, prompts, limits, seed) -> bool:
    out = engine.generate(prompts, limits, seed)
    return out.continuations != SpecEngine(engine.pair, engine.draft_len).generate(prompts, limits, seed).continuations


def test_the_slips_are_registered_with_their_conditions():
    assert set(SERVING_SLIPS) == {"stale-prefix-block", "preempt-drops-last-step", "deep-draft-offset",
                                  "long-context-offset"}
    for name, slip in SERVING_SLIPS.items():
        assert isinstance(slip, ServingSlip) and issubclass(slip.engine, ServingSpecEngine) and slip.engine.__doc__
        assert slip.condition in ("prefix-cache", "preemption", "draft-depth", "long-context")
        assert slip.engine.name == name


def test_stale_prefix_block():
    pair, prompts = toy_pair(12), random_prompts(4, 6, seed=2)
    found = False
    for seed in range(3):
        engine = serving_engine(pair, "prefix-cache", slip="stale-prefix-block")
        assert isinstance(engine, SERVING_SLIPS["stale-prefix-block"].engine) and engine.prefix_cache
        first = same_as_plain(engine, prompts, 16, seed)  # a fresh cache: nothing read, nothing differs
        follow_ups = [p + c + [1] for p, c in zip(prompts, first.continuations)]
        found = found or differs(engine, follow_ups, 16, seed + 10)
    assert found


def test_preempt_drops_last_step():
    pair, prompts = toy_pair(12), random_prompts(4, 10, seed=3)
    assert any(differs(serving_engine(pair, "preemption", slip="preempt-drops-last-step"), prompts, 24, seed)
               for seed in range(3))
    engine = SERVING_SLIPS["preempt-drops-last-step"].engine(pair)  # no budget: no preemption
    for seed in range(3):
        same_as_plain(engine, prompts, 24, seed)


def test_deep_draft_offset():
    pair, prompts = toy_pair(12), random_prompts(4, 5, seed=4)
    assert any(differs(serving_engine(pair, "draft-depth=5", slip="deep-draft-offset"), prompts, 16, seed)
               for seed in range(3))
    for seed in range(3):
        same_as_plain(serving_engine(pair, "draft-depth=3", slip="deep-draft-offset"), prompts, 16, seed)


def test_long_context_offset():
    pair = toy_pair(12)
    engine = serving_engine(pair, "long-context", slip="long-context-offset")
    assert engine.limit == 1000
    assert any(differs(engine, random_prompts(2, 1005, seed=5), 8, seed) for seed in range(3))
    for seed in range(3):
        same_as_plain(engine, random_prompts(2, 40, seed=5), 16, seed)


# --- arguments --------------------------------------------------------------------------------------


@pytest.mark.parametrize("argument, value", [
    ("draft_len", 0), ("draft_len", 2.0), ("prefix_cache", "yes"), ("block_size", 0), ("block_size", True),
    ("chunk_tokens", 0), ("chunk_tokens", 2.5), ("kv_budget", -1), ("arrival_gap", 0), ("arrival_gap", "2"),
])
def test_bad_arguments_are_named(argument, value):
    with pytest.raises(InvalidArgument, match=f"^{argument}:"):
        ServingSpecEngine(toy_pair(12), **{argument: value})


@pytest.mark.parametrize("condition, slip, argument", [
    ("prefix", None, "condition"), ("draft-depth=0", None, "condition"), ("draft-depth=x", None, "condition"),
    (None, None, "condition"), ("preemption", "no-such-slip", "slip"),
])
def test_unknown_conditions_and_slips_are_named(condition, slip, argument):
    with pytest.raises(InvalidArgument, match=f"^{argument}:"):
        serving_engine(toy_pair(12), condition, slip=slip)
