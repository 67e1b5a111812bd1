"""Serving states in the toy's KV-cached loop: prefix caching, chunked prefill, preemption, staggered arrivals,
deep drafts, and the slips real engines shipped in them.

:class:`ServingSpecEngine` is :class:`~spectr_audit.generation.library.toy.SpecEngine` with the scheduler of a
serving engine, each feature off by default:

* ``prefix_cache``: an engine-lifetime cache of block-aligned prefixes (``block_size`` tokens a block), kept
  across calls: the key is a row's first ``k * block_size`` tokens (prompt, then committed tokens), the value
  the target's and the draft's states after them.  A row starts from the longest cached prefix of its prompt
  (at least one prompt token is left to compute) and registers every block its prefill or its committed
  tokens complete, so a follow-up call whose prompts extend the first call's outputs (a multi-turn chat)
  reads the blocks the first call wrote while decoding;
* ``chunk_tokens``: a prefill computes at most this many tokens per loop iteration while the other rows keep
  decoding (a row decodes once its prefill is done);
* ``kv_budget``: a budget of cached tokens (a row holds its prompt, its committed tokens and the
  ``draft_len`` slots of the coming step); before each decode, while the rows holding cache exceed it and
  more than one does, the most recently started row is preempted (vLLM's recompute policy: its states are
  dropped, it waits at the head of the queue and is prefilled again from its prompt and committed tokens
  when the budget allows); a waiting row, new or preempted, starts only when its tokens fit in the budget (or
  no row holds cache), and a row alone is never preempted, so the loop always progresses;
* ``arrival_gap``: row ``i`` arrives at loop iteration ``i * arrival_gap`` (concurrent clients), joining the
  rows already decoding.

Each feature changes the schedule and what is recomputed, never the arithmetic: a row draws from its own
stream and a :class:`~spectr_audit.generation.library.toy.ToyState` is a sequential sum over the same tokens
in the same order whether it was cached, recomputed or stepped, so the engine returns exactly the tokens (and
counters) of :class:`SpecEngine` for the same prompts, limits and seed.  Its
:class:`~spectr_audit.generation.contract.GenerationOutput` carries the call's serving counters in ``stats``
(:data:`SERVING_STATS`).

:data:`SERVING_SLIPS` lists the planted slips, one small override each, with the condition that shows them;
:func:`serving_engine` builds the engine (correct, or with a slip) configured for a condition.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional, Sequence

from spectr_audit._arguments import check_positive_int
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.conditions import STAT_NAMES, parse_condition
from spectr_audit.generation.contract import GenerationOutput
from spectr_audit.generation.library.toy import SpecEngine, ToyPair, ToyState, _Row

__all__ = [
    "SERVING_SLIPS",
    "SERVING_STATS",
    "PREEMPTION_KV_BUDGET",
    "ServingSlip",
    "ServingSpecEngine",
    "serving_engine",
]

#: The counters every call reports in ``GenerationOutput.stats``: every one the conditions read.
SERVING_STATS = tuple(STAT_NAMES)

#: The KV budget (tokens) of the ``"preemption"`` condition.  Four rows of 10-token prompts hold 52 tokens at
#: their first step (10 + 3 draft slots each) and pass 60 within a step or two, so a batch of four such rows
#: asking 24 new tokens each is preempted 2 to 5 times (seeds 0-9, ``ToyPair(12)``, random prompts; a budget
#: of 70 gives 2 or 3, of 100 one or two); a row alone is never preempted.
PREEMPTION_KV_BUDGET = 60


@dataclasses.dataclass
class _ServingRow(_Row):
    """One request while it is scheduled: where it stands, and what it holds.

    ``phase`` is ``"new"`` (not arrived), ``"waiting"`` (arrived or preempted, holding no cache),
    ``"prefill"`` (computing ``pending`` from ``computed`` on), ``"decode"`` or ``"done"``.
    """

    prompt: list = dataclasses.field(default_factory=list)
    phase: str = "new"
    pending: list = dataclasses.field(default_factory=list)
    computed: int = 0
    chunks: int = 0
    chunked: bool = False
    stamp: int = 0
    decoded: bool = False
    last_step: int = 0

    @property
    def holds(self) -> bool:
        """Whether the row holds cache (prefilling or decoding)."""
        return self.phase in ("prefill", "decode")


class ServingSpecEngine(SpecEngine):
    """A correct speculative loop with a serving engine's scheduler and prefix cache over a :class:`ToyPair`.

    Parameters
    ----------
    pair : ToyPair
    draft_len : int
        Draft tokens proposed per step (the draft depth).
    prefix_cache : bool
        Keep block-aligned prefixes' states across rows and calls (the engine's lifetime).
    block_size : int
        Tokens per cache block.
    chunk_tokens : int, optional
        Prefill at most this many tokens per loop iteration (None: a whole prefill at once).
    kv_budget : int, optional
        Cached tokens the rows may hold together before the most recently started is preempted (None: no limit).
    arrival_gap : int, optional
        Row ``i`` arrives at loop iteration ``i * arrival_gap`` (None: every row at once).
    """

    name = "toy speculative (serving)"
    #: Blocks the prefix cache keeps; past it the least recently used is evicted (a miss later, never a wrong hit).
    cache_capacity = 1 << 16

    def __init__(self, pair: ToyPair, draft_len: int = 3, *, prefix_cache: bool = False, block_size: int = 4,
                 chunk_tokens: Optional[int] = None, kv_budget: Optional[int] = None,
                 arrival_gap: Optional[int] = None):
        if isinstance(draft_len, bool) or not isinstance(draft_len, int):
            raise InvalidArgument(f"draft_len: expected a positive integer, got {draft_len!r}")
        super().__init__(pair, draft_len)
        if not isinstance(prefix_cache, bool):
            raise InvalidArgument(f"prefix_cache: expected a bool, got {prefix_cache!r}")
        self.prefix_cache = prefix_cache
        self.block_size = check_positive_int("block_size", block_size, allow_none=False)
        self.chunk_tokens = check_positive_int("chunk_tokens", chunk_tokens)
        self.kv_budget = check_positive_int("kv_budget", kv_budget)
        self.arrival_gap = check_positive_int("arrival_gap", arrival_gap)
        self._blocks: collections.OrderedDict = collections.OrderedDict()

    def clear_prefix_cache(self) -> None:
        """Forget every cached block."""
        self._blocks.clear()

    @property
    def cached_blocks(self) -> int:
        """Blocks in the prefix cache."""
        return len(self._blocks)

    # --- the steps -----------------------------------------------------------------------------

    def cache_block(self, row, sequence: tuple, target: ToyState, draft: ToyState) -> None:
        """Register the states after ``sequence`` (a block-aligned prefix of the row's tokens) in the prefix
        cache; a block already there is kept (it is reused, not rewritten)."""
        if sequence in self._blocks:
            self._blocks.move_to_end(sequence)
            return
        self._blocks[sequence] = (target, draft)
        if len(self._blocks) > self.cache_capacity:
            self._blocks.popitem(last=False)

    def commit(self, row, emitted: list, drafts: list, batch: list) -> None:
        """Append the emitted tokens to both caches, registering every block they complete."""
        length = len(row.prompt) + len(row.tokens) - len(emitted)
        for token in emitted:
            row.target = self.pair.target.step(row.target, token, self.advance(len(emitted)))
            row.draft = self.pair.draft.step(row.draft, token, self.advance(len(emitted)))
            length += 1
            if self.prefix_cache and length % self.block_size == 0:
                self.cache_block(row, tuple(row.prompt + row.tokens)[:length], row.target, row.draft)
        row.last_step = len(emitted)

    def recompute_tokens(self, row) -> list:
        """The tokens a row's caches are rebuilt from when it is prefilled (again, after a preemption)."""
        return row.prompt + row.tokens

    # --- the scheduler --------------------------------------------------------------------------

    def _holding(self, row) -> int:
        """Cached tokens a row holds: its prompt, its committed tokens and the coming step's draft slots."""
        return len(row.prompt) + len(row.tokens) + self.draft_len

    def _start(self, row, stats: dict) -> None:
        """Give a waiting row its cache: the longest cached prefix, the rest to prefill."""
        row.pending = list(self.recompute_tokens(row))
        row.target = row.draft = None
        row.computed = row.chunks = 0
        if self.prefix_cache:
            for blocks in range((len(row.pending) - 1) // self.block_size, 0, -1):
                key = tuple(row.pending[: blocks * self.block_size])
                hit = self._blocks.get(key)
                if hit is not None:
                    self._blocks.move_to_end(key)
                    row.target, row.draft = hit
                    row.computed = len(key)
                    stats["cached_tokens"] += row.computed
                    break
        row.phase = "prefill"

    def _prefill(self, row, stats: dict) -> None:
        """Compute one chunk of a row's pending tokens (all of them without chunking)."""
        end = len(row.pending) if self.chunk_tokens is None else min(len(row.pending),
                                                                      row.computed + self.chunk_tokens)
        for position in range(row.computed, end):
            token = row.pending[position]
            if position == 0:
                row.target, row.draft = self.pair.target.start([token]), self.pair.draft.start([token])
            else:
                row.target = self.pair.target.step(row.target, token)
                row.draft = self.pair.draft.step(row.draft, token)
            if self.prefix_cache and (position + 1) % self.block_size == 0:
                self.cache_block(row, tuple(row.pending[: position + 1]), row.target, row.draft)
        row.computed = end
        row.chunks += 1
        if row.computed == len(row.pending):
            if row.chunks > 1 and not row.chunked:
                row.chunked = True
                stats["chunked_prompts"] += 1
            row.phase = "decode"

    def _preempt(self, row, stats: dict) -> None:
        row.target = row.draft = None
        row.phase = "waiting"
        stats["preemptions"] += 1

    # --- the loop -------------------------------------------------------------------------------

    def generate(self, prompts, max_new_tokens, seed):
        limits = max_new_tokens if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * len(prompts)
        rows = [_ServingRow(i, None, None, [], int(limit), self.row_generator(seed, i),
                            prompt=[int(t) for t in prompt]) for i, (prompt, limit) in enumerate(zip(prompts, limits))]
        stats = dict.fromkeys(SERVING_STATS, 0)
        waiting: list = []
        stamps = 0
        iteration = 0
        eos = self.pair.eos_token_id
        while any(row.phase != "done" for row in rows):
            for row in rows:  # arrivals
                if row.phase == "new" and iteration >= row.index * (self.arrival_gap or 0):
                    if any(other.decoded and other.holds for other in rows):
                        stats["joined_running"] += 1
                    row.phase = "waiting"
                    waiting.append(row)
            while waiting:  # admissions, first come first served, while the budget allows
                holding = [row for row in rows if row.holds]
                if (holding and self.kv_budget is not None
                        and sum(map(self._holding, holding)) + self._holding(waiting[0]) > self.kv_budget):
                    break
                row = waiting.pop(0)
                row.stamp, stamps = stamps, stamps + 1
                self._start(row, stats)
            for row in rows:
                if row.phase == "prefill":
                    self._prefill(row, stats)
            if self.kv_budget is not None:  # preemptions, the most recently started first
                holding = [row for row in rows if row.holds]
                while len(holding) > 1 and sum(map(self._holding, holding)) > self.kv_budget:
                    victim = max(holding, key=lambda row: row.stamp)
                    holding.remove(victim)
                    self._preempt(victim, stats)
                    waiting.insert(0, victim)
            batch = [row for row in rows if row.phase == "decode"]
            for row in batch:
                emitted = self.step(row, batch)
                stats["draft_depth"] = max(stats["draft_depth"], self.draft_len)
                row.decoded = True
                emitted = self.truncate_at_eos(emitted)[: row.limit - len(row.tokens)]
                row.tokens.extend(emitted)
                self.commit(row, emitted, [emitted], batch)
                if len(row.tokens) >= row.limit or (eos is not None and emitted and emitted[-1] == eos):
                    row.phase = "done"
                    row.target = row.draft = None
            iteration += 1
        return GenerationOutput(self.finish(rows), accepted=[r.accepted for r in rows],
                                target_calls=[r.calls for r in rows], stats=stats)


# --- planted slips ------------------------------------------------------------------------------


class StalePrefixBlock(ServingSpecEngine):
    """A block completed in a step with a rejection is registered in the prefix cache over slots that now hold
    another request's KV.

    The rejection frees the slots the rejected draft tail was written to while the block's hash stays mapped in
    the prefix cache; another running request is given the freed slots and writes its own KV there, so the
    cached block reads back that request's context (here: the block registered in such a step holds the states
    of another row of the batch).  The row that wrote the block keeps its own correct states, so a call's output
    is unchanged; a later row that reads the block from the cache (a follow-up call whose prompt extends the
    output) starts from another request's context.  Ground truth: wrong laws after prefix-cache hits on blocks
    completed in a step that rejected a draft token, in batches of two rows or more.
    """

    name = "stale-prefix-block"
    #: The row whose slots took over the block being registered (None: no rejection in this step).
    _reused_by = None

    def commit(self, row, emitted, drafts, batch):
        rejected = bool(emitted) and len(emitted) <= self.draft_len and emitted[-1] != row.drafts[len(emitted) - 1]
        self._reused_by = next((other for other in batch if other is not row and other.target is not None), None) \
            if rejected else None
        try:
            super().commit(row, emitted, drafts, batch)
        finally:
            self._reused_by = None

    def cache_block(self, row, sequence, target, draft):
        if self._reused_by is not None:
            target, draft = self._reused_by.target, self._reused_by.draft
        super().cache_block(row, sequence, target, draft)


class PreemptDropsLastStep(ServingSpecEngine):
    """A preempted request is recomputed without the tokens it committed in its last step before preemption.

    Their KV entries were written in the step's verification but their blocks were not yet marked computed
    when the request was preempted, so the recompute rebuilds the caches from the prompt and the committed
    tokens minus that step's, while the output keeps them.  Ground truth: after a preemption the row
    continues from a context short of up to ``draft_len + 1`` tokens (wrong laws from there on).
    """

    name = "preempt-drops-last-step"

    def recompute_tokens(self, row):
        return row.prompt + row.tokens[: len(row.tokens) - row.last_step]


class DeepDraftOffset(ServingSpecEngine):
    """At draft depth 4 or more, the acceptance test of the 4th and later drafted tokens reads the target's law
    one position early (an offset into the verification logits correct for the depths it was tested at).

    Ground truth: at depth <= 3 the loop is correct; deeper, tokens drafted 4th or later are accepted with
    probability ``min(1, q'/p)`` for the previous position's law ``q'``.
    """

    name = "deep-draft-offset"

    def acceptance_law(self, laws, i):
        return laws[i - 1] if i >= 3 else laws[i]


class LongContextOffset(ServingSpecEngine):
    """Past absolute position 1000 the target's position for a token is one less than its true position
    (a rotary table extended off by one).

    Ground truth: correct for contexts up to position 1000; past it every target law (acceptance, residual,
    bonus) is the one of the previous position.
    """

    name = "long-context-offset"
    limit = 1000

    def target_law(self, state):
        if state.position > self.limit:
            state = dataclasses.replace(state, position=state.position - 1)
        return super().target_law(state)


@dataclasses.dataclass(frozen=True)
class ServingSlip:
    """A planted slip in a serving state.

    Attributes
    ----------
    engine : type
        The :class:`ServingSpecEngine` subclass.
    condition : str
        The kind of condition it shows under (:data:`~spectr_audit.generation.conditions.CONDITION_KINDS`).
    needs : str
        What it takes to be seen, in words.
    """

    engine: type
    condition: str
    needs: str


#: Every planted serving slip, by name.
SERVING_SLIPS = {
    "stale-prefix-block": ServingSlip(
        StalePrefixBlock, "prefix-cache",
        "a follow-up call whose prompts extend an earlier call's outputs (cache hits on blocks completed in a "
        "step with a rejection, in batches of two rows or more)"),
    "preempt-drops-last-step": ServingSlip(
        PreemptDropsLastStep, "preemption", "a KV budget small enough that running requests are preempted"),
    "deep-draft-offset": ServingSlip(DeepDraftOffset, "draft-depth", "a draft depth of 4 or more"),
    "long-context-offset": ServingSlip(LongContextOffset, "long-context", "contexts past position 1000"),
}


#: The toy's setting under each kind of condition (a depth sets ``draft_len``; long contexts need none: the
#: audit's prompts make the condition).
_SETTINGS = {"prefix-cache": {"prefix_cache": True, "block_size": 4}, "chunked-prefill": {"chunk_tokens": 8},
             "preemption": {"kv_budget": PREEMPTION_KV_BUDGET}, "concurrency": {"arrival_gap": 2},
             "draft-depth": {}, "long-context": {}}


def serving_engine(pair: ToyPair, condition: str, *, slip: Optional[str] = None,
                   draft_len: int = 3) -> ServingSpecEngine:
    """The serving loop over ``pair`` configured for ``condition``, correct or with the planted ``slip``.

    Parameters
    ----------
    pair : ToyPair
    condition : str
        A condition name (:func:`~spectr_audit.generation.conditions.parse_condition`): ``"prefix-cache"``
        (prefix caching, blocks of 4), ``"chunked-prefill"`` (chunks of 8 tokens, whatever the prompts' length),
        ``"preemption"`` (a KV budget of :data:`PREEMPTION_KV_BUDGET` tokens), ``"concurrency"`` (a row arrives
        every 2 loop iterations), ``"draft-depth=N"`` (a draft depth of N) or ``"long-context"`` (no feature:
        the prompts make the condition).
    slip : str, optional
        A key of :data:`SERVING_SLIPS`: that slip's engine with the same configuration.
    draft_len : int
        The draft depth (the ``"draft-depth=N"`` condition sets its own).
    """
    parsed = parse_condition(condition, "condition")
    settings = dict(_SETTINGS[parsed.kind], draft_len=parsed.value if parsed.kind == "draft-depth" else draft_len)
    if slip is None:
        engine = ServingSpecEngine
    elif slip in SERVING_SLIPS:
        engine = SERVING_SLIPS[slip].engine
    else:
        raise InvalidArgument(f"slip: expected None or one of {sorted(SERVING_SLIPS)}, got {slip!r}")
    return engine(pair, **settings)
