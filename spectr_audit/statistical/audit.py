"""The statistical audit: black-box verifiers judged by their emitted strings.

:func:`statistical_audit` runs a verifier on many drafted batches, completes each emitted
string with target samples to N tokens, and tests the counts against the exact target law
(docs/audit/statistical.md).  One audit is one *family* of sub-tests of
the null hypothesis "the verifier is exact":

``pearson``, ``g-test``
    Chi-square and likelihood-ratio tests of the completed strings over a prefix-tree
    partition of V^N (:mod:`spectr_audit.statistical.sampling`), sparse cells pooled.  The sample size is
    planned for these: power ``power`` against every law at TV >= ``min_detectable_tv``
    (:mod:`spectr_audit.statistical.power`).
``stratified-pearson``
    When the draft space is small, a second sample drawn per draft tuple (strata of known
    probability); the draft-sampling noise drops out of its null distribution.
``acceptance<=optimal``
    P(first emitted token is among the drafts' first tokens) significantly above the
    optimal-transport bound alpha* proves inexactness (exact binomial test).
``block-efficiency<=bound``
    For L >= 2: the mean emitted length significantly above ``1 + sum_i alpha*(p^i, q^i, K)``
    proves inexactness: the first i emitted tokens of an exact verifier are a q-distributed
    string, and they coincide with a draft prefix when more than i tokens are emitted.
``e-process``
    An anytime-valid likelihood-ratio e-process, checked after every chunk, that stops the
    audit early on blatant bugs.
``support``
    Not a statistical test: a completed string of target probability 0 proves inexactness.

The family's p-value is Holm's (the smallest Holm-adjusted p-value), so an exact verifier
gets ``pvalue <= alpha`` with probability at most ``alpha`` (up to the chi-square
approximation).  Stopping early is safe: it happens only when the e-process's anytime-valid
p-value is below ``alpha / m``, where Holm rejects whatever the other sub-tests say.

Optimality is reported apart (it is not about exactness): acceptance below a claimed value
(the SpecTr guarantee for verifiers that declare ``"spectr"``, or ``claimed_acceptance``) and
block efficiency below ``claimed_block_efficiency``, by exact binomial and z tests.

:func:`sampler_law_agreement` (in :mod:`spectr_audit.statistical.agreement`, re-exported here) checks
a verifier that has ``output_probs`` against its own law.

The pipeline is :func:`statistical_audit`'s body, one private module per stage beside this one:
``_audit_args`` validates (after the arguments shared with :func:`sampler_law_agreement`,
``_stages``), ``_planning`` plans (the bounds, the family, :func:`plan_sample_size`),
``_designs`` samples (the main and the stratified design) and ``_families`` tests (the two Holm
families, the result); :func:`statistical_tree_audit` is the entry point for draft trees.

When an audit fails: rerun with another ``seed``.  An exact verifier fails at rate ``alpha``
(1e-3 by default), so a failure that repeats is a finding; ``worst_cells`` names the strings
whose counts are furthest from the target law.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from spectr_audit import defaults
from spectr_audit.contract.tree import DraftTree
from spectr_audit.drafting.models import Model
from spectr_audit.errors import InvalidArgument
from spectr_audit.statistical._audit_args import validate_audit, with_params
from spectr_audit.statistical._designs import sample_audit
from spectr_audit.statistical._families import judge_audit
from spectr_audit.statistical._planning import MAX_STRATIFIED_CELLS, MIN_PER_STRATUM  # noqa: F401 (re-exported)
from spectr_audit.statistical._planning import plan_audit
from spectr_audit.statistical._stages import validate_common
from spectr_audit.statistical.gof import MIN_EXPECTED, TestResult
from spectr_audit.statistical.power import DEFAULT_ALPHA, DEFAULT_MIN_DETECTABLE_TV, DEFAULT_POWER
from spectr_audit.statistical.results import LawAgreementResult, StatisticalAuditResult, WorstCell

# re-exported, in the order the API reference lists them (statistical_tree_audit after statistical_audit)
from spectr_audit.statistical.agreement import sampler_law_agreement
from spectr_audit.statistical._planning import plan_sample_size

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_MIN_DETECTABLE_TV",
    "DEFAULT_POWER",
    "LawAgreementResult",
    "StatisticalAuditResult",
    "TestResult",
    "WorstCell",
    "plan_sample_size",
    "sampler_law_agreement",
    "statistical_audit",
    "statistical_tree_audit",
]


def statistical_audit(
    verifier,
    draft_model: Model,
    target_model: Model,
    num_drafts: int,
    draft_len: int = 1,
    *,
    num_tokens: Optional[int] = None,
    prefix: Sequence[int] = (),
    alpha: float = DEFAULT_ALPHA,
    min_detectable_tv: float = DEFAULT_MIN_DETECTABLE_TV,
    power: float = DEFAULT_POWER,
    num_samples: Optional[int] = None,
    max_samples: Optional[int] = None,
    max_seconds: Optional[float] = None,
    seed: int = 0,
    device: Union[str, torch.device] = "cpu",
    chunk_size: Optional[int] = None,
    stratify: Union[bool, str] = "auto",
    sequential: bool = True,
    claimed_acceptance: Optional[float] = None,
    claimed_block_efficiency: Optional[float] = None,
    min_expected: float = MIN_EXPECTED,
    max_cells: int = defaults.PARTITION_MAX_CELLS,
    max_strata: int = defaults.MAX_STRATA,
    certify_tv: Optional[float] = None,
    distributed: Union[bool, str, object] = "auto",
    tree=None,
    draft_scheme: Optional[str] = None,
    params=None,
    order="vllm",
) -> StatisticalAuditResult:
    """Audit a (black-box) verifier's exactness from its emitted strings.

    With ``tree`` (a :class:`~spectr_audit.contract.tree.DraftTree`) the verifier is a tree
    verifier and each sample drafts the tree under ``draft_scheme``: see :func:`statistical_tree_audit`.

    Parameters
    ----------
    verifier : Verifier, class, object with ``verify``, or function
        Converted with :func:`spectr_audit.contract.convert.as_verifier`; only ``verify`` is used.
    draft_model, target_model : Model
        Draft and target next-token models (context-free, Markov, or any
        :class:`~spectr_audit.drafting.models.Model`).
    num_drafts : int
        K.
    draft_len : int
        L.
    num_tokens : int, optional
        N, the length the emitted strings are completed to; default ``L + 1`` (one
        iteration).  Larger values run the decoding loop (:func:`spectr_audit.drafting.decoding.decode`)
        for as many iterations as N tokens take.
    prefix : sequence of int
        The context before the audited step.
    alpha : float
        False-alarm rate of the whole audit (Holm over its sub-tests).  Default 1e-3.
    min_detectable_tv : float
        The TV distance the sample size is planned to detect.  Default 0.005.
    power : float
        Probability of flagging a verifier at that TV.  Default 0.99.
    num_samples : int, optional
        Run exactly this many samples in the main design instead of the planned number.
    max_samples : int, optional
        Budget: cap the main design's samples (the result reports the power that remains).
    max_seconds : float, optional
        Budget: stop sampling after this much wall time (half of it for the main design when
        the stratified design runs too).
    seed : int
        Seeds the one ``torch.Generator`` used for drafts, verdicts and completions.
    device : str or torch.device
    chunk_size : int, optional
        Rows per verifier call; default ``target_probs`` of about 8 MB on a CPU (256 MB on an
        accelerator), at most 2^18 rows (:func:`spectr_audit.statistical.sampling.default_chunk_size`).
    stratify : bool or "auto"
        Run the per-draft-tuple stratified test; ``"auto"``: when the draft tuples number at
        most ``max_strata`` and each gets 32 samples on average.  Its sample has the main
        design's size.
    sequential : bool
        Include the e-process and stop early when it alone already rejects.
    claimed_acceptance : float, optional
        Acceptance the verifier claims; defaults to the SpecTr guarantee
        ``(1 - (1 - 1/K)^K) alpha*`` for verifiers that declare ``"spectr"``.
    claimed_block_efficiency : float, optional
        Block efficiency (mean emitted length) the verifier claims.
    min_expected : float
        Cells with a smaller expected count are pooled.
    max_cells : int
        Cap on the partition's cells (a coarser prefix partition beyond it).
    max_strata : int
        Largest number of draft tuples for the stratified test.
    certify_tv : float, optional
        Certify ``TV(F, q) <= certify_tv`` on the partition: the sample is planned so that an
        exact verifier is certified with probability ``power``, and the audit stops at the first
        chunk where the anytime-valid upper bound is at most ``certify_tv`` (``"certified"``)
        or the lower bound above it (``"refuted"``); the stratified design does not run.  The
        certificate's error rate is ``alpha``.
    distributed : "auto", bool or process group
        Spread the chunks over a ``torch.distributed`` group (``"auto"``: the default group when
        one is initialised with several processes).  Counts and verdicts are bit-identical
        for any number of processes (:mod:`spectr_audit.statistical.sharding`); every process
        must call the audit with the same arguments.
    params : SamplingParams, optional
        Sampling parameters (one setting, scalars).  The models are then raw: drafts come from
        the processed draft law, completions and tests from the processed target law
        (:func:`~spectr_audit.contract.sampling.process_logits` with ``order``), the bounds are
        those of the processed laws, and a verifier that takes logits is handed the raw logits
        of every node and ``params`` (:func:`~spectr_audit.contract.logits.verify_with_params`;
        docs/sampling.md).  One iteration only (``num_tokens = L + 1``) for such a verifier.
    order : str, sequence of str or ProcessingOrder
        The engine's processing conventions (default ``"vllm"``).

    Returns
    -------
    StatisticalAuditResult

    Raises
    ------
    InvalidArgument
        On bad arguments, or a verifier that does not support (K, L).
    VerifierError
        When the verifier breaks the output contract.

    Notes
    -----
    Every result carries an estimate of ``TV(F, q)`` on the partition (``tv_estimate``), with
    an interval at level ``1 - alpha`` valid at the audit's stopping time (``tv_lower``,
    ``tv_upper``; :mod:`spectr_audit.statistical.confidence`), computed from the main design.
    A result that rejects nothing while its achieved ``min_detectable_tv`` is above the one
    asked for (a budget, a fixed ``num_samples``) has the verdict ``"INCONCLUSIVE"``.

    Validity: the Pearson and G tests are asymptotic (every pooled cell has an expected count
    of at least ``min_expected``); the binomial tests are exact; the stratified test is
    asymptotic in the per-tuple counts; the e-process is exact at any stopping time.
    ``min_detectable_tv`` refers to TV on the audited partition: when it is not the full V^N
    (``full_partition`` False) deviations inside a cell are not seen.  Acceptance and block
    efficiency are measured for one iteration only (``num_tokens = L + 1``).

    A verifier that returns a carried correction (:mod:`spectr_audit.contract.correction`) is judged
    together with it: completions follow the corrected target, as the decoding loop would.

    Examples
    --------
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> from spectr_audit.registry import load_verifier
    >>> result = statistical_audit(load_verifier("speculative"), ContextFreeModel([0.6, 0.4]),
    ...                            ContextFreeModel([0.3, 0.7]), num_drafts=1, num_samples=20_000)
    >>> result.rejects(), result.num_tests
    (False, 5)
    """
    if params is not None:
        verifier, draft_model, target_model = with_params(verifier, draft_model, target_model, params, order, prefix,
                                                          num_tokens, draft_len, tree)
    # validate -> plan -> sample -> test; validation and the stages' plumbing are shared (_stages)
    common = validate_common(verifier, draft_model, target_model, num_drafts, draft_len, prefix=prefix, alpha=alpha,
                             min_detectable_tv=min_detectable_tv, power=power, num_samples=num_samples,
                             max_samples=max_samples, max_seconds=max_seconds, seed=seed, device=device,
                             chunk_size=chunk_size, min_expected=min_expected, tree=tree,
                             draft_scheme=draft_scheme)
    args = validate_audit(common, num_tokens, stratify, sequential, claimed_acceptance, claimed_block_efficiency,
                          max_cells, max_strata, certify_tv, distributed)
    plan = plan_audit(args)
    return judge_audit(args, plan, sample_audit(args, plan))


def statistical_tree_audit(
    verifier,
    draft_model: Model,
    target_model: Model,
    tree,
    *,
    draft_scheme: Optional[str] = None,
    **kwargs,
) -> StatisticalAuditResult:
    """Audit a (black-box) tree verifier's exactness from its emitted strings on ``tree``.

    The pipeline of :func:`statistical_audit` (validate -> plan -> sample -> test, same arguments
    as keywords), each sample a fresh draft of ``tree`` under ``draft_scheme``
    (:func:`spectr_audit.drafting.tree.draft_tree`; default the verifier's first scheme), the
    emitted string (1 to ``max_depth + 1`` tokens) completed with target samples to
    ``max_depth + 1`` tokens.  ``acceptance<=optimal`` tests the root's membership acceptance
    against the tree's alpha* (docs/audit/bounds.md); under ``topk`` and ``none``
    ``block-efficiency<=bound`` tests the mean emitted length against ``1 + sum_n q(path(n))``.
    The stratified design and the multi-iteration run are for chains only.

    Parameters
    ----------
    verifier : TreeVerifier, or anything :func:`~spectr_audit.contract.convert.as_tree_verifier` takes
    draft_model, target_model : Model
    tree : DraftTree
    draft_scheme : str, optional
        One of the verifier's ``draft_schemes``.
    **kwargs
        Any keyword of :func:`statistical_audit` (``alpha``, ``num_samples``, ``max_samples``,
        ``seed``, ...).

    Examples
    --------
    >>> from spectr_audit.contract.tree import DraftTree
    >>> from spectr_audit.drafting.models import ContextFreeModel
    >>> from spectr_audit.registry import load_tree_verifier
    >>> tree = DraftTree.from_paths([(0,), (1,), (0, 0)])
    >>> result = statistical_tree_audit(load_tree_verifier("tree-target-only"), ContextFreeModel([0.5, 0.3, 0.2]),
    ...                                 ContextFreeModel([0.2, 0.3, 0.5]), tree, draft_scheme="topk",
    ...                                 num_samples=20_000)
    >>> result.rejects()
    False
    """
    if not isinstance(tree, DraftTree):
        raise InvalidArgument(f"tree: expected a DraftTree, got {type(tree).__name__}")
    return statistical_audit(verifier, draft_model, target_model, len(tree.children[0]), tree.max_depth,
                             tree=tree, draft_scheme=draft_scheme, **kwargs)
