"""Serving conditions: engine settings the generation audit runs as arms of their own, each judged and each shown
reached.

The batch designs of :mod:`~spectr_audit.generation.designs` run fresh prompts through a fresh engine; the
hardest speculative-decoding bugs appear only in serving states such a batch never reaches: a prefix cache hit
after a rejection, a prompt prefilled in chunks beside decoding requests, a request preempted and recomputed,
requests arriving while others decode, a deep draft, a long context.  A **condition** is the engine under one such
setting (a generator of the same contract, made by the caller or the engine's factory with the setting on), and
the audit runs it on a design that reaches the state:

``prefix-cache``
    a batch run once (it writes the cache), then each of its rows again as a follow-up: the prompt followed by
    what the first pass emitted, so the follow-up reads the blocks the first pass wrote while it decoded.  The
    follow-up's tokens are the condition's stratum (tokens after a cache hit); reached when the engine reports
    ``cached_tokens`` > 0 on the follow-ups.
``chunked-prefill`` (``chunked-prefill=N``)
    batches mixing prompts tiled to ``N`` tokens (default 64: set the engine's chunk budget below it) with short
    ones, which decode while the long ones are still in prefill; reached when ``chunked_prompts`` > 0.
``preemption``
    one call of every prompt twice over (at least twice the batch size), for an engine given a KV budget too small
    to hold them; reached when ``preemptions`` > 0.
``concurrency``
    the same many rows in one call, for an engine (or a served engine's client) that admits them over time;
    reached when ``joined_running`` > 0.
``draft-depth=N``
    the ragged batches, for the engine drafting ``N`` tokens per step; reached when the engine reports
    ``draft_depth`` = ``N``.
``long-context`` (``long-context=N``)
    batches of prompts tiled to ``N`` tokens (default 1000), so every emitted token is at an absolute position of
    at least ``N``; reached by the audit's own count of such tokens.

The counters are the engine's, per call (:attr:`~spectr_audit.generation.contract.GenerationOutput.stats`).  A
condition the engine does not show reached is said so, and the audit's verdict is then not a PASS: an arm that
never preempted has not tested preemption.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Optional, Sequence

from spectr_audit.errors import InvalidArgument

__all__ = [
    "CONDITION_KINDS",
    "STAT_NAMES",
    "Condition",
    "condition_reached",
    "parse_condition",
    "tiled",
]

#: Every kind of condition, in the order the audit runs them.
CONDITION_KINDS = ("prefix-cache", "chunked-prefill", "preemption", "concurrency", "draft-depth", "long-context")
#: The engine's counters (``GenerationOutput.stats``) the conditions read, with what each counts in one call.
STAT_NAMES = {
    "cached_tokens": "prompt tokens whose cache was read from the prefix cache",
    "chunked_prompts": "prompts prefilled over more than one chunk",
    "preemptions": "times a request was preempted (its cache freed and recomputed or swapped)",
    "joined_running": "requests admitted while others were decoding",
    "draft_depth": "the most draft tokens proposed in one step",
}
#: The counter each condition is reached by (long-context is counted by the audit).
_REACHED_BY = {"prefix-cache": "cached_tokens", "chunked-prefill": "chunked_prompts", "preemption": "preemptions",
               "concurrency": "joined_running", "draft-depth": "draft_depth"}
#: The value a condition of a kind takes unless its name sets one (draft-depth must).
_DEFAULT_VALUE = {"chunked-prefill": 64, "long-context": 1000}
_NAME = re.compile(r"^([a-z-]+?)(?:=(\d+))?$")


@dataclasses.dataclass(frozen=True)
class Condition:
    """One condition: its name as given, its kind, its value (the depth, the tiled prompt length, the context
    length; None for the others) and the engine under it (the contract's wrapped generator, set by the audit)."""

    name: str
    kind: str
    value: Optional[int] = None
    generator: Any = None

    @property
    def counter(self) -> Optional[str]:
        """The engine counter that shows it reached (None: the audit counts it)."""
        return _REACHED_BY.get(self.kind)


def parse_condition(name: Any, argument: str = "conditions") -> Condition:
    """A condition from its name: a kind of :data:`CONDITION_KINDS`, with ``=N`` where it takes a value.

    >>> parse_condition("draft-depth=4")
    Condition(name='draft-depth=4', kind='draft-depth', value=4, generator=None)
    >>> parse_condition("long-context").value
    1000
    """
    if not isinstance(name, str):
        raise InvalidArgument(f"{argument}: condition names must be strings, got {name!r}")
    match = _NAME.match(name.strip())
    kind = match.group(1) if match else None
    if kind not in CONDITION_KINDS:
        raise InvalidArgument(f"{argument}: unknown condition {name!r}; expected one of {', '.join(CONDITION_KINDS)} "
                              f"(draft-depth=N, chunked-prefill=N and long-context=N take a value)")
    value = int(match.group(2)) if match.group(2) is not None else _DEFAULT_VALUE.get(kind)
    if kind == "draft-depth" and (value is None or value < 1):
        raise InvalidArgument(f"{argument}: {name!r}: draft-depth takes the depth, draft-depth=N with N >= 1")
    if kind in ("prefix-cache", "preemption", "concurrency") and match.group(2) is not None:
        raise InvalidArgument(f"{argument}: {name!r}: {kind} takes no value")
    if kind in ("chunked-prefill", "long-context") and value < 2:
        raise InvalidArgument(f"{argument}: {name!r}: {kind}=N takes N >= 2 tokens")
    return Condition(name.strip(), kind, value)


def check_conditions(conditions: Any, make) -> tuple:
    """The audit's conditions from ``conditions`` (a mapping of condition names to the engine under each, or
    None), each generator wrapped by ``make(obj, name)``; distinct names, in the order given."""
    if conditions is None:
        return ()
    if not isinstance(conditions, Mapping):
        raise InvalidArgument(f"conditions: expected a mapping of condition names to generators (e.g. "
                              f"{{'preemption': generate_small_kv}}), got {type(conditions).__name__}")
    out = []
    for name, generate in conditions.items():
        condition = parse_condition(name)
        if condition.name in {c.name for c in out}:
            raise InvalidArgument(f"conditions: {condition.name!r} given twice")
        if generate is None or not (callable(generate) or hasattr(generate, "generate")):
            raise InvalidArgument(f"conditions[{name!r}]: expected the engine under the condition (a generator: "
                                  f"generate(prompts, max_new_tokens, seed)), got {type(generate).__name__}")
        out.append(dataclasses.replace(condition, generator=make(generate, condition.name)))
    order = {kind: k for k, kind in enumerate(CONDITION_KINDS)}
    return tuple(sorted(out, key=lambda c: (order[c.kind], c.value or 0)))


def tiled(prompt: Sequence[int], length: int) -> tuple:
    """``prompt`` repeated to ``length`` tokens (a long prompt from a short one, every id the prompt's).

    >>> tiled([1, 2, 3], 7)
    (1, 2, 3, 1, 2, 3, 1)
    """
    prompt = tuple(int(t) for t in prompt)
    return (prompt * (length // len(prompt) + 1))[:length]


def condition_reached(condition: Condition, stats: Optional[Mapping[str, int]], long_tokens: int = 0) -> tuple:
    """``(reached, words)``: True, False, or None where the engine reported no counter to show it; ``stats`` are
    the engine's counters summed over the condition's counted calls (``draft_depth``: the largest), and
    ``long_tokens`` the tokens the audit scored at absolute positions of at least the context length.

    >>> condition_reached(parse_condition("preemption"), {"preemptions": 0})
    (False, 'no preemption happened (the engine reported 0 preemptions)')
    >>> condition_reached(parse_condition("draft-depth=4"), {"draft_depth": 4})
    (True, 'drafted 4 tokens per step')
    """
    if condition.kind == "long-context":
        if long_tokens:
            return True, f"{long_tokens} tokens at positions >= {condition.value}"
        return False, f"no token reached position {condition.value}"
    counter = condition.counter
    if stats is None or counter not in stats:
        return None, f"not shown: the engine reports no {counter} counter (GenerationOutput.stats)"
    value = int(stats[counter])
    if condition.kind == "draft-depth":
        if value == condition.value:
            return True, f"drafted {value} tokens per step"
        return False, f"the engine reported a draft depth of {value}, not {condition.value}"
    if value > 0:
        return True, {"prefix-cache": f"{value} prompt tokens read from the prefix cache",
                      "chunked-prefill": f"{value} prompts prefilled in chunks",
                      "preemption": f"{value} preemptions",
                      "concurrency": f"{value} requests joined running ones"}[condition.kind]
    return False, {"prefix-cache": "no prefix cache hit (the engine reported 0 cached tokens)",
                   "chunked-prefill": "no prompt was prefilled in chunks (the engine reported 0)",
                   "preemption": "no preemption happened (the engine reported 0 preemptions)",
                   "concurrency": "no request joined running ones (the engine reported 0)"}[condition.kind]
