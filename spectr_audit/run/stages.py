"""The stages of a chain audit, in the order :func:`~spectr_audit.run.runner.audit_case` runs them.

One table read by both the runner (which stage runs) and the memory budget
(:func:`~spectr_audit.run.budget.audit_needs`, what each stage that runs would allocate), so
that the two cannot disagree about what an audit does.

======================  ==========================================================================
stage                   runs when
======================  ==========================================================================
``probe``               always: the contract probe (:mod:`spectr_audit.run.guard`)
``optimality``          the case asks for ``optimality``: alpha* and SpecTr's bound
``exact``               the verifier has an exact law and the case asks for ``exact``
``multi-iteration``     ... and the verifier carries a next-iteration repair, the case asking for
                        ``multi-iteration`` or ``exact``
``sampler``             ... the case asks for ``sampler``: the sampler against its own law
``certificate``         ... always (with ``certify_tv``, the exact TV is the certificate)
``statistical``         the verifier has no exact law and the case asks for ``statistical``
``block-lp``            the case asks for ``block-lp``, L > 1 and i.i.d. drafts (an extra: skipped
                        with a note when over the memory budget)
======================  ==========================================================================

A draft-tree case runs the stages of :data:`TREE_STAGES` through the same loop, for the tree verifier
(a chain verifier converted to run on chain trees):

======================  ==========================================================================
stage                   runs when
======================  ==========================================================================
``optimality``          the case asks for ``optimality``: the tree bound
``exact``               the tree verifier has a tree law and the case asks for ``exact`` (beyond the
                        enumeration's reach it notes why and leaves the law to the next stage)
``statistical``         the case asks for ``statistical`` or ``exact``, and the exact stage did not
                        enumerate the law
``bounds``              always: acceptance and accepted length against the tree bound, where computed
======================  ==========================================================================
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

__all__ = ["CHAIN_STAGES", "EXTRA_STAGES", "TREE_STAGES", "Stage", "carries_correction", "chain_stages", "tree_stages"]


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a chain audit: its name and when it runs (``applies(verifier, case, carries)``)."""

    name: str
    applies: Callable[[Any, Any, bool], bool]


def carries_correction(verifier: Any) -> bool:
    """Whether ``verifier`` declares a carried correction: the rule of
    :func:`spectr_audit.contract.correction.has_carried_correction`, here without importing the contract
    (torch), so that the memory budget stays importable without it."""
    return callable(getattr(verifier, "carried_correction", None))


def _exact_law(verifier) -> bool:
    return bool(verifier.has_exact_law)


#: Every stage of a chain audit, in the order it runs.
CHAIN_STAGES: tuple[Stage, ...] = (
    Stage("probe", lambda verifier, case, carries: True),
    Stage("optimality", lambda verifier, case, carries: "optimality" in case.checks),
    Stage("exact", lambda verifier, case, carries: _exact_law(verifier) and "exact" in case.checks),
    Stage("multi-iteration", lambda verifier, case, carries: _exact_law(verifier) and carries
          and ("multi-iteration" in case.checks or "exact" in case.checks)),
    Stage("sampler", lambda verifier, case, carries: _exact_law(verifier) and "sampler" in case.checks),
    Stage("certificate", lambda verifier, case, carries: _exact_law(verifier)),
    Stage("statistical", lambda verifier, case, carries: not _exact_law(verifier) and "statistical" in case.checks),
    Stage("block-lp", lambda verifier, case, carries: "block-lp" in case.checks and case.draft_len > 1
          and verifier.draft_scheme == "iid"),
)

#: Stages that are extras: skipped with a note, not refused, when over the memory budget.
EXTRA_STAGES = frozenset({"block-lp"})


def chain_stages(verifier: Any, case: Any) -> tuple[str, ...]:
    """The names of the stages :func:`~spectr_audit.run.runner.audit_case` runs for ``verifier`` on the chain
    ``case``, in order.

    Examples
    --------
    >>> from types import SimpleNamespace as NS
    >>> exact = NS(has_exact_law=True, draft_scheme="iid")
    >>> chain_stages(exact, NS(checks=("exact", "optimality"), draft_len=1))
    ('probe', 'optimality', 'exact', 'certificate')
    >>> chain_stages(NS(has_exact_law=False, draft_scheme="iid"), NS(checks=("statistical", "block-lp"), draft_len=2))
    ('probe', 'statistical', 'block-lp')
    """
    carries = carries_correction(verifier)
    return tuple(stage.name for stage in CHAIN_STAGES if stage.applies(verifier, case, carries))


#: Every stage of a draft-tree audit, in the order it runs (``carries`` is unused: a tree verifier carries no
#: repair, and a chain verifier that does is audited on chain cases).
TREE_STAGES: tuple[Stage, ...] = (
    Stage("optimality", lambda verifier, case, carries: "optimality" in case.checks),
    Stage("exact", lambda verifier, case, carries: bool(verifier.has_tree_law) and "exact" in case.checks),
    Stage("statistical", lambda verifier, case, carries: "statistical" in case.checks or "exact" in case.checks),
    Stage("bounds", lambda verifier, case, carries: True),
)


def tree_stages(tree_verifier: Any, case: Any) -> tuple[str, ...]:
    """The names of the stages :func:`~spectr_audit.run.runner.audit_tree_case` runs for ``tree_verifier`` on
    the tree ``case``, in order (the statistical stage stands down where the exact one enumerated the law).

    Examples
    --------
    >>> from types import SimpleNamespace as NS
    >>> tree_stages(NS(has_tree_law=True), NS(checks=("exact", "optimality")))
    ('optimality', 'exact', 'statistical', 'bounds')
    >>> tree_stages(NS(has_tree_law=False), NS(checks=("exact",)))
    ('statistical', 'bounds')
    """
    return tuple(stage.name for stage in TREE_STAGES if stage.applies(tree_verifier, case, False))
