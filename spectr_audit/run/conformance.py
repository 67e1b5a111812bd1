"""A one-call conformance check for third-party verifiers: :func:`check_verifier`.

The check has two parts.

*Contract* (deterministic, on drafted batches for every requested (K, L)): the verifier runs
on float64 and float32 inputs, returns int64 ``[batch_size]`` fields in range, leaves its
inputs untouched, is deterministic under a fixed ``torch.Generator``, never emits a token of
zero target probability, and, where it has an exact law (``output_probs``), that law is valid
and its sampler follows it conditionally on the drafts.

*Fidelity*: :func:`spectr_audit.run.runner.audit_case` on a standard small suite (the exact audit
where a law exists); where the audit measured no fidelity (a black box and a runner without the
statistical audit wired in), :func:`spectr_audit.statistical.audit.statistical_audit` is run on the
case so that a black box is still judged by its emitted strings.

Statistical parts use fixed seeds; their false-alarm rate is stated on :func:`check_verifier`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence, Union

import torch

from spectr_audit import defaults
from spectr_audit._validation import check_prob
from spectr_audit.contract.convert import as_verifier
from spectr_audit.contract.logits import FunctionLogitsVerifier, takes_logits
from spectr_audit.contract.sampling import SamplingParams, processing_order
from spectr_audit.contract.verifier import FunctionVerifier, Verifier, check_output_probs, check_verify_output
from spectr_audit.drafting.harness import draft
from spectr_audit.errors import InvalidArgument, SpectrAuditError
from spectr_audit.registry import load_verifier
from spectr_audit.run import budget, guard
from spectr_audit.run.runner import AuditOptions, add_statistical_result, audit_case, scheme_fits
from spectr_audit.run.suite import Suite, load_suite, model_from_spec, parse_suite
from spectr_audit.run.tree_conformance import check_tree_verifier
from spectr_audit.run.conformance_checks import (  # noqa: F401 (ConformanceCheck, alpha_split_text, describe_result re-exported)
    _CONTRACT_DRAFT,
    _CONTRACT_TARGET,
    ConformanceCheck,
    ConformanceFailure,
    ConformanceResult,
    _call_checks,
    _conformance_result,
    _hide_for_failure,
    _sampler_law_checks,
    _string_counts,
    _test_alpha,
    alpha_split_text,
    describe_result,
)
from spectr_audit.statistical.audit import statistical_audit

__all__ = ["ConformanceCheck", "ConformanceResult", "ConformanceFailure", "check_verifier", "standard_suite"]

IntOrInts = Union[int, Sequence[int]]


# ---------------------------------------------------------------------------------------------
# The standard suite
# ---------------------------------------------------------------------------------------------


def _as_ints(value: IntOrInts, argument: str) -> tuple[int, ...]:
    values = (value,) if isinstance(value, int) else value
    try:
        values = tuple(values)
    except TypeError:
        raise InvalidArgument(f"{argument}: expected an integer >= 1 or a sequence of them, got {value!r}") from None
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise InvalidArgument(f"{argument}: expected an integer >= 1 or a non-empty sequence of them, got {value!r}")
    return values


def standard_suite(num_drafts: IntOrInts = (1, 2), draft_len: IntOrInts = 1) -> Any:
    """The small suite :func:`check_verifier` audits on, for the given K and L.

    Token cases (L = 1): SpecTr's seed example, a draft with zero mass where the target has
    some, a drafted token the target forbids, a Dirichlet V = 5 pair and a sparse V = 6 pair.
    Sequence cases (L >= 2): the context-free seed example and a Markov V = 3 pair.  Every case
    is small enough for the exact audit's enumeration.

    Returns
    -------
    spectr_audit.run.suite.Suite
    """
    ks = _as_ints(num_drafts, "num_drafts")
    ls = _as_ints(draft_len, "draft_len")
    token_cases = [
        ("seed-spectr", [0.6, 0.4], [0.3, 0.7]),
        ("draft-misses-target", [1.0, 0.0], [0.5, 0.5]),
        ("target-forbids-draft", [0.5, 0.4, 0.1, 0.0], [0.0, 0.3, 0.3, 0.4]),
        ("dirichlet-v5", {"dirichlet": {"vocab_size": 5, "seed": 1}}, {"dirichlet": {"vocab_size": 5, "seed": 2}}),
        ("sparse-v6", {"dirichlet": {"vocab_size": 6, "concentration": 0.3, "seed": 3}},
         {"dirichlet": {"vocab_size": 6, "concentration": 0.3, "seed": 4}}),
    ]
    sequence_cases = [
        ("seq-seed-spectr", [0.6, 0.4], [0.3, 0.7]),
        ("seq-markov-v3", {"markov": {"vocab_size": 3, "order": 1, "seed": 5}},
         {"markov": {"vocab_size": 3, "order": 1, "seed": 6}}),
    ]
    cases = []
    for length in ls:
        for base, draft_spec, target_spec in token_cases if length == 1 else sequence_cases:
            for k in ks:
                cases.append({"name": f"{base}/K={k}/L={length}", "draft": draft_spec, "target": target_spec,
                              "num_drafts": k, "draft_len": length})
    return parse_suite({"suite": {"name": "conformance"}, "case": cases}, source="conformance suite")


# ---------------------------------------------------------------------------------------------
# Contract checks
# ---------------------------------------------------------------------------------------------


def _to_verifier(verifier: Any, name: Optional[str], output_probs: Optional[Callable], draft_scheme: Optional[str]):
    is_plain_function = (callable(verifier) and not isinstance(verifier, (type, str, Verifier))
                         and not hasattr(verifier, "verify") and not hasattr(verifier, "verify_logits"))
    if is_plain_function and getattr(verifier, "takes_logits", False):
        # fn(draft_tokens, draft_logits, target_logits, params, generator), as engines verify
        return FunctionLogitsVerifier(verifier, name=name, output_probs=output_probs, draft_scheme=draft_scheme or "iid")
    if is_plain_function:
        return FunctionVerifier(verifier, name=name, output_probs=output_probs, draft_scheme=draft_scheme or "iid")
    if output_probs is not None:
        raise InvalidArgument("output_probs: only for a plain verify function; a class or object declares its own")
    converted = load_verifier(verifier) if isinstance(verifier, str) else as_verifier(verifier, name=name)
    if name and isinstance(verifier, str):
        converted.name = name
    if draft_scheme is not None and draft_scheme != converted.draft_scheme:
        raise InvalidArgument(
            f"draft_scheme: {converted.name!r} declares {converted.draft_scheme!r}; got {draft_scheme!r}"
        )
    return converted


def _contract_models(draft_len: int, draft_scheme: str):
    if draft_len >= 2:
        return (model_from_spec({"markov": {"vocab_size": 3, "seed": 5}}, "conformance draft"),
                model_from_spec({"markov": {"vocab_size": 3, "seed": 6}}, "conformance target"))
    if draft_scheme == "without_replacement":  # K distinct drafts need a full draft support
        return (model_from_spec({"dirichlet": {"vocab_size": 5, "seed": 1}}, "conformance draft"),
                model_from_spec({"dirichlet": {"vocab_size": 5, "seed": 2}}, "conformance target"))
    return model_from_spec(_CONTRACT_DRAFT, "conformance draft"), model_from_spec(_CONTRACT_TARGET, "conformance target")


def _contract_checks(verifier, num_drafts: int, draft_len: int, seed: int, batch_size: int, num_samples: int,
                     alpha: float) -> list[ConformanceCheck]:
    where = f"K={num_drafts}, L={draft_len}"
    draft_model, target_model = _contract_models(draft_len, verifier.draft_scheme)
    vocab_size = draft_model.vocab_size
    generator = torch.Generator().manual_seed(seed)
    contexts = torch.zeros(batch_size, 0, dtype=torch.int64)
    batch = draft(draft_model, target_model, contexts, num_drafts, draft_len, generator, verifier.draft_scheme)
    inputs = (batch.draft_tokens, batch.draft_probs, batch.target_probs)

    def run(args, seed_value):
        raw = verifier.verify(*args, torch.Generator().manual_seed(seed_value))
        return check_verify_output(raw, batch_size, num_drafts, draft_len, vocab_size, who=verifier.name)

    def emitted_ok(first):
        """Every emitted token has positive target probability at its node."""
        rows = torch.arange(batch_size)
        ok = torch.ones(batch_size, dtype=torch.bool)
        for level in range(draft_len + 1):
            node_target = batch.target_probs[rows, first.draft_index, level]  # [batch_size, vocab_size]
            drafted = batch.draft_tokens[rows, first.draft_index, level] if level < draft_len else first.next_token
            token = torch.where(first.num_accepted == level, first.next_token, drafted)
            active = first.num_accepted >= level
            mass = node_target.gather(1, token.unsqueeze(1)).squeeze(1)
            ok &= ~(active & (mass <= 0))
        return ok

    # The contract inputs have zero entries by design (a forbidden token, an unproposed one), and an
    # in-place change that scales or clamps an entry leaves a zero unchanged: check on inputs whose
    # every probability is positive too.
    return _call_checks(
        run, inputs, ("draft_tokens", "draft_probs", "target_probs"), where, seed, verb="verify", fields=("num_accepted", "draft_index", "next_token"), emitted_ok=emitted_ok,
        dense_mutations=lambda: guard.dense_mutations(verifier, vocab_size, num_drafts, draft_len, seed, batch_size),
        law_checks=(lambda: _law_checks(verifier, batch, num_samples, alpha, seed, where)) if verifier.has_exact_law
        else None)


def _law_checks(verifier, batch, num_samples: int, alpha: float, seed: int, where: str) -> list[ConformanceCheck]:
    """The exact law is valid, and the sampler follows it on a few fixed draft tuples."""
    batch_size, num_drafts, draft_len = batch.draft_tokens.shape
    vocab_size = batch.draft_probs.shape[-1]

    def checked_law():
        return check_output_probs(verifier.output_probs(batch.draft_tokens, batch.draft_probs, batch.target_probs),
                                  batch_size, num_drafts, draft_len, vocab_size, who=verifier.name)

    def sample(law, t: int, per_tuple: int):
        """The draft tuple of row ``t``: its label, the sampler's strings over ``per_tuple`` calls, the law's."""
        tokens = batch.draft_tokens[t:t + 1].expand(per_tuple, -1, -1).contiguous()
        draft_probs = batch.draft_probs[t:t + 1].expand(per_tuple, -1, -1, -1).contiguous()
        target_probs = batch.target_probs[t:t + 1].expand(per_tuple, -1, -1, -1).contiguous()
        output = verifier.verify(tokens, draft_probs, target_probs, torch.Generator().manual_seed(seed + 1 + t))
        observed = _string_counts(tokens, output, draft_len)
        expected: dict = {}
        drafts = batch.draft_tokens[t].tolist()
        for (k, n, y) in (law[t] > 0).nonzero().tolist():
            key = tuple(drafts[k][:n]) + (y,)
            expected[key] = expected.get(key, 0.0) + float(law[t, k, n, y]) * per_tuple
        return f"drafts {drafts}", observed, expected

    return _sampler_law_checks(checked_law, sample, batch_size, num_samples, alpha, where, law_name="output_probs",
                               worst_cell=True)


# ---------------------------------------------------------------------------------------------
# Fidelity
# ---------------------------------------------------------------------------------------------


def _sampled_fidelity(verifier, case, result, options):
    """Add the statistical audit to a result that measured no fidelity (a black box)."""
    sampling = {} if getattr(case, "params", None) is None else {"params": case.params, "order": case.order}
    try:
        audit = statistical_audit(verifier, case.draft_model, case.target_model, case.num_drafts, case.draft_len,
                                  prefix=case.prefix, alpha=options.alpha, max_samples=options.max_samples,
                                  max_seconds=options.max_seconds, seed=options.seed, certify_tv=options.certify_tv,
                                  **sampling)
    except (SpectrAuditError, ValueError, RuntimeError, TypeError, IndexError) as exc:
        return dataclasses.replace(result, error=f"statistical audit: {type(exc).__name__}: {exc}")
    metrics = dict(result.metrics)
    details = {k: v for k, v in result.details.items() if k != "note"}
    checks = [c for c in result.checks if c.name != "ran"]
    add_statistical_result(audit, checks, metrics, details)
    metrics["statistic"] = audit.statistic
    return dataclasses.replace(result, checks=tuple(checks), metrics=metrics, details=details)


def _measured_fidelity(result) -> bool:
    return any(key in result.metrics for key in ("tv_distance", "max_abs_error", "pvalue"))


def _check_num_samples(num_samples) -> None:
    """InvalidArgument unless ``num_samples`` is an integer of at least 100 (chain and tree checks alike)."""
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 100:
        raise InvalidArgument(f"num_samples: expected an integer >= 100, got {num_samples!r}")


def _check_arguments(seed, num_samples, alpha, batch_size, draft_scheme, suite) -> float:
    """Validate :func:`check_verifier`'s numbers and options (InvalidArgument naming the bad one); returns alpha."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise InvalidArgument(f"seed: expected an integer, got {seed!r}")
    _check_num_samples(num_samples)
    alpha = check_prob("alpha", alpha)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InvalidArgument(f"batch_size: expected a positive integer, got {batch_size!r}")
    if draft_scheme is not None and draft_scheme not in ("iid", "without_replacement"):
        raise InvalidArgument(f"draft_scheme: expected 'iid' or 'without_replacement', got {draft_scheme!r}")
    if suite is not None and not isinstance(suite, (str, Suite)):
        raise InvalidArgument(f"suite: expected a Suite or a suite name/path, got {type(suite).__name__}")
    return alpha


def _supported_drafts(verifier, ks: Optional[tuple], ls: tuple) -> tuple:
    """The K to check: those given (every (K, L) supported, or InvalidArgument), else each of 1, 2 that fits."""
    if ks is None:
        ks = tuple(k for k in (1, 2) if any(verifier.supports(k, length) for length in ls)) or (verifier.min_drafts,)
    unsupported = [(k, length) for k in ks for length in ls if not verifier.supports(k, length)]
    if unsupported:
        raise InvalidArgument(
            f"num_drafts, draft_len: verifier {verifier.name!r} supports num_drafts in {verifier.drafts_range()} "
            f"and draft_len in {verifier.draft_len_range()}; got (K, L) = {unsupported}"
        )
    return ks


def _default_lengths(verifier) -> tuple:
    """The L checked when none is given: 1, or the smallest L the verifier supports (up to 16) when not 1."""
    return next(((length,) for length in range(1, 17) if verifier.supports_draft_len(length)), (1,))


#: The sampling settings a verifier that takes logits is checked at when none is given: a temperature
#: below 1, top-k (above 1), top-p; each is valid in every engine's processing order.
LOGITS_CHECK_SETTINGS: tuple = (
    {"temperature": 0.6},
    {"temperature": 1.3, "top_k": 2},
    {"top_p": 0.8},
)


def _sampling_settings(verifier, params, order) -> list:
    """The sampling settings to check at: ``params``; for a verifier that takes logits and none given,
    :data:`LOGITS_CHECK_SETTINGS`; otherwise none (``[None]``: each case's own)."""
    processing_order(order)
    if params is not None:
        if not isinstance(params, SamplingParams):
            raise InvalidArgument(f"params: expected SamplingParams, got {type(params).__name__}")
        if params.batch_size is not None:
            raise InvalidArgument("params: a check takes one setting for all its rows; give scalars")
        return [params]
    if takes_logits(verifier):
        return [SamplingParams(**setting) for setting in LOGITS_CHECK_SETTINGS]
    return [None]


def _cases_at(cases: list, settings: list, order) -> list:
    """Each chain case without parameters at each setting (named ``case/temperature=0.6`` ...); cases with
    their own parameters, and every case when there is no setting, as they are."""
    if settings == [None]:
        return cases
    out = []
    for case in cases:
        if getattr(case, "tree", None) is not None or case.params is not None:
            out.append(case)
            continue
        for params in settings:
            label = ",".join(f"{key}={value:g}" for key, value in params.describe().items()) or "neutral"
            name = case.name + (f"/{label}" if len(settings) > 1 or params.describe() else "")
            out.append(dataclasses.replace(case, name=name, params=params, order=order))
    return out


def _fitting_cases(verifier, suite, ks: tuple, ls: tuple) -> tuple:
    """The suite (the standard one for ``ks`` x ``ls`` by default) and its cases the verifier can run."""
    if suite is None:
        suite = standard_suite(ks, ls)
    elif isinstance(suite, str):
        suite = load_suite(suite)
    cases = [c for c in suite.cases if verifier.supports(c.num_drafts, c.draft_len) and scheme_fits(verifier, c)]
    if not cases:
        raise InvalidArgument(f"suite: no case of {suite.name!r} fits verifier {verifier.name!r}")
    return suite, cases


def check_verifier(
    verifier: Any,
    *,
    num_drafts: Optional[IntOrInts] = None,
    draft_len: Optional[IntOrInts] = None,
    name: Optional[str] = None,
    output_probs: Optional[Callable] = None,
    draft_scheme: Optional[str] = None,
    seed: int = defaults.SEED,
    num_samples: int = defaults.CHECK_SAMPLES,
    alpha: float = defaults.ALPHA,
    batch_size: int = 64,
    suite: Any = None,
    raise_on_failure: bool = True,
    max_samples: Optional[int] = None,
    max_seconds: Optional[float] = None,
    certify_tv: Optional[float] = None,
    tree: Any = None,
    max_memory: Any = None,
    verifier_timeout: Optional[float] = defaults.VERIFIER_TIMEOUT,
    params: Any = None,
    order: str = "vllm",
) -> ConformanceResult:
    """Check that a verifier honours the contract and is lossless on a standard suite.

    With ``tree`` the verifier is checked as a tree verifier on that draft tree (or those trees):
    see :mod:`spectr_audit.run.tree_conformance`.

    Parameters
    ----------
    verifier : callable, Verifier, class, object with ``verify``, or str
        A plain ``verify(draft_tokens, draft_probs, target_probs, generator)`` function, a
        :class:`~spectr_audit.contract.verifier.Verifier`, or a built-in name / import string.
    num_drafts, draft_len : int or sequence of int
        The K and L to check (every combination).  Default: L = 1 (for a verifier that does not take
        it, the smallest L it supports, e.g. the one a fixed-length verifier declares) and each K in
        (1, 2) that the verifier supports.
    name : str, optional
        Name used in messages (default: the function's name).
    output_probs : callable, optional
        The exact law of a plain function (enables the exact audit and the sampler-vs-law check).
    draft_scheme : {"iid", "without_replacement"}, optional
        How a plain function's drafts must be drawn (default ``"iid"``).
    seed : int
        Seeds every draw (drafts, verdicts, statistical samples).
    num_samples : int
        Sample budget of each statistical test (sampler vs law; the statistical audit of a
        black box per case).
    alpha : float
        False-alarm rate of the whole check for an exact verifier (Bonferroni over its
        statistical tests).
    batch_size : int
        Rows of the drafted batches used by the contract checks.
    suite : Suite or str, optional
        Audit on this suite instead of :func:`standard_suite`.
    raise_on_failure : bool
        Raise :class:`ConformanceFailure` (an ``AssertionError``) when a check fails; else
        return the report.
    max_memory : int or str, optional
        Memory budget (bytes, or a size such as ``"4GiB"``); default a fraction of the machine's
        memory.  A check whose batches or audits would exceed it is refused before it starts
        (:class:`~spectr_audit.run.budget.MemoryBudgetExceeded`).  Not for a tree check (refused:
        the exact tree audit holds its enumeration to its own limits).
    verifier_timeout : float, optional
        Seconds one call of the verifier may take (``None`` or 0: no limit); a call past it
        fails the check it was part of (:mod:`spectr_audit.run.guard`).  A tree check limits
        ``verify_tree`` and ``tree_output_probs`` alike.
    max_samples : int, optional
        The same budget as ``num_samples`` (the name every sampling face uses); wins when given.
    max_seconds : float, optional
        Wall-time budget of each statistical audit's sampling.
    tree : DraftTree, str, path list, or a list of them, optional
        Check a tree verifier (a plain ``verify_tree`` function, a
        :class:`~spectr_audit.contract.tree_verifier.TreeVerifier`, or a name) on these draft
        trees: a :class:`~spectr_audit.contract.tree.DraftTree`, a spec such as
        ``"paths:[[0],[1],[0,0]]"`` or ``"cartesian:2,2"``, or a path list.  ``draft_scheme``
        then names the tree draft scheme to check (default: every scheme the verifier declares;
        ``"iid"`` for a plain function); ``num_drafts`` and ``draft_len`` do not apply.
    certify_tv : float, optional
        Certify TV <= ``certify_tv`` on every case (a black box by the statistical audit's
        anytime-valid upper bound on its partition, a verifier with an exact law by its exact TV);
        ``report.certified`` says whether every case was.
    params : SamplingParams, optional
        Hold the verifier to the law the engine's sampler draws from with these parameters on every
        case (one setting, scalars; docs/sampling.md).  A verifier that takes logits
        (``takes_logits = True``, a ``verify_logits`` method, or a plain function with
        ``fn.takes_logits = True`` and the signature ``(draft_tokens, draft_logits, target_logits,
        params, generator)``) is handed the raw logits and the parameters; without ``params`` it is
        checked at each setting of :data:`LOGITS_CHECK_SETTINGS` (a temperature below 1, top-k,
        top-p).
    order : str
        The engine's processing order (``"vllm"``, ``"sglang"``, ``"transformers"``, ``"eagle"``).

    Returns
    -------
    ConformanceResult

    Raises
    ------
    ConformanceFailure
        With a message naming each failed check, the case, and the worst cells.
    InvalidArgument
        On bad arguments, or (K, L) the verifier does not support.

    Notes
    -----
    The contract checks are deterministic.  The statistical tests (the sampler against its
    exact law; the statistical audit of a verifier without one) run at a combined level
    ``alpha``: an exact verifier fails at most at that rate, and with a fixed ``seed`` the
    outcome is reproducible.  A failure of a statistical test alone: rerun with another seed;
    one that repeats is a finding.  A verifier with an exact law is audited exactly (float64
    enumeration), with no false alarms.

    Examples
    --------
    >>> from spectr_audit.run.conformance import check_verifier
    >>> report = check_verifier("kseq", num_drafts=2, draft_len=1, num_samples=2000)
    >>> report.passed
    True

    A verifier that takes logits, checked at three sampling settings:

    >>> report = check_verifier("logits-speculative", num_drafts=1, raise_on_failure=False)
    >>> report.passed, sorted({r.metrics["sampling"] for r in report.audit.results})
    (True, ['temperature=0.6; vllm order', 'temperature=1.3, top_k=2; vllm order', 'top_p=0.8; vllm order'])
    """
    # Inside pytest a failure is shown from the caller's line: its message names every failed check.
    __tracebackhide__ = _hide_for_failure
    if tree is not None:
        if num_drafts is not None or draft_len is not None:
            raise InvalidArgument("num_drafts, draft_len: a tree check takes them from tree; drop them")
        if certify_tv is not None:
            raise InvalidArgument("certify_tv: not available for a tree check")
        if params is not None:
            raise InvalidArgument("params: a tree verifier is handed probabilities; give the processed laws as the "
                                  "suite's models instead")
        if max_memory is not None:
            raise InvalidArgument("max_memory: a tree check is not sized by the memory budget (the exact tree audit "
                                  "refuses an enumeration beyond its own limits); drop it")
        if max_samples is not None:
            num_samples = max_samples
        _check_num_samples(num_samples)
        return check_tree_verifier(verifier, tree=tree, name=name, output_probs=output_probs,
                                   draft_scheme=draft_scheme, seed=seed, num_samples=num_samples,
                                   alpha=check_prob("alpha", alpha), batch_size=batch_size, suite=suite,
                                   raise_on_failure=raise_on_failure, max_seconds=max_seconds,
                                   verifier_timeout=guard.check_timeout(verifier_timeout))
    ks = None if num_drafts is None else _as_ints(num_drafts, "num_drafts")
    ls = None if draft_len is None else _as_ints(draft_len, "draft_len")
    if max_samples is not None:
        num_samples = max_samples
    if max_seconds is not None and (isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float))
                                    or not 0 < max_seconds < math.inf):
        raise InvalidArgument(f"max_seconds: expected a positive number, got {max_seconds!r}")
    if certify_tv is not None and (isinstance(certify_tv, bool) or not isinstance(certify_tv, (int, float))
                                   or not 0 < certify_tv < 1):
        raise InvalidArgument(f"certify_tv: expected a number in (0, 1), got {certify_tv!r}")
    alpha = _check_arguments(seed, num_samples, alpha, batch_size, draft_scheme, suite)
    verifier = _to_verifier(verifier, name, output_probs, draft_scheme)
    ls = ls if ls is not None else _default_lengths(verifier)
    ks = _supported_drafts(verifier, ks, ls)
    settings = _sampling_settings(verifier, params, order)
    suite, cases = _fitting_cases(verifier, suite, ks, ls)
    cases = _cases_at(cases, settings, order)
    combos = [(k, length) for k in ks for length in ls
              if verifier.draft_scheme == "iid" or (length == 1 and k <= 5)]
    test_alpha = _test_alpha(alpha, len(combos), len(cases), verifier.has_exact_law)
    verifier_timeout = guard.check_timeout(verifier_timeout)
    options = AuditOptions(seed=seed, alpha=test_alpha, max_samples=num_samples, max_seconds=max_seconds,
                           certify_tv=certify_tv, max_memory=budget.resolve_max_memory(max_memory),
                           verifier_timeout=verifier_timeout)
    budget.check_conformance(verifier, combos, cases, batch_size=batch_size, num_samples=num_samples, options=options)
    checks: list[ConformanceCheck] = []
    results = []
    with guard.time_limited(verifier, verifier_timeout) as limited:
        for k, length in combos:
            checks += _contract_checks(limited, k, length, seed, batch_size, num_samples, test_alpha)
        for case in cases:
            # audit_case limits the calls itself (the outer limit holds where both do)
            result = audit_case(verifier, case, options)
            if result.error is None and not _measured_fidelity(result):
                result = _sampled_fidelity(limited, case, result, options)
            results.append(result)
    report = _conformance_result(verifier, checks, results, suite, seed, alpha,
                                 {} if settings == [None] else {"sampling": [p.describe() for p in settings],
                                                                "order": order})
    if raise_on_failure and not report.passed:
        raise ConformanceFailure(report)
    return report
