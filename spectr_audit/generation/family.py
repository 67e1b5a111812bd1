"""The generation audit's Holm family, planned: which tests it holds, counted once.

The analysis (:mod:`spectr_audit.generation.analysis`) plans its tests in a :class:`FamilyPlan` and
quotes each test's minimum detectable TV at ``alpha / plan.size``: every test the result lists shares
the false-alarm rate (its Bonferroni share).  The stopping rule (:mod:`spectr_audit.generation.schedule`)
reads the ``holm_size`` of :meth:`FamilyPlan.largest` as
:func:`~spectr_audit.generation.analysis.largest_family` fills it from the planned jobs: the e-process's p-value
times the largest Holm family the analysis can build, known before any job runs.  The Holm members, in the order the analysis builds
them:

* ``pit ORDER / STRATUM`` for each PIT order and each tested stratum (all tokens, each arm, each serving
  condition, each position bucket, each prompt when there are several);
* ``surprisal / STRATUM`` for each tested stratum but the prompts;
* the agreement tests of repeated requests (``independence / within a batch``, ``... / across calls``);
* ``e-process``;
* ``two-sample ORDER / STRATUM`` against a reference (all tokens, each arm), none when greedy.

then the decisive checks, outside Holm's adjustment (any one violation decides) but counted in the
Bonferroni share: ``support`` always, ``end-of-sequence`` with an end-of-sequence id, ``greedy`` for a
greedy engine against a reference.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

from spectr_audit.generation.designs import ARMS
from spectr_audit.generation.options import _bucket_names

__all__ = ["AGREEMENT_TESTS", "DECISIVE_CHECKS", "EPROCESS_TEST", "FamilyPlan"]

#: The agreement tests of repeated requests: first tokens within a batch (repeated arm) and across rounds.
AGREEMENT_TESTS = ("independence / within a batch", "independence / across calls")
#: The anytime-valid e-process's entry of the family.
EPROCESS_TEST = "e-process"
#: The decisive checks, in the order the result lists them.
DECISIVE_CHECKS = ("support", "end-of-sequence", "greedy")


@dataclasses.dataclass(frozen=True)
class FamilyPlan:
    """The tests of one Holm family.

    Attributes
    ----------
    orderings : tuple of str
        The PIT orders.
    strata : tuple of str
        The strata the one-sample tests run on (``all``, ``arm single``, ``positions 0-15``, ``prompt 2``,
        with requests of several kinds ``request sampled+penalties``).
    agreement : tuple of str
        The agreement tests (some of :data:`AGREEMENT_TESTS`).
    eprocess : bool
        Whether the e-process is a member.
    two_sample : tuple of str
        The strata of the two-sample tests against the reference (``all``, ``arm single``, ...).
    checks : tuple of str
        The decisive checks (some of :data:`DECISIVE_CHECKS`).
    """

    orderings: tuple
    strata: tuple
    agreement: tuple = ()
    eprocess: bool = False
    two_sample: tuple = ()
    checks: tuple = ()

    @classmethod
    def largest(cls, orderings: Sequence[str], arms: Sequence[str], position_buckets: Sequence[int],
                num_prompts: int, has_reference: bool, request_kinds: Sequence[str] = (), *,
                capacity: Optional[Mapping[str, int]] = None, min_stratum_tokens: int = 0,
                agreement: Sequence[str] = AGREEMENT_TESTS, conditions: Sequence[str] = ()) -> "FamilyPlan":
        """The largest family the analysis can build: every stratum filled, every agreement test, the
        e-process, and with a reference the two-sample tests of all tokens and of every arm.

        With ``capacity`` (stratum name -> the most tokens the planned jobs can put in it), a stratum
        other than ``all`` whose capacity is under ``min_stratum_tokens`` is left out, as the analysis
        leaves out a stratum with too few tokens; ``agreement`` names the agreement tests the design
        can pair; ``conditions`` names the serving conditions (a stratum each, after the arms)."""
        def fillable(name: str) -> bool:
            return name == "all" or capacity is None or capacity.get(name, 0) >= min_stratum_tokens

        arm_strata = tuple(f"arm {arm}" for arm in ARMS if arm in arms)
        strata = (("all",) + arm_strata + tuple(f"condition {name}" for name in conditions)
                  + tuple(_bucket_names(tuple(position_buckets)))
                  + (tuple(f"prompt {p}" for p in range(num_prompts)) if num_prompts > 1 else ())
                  + tuple(f"request {kind}" for kind in request_kinds))
        strata = tuple(name for name in strata if fillable(name))
        two_sample = tuple(name for name in ("all",) + arm_strata if fillable(name)) if has_reference else ()
        return cls(tuple(orderings), strata, tuple(t for t in AGREEMENT_TESTS if t in agreement), True, two_sample)

    @staticmethod
    def decisive_checks(eos_token_id, greedy_against_reference: bool, request_checks: Sequence[str] = ()) -> tuple:
        """The decisive checks the analysis runs: support; end-of-sequence with an id; greedy against a reference;
        and with requests their checks (logprobs where any request asks for them, stopping, constraint where any
        request carries one)."""
        return (("support",) + (("end-of-sequence",) if eos_token_id is not None else ())
                + (("greedy",) if greedy_against_reference else ()) + tuple(request_checks))

    def members(self) -> tuple:
        """The Holm family's tests, in the order the analysis builds them."""
        return (tuple(f"pit {order} / {name}" for order in self.orderings for name in self.strata)
                + tuple(f"surprisal / {name}" for name in self.strata if not name.startswith("prompt"))
                + tuple(self.agreement) + ((EPROCESS_TEST,) if self.eprocess else ())
                + tuple(f"two-sample {order} / {name}" for order in self.orderings for name in self.two_sample))

    def tests(self) -> tuple:
        """Every test the result lists: the Holm family, then the decisive checks."""
        return self.members() + tuple(self.checks)

    @property
    def holm_size(self) -> int:
        """The number of tests Holm's adjustment runs over."""
        return len(self.members())

    @property
    def size(self) -> int:
        """The number of tests that share the false-alarm rate (at least 1)."""
        return max(1, len(self.tests()))
