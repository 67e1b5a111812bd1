"""The stages of an audit, in the order :func:`~spectr_audit.run.runner.audit_case` runs them.

One table for every case, read by both the runner (which stage runs) and the memory budget
(:func:`~spectr_audit.run.budget.audit_needs`, what each stage that runs would allocate), so that
the two cannot disagree about what an audit does.

A case is a draft tree under a draft scheme: a chain case (K drafts of L tokens) is the tree
``DraftTree.chains(K, L)`` under the verifier's own scheme, audited with the chain contract (its
verifier's ``verify`` and ``output_probs``, with sampling parameters where the case has them); a
draft-tree case names its tree, and its verifier is a tree verifier (a chain verifier is converted to
run on chain trees).  Every case runs through the same loop and the same checks: alpha*, the exact law,
the statistical audit, acceptance against alpha*, the certificate.  What a chain audit computes beyond
a tree audit (the probe, the multi-iteration law, the sampler against its law, the block LP) are stages
that apply to chain cases only.

======================  ==========================================================================
stage                   runs when
======================  ==========================================================================
``probe``               a chain case: the contract probe (:mod:`spectr_audit.run.guard`)
``optimality``          the case asks for ``optimality``: alpha* (and SpecTr's bound, i.i.d. chains;
                        the best accepted length, trees: the tree bound)
``exact``               the verifier has an exact law and the case asks for ``exact`` (a tree case
                        beyond the enumeration's reach notes why and leaves the law to ``statistical``)
``statistical``         a chain case: no exact law and the case asks for ``statistical``; a tree
                        case: it asks for ``statistical`` or ``exact``, and the exact stage did not
                        enumerate the law
``bounds``              an exact law, or a tree case: acceptance against alpha* (an exact acceptance
                        within the tolerance, a sampled one by a binomial test), a tree's accepted
                        length against its bound; where computed
``multi-iteration``     a chain case, the verifier has an exact law and carries a next-iteration
                        repair, the case asking for ``multi-iteration`` or ``exact``
``sampler``             a chain case, an exact law, the case asks for ``sampler``: the sampler
                        against its own law
``certificate``         an exact law (with ``certify_tv``, the exact TV is the certificate)
``block-lp``            a chain case that asks for ``block-lp``, L > 1 and i.i.d. drafts (an extra:
                        skipped with a note when over the memory budget)
======================  ==========================================================================
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

__all__ = ["EXTRA_STAGES", "STAGES", "Facts", "Stage", "audit_stages", "carries_correction", "facts"]


@dataclasses.dataclass(frozen=True)
class Facts:
    """What decides which stages apply, beyond the case's checks: whether the case is a chain case (audited
    with the chain contract), whether the verifier has an exact law (``output_probs`` on a chain case,
    ``tree_output_probs`` on a tree case), and whether it carries a next-iteration repair."""

    chain: bool
    law: bool
    carries: bool


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of an audit: its name and when it runs (``applies(verifier, case, facts)``)."""

    name: str
    applies: Callable[[Any, Any, Facts], bool]


def carries_correction(verifier: Any) -> bool:
    """Whether ``verifier`` declares a carried correction: the rule of
    :func:`spectr_audit.contract.correction.has_carried_correction`, here without importing the contract
    (torch), so that the memory budget stays importable without it."""
    return callable(getattr(verifier, "carried_correction", None))


#: Every stage of an audit, in the order it runs.
STAGES: tuple[Stage, ...] = (
    Stage("probe", lambda verifier, case, f: f.chain),
    Stage("optimality", lambda verifier, case, f: "optimality" in case.checks),
    Stage("exact", lambda verifier, case, f: f.law and "exact" in case.checks),
    Stage("statistical", lambda verifier, case, f: (not f.law and "statistical" in case.checks) if f.chain
          else ("statistical" in case.checks or "exact" in case.checks)),
    Stage("bounds", lambda verifier, case, f: f.law or not f.chain),
    Stage("multi-iteration", lambda verifier, case, f: f.chain and f.law and f.carries
          and ("multi-iteration" in case.checks or "exact" in case.checks)),
    Stage("sampler", lambda verifier, case, f: f.chain and f.law and "sampler" in case.checks),
    Stage("certificate", lambda verifier, case, f: f.law),
    Stage("block-lp", lambda verifier, case, f: f.chain and "block-lp" in case.checks and case.draft_len > 1
          and verifier.draft_scheme == "iid"),
)

#: Stages that are extras: skipped with a note, not refused, when over the memory budget.
EXTRA_STAGES = frozenset({"block-lp"})


def facts(verifier: Any, case: Any) -> Facts:
    """The :class:`Facts` of auditing ``verifier`` on ``case``: a chain case when the case names no tree
    (``verifier`` a chain verifier), a tree case otherwise (``verifier`` the tree verifier audited)."""
    chain = getattr(case, "tree", None) is None
    law = bool(verifier.has_exact_law if chain else verifier.has_tree_law)
    return Facts(chain=chain, law=law, carries=chain and carries_correction(verifier))


def audit_stages(verifier: Any, case: Any) -> tuple[str, ...]:
    """The names of the stages :func:`~spectr_audit.run.runner.audit_case` runs for ``verifier`` on ``case``,
    in order (on a tree case, ``verifier`` is the tree verifier audited).

    Examples
    --------
    >>> from types import SimpleNamespace as NS
    >>> exact = NS(has_exact_law=True, draft_scheme="iid")
    >>> audit_stages(exact, NS(checks=("exact", "optimality"), draft_len=1))
    ('probe', 'optimality', 'exact', 'bounds', 'certificate')
    >>> audit_stages(NS(has_exact_law=False, draft_scheme="iid"), NS(checks=("statistical", "block-lp"), draft_len=2))
    ('probe', 'statistical', 'block-lp')
    >>> audit_stages(NS(has_tree_law=True), NS(checks=("exact", "optimality"), tree="chains:2,2"))
    ('optimality', 'exact', 'statistical', 'bounds', 'certificate')
    >>> audit_stages(NS(has_tree_law=False), NS(checks=("exact",), tree="chains:2,2"))
    ('statistical', 'bounds')
    """
    found = facts(verifier, case)
    return tuple(stage.name for stage in STAGES if stage.applies(verifier, case, found))
