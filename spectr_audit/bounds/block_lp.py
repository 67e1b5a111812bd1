"""The sequence-level optimum on small cases: the block LPs (docs/audit/bounds.md).

For every draft tuple (K drafts of L tokens) a verifier chooses a law
``pi(s | tuple)`` over the strings it may emit: a prefix (length 0..L) of one of
the drafts followed by one token.  Block efficiency is ``E[len(s)]``.

* The unmodified-continuation LP maximises ``E[len(s)]`` among verifiers that are
  exact when decoding continues with the plain target: for every ``w`` of
  ``L + 1`` tokens, ``sum_tuple P(tuple) sum_{s prefix of w} pi(s|tuple) q(w)/q(s)
  = q(w)``.  At K = 1 its optimum is block verification's efficiency (Sun et al.,
  Theorem 2).
* The repair-allowed LP keeps only the prefix cap ``B(u) <= q(u)`` for every
  prefix ``u`` of up to ``L + 1`` tokens, with ``B(u) = sum_tuple P(tuple)
  sum_{s starts with u} pi(s|tuple)``: what a verifier with a next-iteration repair
  may reach.  At K = 1 its optimum is ``sum_{t=0}^{L} sum_{x^t} min(p(x^t), q(x^t))``,
  greedy block verification's efficiency.

Strings with ``q(s) = 0`` are left out (an exact verifier never emits them).  The
LPs are solved with cvxpy (CLARABEL by default); the solver status is reported, and
values are NaN unless the status is optimal.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch

from spectr_audit.errors import InvalidArgument
from spectr_audit.contract.tree import DraftTree
from spectr_audit.exact.law import target_laws
from spectr_audit.exact.tree import TreeDraftEnumeration, enumerate_tree_drafts, level_codes
from spectr_audit import defaults
from spectr_audit.drafting.models import Model

__all__ = ["BlockLPResult", "CLARABEL_FALLBACK_OPTIONS", "CLARABEL_OPTIONS", "block_lp"]

#: Statuses under which a value is reported.
_SOLVED = ("optimal",)

#: CLARABEL's defaults stop near 1e-8; the audit compares optima with exact efficiencies
#: (``defaults.LP_SOLVER_TOL``).
CLARABEL_OPTIONS = {"tol_gap_abs": defaults.LP_SOLVER_TOL, "tol_gap_rel": defaults.LP_SOLVER_TOL,
                    "tol_feas": defaults.LP_SOLVER_TOL, "tol_ktratio": 1e-9}
#: Tried next when a badly scaled case does not reach an optimal status under CLARABEL_OPTIONS.
CLARABEL_FALLBACK_OPTIONS = {"tol_gap_abs": defaults.LP_SOLVER_FALLBACK_TOL,
                             "tol_gap_rel": defaults.LP_SOLVER_FALLBACK_TOL,
                             "tol_feas": defaults.LP_SOLVER_FALLBACK_TOL}


@dataclasses.dataclass(frozen=True)
class BlockLPResult:
    """Optima of the two block LPs for one (draft model, target model, K, L, prefix).

    Values are expected emitted lengths, i.e. block efficiencies (``E[tau] + 1``).
    """

    num_drafts: int
    draft_len: int
    vocab_size: int
    num_draft_tuples: int
    #: variables shared by both LPs: pi(s | tuple) per (tuple, allowed string), then E(s)/q(s) per string
    num_variables: int
    solver: str
    #: optimum among verifiers exact with unmodified continuation (NaN unless solved)
    unmodified_value: float
    unmodified_status: str
    #: exactness equalities (one per w with q(w) > 0), string links, tuple normalisations but one (implied)
    unmodified_num_constraints: int
    #: optimum when a next-iteration repair is allowed (prefix caps only)
    repair_value: float
    repair_status: str
    repair_num_constraints: int

    @property
    def solved(self) -> bool:
        """Both LPs reached an optimal status."""
        return self.unmodified_status in _SOLVED and self.repair_status in _SOLVED


def _distinct_candidates(levels):
    """Allowed outputs, deduplicated, from ``(codes [T, n, V], q(s) [T, n, V])`` per string length 1, 2, ...
    (T draft tuples or realisations, n strings of that length offered by each): (tuple, length, code, q(s))
    as numpy arrays, strings with q(s) = 0 left out."""
    keys, joints = [], []
    for length, (codes, joint) in enumerate(levels, start=1):
        tuples = torch.arange(codes.shape[0]).view(-1, 1, 1).expand_as(codes)
        lengths = torch.full_like(codes, length)
        keys.append(torch.stack([tuples.reshape(-1), lengths.reshape(-1), codes.reshape(-1)], 1))
        joints.append(joint.reshape(-1))
    keys = torch.cat(keys).numpy()
    joints = torch.cat(joints).numpy()
    # Drafts sharing a prefix (tree nodes sharing a token path) offer the same string once.
    keys, first = np.unique(keys, axis=0, return_index=True)
    joints = joints[first]
    keep = joints > 0
    return keys[keep, 0], keys[keep, 1], keys[keep, 2], joints[keep]


def _path_joints(enumeration: TreeDraftEnumeration) -> torch.Tensor:  # [R, N + 1]
    """q(path(n)) for every realisation and node."""
    tree = enumeration.tree
    paths = enumeration.node_paths
    joint = torch.ones(enumeration.num_realisations, tree.num_nodes, dtype=torch.float64)
    for node in range(1, tree.num_nodes):
        parent = tree.parents[node]
        step = enumeration.path_target_probs[paths[:, parent]].gather(1, enumeration.node_tokens[:, node : node + 1])
        joint[:, node] = joint[:, parent] * step.squeeze(1)
    return joint


def realisation_candidates(enumeration: TreeDraftEnumeration):
    """Allowed outputs of every realisation of a tree's drafts (a tree path then one token), deduplicated:
    (realisation, length, code, q(s)) as numpy arrays.  On ``DraftTree.chains(K, L)`` these are the chain tuples'
    outputs (a prefix of one draft then one token), with the same floats."""
    joint = _path_joints(enumeration)
    target = enumeration.path_target_probs[enumeration.node_paths]  # [R, N + 1, V]
    by_depth = level_codes(enumeration.tree, enumeration.path_codes, enumeration.vocab_size)
    # q(s) of s = a node's path then a token
    return _distinct_candidates((codes, joint[:, nodes].unsqueeze(-1) * target[:, nodes]) for nodes, codes in by_depth)


def _solve(problem, solver: str, attempts: Sequence[dict]) -> tuple[float, str]:
    """Solve with each option set in turn until the status is optimal; the last status is reported."""
    import cvxpy as cp

    status = "not_solved"
    for options in attempts:
        # A fresh problem per attempt: re-solving one object reuses the previous attempt's solver settings.
        problem = cp.Problem(problem.objective, problem.constraints)
        try:
            with warnings.catch_warnings():
                # An inaccurate solution is reported through the status, not a warning.
                warnings.simplefilter("ignore", UserWarning)
                problem.solve(solver=solver, **options)
        except cp.error.SolverError as exc:
            status = f"solver_error: {exc}"
            continue
        status = str(problem.status)
        if status in _SOLVED:
            return float(problem.value), status
    return math.nan, status


def _distinct_strings(length: np.ndarray, code: np.ndarray, string_target: np.ndarray):
    """The distinct candidate strings: their lengths and codes, the string of each variable, and q(s)."""
    strings, string_of_var = np.unique(np.stack([length, code], 1), axis=0, return_inverse=True)
    string_of_var = string_of_var.reshape(-1)
    string_q = np.zeros(strings.shape[0])
    string_q[string_of_var] = string_target
    return strings[:, 0], strings[:, 1], string_of_var, string_q


def _exactness_rows(string_length: np.ndarray, string_code: np.ndarray, target_full: np.ndarray,
                    vocab_size: int, full: int) -> sp.csr_matrix:
    """Unmodified continuation: one row per w of ``full`` tokens with q(w) > 0, summing ratio(s) over s prefix of w.

    ``sum_{s prefix of w} E(s)/q(s) = 1`` is the LP's ``sum_tuple P(tuple) sum_s pi(s|tuple) q(w)/q(s) = q(w)``
    divided by q(w) (docs/audit/bounds.md).
    """
    rows, cols = [], []
    for m in range(1, full + 1):
        sel = np.nonzero(string_length == m)[0]
        tail = vocab_size ** (full - m)
        rows.append((string_code[sel, None] * tail + np.arange(tail)).reshape(-1))  # every w extending s
        cols.append(np.repeat(sel, tail))
    rows, cols = np.concatenate(rows), np.concatenate(cols)
    possible = target_full > 0
    keep = possible[rows]
    row_index = np.cumsum(possible) - 1
    return sp.csr_matrix(
        (np.ones(int(keep.sum())), (row_index[rows[keep]], cols[keep])), shape=(int(possible.sum()), len(string_code))
    )


def _cap_rows(string_length: np.ndarray, string_code: np.ndarray, string_q: np.ndarray, caps: np.ndarray,
              vocab_size: int, full: int) -> sp.csr_matrix:
    """Prefix caps: one row per u of 1 .. ``full`` tokens, ``sum_{s extends u} q(s)/q(u) ratio(s)`` (caps: q(u))."""
    offsets = np.cumsum([0] + [vocab_size**m for m in range(1, full + 1)])
    rows, cols = [], []
    for m in range(1, full + 1):
        sel = np.nonzero(string_length >= m)[0]
        rows.append(offsets[m - 1] + string_code[sel] // vocab_size ** (string_length[sel] - m))
        cols.append(sel)
    rows, cols = np.concatenate(rows), np.concatenate(cols)
    # Strings with q(s) > 0 only extend prefixes with q(u) > 0.
    return sp.csr_matrix((string_q[cols] / caps[rows], (rows, cols)), shape=(offsets[-1], len(string_code)))


def _solver_attempts(solver: str, solver_options: Optional[dict] = None) -> list[dict]:
    """The option sets to try in turn (see :func:`block_lp`); refuses a solver cvxpy does not have."""
    import cvxpy as cp

    if solver not in cp.installed_solvers():
        raise InvalidArgument(f"solver: {solver!r} is not installed; installed: {cp.installed_solvers()}")
    if solver_options is not None:
        return [solver_options]
    return [CLARABEL_OPTIONS, CLARABEL_FALLBACK_OPTIONS, {}] if solver == "CLARABEL" else [{}]


def _string_lps(tuple_of: np.ndarray, length: np.ndarray, code: np.ndarray, string_target: np.ndarray,
                tuple_weight: np.ndarray, target_model: Model, prefix: Sequence[int], full: int, vocab_size: int,
                solver: str, attempts: Sequence[dict]) -> dict:
    """Maximise ``E[len(s)]`` over ``pi(s | tuple)`` for the candidates ``(tuple_of, length, code, q(s))`` of
    tuples of probability ``tuple_weight``, with strings of up to ``full`` tokens: the unmodified-continuation
    LP and the repair-allowed one (docs/audit/bounds.md).  Returns the fields of :class:`BlockLPResult` that
    describe the LPs (the block and tree LPs share them)."""
    import cvxpy as cp

    num_tuples = tuple_weight.shape[0]
    num_vars = tuple_of.shape[0]
    # Variables scaled for the solver: mass[v] = P(tuple) pi(s|tuple) per candidate and ratio[s] = E(s)/q(s)
    # per distinct string, linked by sum_tuple mass = q(s) ratio(s); the constraints on ratio then have
    # coefficients in [0, 1] instead of q(w)/q(s), which spans many orders of magnitude.
    string_length, string_code, string_of_var, string_q = _distinct_strings(length, code, string_target)
    num_strings = string_q.shape[0]
    mass = cp.Variable(num_vars, nonneg=True)
    ratio = cp.Variable(num_strings, nonneg=True)
    normalise = sp.csr_matrix((np.ones(num_vars), (tuple_of, np.arange(num_vars))), shape=(num_tuples, num_vars))
    gather = sp.csr_matrix((np.ones(num_vars), (string_of_var, np.arange(num_vars))), shape=(num_strings, num_vars))
    link = gather @ mass == cp.multiply(string_q, ratio)
    objective = cp.Maximize(length @ mass)
    prefix_laws = [law.numpy() for law in target_laws(target_model, prefix, full)[1]]  # q(u), u of 1 .. full tokens

    # Unmodified continuation: for every w of `full` tokens with q(w) > 0, sum_{s prefix of w} E(s)/q(s) = 1.
    exactness = _exactness_rows(string_length, string_code, prefix_laws[-1], vocab_size, full)
    # The exactness rows, weighted by q(w), sum to total mass 1, as do the normalisations: drop the last
    # normalisation so that the equality system has full rank (interior-point solvers stall otherwise).
    unmodified = cp.Problem(
        objective, [normalise[:-1] @ mass == tuple_weight[:-1], link, exactness @ ratio == 1]
    )
    unmodified_value, unmodified_status = _solve(unmodified, solver, attempts)

    # Repair allowed: B(u) <= q(u) for every u of 1 .. full tokens, as sum_{s extends u} q(s)/q(u) ratio(s) <= 1.
    cap = _cap_rows(string_length, string_code, string_q, np.concatenate(prefix_laws), vocab_size, full)
    repair = cp.Problem(objective, [normalise @ mass == tuple_weight, link, cap @ ratio <= 1])
    repair_value, repair_status = _solve(repair, solver, attempts)
    return dict(
        num_variables=num_vars + num_strings,
        unmodified_value=unmodified_value,
        unmodified_status=unmodified_status,
        unmodified_num_constraints=int(exactness.shape[0]) + num_strings + num_tuples - 1,
        repair_value=repair_value,
        repair_status=repair_status,
        repair_num_constraints=int(cap.shape[0]) + num_strings + num_tuples,
    )


def block_lp(
    draft_model: Model,
    target_model: Model,
    num_drafts: int,
    draft_len: int,
    *,
    prefix: Sequence[int] = (),
    solver: str = "CLARABEL",
    solver_options: Optional[dict] = None,
) -> BlockLPResult:
    """Solve both block LPs for i.i.d. drafts after ``prefix``.

    Parameters
    ----------
    draft_model, target_model : Model
    num_drafts, draft_len : int
        K and L.
    prefix : sequence of int
        The context before the iteration.
    solver : str
        A cvxpy LP solver name.
    solver_options : dict, optional
        Passed to ``Problem.solve``.  By default CLARABEL runs with tightened tolerances
        (``CLARABEL_OPTIONS``: optima agree with exact efficiencies to about 1e-10) and, if
        that does not end optimal (badly scaled cases), with ``CLARABEL_FALLBACK_OPTIONS``,
        then with its own defaults (about 1e-6 in the worst cases seen); the status of the
        last attempt is reported.

    Returns
    -------
    BlockLPResult

    Notes
    -----
    Variables: one ``pi(s | tuple)`` per draft tuple and allowed string (about
    ``(V^L)^K K (L + 1) V``) and one ``E(s) / q(s)`` per distinct string; constraints: up to
    ``V^(L+1)`` exactness equalities (or ``sum_m V^m`` caps), one link per string, one
    normalisation per draft tuple.  Small cases only.

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> result = block_lp(ContextFreeModel([2/3, 1/3]), ContextFreeModel([1/3, 2/3]), 1, 2)
    >>> round(result.unmodified_value * 9, 4), round(result.repair_value * 9, 4)   # 20/9 and 21/9
    (20.0, 21.0)
    """
    if not isinstance(num_drafts, int) or num_drafts < 1:
        raise InvalidArgument(f"num_drafts: expected an integer >= 1, got {num_drafts!r}")
    if not isinstance(draft_len, int) or draft_len < 1:
        raise InvalidArgument(f"draft_len: expected an integer >= 1, got {draft_len!r}")
    attempts = _solver_attempts(solver, solver_options)
    vocab_size = draft_model.vocab_size
    # the draft tuples are the realisations of the chain tree (the same tuples, order and weights)
    enumeration = enumerate_tree_drafts(draft_model, target_model, DraftTree.chains(num_drafts, draft_len), "iid",
                                        prefix, max_realisations=defaults.EXACT_MAX_TUPLES)
    lps = _string_lps(*realisation_candidates(enumeration), enumeration.weights.double().numpy(), target_model, prefix,
                      draft_len + 1, vocab_size, solver, attempts)
    return BlockLPResult(
        num_drafts=num_drafts,
        draft_len=draft_len,
        vocab_size=vocab_size,
        num_draft_tuples=enumeration.num_realisations,
        solver=solver,
        **lps,
    )
