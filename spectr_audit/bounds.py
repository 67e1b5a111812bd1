"""Optimal multi-draft acceptance, and the acceptance K-SEQ reaches.

Notation follows ALGORITHMS.md: p is the draft distribution, q the target distribution,
K the number of drafts, V the vocabulary size.  In code they are ``draft_probs``,
``target_probs``, ``num_drafts`` and ``vocab_size``.

Three numbers describe how often a token-level multi-draft verifier can keep a draft token:

* alpha*, the optimal membership acceptance: the largest ``P(Y in S(X_1..X_K))`` over all
  couplings of the drafts with an output ``Y ~ q`` (section 6).  :func:`optimal_acceptance`
  computes it in closed form at any vocabulary size; :func:`optimal_acceptance_lp` solves the
  transport LP on small cases and is the closed form's slow oracle.  No exact verifier can
  exceed alpha*: a measured acceptance above it proves the verifier inexact.
* K-SEQ's acceptance ``P_A`` at ``rho*`` (section 2): :func:`kseq_acceptance`,
  :func:`kseq_rho_star`, :func:`kseq_accept_prob`.
* SpecTr's guarantee ``P_A >= (1 - (1 - 1/K)^K) alpha*``: :func:`spectr_guarantee`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from collections.abc import Mapping
from typing import Optional, Sequence, Union

import numpy as np
import torch

from spectr_audit.compiled import compiled_enabled, kseq_low_sums
from spectr_audit.contract import PROB_ATOL
from spectr_audit.errors import InvalidArgument, SpectrAuditError

__all__ = [
    "AcceptanceBound",
    "KSeqAcceptance",
    "LPBound",
    "kseq_accept_prob",
    "kseq_acceptance",
    "kseq_rho_star",
    "optimal_acceptance",
    "optimal_acceptance_lp",
    "optimal_acceptance_lp_from_sets",
    "spectr_guarantee",
]

#: A probability vector or a batch of them: torch tensor, numpy array or nested list.
ProbsLike = Union[torch.Tensor, np.ndarray, Sequence]

#: Solvers tried in order by the LP when none is named.
_LP_SOLVERS: tuple[str, ...] = ("CLARABEL", "HIGHS", "SCS")

#: Bisection steps for rho*: 64 halvings of [1, K] reach adjacent floats for any K < 2**10.
_BISECTION_STEPS = 64

#: Prefix values within this of the minimum count as ties when choosing the minimising set.
_TIE_ATOL = 1e-12


# ---------------------------------------------------------------------------------------------
# Result types
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AcceptanceBound:
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
        if self.value.numel() != 1:
            raise InvalidArgument(
                f"item(): defined for a single row only; value has shape {tuple(self.value.shape)}"
            )
        return float(self.value.reshape(()).item())

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
class LPBound:
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
class KSeqAcceptance:
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
        if self.value.numel() != 1:
            raise InvalidArgument(
                f"item(): defined for a single row only; value has shape {tuple(self.value.shape)}"
            )
        return float(self.value.reshape(()).item())


# ---------------------------------------------------------------------------------------------
# Input validation (public boundary only)
# ---------------------------------------------------------------------------------------------


def _sum_atol(dtype: torch.dtype, vocab_size: int) -> float:
    """Row-sum tolerance: PROB_ATOL, widened for half precision whose rounding grows with V."""
    if dtype in (torch.float16, torch.bfloat16):
        eps = torch.finfo(dtype).eps
        return max(PROB_ATOL, 4 * eps * math.sqrt(vocab_size) + eps)
    return PROB_ATOL


def _as_float64(name: str, probs: ProbsLike) -> tuple[torch.Tensor, float]:
    """Convert to a float64 tensor (same device for torch input); also return the sum tolerance."""
    if isinstance(probs, torch.Tensor):
        if not probs.is_floating_point():
            raise InvalidArgument(f"{name}: expected a floating-point tensor, got dtype {probs.dtype}")
        dtype = probs.dtype
        tensor = probs.detach().to(torch.float64)
    else:
        try:
            array = np.asarray(probs, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(
                f"{name}: expected a torch tensor, numpy array or nested list of floats, "
                f"got {type(probs).__name__} ({exc})"
            ) from None
        dtype = torch.float64
        tensor = torch.as_tensor(array)
    if tensor.dim() == 0:
        raise InvalidArgument(f"{name}: expected shape [..., vocab_size], got a scalar")
    if tensor.shape[-1] == 0:
        raise InvalidArgument(f"{name}: vocab_size must be >= 1, got shape {tuple(tensor.shape)}")
    return tensor, _sum_atol(dtype, tensor.shape[-1])


def _check_simplex(name: str, probs: torch.Tensor, atol: float) -> None:
    """Finite, non-negative rows that sum to 1 within ``atol``."""
    if probs.numel() == 0:
        return
    finite = torch.isfinite(probs)
    if not bool(finite.all()):
        bad = tuple((~finite).nonzero()[0].tolist())
        raise InvalidArgument(f"{name}: probabilities must be finite; found {probs[bad].item()} at index {bad}")
    negative = probs < 0
    if bool(negative.any()):
        bad = tuple(negative.nonzero()[0].tolist())
        raise InvalidArgument(
            f"{name}: probabilities must be non-negative; found {probs[bad].item()} at index {bad}"
        )
    sums = probs.sum(-1)
    off = (sums - 1).abs() > atol
    if bool(off.any()):
        bad = tuple(off.nonzero()[0].tolist())
        raise InvalidArgument(
            f"{name}: each distribution must sum to 1 within {atol:.1e}; the row at batch index {bad} "
            f"sums to {sums[bad].item():.6g}"
        )


def _validated_pair(
    draft_probs: ProbsLike, target_probs: ProbsLike, *, one_dim: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both distributions as float64 tensors of one shape, each row renormalised to sum 1."""
    target, target_atol = _as_float64("target_probs", target_probs)
    draft, draft_atol = _as_float64("draft_probs", draft_probs)
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
    _check_simplex("draft_probs", draft, draft_atol)
    _check_simplex("target_probs", target, target_atol)
    # Renormalise in float64 so that the bounds describe exact distributions.
    return draft / draft.sum(-1, keepdim=True), target / target.sum(-1, keepdim=True)


def _check_num_drafts(num_drafts: object) -> int:
    """num_drafts as a Python int >= 1."""
    if isinstance(num_drafts, bool):
        raise InvalidArgument(f"num_drafts: expected an integer >= 1, got {num_drafts!r}")
    try:
        value = operator.index(num_drafts)
    except TypeError:
        raise InvalidArgument(
            f"num_drafts: expected an integer >= 1, got {num_drafts!r} ({type(num_drafts).__name__})"
        ) from None
    if value < 1:
        raise InvalidArgument(f"num_drafts: expected an integer >= 1, got {value}")
    return value


def _num_drafts_tensor(
    num_drafts: Union[int, torch.Tensor], batch_shape: torch.Size, device: torch.device
) -> torch.Tensor:
    """num_drafts as a float64 tensor of shape batch_shape; shape checks only (no host sync)."""
    if isinstance(num_drafts, torch.Tensor):
        if num_drafts.dtype == torch.bool or num_drafts.is_complex():
            raise InvalidArgument(f"num_drafts: expected an integer or float tensor, got dtype {num_drafts.dtype}")
        # (numpy's broadcast rule: torch.broadcast_shapes imports sympy on first use, ~1 s)
        try:
            shape = torch.Size(np.broadcast_shapes(tuple(num_drafts.shape), tuple(batch_shape)))
        except ValueError:
            shape = None
        if shape != batch_shape:
            raise InvalidArgument(
                f"num_drafts: expected a tensor broadcastable to the batch shape {tuple(batch_shape)}, "
                f"got shape {tuple(num_drafts.shape)}"
            )
        return num_drafts.to(device=device, dtype=torch.float64).expand(batch_shape)
    value = _check_num_drafts(num_drafts)
    return torch.full(batch_shape, float(value), dtype=torch.float64, device=device)


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
    k = _check_num_drafts(num_drafts)
    return 1.0 - (1.0 - 1.0 / k) ** k


def optimal_acceptance(
    # [..., vocab_size]
    draft_probs: ProbsLike,
    # [..., vocab_size]
    target_probs: ProbsLike,
    num_drafts: int,
) -> AcceptanceBound:
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
    AcceptanceBound
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
    k = _check_num_drafts(num_drafts)
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
    return AcceptanceBound(
        value=min_value.clamp(0.0, 1.0),
        argmin_set_size=argmin_size.to(torch.int64),
        token_order=order,
        num_drafts=k,
    )


# ---------------------------------------------------------------------------------------------
# Transport LP (small cases; the closed form's oracle)
# ---------------------------------------------------------------------------------------------


def _iid_set_probs(draft: np.ndarray, num_drafts: int) -> dict[frozenset[int], float]:
    """P(set of distinct drafts = S) for K i.i.d. drafts, by enumerating multisets."""
    support = np.flatnonzero(draft > 0).tolist()
    k_factorial = math.factorial(num_drafts)
    set_probs: dict[frozenset[int], float] = {}
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


def _solve_set_lp(
    set_probs: dict[frozenset[int], float],
    target: np.ndarray,
    solver: Optional[str],
    max_variables: int,
) -> LPBound:
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
    inaccurate: Optional[LPBound] = None
    for name in candidates:
        try:
            problem.solve(solver=name)
        except cp.error.SolverError as exc:
            failures.append(f"{name}: {exc}")
            continue
        if problem.status in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE):
            result = LPBound(
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
    max_variables: int = 200_000,
) -> LPBound:
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
    LPBound
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
    target, atol = _as_float64("target_probs", target_probs)
    if target.dim() != 1:
        raise InvalidArgument(f"target_probs: expected shape [vocab_size], got {tuple(target.shape)}")
    _check_simplex("target_probs", target, atol)
    vocab_size = target.shape[0]
    if not isinstance(set_probs, Mapping):
        raise InvalidArgument(
            f"set_probs: expected a mapping of frozenset of token ids to probability, got {type(set_probs).__name__}"
        )
    if isinstance(max_variables, bool) or not isinstance(max_variables, int) or max_variables < 1:
        raise InvalidArgument(f"max_variables: expected an integer >= 1, got {max_variables!r}")
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
    if abs(total - 1.0) > PROB_ATOL:
        raise InvalidArgument(f"set_probs: masses must sum to 1 within {PROB_ATOL:.1e}, got {total:.6g}")
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
    max_variables: int = 200_000,
) -> LPBound:
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
    LPBound
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
    k = _check_num_drafts(num_drafts)
    if isinstance(max_variables, bool) or not isinstance(max_variables, int) or max_variables < 1:
        raise InvalidArgument(f"max_variables: expected an integer >= 1, got {max_variables!r}")
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


# ---------------------------------------------------------------------------------------------
# K-SEQ
# ---------------------------------------------------------------------------------------------


def kseq_accept_prob(
    # [...]
    beta: torch.Tensor,
    # [...] or int
    num_drafts: Union[int, torch.Tensor],
) -> torch.Tensor:
    """K-SEQ's ``P_A = 1 - (1 - beta)^K``, computed without cancellation.

    Parameters
    ----------
    beta : torch.Tensor, shape ``[...]``
        ``beta(rho) = sum_x min(p(x), q(x) / rho)``; values are clamped to ``[0, 1]``.
    num_drafts : int or torch.Tensor broadcastable to ``[...]``
        K.

    Returns
    -------
    torch.Tensor
        ``[...]`` float64.

    Notes
    -----
    Evaluated as ``-expm1(K log1p(-beta))``: exact to a few ulps even for tiny beta, where
    ``1 - (1 - beta)**K`` loses all relative precision.

    Examples
    --------
    >>> kseq_accept_prob(torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64), 2)
    tensor([0.0000, 0.7500, 1.0000], dtype=torch.float64)
    """
    beta = beta.to(torch.float64).clamp(0.0, 1.0)
    if isinstance(num_drafts, torch.Tensor):
        num_drafts = num_drafts.to(device=beta.device, dtype=torch.float64)
    return -torch.expm1(num_drafts * torch.log1p(-beta))


def _kseq_beta(draft: torch.Tensor, target: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """beta(rho) = sum_x min(p(x), q(x) / rho), per row."""
    return torch.minimum(draft, target / rho.unsqueeze(-1)).sum(-1)


def _kseq_gap(draft: torch.Tensor, target: torch.Tensor, rho: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """f(rho) = rho beta - (1 - (1 - beta)^K), evaluated without cancellation (see kseq_rho_star)."""
    scaled_target = target / rho.unsqueeze(-1)
    diff = draft - scaled_target
    beta = torch.minimum(draft, scaled_target, out=scaled_target).sum(-1)  # reuse the buffer
    positive = diff.clamp(min=0)
    draft_excess = positive.sum(-1)  # 1 - beta for a normalised draft row
    target_excess = positive.sub_(diff).sum(-1)  # (-diff)_+ summed: (1 - rho beta) / rho for a normalised target row
    near_one = draft_excess.pow(num_drafts) - rho * target_excess
    small = rho * beta + torch.expm1(num_drafts * torch.log1p(-beta.clamp(max=1.0)))
    return torch.where(beta < 0.5, small, near_one)


def kseq_rho_star(
    # [..., vocab_size]
    draft_probs: torch.Tensor,
    # [..., vocab_size]
    target_probs: torch.Tensor,
    # [...] or int
    num_drafts: Union[int, torch.Tensor],
) -> torch.Tensor:
    """rho*, K-SEQ's acceptance scale, by bisection on ``[1, K]``; batched, no host sync.

    Parameters
    ----------
    draft_probs : torch.Tensor, shape ``[..., vocab_size]``
        Draft distributions p (float; computed in float64 on their device).
    target_probs : torch.Tensor, shape ``[..., vocab_size]``
        Target distributions q.
    num_drafts : int or torch.Tensor broadcastable to ``[...]``
        K per row (int or float dtype; rows may differ).

    Returns
    -------
    torch.Tensor
        ``[...]`` float64: rho*, the smallest rho in ``[1, K]`` with ``f(rho) >= 0`` (to the
        float64 resolution), where ``f(rho) = rho beta(rho) - (1 - (1 - beta(rho))^K)`` and
        ``beta(rho) = sum_x min(p(x), q(x) / rho)``.

    Notes
    -----
    This is the hot path of the K-SEQ verifier, so only shapes and dtypes are checked: rows
    are assumed to be distributions and K >= 1 (use :func:`kseq_acceptance` for a validated
    entry point).  It runs a fixed 64 bisection steps, each O(V) per row, with no Python loop
    over rows or tokens and no device-to-host sync.

    ``f`` is non-decreasing on ``[1, K]`` with ``f(1) <= 0 <= f(K)``; every rho with
    ``f(rho) >= 0`` is valid (the residual ``q - (P_A / beta) min(p, q / rho)`` is
    non-negative) and a rho just below rho* is not.  The bisection therefore keeps the upper
    bracket, where ``f`` evaluated in floating point is non-negative, and returns it.

    ``f`` is a difference of nearly equal numbers, so it is evaluated in the form that keeps
    its relative accuracy.  For ``beta < 1/2``: ``rho beta + expm1(K log1p(-beta))``.  For
    ``beta >= 1/2``, with normalised rows, ``1 - beta = sum_x (p(x) - q(x)/rho)_+`` and
    ``rho beta - 1 = -rho sum_x (q(x)/rho - p(x))_+``, so
    ``f = (sum_x (p - q/rho)_+)^K - rho sum_x (q/rho - p)_+``: sums of non-negative terms, a
    difference of two monotone terms (hence non-decreasing in floating point too), and exactly
    ``(1 - 1/rho)^K >= 0`` when p = q, so rho* = 1 there rather than wherever rounding noise
    of size 1e-16 first looks non-negative (with K = 8 that can be 1.01).

    Edge cases: K = 1 gives rho* = 1; disjoint supports (``beta = 0``, so ``f = 0``) give
    rho* = 1 and ``P_A = 0``; p = q gives rho* = 1 and ``P_A = 1``.

    Examples
    --------
    >>> draft = torch.tensor([0.6, 0.4], dtype=torch.float64)
    >>> target = torch.tensor([0.3, 0.7], dtype=torch.float64)
    >>> rho = kseq_rho_star(draft, target, 2)
    >>> bool(abs(rho - (0.8 + 0.34 ** 0.5)) < 1e-12)
    True
    """
    if not isinstance(draft_probs, torch.Tensor) or not isinstance(target_probs, torch.Tensor):
        raise InvalidArgument(
            f"draft_probs, target_probs: expected torch tensors, got "
            f"{type(draft_probs).__name__} and {type(target_probs).__name__}"
        )
    if not draft_probs.is_floating_point() or not target_probs.is_floating_point():
        raise InvalidArgument(
            f"draft_probs, target_probs: expected floating-point tensors, got {draft_probs.dtype} and "
            f"{target_probs.dtype}"
        )
    if target_probs.dim() == 0:
        raise InvalidArgument("target_probs: expected shape [..., vocab_size], got a scalar")
    if draft_probs.shape != target_probs.shape:
        raise InvalidArgument(
            f"draft_probs: expected shape [..., vocab_size] matching target_probs {tuple(target_probs.shape)}, "
            f"got {tuple(draft_probs.shape)}"
        )
    if draft_probs.device != target_probs.device:
        raise InvalidArgument(
            f"draft_probs: expected the device of target_probs ({target_probs.device}), got {draft_probs.device}"
        )
    draft = draft_probs.to(torch.float64)
    target = target_probs.to(torch.float64)
    batch_shape = draft.shape[:-1]
    k = _num_drafts_tensor(num_drafts, batch_shape, draft.device)
    return _rho_star_sorted(draft, target, k)


def kseq_rho_star_bisection(
    # [..., vocab_size]
    draft_probs: torch.Tensor,
    # [..., vocab_size]
    target_probs: torch.Tensor,
    # [...] or int
    num_drafts: Union[int, torch.Tensor],
) -> torch.Tensor:
    """rho* by 64 bisection steps over the whole vocabulary: the slow reference for :func:`kseq_rho_star`."""
    draft = draft_probs.to(torch.float64)
    target = target_probs.to(torch.float64)
    batch_shape = draft.shape[:-1]
    k = _num_drafts_tensor(num_drafts, batch_shape, draft.device)
    low = torch.ones(batch_shape, dtype=torch.float64, device=draft.device)
    high = k.clone()
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (low + high)
        valid = _kseq_gap(draft, target, mid, k) >= 0
        high = torch.where(valid, mid, high)
        low = torch.where(valid, low, mid)
    return high


def _segment_gap(rho, draft_high, target_high, draft_low, target_low, k):
    """f(rho) on a segment where the tokens with q/p <= rho are fixed ("low") and the rest are "high".

    With normalised rows, ``rho beta - 1 = rho P_high - Q_high`` and
    ``1 - beta = P_low - Q_low / rho`` (a sum of non-negative terms ``p - q/rho``), so
    ``f = rho P_high - Q_high + (P_low - Q_low / rho)^K``: exactly ``(1 - 1/rho)^K`` when p = q.
    For ``beta < 1/2`` the direct form ``rho beta + expm1(K log1p(-beta))`` is the accurate one
    (exactly 0 for disjoint supports), as in :func:`_kseq_gap`.
    """
    return _segment_gap_and_slope(rho, draft_high, target_high, draft_low, target_low, k)[0]


def _segment_gap_and_slope(rho, draft_high, target_high, draft_low, target_low, k):
    """``(f, df/drho)`` of :func:`_segment_gap`; ``df/drho = P_high + K (1 - beta)^(K-1) Q_low / rho^2``."""
    beta = target_low / rho + draft_high
    one_minus_beta = (draft_low - target_low / rho).clamp(min=0)
    power_below = one_minus_beta ** (k - 1)  # (1 - beta)^(K-1); times (1 - beta) gives the K-th power
    near_one = rho * draft_high - target_high + power_below * one_minus_beta
    small = rho * beta + torch.expm1(k * torch.log1p(-beta.clamp(max=1.0)))
    slope = draft_high + k * power_below * target_low / (rho * rho)
    return torch.where(beta < 0.5, small, near_one), slope


def _solve_segment(draft_high, target_high, draft_low, target_low, k, low, high, *, steps, until_converged=False):
    """The smallest rho in ``[low, high]`` with segment gap >= 0, by safeguarded Newton.

    Requires gap(low) < 0 <= gap(high) on a segment where the formula is exact.  Newton steps
    that leave the bracket, or do not at least halve the previous step (slow, multiple-root-like
    convergence, e.g. p close to q), are replaced by bisection (``rtsafe``).  Returns the valid
    upper bracket.  With ``until_converged`` (CPU-side exact laws) rows stop once the bracket or
    the step is at the float64 resolution, checked with a host sync per step, for at most
    ``steps`` steps; otherwise exactly ``steps`` steps run (no host sync, for hot paths).  Each
    row's result depends only on that row.
    """
    x = high.clone()
    step_before = high - low
    done = torch.zeros_like(high, dtype=torch.bool)
    for _ in range(steps):
        gap, slope = _segment_gap_and_slope(x, draft_high, target_high, draft_low, target_low, k)
        valid = gap >= 0
        high = torch.where(valid & ~done, torch.minimum(high, x), high)
        low = torch.where(valid | done, low, torch.maximum(low, x))
        newton = x - gap / slope
        step = newton - x
        use_newton = (newton > low) & (newton < high) & (step.abs() <= 0.5 * step_before.abs())
        moved = torch.where(use_newton, newton, 0.5 * (low + high))
        tiny = 4 * torch.finfo(torch.float64).eps * high
        done = done | (high - low <= tiny) | ((moved - x).abs() <= tiny) | (gap == 0)
        step_before = torch.where(done, step_before, moved - x)
        x = torch.where(done, x, moved)
        if until_converged and bool(done.all()):
            break
    # Newton may converge from the invalid side (f concave there): probe a few ulps upwards.
    ulps = torch.tensor([0, 1, 2, 4, 8, 16, 64, 256], dtype=torch.float64, device=x.device)
    probes = x.unsqueeze(-1) * (1 + ulps * torch.finfo(torch.float64).eps)  # [..., 8], all at once
    columns = (t.unsqueeze(-1) for t in (draft_high, target_high, draft_low, target_low, k))
    gap = _segment_gap(probes, *columns)
    first_valid = torch.where(gap >= 0, probes, torch.full_like(probes, float("inf"))).amin(-1)
    return torch.minimum(high, first_valid)


def _rho_star_sorted(draft: torch.Tensor, target: torch.Tensor, k: torch.Tensor, *, hot: bool = False) -> torch.Tensor:
    """Exact piecewise solve: sort tokens by q/p, locate rho*'s segment, solve a scalar equation there.

    beta(rho) changes formula only at the ratios q(x)/p(x); between two consecutive ratios f
    is a smooth function of rho with a handful of per-row constants (prefix and suffix sums
    in ratio order).  f is evaluated at every ratio inside [1, K] at once, the last ratio
    with f < 0 and the first with f >= 0 bracket rho*, and a safeguarded Newton iteration
    inside that segment (no pass over the vocabulary) returns the valid upper bracket.
    ``hot``: at most :data:`_HOT_NEWTON_STEPS` Newton steps, and no host sync on accelerators
    (sampler hot path; on the CPU rows still stop once converged).
    """
    # The segment formula assumes rows that sum to 1; inputs may be off by the validation tolerance.
    draft = draft / draft.sum(-1, keepdim=True)
    target = target / target.sum(-1, keepdim=True)
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=draft.device)
    ratio = torch.where(draft > 0, target / torch.where(draft > 0, draft, torch.ones_like(draft)), inf)
    ratio, order = ratio.sort(dim=-1)
    draft_sorted = draft.gather(-1, order)
    target_sorted = target.gather(-1, order)
    # low[j] = sum over the first j + 1 tokens; high[j] = sum over the rest (exactly 0 when empty)
    draft_low = draft_sorted.cumsum(-1)
    target_low = target_sorted.cumsum(-1)
    draft_high = draft_sorted.flip(-1).cumsum(-1).flip(-1)
    target_high = target_sorted.flip(-1).cumsum(-1).flip(-1)
    zero = torch.zeros_like(draft_high[..., :1])
    draft_high = torch.cat([draft_high[..., 1:], zero], dim=-1)
    target_high = torch.cat([target_high[..., 1:], zero], dim=-1)
    kk = k.unsqueeze(-1)
    inside = (ratio >= 1) & (ratio <= kk)
    rho_at = torch.where(inside, ratio, torch.ones_like(ratio))
    gap_at = _segment_gap(rho_at, draft_high, target_high, draft_low, target_low, kk)
    ones = torch.ones_like(k)
    low_end = torch.where(inside & (gap_at < 0), ratio, -inf).amax(-1).clamp(min=1.0)
    high_end = torch.minimum(torch.where(inside & (gap_at >= 0), ratio, inf).amin(-1), k)
    # The segment (low_end, high_end): tokens with ratio <= low_end are "low".
    count = torch.searchsorted(ratio, low_end.unsqueeze(-1).contiguous(), right=True)  # [..., 1]

    def at(prefix_sums: torch.Tensor, empty_value: float) -> torch.Tensor:
        idx = (count - 1).clamp(min=0)
        value = prefix_sums.gather(-1, idx).squeeze(-1)
        return torch.where(count.squeeze(-1) > 0, value, torch.full_like(value, empty_value))

    d_low, t_low = at(draft_low, 0.0), at(target_low, 0.0)
    # high sums over tokens after the first `count`: total minus nothing when count = 0
    d_high = torch.where(count.squeeze(-1) > 0, at(draft_high, 0.0), draft_sorted.sum(-1))
    t_high = torch.where(count.squeeze(-1) > 0, at(target_high, 0.0), target_sorted.sum(-1))
    high = _solve_segment(
        d_high, t_high, d_low, t_low, k, low_end, high_end,
        steps=_HOT_NEWTON_STEPS if hot else 4 * _BISECTION_STEPS,
        # On the CPU a convergence check costs no device round trip, so the hot path stops early there too.
        until_converged=not hot or draft.device.type == "cpu",
    )
    at_one = _segment_gap(ones, d_high, t_high, d_low, t_low, k) >= 0
    return torch.where((low_end <= 1) & at_one, ones, high)


#: Safeguarded Newton steps inside rho*'s segment on the hot path (quadratic convergence from a bracket).
_HOT_NEWTON_STEPS = 24

#: Vocabulary size above which the sampler finds rho* without sorting (:func:`kseq_rho_star_sampler`).
_SORT_FREE_MIN_VOCAB = 256

#: Passes over the vocabulary of the sort-free rho* solve.
_SORT_FREE_PASSES = 6


def _grid_root(is_valid, below: torch.Tensor, above: torch.Tensor, *, rounds: int = 6, points: int = 16) -> torch.Tensor:
    """Smallest valid point of a monotone predicate on ``[below, above]``, to ``(above - below) / points**rounds``.

    Each round evaluates ``is_valid`` (``[..., points] -> [..., points]`` bool) at ``points`` evenly
    spaced points at once and keeps the cell where it turns true: a grid search instead of
    ``rounds * log2(points)`` sequential bisection steps (each a dozen tiny kernel launches).
    ``above`` is assumed valid; the result is always a point found valid (or ``above``).
    """
    steps = torch.arange(1, points + 1, dtype=below.dtype, device=below.device) / points
    for _ in range(rounds):
        grid = below.unsqueeze(-1) + (above - below).unsqueeze(-1) * steps  # [..., points]; the last is `above`
        valid = is_valid(grid)
        valid[..., -1] = True
        first = valid.to(torch.int8).argmax(-1, keepdim=True)  # first valid grid point
        new_above = grid.gather(-1, first).squeeze(-1)
        new_below = torch.where(first.squeeze(-1) > 0, grid.gather(-1, (first - 1).clamp(min=0)).squeeze(-1), below)
        below, above = new_below, torch.minimum(new_above, above)
    return above


def _complement(low_mass: torch.Tensor, margin: float) -> torch.Tensor:
    """``1 - low_mass``, with values within ``margin`` of 0 (the rounding of ``1 - sum``) set to exactly 0.

    Exact zeros matter: disjoint supports give beta = 0 and f(1) = 0 only if the high draft mass is 0.
    """
    high = 1 - low_mass
    return torch.where(high > margin, high, torch.zeros_like(high))


def kseq_rho_star_sampler(
    # [n, vocab_size] float32 or float64
    draft_probs: torch.Tensor,
    # [n, vocab_size]
    target_probs: torch.Tensor,
    # [n] float64
    num_drafts: torch.Tensor,
    *,
    passes: int = _SORT_FREE_PASSES,
) -> torch.Tensor:  # [n] float64
    """A valid rho for K-SEQ's sampler, equal to rho* to the inputs' precision; no sort, no host sync on accelerators.

    The exact law uses :func:`kseq_rho_star`; a sampler only needs a rho with ``f(rho) >= 0``
    (then the residual is non-negative and the output law is exactly q) that is as small as the
    inputs' precision allows (acceptance).  Small vocabularies take the sorted solve with a fixed
    number of Newton steps.  Larger ones avoid the O(V log V) sort: each pass classifies tokens at
    two candidates c (``q/p <= c``) and sums p, q and the count over the low tokens with one batched
    matrix product, which gives f(c) exactly and f on the whole segment around c.  The next two
    candidates are the roots of the segment functions through the bracket's lower and upper ends
    (a Newton-like step that knows f's curvature; where the upper end's root is no better, the
    lower end's root overshot by four of its steps), each rounded up to the next value of the
    inputs' dtype so that it lands on the valid side of a root inside the segment (the roots come
    from a grid search inside the bracket to 1/16^6 of its width: no pass over the vocabulary).
    The answer is the smallest candidate found valid, refined by an exact segment solve when no
    ratio lies between it and the largest invalid candidate.  f(c) counts as valid only above a
    margin of 16 ulps of the inputs' dtype, which covers the rounding of float32 sums; with float32
    rows that leaves residual mass of order 1e-6 on tokens whose exact residual at rho* is 0 (the
    output law is still exactly q: any valid rho gives it).

    Parameters
    ----------
    draft_probs, target_probs : torch.Tensor, shape ``[n, vocab_size]``
        Distributions (within the input tolerance of summing to 1), float32 or float64.
    num_drafts : torch.Tensor, shape ``[n]``
        K >= 1 per row, float64.
    passes : int
        Passes over the vocabulary (sort-free path).
    """
    n, vocab_size = draft_probs.shape
    k = num_drafts.to(torch.float64)
    if vocab_size <= _SORT_FREE_MIN_VOCAB:
        return _rho_star_sorted(draft_probs.double(), target_probs.double(), k, hot=True)
    dtype, device = draft_probs.dtype, draft_probs.device
    margin = 16 * torch.finfo(dtype).eps
    fused = compiled_enabled()
    if fused:  # one fused kernel per pass (spectr_audit.compiled), nothing materialised
        totals = torch.stack([draft_probs.sum(-1), target_probs.sum(-1)], dim=-1).double().unsqueeze(-1)
    else:
        ratio = (target_probs / draft_probs).unsqueeze(1)  # [n, 1, V]; inf (p = 0 < q), nan (0/0): never "low"
        # [n, 3, V]: p, q and ones, so one bmm against the low masks gives P_low, Q_low and the low count
        stacked = torch.stack([draft_probs, target_probs, torch.ones_like(draft_probs)], dim=1)
        totals = stacked[:, :2].sum(-1).double().unsqueeze(-1)  # [n, 2, 1]
    ones = torch.ones(n, dtype=torch.float64, device=device)
    low, high = ones.clone(), k.clone()
    low_sums = torch.zeros(n, 3, dtype=torch.float64, device=device)
    high_sums = torch.full((n, 3), -1.0, dtype=torch.float64, device=device)  # count -1: not evaluated
    up = torch.tensor(float("inf"), dtype=dtype, device=device)
    kk = k.unsqueeze(-1)
    candidates = torch.stack([ones, k], dim=-1)  # [n, 2]: two candidates per pass, one from each side
    # [n, 2, V], reused by every pass: a comparison written straight into a float buffer is one cheap
    # pass, where a bool mask and its conversion cost an allocation and two more
    low_mask = None if fused else torch.empty(n, 2, vocab_size, dtype=dtype, device=device)
    for _ in range(passes):
        threshold = candidates.to(dtype)
        candidates = threshold.double()
        if fused:
            sums = kseq_low_sums(draft_probs, target_probs, threshold).double()  # [n, 3, 2]
        else:
            torch.le(ratio, threshold.unsqueeze(-1), out=low_mask)
            sums = torch.bmm(stacked, low_mask.transpose(1, 2)).double()  # [n, 3, 2]
        sums = torch.cat([sums[:, :2] / totals, sums[:, 2:]], dim=1)  # normalised P_low, Q_low; count
        d_low, t_low = sums[:, 0], sums[:, 1]  # [n, 2]
        d_high, t_high = _complement(d_low, margin), _complement(t_low, margin)
        gap = _segment_gap(candidates, d_high, t_high, d_low, t_low, kk)
        for side in range(2):
            c, s = candidates[:, side], sums[:, :, side]
            # rho = 1 is judged without the margin: f(1) = (1 - beta)^K - (1 - beta) is exactly 0 for p = q,
            # disjoint supports or K = 1, and negative otherwise by far more than the rounding
            valid = gap[:, side] >= torch.where(c == 1, 0.0, margin)
            new_high = valid & (c <= high)
            new_low = ~valid & (c >= low)
            high = torch.where(new_high, c, high)
            high_sums = torch.where(new_high.unsqueeze(-1), s, high_sums)
            low = torch.where(new_low, c, low)
            low_sums = torch.where(new_low.unsqueeze(-1), s, low_sums)
        # Next candidates: the roots of the segment functions through the bracket's two ends, found by a
        # grid search inside the bracket (robust where Newton crawls, e.g. p close to q; no pass over the
        # vocabulary), on the side where they are >= margin, rounded up to the next value of the dtype.
        ends = torch.stack([low_sums, high_sums.clamp(min=0)], dim=-1)  # [n, 3, 2]
        e_low_d, e_low_t = ends[:, 0], ends[:, 1]
        e_high_d, e_high_t = _complement(e_low_d, margin), _complement(e_low_t, margin)
        above = _grid_root(
            lambda x: _segment_gap(x, *(t.unsqueeze(-1) for t in (e_high_d, e_high_t, e_low_d, e_low_t, kk))) >= margin,
            low.unsqueeze(-1).expand(n, 2), high.unsqueeze(-1).expand(n, 2),
        )
        roots = torch.nextafter(above.to(dtype), up).double()
        # Where the upper end's root does not lie above the lower end's (the lower end's model creeps up
        # on rho*, e.g. p close to q), overshoot the lower end's root by 4 of its steps instead.
        from_low, from_high = roots[:, 0], roots[:, 1]
        overshoot = from_low + 4 * (from_low - low)
        roots = torch.stack([from_low, torch.where(from_high > from_low, from_high, overshoot)], dim=-1)
        inside = (roots > low.unsqueeze(-1)) & (roots < high.unsqueeze(-1)) & torch.isfinite(roots)
        middle = (0.5 * (low + high)).unsqueeze(-1)
        candidates = torch.where(inside, roots, middle)
    same_segment = low_sums[:, 2] == high_sums[:, 2]
    d_low, t_low = low_sums[:, 0], low_sums[:, 1]
    d_high, t_high = _complement(d_low, margin), _complement(t_low, margin)
    refined = _solve_segment(d_high, t_high, d_low, t_low, k, low, high, steps=_HOT_NEWTON_STEPS)
    # the same margin as the candidates: move up until f is at least `margin` (one Newton step on the segment)
    gap, slope = _segment_gap_and_slope(refined, d_high, t_high, d_low, t_low, k)
    refined = refined + (margin - gap).clamp(min=0) / slope
    return torch.where(same_segment, torch.minimum(refined, high), high)


def kseq_acceptance(
    # [..., vocab_size]
    draft_probs: ProbsLike,
    # [..., vocab_size]
    target_probs: ProbsLike,
    # [...] or int
    num_drafts: Union[int, torch.Tensor],
) -> KSeqAcceptance:
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
    KSeqAcceptance
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
        k = _num_drafts_tensor(num_drafts, batch_shape, draft.device)
        bad = (k < 1) | (k != k.floor())
        if bool(bad.any()):
            index = tuple(bad.nonzero()[0].tolist())
            raise InvalidArgument(
                f"num_drafts: expected integral values >= 1, found {k[index].item()} at batch index {index}"
            )
    else:
        k = _check_num_drafts(num_drafts)
    rho = kseq_rho_star(draft, target, k)
    beta = _kseq_beta(draft, target, rho)
    return KSeqAcceptance(value=kseq_accept_prob(beta, k), rho_star=rho, beta=beta)
