"""The stages shared by the statistical audit and the sampler-vs-law check (private).

Both run validate -> plan -> sample -> test:

* validate: :func:`validate_common`, the arguments both take, checked once at the boundary
  (each entry point passes its own on by keyword);
* plan: :func:`budgeted`, the planned sample size replaced by an exact size or cut to a budget;
* sample: :func:`stream_chunks`, the chunk loop with its early stops and its wall-time deadline;
* test: :func:`with_min_detectable_tv`, :func:`holm_family`, :func:`support_test`,
  :func:`deciding_test` and :func:`family_result`: the Holm family of sub-tests, the support
  check beside it, the sub-test that decides, and the result they make.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Optional, Sequence, Union

import torch

from spectr_audit._validation import check_positive_int, check_prob
from spectr_audit.contract.tree import TREE_DRAFT_SCHEMES, DraftTree
from spectr_audit.contract.verifier import Verifier
from spectr_audit.contract.convert import as_tree_verifier, as_verifier
from spectr_audit.drafting.models import Model
from spectr_audit.errors import InvalidArgument
from spectr_audit.statistical import power as sizing
from spectr_audit.statistical._checks import check_models, check_prefix, check_seconds, chunk_schedule
from spectr_audit.statistical.gof import TestResult, holm
from spectr_audit.statistical.sampling import default_chunk_size


# ---------------------------------------------------------------------------------------------
# Validate
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CommonArgs:
    """The arguments both audits take, validated."""

    verifier: Verifier
    draft_model: Model
    target_model: Model
    vocab_size: int
    num_drafts: int
    draft_len: int
    prefix: tuple
    alpha: float
    #: as given (validated): the TV distance the sample size is planned to detect
    min_detectable_tv: float
    power: float
    num_samples: Optional[int]
    max_samples: Optional[int]
    max_seconds: Optional[float]
    seed: int
    device: torch.device
    chunk_size: int
    min_expected: float
    #: the draft tree of a tree audit (None: the chain contract's K x L drafts); ``verifier`` is
    #: then a TreeVerifier, ``num_drafts`` the root's children and ``draft_len`` the tree's depth
    tree: Optional[DraftTree]
    #: the tree's draft scheme (None for chains: the verifier's own ``draft_scheme``)
    draft_scheme: Optional[str]


def _validate_tree(verifier, tree, draft_scheme, needs_exact_law: bool):
    """A tree audit's verifier (as a TreeVerifier), its scheme, K (the root's children) and L (the depth)."""
    if not isinstance(tree, DraftTree):
        raise InvalidArgument(f"tree: expected a DraftTree or None, got {type(tree).__name__}")
    verifier = as_tree_verifier(verifier)
    if needs_exact_law and not verifier.has_tree_law:
        raise InvalidArgument(f"verifier: {verifier.name!r} has no tree_output_probs; use statistical_audit")
    verifier.check_supports_tree(tree)
    draft_scheme = draft_scheme or verifier.draft_schemes[0]
    if draft_scheme not in TREE_DRAFT_SCHEMES:
        raise InvalidArgument(f"draft_scheme: expected one of {TREE_DRAFT_SCHEMES}, got {draft_scheme!r}")
    if draft_scheme not in verifier.draft_schemes:
        raise InvalidArgument(
            f"draft_scheme: {verifier.name!r} verifies drafts of the schemes {verifier.draft_schemes}; auditing it under "
            f"{draft_scheme!r} would blame it for a draft-scheme mismatch, not a bug")
    return verifier, draft_scheme, len(tree.children[0]), tree.max_depth


def validate_common(
    verifier,
    draft_model: Model,
    target_model: Model,
    num_drafts: int,
    draft_len: int,
    *,
    prefix: Sequence[int],
    alpha: float,
    min_detectable_tv: float,
    power: float,
    num_samples: Optional[int],
    max_samples: Optional[int],
    max_seconds: Optional[float],
    seed: int,
    device: Union[str, torch.device],
    chunk_size: Optional[int],
    min_expected: float,
    needs_exact_law: bool = False,
    tree: Optional[DraftTree] = None,
    draft_scheme: Optional[str] = None,
) -> CommonArgs:
    """Check the shared arguments (InvalidArgument naming the first bad one); fill the defaults.

    With ``tree`` the verifier is converted to a tree verifier, ``num_drafts`` and ``draft_len``
    are taken from the tree (the root's children, the depth) and ``draft_scheme`` defaults to
    the verifier's first.
    """
    vocab_size = check_models(draft_model, target_model)
    if tree is not None:
        verifier, draft_scheme, num_drafts, draft_len = _validate_tree(verifier, tree, draft_scheme, needs_exact_law)
    else:
        if draft_scheme is not None:
            raise InvalidArgument("draft_scheme: only for a tree audit (with tree=...); a chain verifier declares its own")
        verifier = as_verifier(verifier)
        if needs_exact_law and not verifier.has_exact_law:
            raise InvalidArgument(f"verifier: {verifier.name!r} has no output_probs; use statistical_audit")
        num_drafts = check_positive_int("num_drafts", num_drafts, allow_none=False)
        draft_len = check_positive_int("draft_len", draft_len, allow_none=False)
        verifier.check_supports(num_drafts, draft_len)
    prefix = check_prefix(prefix, vocab_size)
    alpha = check_prob("alpha", alpha)
    power = check_prob("power", power)
    sizing.effect_size_for_tv(min_detectable_tv)
    num_samples = check_positive_int("num_samples", num_samples)
    max_samples = check_positive_int("max_samples", max_samples)
    max_seconds = check_seconds(max_seconds)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidArgument(f"seed: expected an integer, got {seed!r}")
    if (isinstance(min_expected, bool) or not isinstance(min_expected, (int, float))
            or not math.isfinite(min_expected) or min_expected <= 0):
        raise InvalidArgument(f"min_expected: expected a finite number > 0 (the expected count below which cells "
                              f"are pooled), got {min_expected!r}")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise InvalidArgument(f"device: expected a torch device ('cpu', 'cuda', 'cuda:1', ...), got {device!r}") from error
    # a tree's rows hold N + 1 nodes of V entries: the size of a chain row with K = N + 1, L = 0
    chunk_size = (check_positive_int("chunk_size", chunk_size)
                  or (default_chunk_size(tree.num_nodes, 0, vocab_size, device) if tree is not None
                      else default_chunk_size(num_drafts, draft_len, vocab_size, device)))
    return CommonArgs(verifier, draft_model, target_model, vocab_size, num_drafts, draft_len, prefix, alpha,
                      min_detectable_tv, power, num_samples, max_samples, max_seconds, seed, device, chunk_size,
                      min_expected, tree, draft_scheme)


#: The arguments of :func:`validate_common` that every audit entry point takes, under the same names
#: and with the same defaults (the entry points spell them out: their signatures are what users read),
#: and passes on by keyword.
COMMON_PARAMETERS = ("verifier", "draft_model", "target_model", "num_drafts", "draft_len", "prefix", "alpha",
                     "min_detectable_tv", "power", "num_samples", "max_samples", "max_seconds", "seed", "device",
                     "chunk_size", "min_expected")


# ---------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------


def budgeted(planned: int, num_samples: Optional[int], max_samples: Optional[int]) -> tuple[int, str]:
    """Samples to run (``num_samples`` if given, else ``planned``, at most ``max_samples``) and why."""
    total = num_samples if num_samples is not None else planned
    if max_samples is not None and max_samples < total:
        return max_samples, "max_samples"
    return total, "planned"


# ---------------------------------------------------------------------------------------------
# Sample
# ---------------------------------------------------------------------------------------------


def stream_chunks(
    total: int,
    chunk_size: int,
    deadline: Optional[float],
    step: Callable[[int, int], Optional[str]],
) -> tuple[int, str]:
    """Run ``step(size, done)`` over the chunk schedule of ``total`` samples; returns (done, stop reason).

    ``step`` runs one chunk and returns a stop reason to end the loop early (or None); the loop
    also ends, with ``"max_seconds"``, once ``time.perf_counter()`` passes ``deadline`` with
    samples left.  A loop that runs to the end returns ``"planned"``.
    """
    done = 0
    for size in chunk_schedule(total, chunk_size):
        reason = step(size, done)
        done += size
        if reason is not None:
            return done, reason
        if deadline is not None and time.perf_counter() >= deadline and done < total:
            return done, "max_seconds"
    return done, "planned"


# ---------------------------------------------------------------------------------------------
# Test
# ---------------------------------------------------------------------------------------------


def with_min_detectable_tv(result: TestResult, num_samples: int, test_alpha: float, power: float) -> TestResult:
    """``result`` with the smallest TV its test detects with ``power`` (inf below two cells)."""
    mde = (sizing.min_detectable_tv(num_samples, result.num_cells, test_alpha, power)
           if (result.num_cells or 0) >= 2 else math.inf)
    return dataclasses.replace(result, min_detectable_tv=mde)


def holm_family(tests: Sequence[TestResult]) -> tuple[TestResult, ...]:
    """The sub-tests with their Holm-adjusted p-values."""
    return tuple(dataclasses.replace(t, pvalue_adjusted=a) for t, a in zip(tests, holm([t.pvalue for t in tests])))


def support_test(violations: float, num_samples: int, detail: str) -> TestResult:
    """The support check as a sub-test: one sample of probability 0 proves the null false (p = 0)."""
    pvalue = 0.0 if violations else 1.0
    return TestResult("support", violations, pvalue, None, num_samples, pvalue_adjusted=pvalue, detail=detail)


def deciding_test(family: Sequence[TestResult], support: TestResult) -> TestResult:
    """The support check when violated, else the sub-test of smallest adjusted p-value (the first on ties)."""
    return support if support.statistic else min(family, key=lambda t: t.pvalue_adjusted)


def family_result(result_type: type, args: CommonArgs, family: tuple, support: TestResult, *, num_samples: int,
                  min_detectable_tv: float, worst_cells: tuple, seconds: float, **fields):
    """A :class:`~spectr_audit.statistical.results.FamilyResult` of ``result_type``, decided by :func:`deciding_test`.

    Its sub-tests are ``family`` then ``support``; alpha, seed and power are the arguments';
    ``fields`` are those ``result_type`` adds.
    """
    deciding = deciding_test(family, support)
    return result_type(verifier=args.verifier.name, test=deciding.name, statistic=deciding.statistic,
                       pvalue=float(deciding.pvalue_adjusted), alpha=args.alpha, num_samples=num_samples,
                       seed=args.seed, min_detectable_tv=min_detectable_tv, power=args.power,
                       subtests=family + (support,), worst_cells=worst_cells, seconds=seconds, **fields)
