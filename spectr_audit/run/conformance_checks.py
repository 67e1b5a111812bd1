"""The conformance check's building blocks: its check and result records, the failure it raises,
and its one set of contract and law checks (:data:`CONTRACT_CHECKS`), run alike on a chain verifier
(:mod:`spectr_audit.run.conformance`: its ``verify`` on drafted chains, the chain tree
``DraftTree.chains(K, L)``) and on a tree verifier (:mod:`spectr_audit.run.tree_conformance`:
``verify_tree`` on drafted trees); each face hands in how to call its verifier and read its output."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

from spectr_audit.errors import InvalidArgument, SpectrAuditError, VerifierError
from spectr_audit.results import AuditReport

__all__ = ["CONTRACT_CHECKS", "ConformanceCheck", "ConformanceResult", "ConformanceFailure", "alpha_split_text",
           "describe_result"]

#: The contract checks of a chain and a tree verifier alike, in the order they run (the last two where the
#: verifier has an exact law: ``output_probs``, ``tree_output_probs``).  ``where`` tells the two apart: "K=2,
#: L=1" for a chain, the tree and its draft scheme for a tree.
CONTRACT_CHECKS: tuple[str, ...] = (
    "output contract",
    "inputs unchanged",
    "deterministic under a fixed generator",
    "emitted tokens have target mass",
    "float32 inputs",
    "exact law is a distribution",
    "sampler follows the exact law",
)


@dataclasses.dataclass(frozen=True)
class ConformanceCheck:
    """One conformance check: its name, where it ran, whether it held, and why not."""

    name: str
    where: str
    passed: bool
    detail: str = ""

    def __str__(self) -> str:
        mark = "ok  " if self.passed else "FAIL"
        return f"[{mark}] {self.name} ({self.where})" + (f": {self.detail}" if self.detail else "")


@dataclasses.dataclass(frozen=True)
class ConformanceResult:
    """Everything :func:`check_verifier` found.  Numbers and words only; ``passed`` decides.

    Attributes
    ----------
    verifier : str
    checks : tuple of ConformanceCheck
        The contract checks.
    audit : AuditReport
        The fidelity audits on the standard suite (one result per case).
    alpha : float
        False-alarm rate of the whole check (Bonferroni over its statistical tests).
    """

    verifier: str
    checks: tuple
    audit: Any
    alpha: float

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks) and self.audit.passed

    @property
    def inconclusive(self) -> list:
        """Fidelity results that held only without the power asked for (a budget; a certificate not reached)."""
        return self.audit.inconclusive

    @property
    def certified(self) -> bool:
        """Whether every fidelity result is CERTIFIED (only with ``certify_tv``)."""
        return bool(self.audit.results) and all(r.verdict == "CERTIFIED" for r in self.audit.results)

    @property
    def failures(self) -> list:
        """Failed contract checks and fidelity results that did not go as expected."""
        return [c for c in self.checks if not c.passed] + [r for r in self.audit.results if not r.as_expected]

    def message(self, max_cells: int = 5) -> str:
        """A readable account of every failure: the case, the failed checks, the worst cells."""
        failed_checks = [c for c in self.checks if not c.passed]
        failed_results = [r for r in self.audit.results if not r.as_expected]
        # every check counted once, as listed: the contract's, then each fidelity result's (an error, or a
        # verdict against its declaration with no failed check, counts as one)
        total = len(self.checks) + sum(max(1, len(r.checks)) for r in self.audit.results)
        failed_fidelity = sum(max(1, len(r.failed_checks)) if r.error is None else 1 for r in failed_results)
        if not failed_checks and not failed_results:
            inconclusive = self.inconclusive
            note = "" if not inconclusive else (
                f"; {len(inconclusive)} INCONCLUSIVE (nothing rejected, below the planned power: "
                + ", ".join(r.case for r in inconclusive[:5]) + (" ..." if len(inconclusive) > 5 else "") + ")")
            return f"check_verifier({self.verifier}): all {total} checks passed{note}"
        lines = [f"check_verifier({self.verifier}): {len(failed_checks) + failed_fidelity} of {total} checks failed "
                 f"({len(failed_checks)} of the contract's {len(self.checks)}; {failed_fidelity} in the fidelity audits "
                 f"of {len(failed_results)} of {len(self.audit.results)} cases)"]
        for check in failed_checks:
            lines.append(f"  contract: {check}")
        for result in failed_results:
            lines.extend("  " + line for line in describe_result(result, max_cells).splitlines())
        split = alpha_split_text(self.alpha, [r.metrics.get("alpha") for r in self.audit.results])
        if split:
            lines.append(f"  ({split})")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.message()


class ConformanceFailure(SpectrAuditError, AssertionError):
    """Raised by :func:`check_verifier` when a check fails; ``report`` holds every result."""

    def __init__(self, report: ConformanceResult):
        super().__init__(report.message())
        self.report = report


def alpha_split_text(alpha: float, test_alphas: Sequence[Any]) -> str:
    """Why a statistical check's threshold is below ``alpha``: the call's false-alarm rate split over its tests.

    ``test_alphas``: the level each audit ran at (``metrics["alpha"]``; None where none ran).
    Returns "" when every audit ran at ``alpha`` itself (or none ran).

    Examples
    --------
    >>> alpha_split_text(0.001, [0.0002, 0.0002, None])
    'alpha = 0.001 is the false-alarm rate of the whole check, split over its 5 statistical tests (Bonferroni): each runs at 0.001 / 5 = 0.0002'
    """
    levels = sorted({float(a) for a in test_alphas if isinstance(a, (int, float)) and not isinstance(a, bool)})
    if not levels or all(math.isclose(a, alpha) for a in levels):
        return ""
    parts = [f"{alpha:g} / {round(alpha / level)} = {level:g}" for level in levels]
    counts = " or ".join(str(round(alpha / level)) for level in levels)
    return (f"alpha = {alpha:g} is the false-alarm rate of the whole check, split over its {counts} statistical tests "
            f"(Bonferroni): each runs at {' or '.join(parts)}")


def _hide_for_failure(excinfo: Any) -> bool:
    """pytest's ``__tracebackhide__`` filter: hide :func:`check_verifier`'s frame for its own
    :class:`ConformanceFailure` (the message says everything), keep it for any other error."""
    return excinfo.errisinstance(ConformanceFailure)


def describe_result(result: Any, max_cells: int = 5) -> str:
    """Lines naming a result's case, its failed checks and its worst cells (for failure messages)."""
    head = f"fidelity on case {result.case!r}"
    if result.error is not None:
        return f"{head}: audit error: {result.error}"
    if result.expected is False and result.passed:
        return f"{head}: declared inexact but every check held"
    lines = [f"{head}:"]
    for check in result.failed_checks:
        value = "-" if check.value is None else f"{check.value:.6g}"
        threshold = "-" if check.threshold is None else f"{check.threshold:.6g}"
        lines.append(f"  check {check.name} failed: value {value}, threshold {threshold}"
                     + (f" ({check.detail})" if check.detail else ""))
    worst = result.details.get("worst_strings") or []
    if worst:
        cells = "; ".join(f"{w['string']}: {w['implied']:.6g} vs {w['target']:.6g}" for w in worst[:max_cells])
        lines.append(f"  worst cells (string: implied law vs target law): {cells}")
    worst_cells = result.details.get("worst_cells") or []
    if worst_cells and not worst:
        cells = "; ".join(f"{c['cell']}: observed {c['observed']:.6g} vs expected {c['expected']:.6g}"
                          for c in worst_cells[:max_cells])
        lines.append(f"  worst cells (observed vs expected count): {cells}")
    return "\n".join(lines)


#: Token-level contract inputs: the target forbids a token the draft proposes (0) and the draft
#: never proposes a token the target likes (4), so rejections, residuals and zero masses all occur.
_CONTRACT_DRAFT = [0.3, 0.25, 0.25, 0.2, 0.0]


_CONTRACT_TARGET = [0.0, 0.3, 0.15, 0.25, 0.3]


def _rows(mask) -> str:
    rows = mask.nonzero().flatten().tolist()
    return ", ".join(map(str, rows[:8])) + (" ..." if len(rows) > 8 else "")


def _call_checks(run: Callable, inputs: Sequence, names: Sequence[str], where: str, seed: int, *,
                 verb: str, fields: Sequence[str], emitted_ok: Callable, dense_mutations: Callable[[], list] = list,
                 law_checks: Optional[Callable[[], list]] = None) -> list[ConformanceCheck]:
    """The contract checks of a chain or a tree verifier's calls, in the order of :data:`CONTRACT_CHECKS`;
    nothing after the first when it fails.

    ``output contract`` (the first call's output has int64 ``[batch_size]`` fields in range), ``inputs unchanged``
    (the ``names`` of the inputs ``verb`` modified in place, then ``dense_mutations()``), ``deterministic
    under a fixed generator`` (the output ``fields`` of two calls with the same seed), ``emitted tokens
    have target mass`` (``emitted_ok(first_output)``: ``[batch_size]`` bools), ``float32 inputs`` (every
    probability input cast), then ``law_checks()`` where given.  ``run(args, seed)`` calls the verifier on
    ``args`` (``inputs``, or their float32 casts) with a generator seeded ``seed`` and checks its output.
    """
    import functools
    import operator

    import torch

    contract, unchanged, deterministic, target_mass, float32 = CONTRACT_CHECKS[:5]
    # Shapes, dtypes, ranges (float64 inputs).
    originals = [None if t is None else t.clone() for t in inputs]
    try:
        first = run(inputs, seed)
    except (VerifierError, InvalidArgument) as exc:
        return [ConformanceCheck(contract, where, False, str(exc))]
    checks = [ConformanceCheck(contract, where, True, "int64 [batch_size] fields in range")]
    changed = [name for name, before, after in zip(names, originals, inputs)
               if before is not None and not torch.equal(before, after)]
    changed = [f"{verb} modified {', '.join(changed)} in place"] if changed else []
    changed += dense_mutations()
    checks.append(ConformanceCheck(unchanged, where, not changed, "; ".join(changed)))
    # Determinism under a fixed generator.
    second = run(inputs, seed)
    differs = functools.reduce(operator.or_, (getattr(first, field) != getattr(second, field) for field in fields))
    checks.append(ConformanceCheck(
        deterministic, where, not bool(differs.any()),
        f"two calls with torch.Generator().manual_seed({seed}) differ at rows {_rows(differs)}" if differs.any() else ""))
    bad = ~emitted_ok(first)
    checks.append(ConformanceCheck(
        target_mass, where, not bool(bad.any()),
        f"rows {_rows(bad)} emit a token whose target probability is 0 (an exact verifier never does)"
        if bad.any() else ""))
    # float32 inputs.
    try:
        run([t.float() if t is not None and t.is_floating_point() else t for t in inputs], seed)
    except (VerifierError, InvalidArgument) as exc:
        checks.append(ConformanceCheck(float32, where, False, str(exc)))
    else:
        checks.append(ConformanceCheck(float32, where, True))
    if law_checks is not None:
        checks += law_checks()
    return checks


def _string_counts(draft_tokens, output, draft_len: int) -> dict:
    """Emitted strings (as tuples) and their counts; PAD-free."""
    import torch

    batch_size = draft_tokens.shape[0]
    rows = torch.arange(batch_size)
    chosen = draft_tokens[rows, output.draft_index]  # [batch_size, draft_len]
    positions = torch.arange(draft_len + 1)
    padded = torch.cat([chosen, torch.zeros(batch_size, 1, dtype=torch.int64)], 1)
    strings = torch.where(positions < output.num_accepted.unsqueeze(1), padded, torch.full_like(padded, -1))
    strings[rows, output.num_accepted] = output.next_token
    unique, counts = torch.unique(strings, dim=0, return_counts=True)
    return {tuple(t for t in row if t >= 0): int(c) for row, c in zip(unique.tolist(), counts.tolist())}


def _pearson_pvalue(observed: dict, expected: dict) -> Optional[float]:
    """Pearson's test of ``observed`` counts against ``expected`` ones, cells of expected count < 5 pooled
    (None with fewer than two cells)."""
    from scipy import stats

    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for cell in sorted(expected, key=expected.get):
        if expected[cell] < 5:
            pool_o += observed.get(cell, 0)
            pool_e += expected[cell]
        else:
            obs.append(observed.get(cell, 0))
            exp.append(expected[cell])
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    if len(exp) < 2:
        return None
    statistic = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return float(stats.chi2.sf(statistic, len(exp) - 1))


def _sampler_law_checks(law: Callable, sample: Callable, batch_size: int, num_samples: int, alpha: float, where: str,
                        *, law_name: str, worst_cell: bool) -> list[ConformanceCheck]:
    """A chain or a tree verifier's exact law is a distribution, and its sampler follows it on up to three rows.

    The last two of :data:`CONTRACT_CHECKS`.  ``law()``: the checked law (VerifierError / InvalidArgument
    fail the first).  ``sample(law,
    row, num)``: the row's label, the sampler's emitted strings over ``num`` calls on it and their expected
    counts under the law.  The second fails at a string the law (``law_name``) gives
    probability 0, or when Pearson's test rejects on a row at ``alpha`` split over the rows; its detail
    names the row of the smallest p-value (and, with ``worst_cell``, that row's cell furthest off).
    """
    distribution, follows = CONTRACT_CHECKS[5:]
    try:
        computed = law().double()
    except (VerifierError, InvalidArgument) as exc:
        return [ConformanceCheck(distribution, where, False, str(exc))]
    done = [ConformanceCheck(distribution, where, True)]
    num_rows = min(3, batch_size)
    per_row = max(200, num_samples // num_rows)
    worst_p, worst_detail = 1.0, ""
    for row in range(num_rows):
        label, observed, expected = sample(computed, row, per_row)
        impossible = [s for s in observed if expected.get(s, 0.0) <= 0]
        if impossible:
            return done + [ConformanceCheck(
                follows, where, False,
                f"{label}: the sampler emitted {list(impossible[0])} ({observed[impossible[0]]} times), "
                f"which its own {law_name} gives probability 0")]
        pvalue = _pearson_pvalue(observed, expected)
        if pvalue is not None and pvalue < worst_p:
            worst_p = pvalue
            worst_detail = f"{label}: Pearson p = {pvalue:.3g} over {per_row} samples"
            if worst_cell:
                cell = max(expected, key=lambda s: abs(observed.get(s, 0) - expected[s]) / math.sqrt(expected[s]))
                worst_detail += (f"; worst cell {list(cell)}: observed {observed.get(cell, 0)} vs expected "
                                 f"{expected[cell]:.1f}")
    row_alpha = alpha / num_rows
    done.append(ConformanceCheck(
        follows, where, worst_p > row_alpha,
        worst_detail if worst_p <= row_alpha else f"smallest p-value {worst_p:.3g} > {row_alpha:.3g}"))
    return done


def _test_alpha(alpha: float, num_combos: int, num_cases: int, has_law: bool) -> float:
    """The level of each statistical test: Bonferroni over every test a check may run (with a law, one
    sampler test per contract combination; without, one statistical audit per case)."""
    num_tests = num_combos * int(has_law) + num_cases * int(not has_law)
    return alpha / max(1, num_tests)


def _conformance_result(verifier, checks: list, results: list, suite, seed: int, alpha: float,
                        meta: Optional[dict] = None) -> ConformanceResult:
    """The report of a chain or a tree check: its contract checks, and its fidelity results on ``suite``
    (``meta`` adds to the audit report's ``num_cases``, ``seed`` and ``alpha``)."""
    return ConformanceResult(
        verifier=verifier.name,
        checks=tuple(checks),
        audit=AuditReport(results=tuple(results), suite=suite.name,
                          meta={"num_cases": len(results), "seed": seed, "alpha": alpha, **(meta or {})}),
        alpha=alpha,
    )


# The public classes are imported from spectr_audit.run.conformance, and named after it in tracebacks,
# reprs and pickles, as before they moved here.
for _public in (ConformanceCheck, ConformanceResult, ConformanceFailure):
    _public.__module__ = "spectr_audit.run.conformance"
del _public
