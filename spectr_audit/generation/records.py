"""One job's records, typed: what scoring writes, the store keeps and the analysis and the stopping rule read.

A :class:`JobRecord` holds the engine's scored continuations (a :class:`SourceRecord`), the reference's when
the audit has one, the greedy divergences between them (:class:`Divergences`), the engine's own counts
(accepted draft tokens, target calls) and the job's seconds.  Per-token values are named arrays of a
:class:`TokenColumns`; per-continuation values are named arrays of a :class:`SourceRecord`.

The stored form (:meth:`JobRecord.to_stored`, :meth:`JobRecord.from_stored`) is a flat mapping of array
names to numpy arrays (``tok_mass``, ``cont_len``, ``ref_tok_pit_probability``, ``div_row``, ...), saved by
the store as ``.npz`` bytes; this module is the one place that names them, so a store written before the
records were typed reads back unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

__all__ = ["Divergences", "JobRecord", "RequestChecks", "STOP_CODES", "SourceRecord", "TokenColumns"]

#: Stored names of the per-token columns (field, stored name).
_TOKEN_NAMES = (("row", "tok_row"), ("position", "tok_pos"), ("token", "tok_token"), ("mass", "tok_mass"),
                ("surprisal", "tok_surprisal"), ("entropy", "tok_entropy"), ("variance", "tok_var"),
                ("margin", "tok_margin"))
_PIT_PREFIX = "tok_pit_"
_ACCEPT = "tok_accept"
#: Stored names of the per-continuation arrays of a source (field, stored name).
_CONTINUATION_NAMES = (("lengths", "cont_len"), ("after_eos", "cont_after_eos"), ("first_token", "cont_first"),
                       ("first_collision", "cont_chance"))
#: The emitted tokens, concatenated: the engine's and the reference's stored names.
_EMITTED = {"": "cont_tokens", "ref_": "ref_cont_tokens"}
#: The engine's serving counters are stored as ``stat_NAME`` (one integer each), under the mark that it reported some.
_STAT_PREFIX = "stat_"
_STATS_REPORTED = "stats_reported"
#: Stored names of the divergences (field, stored name).
_DIVERGENCE_NAMES = (("row", "div_row"), ("position", "div_pos"), ("margin", "div_margin"),
                     ("engine_token", "div_engine"), ("reference_token", "div_reference"))
#: The reference's stored names are the engine's with this prefix.
_REFERENCE = "ref_"
#: Stored names of the whole-request checks of each continuation (field, stored name); absent from a store of an
#: audit without requests.
_CHECK_NAMES = (("logprob_error", "req_logprob_err"), ("logprob_position", "req_logprob_pos"),
                ("stop_code", "req_stop_code"), ("stop_position", "req_stop_pos"),
                ("constraint_position", "req_constraint_pos"), ("determinism", "req_determinism"))
#: What ``RequestChecks.stop_code`` says (0: nothing wrong).
STOP_CODES = {
    1: "tokens emitted after a stop token or a completed stop string",
    2: "a stop token before min_tokens",
    3: "more tokens than the request's max_tokens",
    4: "the finish reason disagrees with the tokens",
    5: "the usage count disagrees with the tokens",
}


@dataclasses.dataclass
class TokenColumns:
    """Every scored token of one source's continuations in one job, in continuation order.

    ``row`` (the continuation), ``position`` (in it), ``token``, its target ``mass``, ``surprisal``
    (``-log mass``), the law's ``entropy`` and the surprisal's ``variance``, the logit ``margin`` of a zero-mass
    token (NaN elsewhere), ``pit``: the randomized PIT per order, ``accept``: a single-draft sampler's
    acceptance probability there (with a draft scorer).
    """

    row: np.ndarray
    position: np.ndarray
    token: np.ndarray
    mass: np.ndarray
    surprisal: np.ndarray
    entropy: np.ndarray
    variance: np.ndarray
    margin: np.ndarray
    pit: dict
    accept: Optional[np.ndarray] = None

    @classmethod
    def empty(cls, orderings) -> "TokenColumns":
        """No token scored."""
        return cls(*(np.zeros(0) for _ in _TOKEN_NAMES), pit={order: np.zeros(0) for order in orderings})


@dataclasses.dataclass
class SourceRecord:
    """One source's continuations in one job (the engine's, or its reference's), scored.

    ``lengths`` per continuation; ``after_eos``: where an end-of-sequence token comes before a continuation's
    last token (-1: nowhere); ``first_token`` (-1: empty); ``first_collision``: the chance that two independent
    draws of the first position's target law agree, sum of q(v)^2 (NaN: empty); ``emitted``: the tokens,
    concatenated; ``tokens``: the per-token columns.
    """

    lengths: np.ndarray
    after_eos: np.ndarray
    first_token: np.ndarray
    first_collision: np.ndarray
    emitted: np.ndarray
    tokens: TokenColumns
    checks: Optional[RequestChecks] = None


@dataclasses.dataclass
class RequestChecks:
    """Per continuation, what the whole-request checks found.

    ``logprob_error``: the largest gap between a log-probability the engine returned (the emitted token's or one
    of its top-n list) and the scorer's (NaN: none returned); ``logprob_position``: where (-1: none);
    ``stop_code`` (a key of :data:`STOP_CODES`, 0: none) and ``stop_position``; ``constraint_position``: the first
    emitted token the constraint did not allow (-1: none); ``determinism``: the same request and seed rerun in
    another batch gave the same tokens (0), other tokens (1), or was not rerun (-1).
    """

    logprob_error: np.ndarray
    logprob_position: np.ndarray
    stop_code: np.ndarray
    stop_position: np.ndarray
    constraint_position: np.ndarray
    determinism: np.ndarray


@dataclasses.dataclass
class Divergences:
    """Where a greedy engine's continuations first depart from its reference's, one entry per departing row:
    the ``row``, the ``position``, the scorer's logit ``margin`` between the two tokens (NaN: no logits), and the
    ``engine_token`` and ``reference_token`` there."""

    row: np.ndarray
    position: np.ndarray
    margin: np.ndarray
    engine_token: np.ndarray
    reference_token: np.ndarray


@dataclasses.dataclass
class JobRecord:
    """One finished job: the engine's scored continuations and, with a reference, the reference's and the
    divergences; ``accepted`` and ``target_calls`` per continuation as the engine reports them (-1: not
    reported); ``seconds``: generation, reference and scoring; ``stats``: the engine's serving counters of the
    call (a follow-up job's: of its second call; None: none reported)."""

    engine: SourceRecord
    accepted: np.ndarray
    target_calls: np.ndarray
    seconds: np.ndarray
    reference: Optional[SourceRecord] = None
    divergences: Optional[Divergences] = None
    stats: Optional[dict] = None

    def to_stored(self) -> dict:
        """The stored form: stored name -> array."""
        out = {"cont_accepted": self.accepted, "cont_calls": self.target_calls, "seconds": self.seconds}
        if self.stats is not None:
            out[_STATS_REPORTED] = np.ones(1, dtype=np.int64)
            out.update({_STAT_PREFIX + name: np.array([value], dtype=np.int64) for name, value in self.stats.items()})
        out.update(_source_arrays(self.engine, ""))
        if self.reference is not None:
            out.update(_source_arrays(self.reference, _REFERENCE))
        if self.divergences is not None:
            out.update({stored: getattr(self.divergences, field) for field, stored in _DIVERGENCE_NAMES})
        return out

    @classmethod
    def from_stored(cls, arrays: dict) -> "JobRecord":
        """Read the stored form back (a store written before the records were typed holds the same names)."""
        divergences = (Divergences(*(arrays[stored] for _, stored in _DIVERGENCE_NAMES))
                       if _DIVERGENCE_NAMES[0][1] in arrays else None)
        reference = (_source_from(arrays, _REFERENCE) if _REFERENCE + _CONTINUATION_NAMES[0][1] in arrays else None)
        stats = ({name[len(_STAT_PREFIX):]: int(values[0]) for name, values in arrays.items()
                  if name.startswith(_STAT_PREFIX)} if _STATS_REPORTED in arrays else None)
        return cls(_source_from(arrays, ""), arrays["cont_accepted"], arrays["cont_calls"], arrays["seconds"],
                   reference, divergences, stats)


def _source_arrays(source: SourceRecord, prefix: str) -> dict:
    out = {prefix + stored: getattr(source, field) for field, stored in _CONTINUATION_NAMES}
    out[_EMITTED[prefix]] = source.emitted
    out.update({prefix + stored: getattr(source.tokens, field) for field, stored in _TOKEN_NAMES})
    out.update({prefix + _PIT_PREFIX + order: values for order, values in source.tokens.pit.items()})
    if source.tokens.accept is not None:
        out[prefix + _ACCEPT] = source.tokens.accept
    if source.checks is not None:
        out.update({prefix + stored: getattr(source.checks, field) for field, stored in _CHECK_NAMES})
    return out


def _source_from(arrays: dict, prefix: str) -> SourceRecord:
    pit_prefix = prefix + _PIT_PREFIX
    tokens = TokenColumns(*(arrays[prefix + stored] for _, stored in _TOKEN_NAMES),
                          pit={name[len(pit_prefix):]: values for name, values in arrays.items()
                               if name.startswith(pit_prefix)},
                          accept=arrays.get(prefix + _ACCEPT))
    continuation = {field: arrays.get(prefix + stored) for field, stored in _CONTINUATION_NAMES}
    if continuation["after_eos"] is None:  # a store written before the end-of-sequence check
        continuation["after_eos"] = np.zeros(0, dtype=np.int64)
    checks = (RequestChecks(*(arrays[prefix + stored] for _, stored in _CHECK_NAMES))
              if prefix + _CHECK_NAMES[0][1] in arrays else None)
    return SourceRecord(emitted=arrays[_EMITTED[prefix]], tokens=tokens, checks=checks, **continuation)
