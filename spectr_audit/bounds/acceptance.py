"""Optimal multi-draft acceptance, and the acceptance K-SEQ reaches.

Notation (docs/audit/bounds.md): p is the draft distribution, q the target distribution,
K the number of drafts, V the vocabulary size.  In code they are ``draft_probs``,
``target_probs``, ``num_drafts`` and ``vocab_size``.

Three numbers describe how often a token-level multi-draft verifier can keep a draft token:

* alpha*, the optimal membership acceptance: the largest ``P(Y in S(X_1..X_K))`` over all
  couplings of the drafts with an output ``Y ~ q`` (docs/audit/bounds.md).  :func:`optimal_acceptance`
  computes it in closed form at any vocabulary size; :func:`optimal_acceptance_lp` solves the
  transport LP on small cases and is the closed form's slow oracle.  No exact verifier can
  exceed alpha*: a measured acceptance above it proves the verifier inexact.
* K-SEQ's acceptance ``P_A`` at ``rho*`` (docs/rules/kseq.md): :func:`kseq_acceptance`,
  :func:`kseq_rho_star`, :func:`kseq_accept_prob`.
* SpecTr's guarantee ``P_A >= (1 - (1 - 1/K)^K) alpha*``: :func:`spectr_guarantee`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from typing import Optional, Sequence, Union

import numpy as np
import torch

from spectr_audit.verifiers.rho_star import (
    check_num_drafts,
    kseq_beta,
    num_drafts_tensor,
    kseq_accept_prob,
    kseq_rho_star,
)
from spectr_audit import defaults
from spectr_audit._validation import SIMPLEX_ATOL, as_float64, check_simplex
from spectr_audit.errors import InvalidArgument, SpectrAuditError

__all__ = [
    "KSeqAcceptanceResult",
    "OptimalAcceptanceLPResult",
    "OptimalAcceptanceResult",
    "kseq_acceptance",
    "optimal_acceptance",
    "optimal_acceptance_lp",
    "optimal_acceptance_lp_from_sets",
    "check_min_cut_support",
    "spectr_guarantee",
    "without_replacement_set_probs",
]

#: A probability vector or a batch of them: torch tensor, numpy array or nested list.
ProbsLike = Union[torch.Tensor, np.ndarray, Sequence]

#: Solvers tried in order by the LP when none is named.
_LP_SOLVERS: tuple[str, ...] = ("CLARABEL", "HIGHS", "SCS")

#: Prefix values within this of the minimum count as ties when choosing the minimising set.
_TIE_ATOL = 1e-12


# ---------------------------------------------------------------------------------------------
# Result types
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OptimalAcceptanceResult:
    """The optimal membership acceptance alpha*, per row, and the set that attains it.

    Attributes
    ----------
    value : torch.Tensor
        ``[...]`` float64: alpha* for each row, in ``[0, 1]``.  A 0-d tensor for a single
        pair of distributions; use :meth:`item` for a Python float.
    argmin_set_size : torch.Tensor
        ``[...]`` int64: the size of the smallest minimising token set T (0 means the empty
        set, i.e. alpha* = 1).
    token_order : torch.Tensor
        ``[..., vocab_size]`` int64: token ids sorted by ``target / draft`` ascending (tokens
        the draft never proposes last).  The minimising set is its first ``argmin_set_size``
        entries.
    num_drafts : int
        K, the number of i.i.d. drafts.
    """

    # [...]
    value: torch.Tensor
    # [...]
    argmin_set_size: torch.Tensor
    # [..., vocab_size]
    token_order: torch.Tensor
    num_drafts: int

    def item(self) -> float:
        """alpha* as a Python float; only for a single row."""
        return _single_item(self.value)

    def argmin_set(self, index: Sequence[int] = ()) -> frozenset[int]:
        """Token ids of the smallest set T minimising ``q(T) + 1 - p(T)^K`` for one row.

        ``index`` selects the row in the leading (batch) dimensions; leave it empty for a
        single pair of distributions.
        """
        index = tuple(index)
        if len(index) != self.value.dim():
            raise InvalidArgument(
                f"index: expected {self.value.dim()} indices for batch shape {tuple(self.value.shape)}, "
                f"got {index!r}"
            )
        size = int(self.argmin_set_size[index].item())
        return frozenset(self.token_order[index][:size].tolist())


@dataclasses.dataclass(frozen=True)
class OptimalAcceptanceLPResult:
    """The optimal membership acceptance found by the transport LP.

    Attributes
    ----------
    value : float
        The LP optimum alpha* (up to the solver's tolerance, about 1e-8 for CLARABEL).
    status : str
        cvxpy's status string: ``"optimal"``, or ``"optimal_inaccurate"`` when no solver
        reached full accuracy.
    solver : str
        The solver that produced ``value``.
    num_variables : int
        Number of LP variables ``pi(S, y)``, one per draft set S and token y in S.
    num_sets : int
        Number of distinct draft sets S with positive probability.
    """

    value: float
    status: str
    solver: str
    num_variables: int
    num_sets: int


@dataclasses.dataclass(frozen=True)
class KSeqAcceptanceResult:
    """K-SEQ's acceptance at rho*, per row.

    Attributes
    ----------
    value : torch.Tensor
        ``[...]`` float64: ``P_A = 1 - (1 - beta(rho*))^K``, the probability that some draft
        is accepted.
    rho_star : torch.Tensor
        ``[...]`` float64: rho*, the smallest valid rho in ``[1, K]`` (the bisection's upper
        bracket).
    beta : torch.Tensor
        ``[...]`` float64: ``beta(rho*) = sum_x min(p(x), q(x) / rho*)``.
    """

    # [...]
    value: torch.Tensor
    # [...]
    rho_star: torch.Tensor
    # [...]
    beta: torch.Tensor

    def item(self) -> float:
        """P_A as a Python float; only for a single row."""
        return _single_item(self.value)


def _single_item(value: torch.Tensor) -> float:
    """The one entry of a result's ``value`` as a Python float."""
    if value.numel() != 1:
        raise InvalidArgument(f"item(): defined for a single row only; value has shape {tuple(value.shape)}")
    return float(value.reshape(()).item())


# ---------------------------------------------------------------------------------------------
# Input validation (public boundary only)
# ---------------------------------------------------------------------------------------------


def _validated_pair(
    draft_probs: ProbsLike, target_probs: ProbsLike, *, one_dim: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both distributions as float64 tensors of one shape, each row renormalised to sum 1."""
    target, target_atol = as_float64("target_probs", target_probs)
    draft, draft_atol = as_float64("draft_probs", draft_probs)
    if one_dim and target.dim() != 1:
        raise InvalidArgument(f"target_probs: expected shape [vocab_size], got {tuple(target.shape)}")
    if draft.shape != target.shape:
        raise InvalidArgument(
            f"draft_probs: expected shape [..., vocab_size] matching target_probs {tuple(target.shape)}, "
            f"got {tuple(draft.shape)}"
        )
    if draft.device != target.device:
        raise InvalidArgument(
            f"draft_probs: expected the device of target_probs ({target.device}), got {draft.device}"
        )
    check_simplex("draft_probs", draft, draft_atol, index_name="batch index")
    check_simplex("target_probs", target, target_atol, index_name="batch index")
    # Renormalise in float64 so that the bounds describe exact distributions.
    return draft / draft.sum(-1, keepdim=True), target / target.sum(-1, keepdim=True)


# ---------------------------------------------------------------------------------------------
# Closed form
# ---------------------------------------------------------------------------------------------


def spectr_guarantee(num_drafts: int) -> float:
    """SpecTr's approximation factor ``1 - (1 - 1/K)^K`` for K-SEQ.

    Parameters
    ----------
    num_drafts : int
        K >= 1.

    Returns
    -------
    float
        The factor c with ``P_A(K-SEQ) >= c * alpha*``; 1 for K = 1, decreasing to ``1 - 1/e``.

    Notes
    -----
    Valid for i.i.d. drafts (SpecTr, NeurIPS 2023, Theorem 1).

    Examples
    --------
    >>> spectr_guarantee(1), spectr_guarantee(2)
    (1.0, 0.75)
    """
    k = check_num_drafts(num_drafts)
    return 1.0 - (1.0 - 1.0 / k) ** k


def optimal_acceptance(
    # [..., vocab_size]
    draft_probs: ProbsLike,
    # [..., vocab_size]
    target_probs: ProbsLike,
    num_drafts: int,
) -> OptimalAcceptanceResult:
    """The optimal membership acceptance alpha* for K i.i.d. drafts, in closed form.

    ``alpha* = max P(Y in {X_1..X_K})`` over couplings of ``X_i ~ p`` i.i.d. with ``Y ~ q``;
    by max-flow / min-cut it equals ``min over token sets T of [q(T) + 1 - p(T)^K]``.

    Parameters
    ----------
    draft_probs : tensor, numpy array or nested list, shape ``[..., vocab_size]``
        Draft distributions p, one per row.  Any float dtype and device; computed in float64
        on that device.
    target_probs : same type, shape ``[..., vocab_size]``
        Target distributions q.
    num_drafts : int
        K >= 1.

    Returns
    -------
    OptimalAcceptanceResult
        ``value`` is a float64 tensor of shape ``[...]`` (0-d for a single row; ``.item()``
        gives a float); ``argmin_set()`` gives the minimising token set of a row.

    Notes
    -----
    Rows must be finite, non-negative and sum to 1 within 1e-4 (wider for half precision);
    they are renormalised in float64 first.  Only the level sets ``{x : q(x)/p(x) <= t}`` need
    checking: for a fixed draft mass ``s = p(T)`` the smallest ``q(T)`` is a fractional
    knapsack, solved greedily by ascending ``q/p``, whose value ``Q(s)`` is piecewise linear;
    ``Q(s) - s^K`` is concave on each piece, so its minimum is at a breakpoint, i.e. a prefix of
    the sorted order.  The scan covers all V + 1 prefixes (the empty set gives 1), so ties in
    ``q/p`` need no care.  Tokens with ``p = 0`` sort last (ratio +inf).  Cost: one sort and two
    cumulative sums per row, O(V log V).  For K = 1 the value is ``sum_x min(p, q) = 1 - TV``.

    The reported ``argmin_set_size`` is the smallest prefix whose value is within 1e-12 of the
    minimum, so that float rounding does not pick a needlessly large set.

    Examples
    --------
    >>> bound = optimal_acceptance([0.6, 0.4], [0.3, 0.7], num_drafts=2)
    >>> round(bound.item(), 12)
    0.94
    >>> sorted(bound.argmin_set())
    [0]
    >>> optimal_acceptance([[0.6, 0.4], [0.5, 0.5]], [[0.3, 0.7], [0.5, 0.5]], 1).value
    tensor([0.7000, 1.0000], dtype=torch.float64)
    """
    draft, target = _validated_pair(draft_probs, target_probs)
    k = check_num_drafts(num_drafts)
    # Tokens the draft never proposes go last; q = p = 0 tokens may sit anywhere.
    ratio = torch.where(draft > 0, target / draft, torch.full_like(target, math.inf))
    order = torch.sort(ratio, dim=-1, stable=True).indices
    cum_target = target.gather(-1, order).cumsum(-1)
    cum_draft = draft.gather(-1, order).cumsum(-1).clamp(max=1.0)
    empty = target.new_zeros(target.shape[:-1] + (1,))
    # [..., vocab_size + 1]: prefix i holds the i tokens of smallest ratio.
    prefix_values = torch.cat([empty, cum_target], -1) + 1.0 - torch.cat([empty, cum_draft], -1) ** k
    min_value = prefix_values.amin(-1)
    near_min = prefix_values <= min_value.unsqueeze(-1) + _TIE_ATOL
    argmin_size = near_min.to(torch.uint8).argmax(-1)  # first prefix within the tie tolerance
    return OptimalAcceptanceResult(
        value=min_value.clamp(0.0, 1.0),
        argmin_set_size=argmin_size.to(torch.int64),
        token_order=order,
        num_drafts=k,
    )


# ---------------------------------------------------------------------------------------------
# Transport LP (small cases; the closed form's oracle)
# ---------------------------------------------------------------------------------------------


def _check_max_variables(max_variables: object) -> None:
    if isinstance(max_variables, bool) or not isinstance(max_variables, int) or max_variables < 1:
        raise InvalidArgument(f"max_variables: expected an integer >= 1, got {max_variables!r}")


def _iid_set_probs(draft: np.ndarray, num_drafts: int) -> dict[frozenset[int], float]:
    """P(set of distinct drafts = S) for K i.i.d. drafts, by enumerating multisets."""
    support = np.flatnonzero(draft > 0).tolist()
    set_probs: dict[frozenset[int], float] = {}
    if num_drafts > _EXACT_MULTINOMIAL_MAX_K:
        return _iid_set_probs_log(draft, support, num_drafts)
    k_factorial = math.factorial(num_drafts)
    for multiset in itertools.combinations_with_replacement(support, num_drafts):
        coefficient = k_factorial
        weight = 1.0
        for token, copies in itertools.groupby(multiset):
            count = sum(1 for _ in copies)
            coefficient //= math.factorial(count)
            weight *= float(draft[token]) ** count
        key = frozenset(multiset)
        set_probs[key] = set_probs.get(key, 0.0) + coefficient * weight
    return set_probs


def check_min_cut_support(support: int, argument: str = "num_drafts") -> None:
    """InvalidArgument (naming ``argument``) when the bound of drafts without replacement cannot be computed
    on a draft law with ``support`` tokens of positive probability: the set law and the min-cut sum over
    its 2**support token sets, at most 2**:data:`spectr_audit.defaults.MIN_CUT_MAX_SUPPORT`."""
    limit = defaults.MIN_CUT_MAX_SUPPORT
    if support > limit:
        raise InvalidArgument(
            f"{argument}: alpha* of drafts without replacement sums over the 2**{support} sets of the draft's "
            f"{support} tokens of positive probability, above the limit of 2**{limit} "
            f"(spectr_audit.defaults.MIN_CUT_MAX_SUPPORT)")


def without_replacement_set_probs(draft: ProbsLike, num_drafts: int, argument: str = "num_drafts") -> dict:
    """P(set of drafts = S) for ``num_drafts`` tokens drawn one after another without replacement from ``draft``.

    The next draw depends only on the set drawn so far: a token ``t`` not yet drawn comes next with
    probability ``p(t) / (mass not yet drawn)``, that mass summed over the tokens not yet drawn (``1 -``
    the drawn mass would cancel when the last tokens carry tiny mass).  So the law is built one draw at a
    time over the subsets of the draft's support, at most
    :data:`spectr_audit.defaults.MIN_CUT_MAX_SUPPORT` tokens of positive probability
    (:func:`check_min_cut_support`); errors name ``argument``.

    Examples
    --------
    >>> law = without_replacement_set_probs([0.5, 0.3, 0.2], 2)
    >>> round(law[frozenset({0, 1})], 6)          # 0.5 * 0.3 / 0.5 + 0.3 * 0.5 / 0.7
    0.514286
    """
    values = as_float64("draft", draft)[0].reshape(-1).tolist()
    support = [t for t, value in enumerate(values) if value > 0]
    if len(support) < num_drafts:
        raise InvalidArgument(
            f"{argument}: {num_drafts} tokens drawn without replacement need as many of positive draft probability; "
            f"the draft law has {len(support)}")
    check_min_cut_support(len(support), argument)
    size = len(support)
    masks = np.arange(1 << size)  # bit b: the support's b-th token
    mass = np.array([values[t] for t in support])
    inside = np.zeros(1 << size)  # the mass of a set's tokens, summed in token order
    for bit in range(size):
        inside[1 << bit:2 << bit] = inside[:1 << bit] + mass[bit]
    left = inside[(1 << size) - 1 - masks]  # the mass not yet drawn, summed (not subtracted)
    drawn = np.zeros(1 << size, dtype=np.int64)
    for bit in range(size):
        drawn += (masks >> bit) & 1
    law = np.zeros(1 << size)  # P(the first k draws are the set), k = the set's size
    law[0] = 1.0
    for k in range(num_drafts):
        layer = masks[(drawn == k) & (law > 0)]
        for bit in range(size):
            sets = layer[(layer >> bit) & 1 == 0]
            law[sets | (1 << bit)] += law[sets] * (mass[bit] / left[sets])
    full = masks[(drawn == num_drafts) & (law > 0)].tolist()
    return {frozenset(support[b] for b in range(size) if m >> b & 1): float(law[m]) for m in full}


#: Up to this K the multinomial weights are exact integers times float powers; beyond, K! overflows a
#: float (171! > 1.8e308) and p^m underflows while their product need not: logarithms instead.
_EXACT_MULTINOMIAL_MAX_K = 170


def _iid_set_probs_log(draft: np.ndarray, support: list, num_drafts: int) -> dict[frozenset[int], float]:
    """:func:`_iid_set_probs` for large K: multisets as count vectors (stars and bars, O(n) each, not O(K)),
    weights ``exp(lgamma(K + 1) - sum lgamma(m_i + 1) + sum m_i log p_i)``."""
    n = len(support)
    logs = [math.log(float(draft[t])) for t in support]
    log_k_factorial = math.lgamma(num_drafts + 1)
    set_probs: dict[frozenset[int], float] = {}
    for bars in itertools.combinations(range(num_drafts + n - 1), n - 1):
        edges = (-1, *bars, num_drafts + n - 1)
        counts = [edges[i + 1] - edges[i] - 1 for i in range(n)]
        log_mass = log_k_factorial + sum(c * lp - math.lgamma(c + 1) for c, lp in zip(counts, logs) if c)
        key = frozenset(t for t, c in zip(support, counts) if c)
        set_probs[key] = set_probs.get(key, 0.0) + math.exp(log_mass)
    return set_probs


def _solve_set_lp(
    set_probs: dict[frozenset[int], float],
    target: np.ndarray,
    solver: Optional[str],
    max_variables: int,
) -> OptimalAcceptanceLPResult:
    """Maximise sum pi(S, y) s.t. per-set mass <= P(S), per-token mass <= q(y)."""
    import cvxpy as cp
    import scipy.sparse as sp

    sets = [(sorted(s), mass) for s, mass in set_probs.items() if mass > 0]
    num_variables = sum(len(tokens) for tokens, _ in sets)
    if num_variables > max_variables:
        raise InvalidArgument(
            f"max_variables: the LP needs {num_variables} variables, above max_variables={max_variables}; "
            f"use optimal_acceptance (closed form) for cases this large"
        )
    set_index = np.repeat(np.arange(len(sets)), [len(tokens) for tokens, _ in sets])
    token_index = np.fromiter(itertools.chain.from_iterable(t for t, _ in sets), dtype=np.int64, count=num_variables)
    columns = np.arange(num_variables)
    ones = np.ones(num_variables)
    by_set = sp.csr_matrix((ones, (set_index, columns)), shape=(len(sets), num_variables))
    by_token = sp.csr_matrix((ones, (token_index, columns)), shape=(target.shape[0], num_variables))
    set_mass = np.array([mass for _, mass in sets])

    coupling = cp.Variable(num_variables, nonneg=True)
    problem = cp.Problem(
        cp.Maximize(cp.sum(coupling)),
        [by_set @ coupling <= set_mass, by_token @ coupling <= target],
    )

    installed = set(cp.installed_solvers())
    if solver is not None:
        if solver.upper() not in installed:
            raise InvalidArgument(f"solver: {solver!r} is not installed; installed: {sorted(installed)}")
        candidates: tuple[str, ...] = (solver.upper(),)
    else:
        candidates = tuple(name for name in _LP_SOLVERS if name in installed)
    failures: list[str] = []
    inaccurate: Optional[OptimalAcceptanceLPResult] = None
    for name in candidates:
        try:
            problem.solve(solver=name)
        except cp.error.SolverError as exc:
            failures.append(f"{name}: {exc}")
            continue
        if problem.status in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE):
            result = OptimalAcceptanceLPResult(
                value=float(problem.value),
                status=str(problem.status),
                solver=name,
                num_variables=num_variables,
                num_sets=len(sets),
            )
            if problem.status == cp.OPTIMAL:
                return result
            inaccurate = inaccurate or result
        failures.append(f"{name}: status {problem.status}")
    if inaccurate is not None:
        return inaccurate
    raise SpectrAuditError(
        f"optimal acceptance LP ({num_variables} variables): no solver succeeded; " + "; ".join(failures)
    )


def optimal_acceptance_lp_from_sets(
    set_probs: Mapping[frozenset[int], float],
    # [vocab_size]
    target_probs: ProbsLike,
    *,
    solver: Optional[str] = None,
    max_variables: int = defaults.LP_MAX_VARIABLES,
) -> OptimalAcceptanceLPResult:
    """alpha* for any law of the draft set, by the transport LP.

    Parameters
    ----------
    set_probs : mapping of frozenset of int to float
        ``P(S(X_1..X_K) = S)``: the law of the set of distinct draft tokens (any drafting
        scheme: i.i.d., without replacement, ...).  Sets must be non-empty, token ids in
        ``[0, vocab_size)``, masses finite, non-negative, summing to 1 within 1e-4.
    target_probs : tensor, numpy array or list, shape ``[vocab_size]``
        The target distribution q.
    solver : str, optional
        A cvxpy solver name.  By default CLARABEL, falling back to HIGHS then SCS when a
        solver errors or does not reach ``"optimal"``.
    max_variables : int
        Refuse (``InvalidArgument``) LPs with more variables, so callers can skip big cases.

    Returns
    -------
    OptimalAcceptanceLPResult
        The optimum, the solver status and name, and the LP size.

    Raises
    ------
    InvalidArgument
        On invalid input or an LP larger than ``max_variables``.
    SpectrAuditError
        When every solver fails.

    Notes
    -----
    SpecTr's transport LP has a variable ``pi(t, y)`` per draft tuple t and token y, with
    ``sum_y pi(t, y) = P(t)``, ``sum_t pi(t, y) = q(y)``, maximising the mass on ``y in set(t)``.
    Only mass with ``y in set(t)`` is scored, and tuples with the same set are interchangeable,
    so it suffices to solve: variables ``pi(S, y) >= 0`` for ``y in S``, maximise ``sum pi``,
    subject to ``sum_y pi(S, y) <= P(S)`` and ``sum_S pi(S, y) <= q(y)``.  Any full coupling
    restricts to a feasible point of equal value; conversely, split each ``pi(S, y)`` over the
    tuples of S in proportion to ``P(t)``; the leftover row mass and leftover column mass both
    total ``1 - value``, so any coupling of the leftovers completes a full transport plan whose
    value is at least as large.  The inequalities also spare solvers (HiGHS) from declaring the
    equality version infeasible when the marginals' sums differ by ~1e-16.  Masses and q are
    renormalised to sum 1.

    Examples
    --------
    Two drafts without replacement from p = (0.5, 0.3, 0.2); token 2 is drafted with
    probability 17/35 but q(2) = 0.6, so alpha* = 1 - (0.6 - 17/35) = 31/35:

    >>> set_probs = {frozenset({0, 1}): 0.5 * 0.3 / 0.7 + 0.3 * 0.5 / 0.5,
    ...              frozenset({0, 2}): 0.5 * 0.2 / 0.8 + 0.2 * 0.5 / 0.5,
    ...              frozenset({1, 2}): 0.3 * 0.2 / 0.8 + 0.2 * 0.3 / 0.7}
    >>> bound = optimal_acceptance_lp_from_sets(set_probs, [0.2, 0.2, 0.6])
    >>> round(bound.value, 6), bound.status, bound.num_variables
    (0.885714, 'optimal', 6)
    """
    target, atol = as_float64("target_probs", target_probs)
    if target.dim() != 1:
        raise InvalidArgument(f"target_probs: expected shape [vocab_size], got {tuple(target.shape)}")
    check_simplex("target_probs", target, atol, index_name="batch index")
    vocab_size = target.shape[0]
    if not isinstance(set_probs, Mapping):
        raise InvalidArgument(
            f"set_probs: expected a mapping of frozenset of token ids to probability, got {type(set_probs).__name__}"
        )
    _check_max_variables(max_variables)
    cleaned: dict[frozenset[int], float] = {}
    for key, mass in set_probs.items():
        if not isinstance(key, (frozenset, set)) or not key:
            raise InvalidArgument(f"set_probs: keys must be non-empty frozensets of token ids, got {key!r}")
        tokens = []
        for token in key:
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token < vocab_size:
                raise InvalidArgument(
                    f"set_probs: token ids must be integers in [0, {vocab_size}); set {sorted(key)} holds {token!r}"
                )
            tokens.append(int(token))
        mass = float(mass)
        if not math.isfinite(mass) or mass < 0:
            raise InvalidArgument(
                f"set_probs: masses must be finite and non-negative; set {sorted(key)} has {mass!r}"
            )
        frozen = frozenset(tokens)
        cleaned[frozen] = cleaned.get(frozen, 0.0) + mass
    total = sum(cleaned.values())
    if abs(total - 1.0) > SIMPLEX_ATOL:
        raise InvalidArgument(f"set_probs: masses must sum to 1 within {SIMPLEX_ATOL:.1e}, got {total:.6g}")
    target_np = target.cpu().numpy()
    target_np = target_np / target_np.sum()
    normalised = {key: mass / total for key, mass in cleaned.items()}
    return _solve_set_lp(normalised, target_np, solver, max_variables)


def optimal_acceptance_lp(
    # [vocab_size]
    draft_probs: ProbsLike,
    # [vocab_size]
    target_probs: ProbsLike,
    num_drafts: int,
    *,
    solver: Optional[str] = None,
    max_variables: int = defaults.LP_MAX_VARIABLES,
) -> OptimalAcceptanceLPResult:
    """alpha* for K i.i.d. drafts by the transport LP (small cases; oracle for the closed form).

    Parameters
    ----------
    draft_probs : tensor, numpy array or list, shape ``[vocab_size]``
        The draft distribution p.
    target_probs : same type, shape ``[vocab_size]``
        The target distribution q.
    num_drafts : int
        K >= 1.
    solver : str, optional
        A cvxpy solver name; by default CLARABEL, then HIGHS, then SCS.
    max_variables : int
        Refuse (``InvalidArgument``) problems whose LP has more variables, or whose draft
        multisets to enumerate number more, than this.

    Returns
    -------
    OptimalAcceptanceLPResult
        See :func:`optimal_acceptance_lp_from_sets`.

    Notes
    -----
    With n tokens in the support of p the LP has ``sum_{j <= min(n, K)} j C(n, j)`` variables
    and ``C(n + K - 1, K)`` draft multisets are enumerated; both are checked against
    ``max_variables`` before any work.  ``P(set = S)`` sums the multinomial weights
    ``K! / prod m_i! * prod p_i^m_i`` of the multisets with distinct tokens S.  The result
    agrees with :func:`optimal_acceptance` to the solver's tolerance.

    Examples
    --------
    >>> bound = optimal_acceptance_lp([0.6, 0.4], [0.3, 0.7], num_drafts=2)
    >>> round(bound.value, 6), bound.num_sets, bound.num_variables
    (0.94, 3, 4)
    """
    draft, target = _validated_pair(draft_probs, target_probs, one_dim=True)
    k = check_num_drafts(num_drafts)
    _check_max_variables(max_variables)
    draft_np = draft.cpu().numpy()
    support_size = int(np.count_nonzero(draft_np > 0))
    num_multisets = math.comb(support_size + k - 1, k)
    num_variables = sum(j * math.comb(support_size, j) for j in range(1, min(support_size, k) + 1))
    if max(num_multisets, num_variables) > max_variables:
        raise InvalidArgument(
            f"max_variables: {support_size} draft tokens and num_drafts={k} need {num_variables} LP variables "
            f"and {num_multisets} draft multisets, above max_variables={max_variables}; "
            f"use optimal_acceptance (closed form) for cases this large"
        )
    return _solve_set_lp(_iid_set_probs(draft_np, k), target.cpu().numpy(), solver, max_variables)


def kseq_acceptance(
    # [..., vocab_size]
    draft_probs: ProbsLike,
    # [..., vocab_size]
    target_probs: ProbsLike,
    # [...] or int
    num_drafts: Union[int, torch.Tensor],
) -> KSeqAcceptanceResult:
    """K-SEQ's acceptance ``P_A = 1 - (1 - beta(rho*))^K``, validated and batched.

    Parameters
    ----------
    draft_probs : tensor, numpy array or nested list, shape ``[..., vocab_size]``
        Draft distributions p.
    target_probs : same type, shape ``[..., vocab_size]``
        Target distributions q.
    num_drafts : int or torch.Tensor broadcastable to ``[...]``
        K >= 1 per row (integral values).

    Returns
    -------
    KSeqAcceptanceResult
        ``value`` (P_A), ``rho_star`` and ``beta``, each float64 of shape ``[...]``.

    Notes
    -----
    Inputs are validated as in :func:`optimal_acceptance` and renormalised; rho* comes from
    :func:`kseq_rho_star`.  ``P_A = sum_x min(rho* p(x), q(x)) >= sum_x min(p, q)`` and
    ``spectr_guarantee(K) * alpha* <= P_A <= alpha*`` for i.i.d. drafts.

    Examples
    --------
    >>> result = kseq_acceptance([0.6, 0.4], [0.3, 0.7], num_drafts=2)
    >>> bool(abs(result.item() - (0.62 + 0.4 * 0.34 ** 0.5)) < 1e-12)
    True
    """
    draft, target = _validated_pair(draft_probs, target_probs)
    batch_shape = draft.shape[:-1]
    if isinstance(num_drafts, torch.Tensor):
        k = num_drafts_tensor(num_drafts, batch_shape, draft.device)
        bad = (k < 1) | (k != k.floor())
        if bool(bad.any()):
            index = tuple(bad.nonzero()[0].tolist())
            raise InvalidArgument(
                f"num_drafts: expected integral values >= 1, found {k[index].item()} at batch index {index}"
            )
    else:
        k = check_num_drafts(num_drafts)
    rho = kseq_rho_star(draft, target, k)
    beta = kseq_beta(draft, target, rho)
    return KSeqAcceptanceResult(value=kseq_accept_prob(beta, k), rho_star=rho, beta=beta)
