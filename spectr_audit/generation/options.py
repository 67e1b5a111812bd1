"""The generation audit's options: checked once, frozen, and what a stored audit must match to resume."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from spectr_audit._arguments import check_int_at_least as integer
from spectr_audit._arguments import check_number, check_prob
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.designs import ARMS
from spectr_audit.generation.pit import ORDERINGS

#: Continuation positions are bucketed at these boundaries (a slip past position 64 must not drown
#: in the first 64).
POSITION_BUCKETS = (16, 64, 256)
#: With ``rounds="auto"``: the rounds of every arm run first (two, so that the independence test across calls
#: has its pairs), before further rounds of the fastest arm run until the planned power is reached.
AUTO_FIRST_ROUNDS = 2
#: With ``rounds="auto"``, the reference's own test is sized for this multiple of ``min_detectable_tv`` unless
#: ``reference_tv`` is given: a quarter of the engine's tokens (the tokens a test needs go as 1 / TV^2).
REFERENCE_TV_FACTOR = 2.0


@dataclasses.dataclass(frozen=True)
class _Options:
    """The options of one audit, checked (:func:`_check_options`)."""

    vocab_size: int
    max_new_tokens: int
    batch_size: int
    rounds: int
    arms: tuple
    seed: int
    alpha: float
    power: float
    min_detectable_tv: float
    orderings: tuple
    position_buckets: tuple
    zero_mass_tol: float
    logit_tol: float
    max_tokens: Optional[int]
    max_seconds: Optional[float]
    timeout: Optional[float]
    eos_token_id: Optional[int]
    allow_failed_calls: int = 0
    #: ``rounds="auto"``: after the first ``rounds`` of every arm, rounds of the fastest arm until the
    #: all-tokens test reaches ``min_detectable_tv`` at ``power`` (or a budget stops the audit)
    until_power: bool = False
    #: With ``rounds="auto"`` and a reference: the TV the reference's own all-tokens test is sized for (its further
    #: rounds stop once it has the tokens that needs); None: planned rounds, the reference on every call
    reference_tv: Optional[float] = None

    @property
    def power_ordering(self) -> str:
        """The PIT order whose all-tokens test the power is quoted for: ``probability`` if run, else the first."""
        return "probability" if "probability" in self.orderings else self.orderings[0]

    def config(self, prompts: list, reference: bool, draft: bool, per_row_max_new_tokens: bool) -> dict:
        """What must match for a stored audit to be resumed (the jobs, their seeds and what is scored)."""
        fields = dataclasses.asdict(self)
        fields.pop("max_seconds")
        fields.pop("timeout")
        fields.pop("allow_failed_calls")  # how the result is judged, not which jobs run
        if fields.pop("until_power"):
            fields["rounds"] = "auto"  # the rounds run depend on what the first ones measured
        if fields["reference_tv"] is None:
            fields.pop("reference_tv")  # a store written before the option resumes unchanged
        return {**{k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}, "prompts": prompts,
                "reference": reference, "draft_scorer": draft, "per_row_max_new_tokens": per_row_max_new_tokens}


def _bucket_names(buckets: tuple) -> list:
    edges = (0,) + buckets
    names = [f"positions {a}-{b - 1}" for a, b in zip(edges, edges[1:])]
    return names + [f"positions {edges[-1]}+"]


def _check_options(*, vocab_size, max_new_tokens, batch_size, rounds, arms, seed, alpha, power, min_detectable_tv,
                   orderings, position_buckets, zero_mass_tol, logit_tol, max_tokens, max_seconds, timeout,
                   eos_token_id, allow_failed_calls=0, has_draft_scorer: bool, reference_tv=None) -> _Options:
    """The options of :func:`~spectr_audit.generation.audit_generation`, checked (keyword arguments only): each bad
    one an ``InvalidArgument`` naming it."""
    vocab_size = integer("vocab_size", vocab_size, 2)
    max_new_tokens = integer("max_new_tokens", max_new_tokens, 1)
    batch_size = integer("batch_size", batch_size, 2)
    until_power = rounds == "auto"
    if until_power:
        rounds = AUTO_FIRST_ROUNDS
    elif isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise InvalidArgument(f"rounds: expected an integer >= 1 or 'auto' (rounds until the planned power), got "
                              f"{rounds!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):  # any integer: negative seeds are seeds too
        raise InvalidArgument(f"seed: expected an integer, got {seed!r}")
    alpha, power = check_prob("alpha", alpha), check_prob("power", power)
    min_detectable_tv = check_number("min_detectable_tv", min_detectable_tv, 0, 1, low_open=True)
    if reference_tv is not None:
        if not until_power:
            raise InvalidArgument("reference_tv: sizes the reference of an audit that runs until its power; only with "
                                  "rounds='auto' (planned rounds run the reference on every call)")
        reference_tv = check_number("reference_tv", reference_tv, 0, 1, low_open=True)
    elif until_power:
        reference_tv = min(0.5, REFERENCE_TV_FACTOR * min_detectable_tv)
    if orderings is None:
        orderings = ("probability", "ratio", "token-id") if has_draft_scorer else ("probability", "token-id")
    if isinstance(orderings, str):
        orderings = (orderings,)
    if not isinstance(orderings, Sequence):  # a set has no order, and the first order may carry the power
        raise InvalidArgument(f"orderings: expected a sequence of distinct ones of {ORDERINGS}, got {orderings!r}")
    orderings = tuple(orderings)
    if not orderings or any(o not in ORDERINGS for o in orderings) or len(set(orderings)) != len(orderings):
        raise InvalidArgument(f"orderings: expected distinct ones of {ORDERINGS}, got {list(orderings)!r}")
    if "ratio" in orderings and not has_draft_scorer:
        raise InvalidArgument("orderings: 'ratio' needs draft_score (the draft model's law at each position)")
    if isinstance(position_buckets, (str, bytes)) or not isinstance(position_buckets, Sequence):
        raise InvalidArgument(f"position_buckets: expected increasing positive integers, got {position_buckets!r}")
    buckets = tuple(position_buckets)
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets) or \
            list(buckets) != sorted(set(buckets)):
        raise InvalidArgument(f"position_buckets: expected increasing positive integers, got {list(buckets)!r}")
    if max_tokens is not None:
        max_tokens = integer("max_tokens", max_tokens, 1)
    allow_failed_calls = integer("allow_failed_calls", allow_failed_calls, 0)
    for name, value in (("max_seconds", max_seconds), ("timeout", timeout)):
        if value is not None:
            check_number(name, value, 0, math.inf, low_open=True)
    zero_mass_tol = check_number("zero_mass_tol", zero_mass_tol, 0, 1)
    logit_tol = check_number("logit_tol", logit_tol, 0, math.inf)
    if isinstance(arms, str):
        arms = (arms,)
    if not isinstance(arms, Sequence):
        raise InvalidArgument(f"arms: expected some of {ARMS}, got {arms!r}")
    arms = tuple(arms)
    if not arms or any(a not in ARMS for a in arms) or len(set(arms)) != len(arms):
        raise InvalidArgument(f"arms: expected distinct ones of {ARMS}, got {list(arms)!r}")
    if eos_token_id is not None:
        if isinstance(eos_token_id, bool) or not isinstance(eos_token_id, int) or not 0 <= eos_token_id < vocab_size:
            raise InvalidArgument(f"eos_token_id: expected a token id in [0, {vocab_size}), got {eos_token_id!r}")
    return _Options(vocab_size=vocab_size, max_new_tokens=max_new_tokens, batch_size=batch_size, rounds=rounds,
                    arms=arms, seed=seed, alpha=alpha, power=power, min_detectable_tv=min_detectable_tv,
                    orderings=orderings, position_buckets=buckets, zero_mass_tol=zero_mass_tol, logit_tol=logit_tol,
                    max_tokens=max_tokens, max_seconds=None if max_seconds is None else float(max_seconds),
                    timeout=None if timeout is None else float(timeout), eos_token_id=eos_token_id,
                    allow_failed_calls=allow_failed_calls, until_power=until_power,
                    reference_tv=None if reference_tv is None else float(reference_tv))


def _check_flags(**flags) -> None:
    """The switches of :func:`audit_generation`: each None or a bool (``resume`` a bool)."""
    for name, value in flags.items():
        if (value is None and name != "resume") or isinstance(value, bool):
            continue
        raise InvalidArgument(f"{name}: expected {'True or False' if name == 'resume' else 'None, True or False'}, "
                              f"got {value!r}")
