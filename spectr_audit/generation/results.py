"""What a generation audit measured: frozen dataclasses of numbers; the verdict follows from them.

Reports read :meth:`GenerationAuditResult.to_dict` (docs/report-schema.md, "Generation audits").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

__all__ = ["Divergence", "GenerationAuditResult", "StratumRow", "ZeroMassToken"]


def _plain(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


_REQUEST_FIELDS = ("requests", "request_findings", "determinism")


@dataclasses.dataclass(frozen=True)
class ZeroMassToken:
    """An emitted token the scorer gives no mass: decisive unless within the numerics tolerance.

    Attributes
    ----------
    arm, job, row, prompt, position : int or str
        Where: the arm, the job, the row of its batch, the prompt id, the position in the continuation.
    token : int
    margin : float or None
        With a logits scorer: how far (in logits) the token is below the least likely token the
        sampling parameters keep; None without logits.
    numerics : bool
        Whether the margin is within the tolerance (reported, not a finding).
    """

    arm: str
    job: int
    row: int
    prompt: int
    position: int
    token: int
    margin: Optional[float]
    numerics: bool


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first token where a greedy engine and its reference disagree.

    Attributes
    ----------
    arm, job, row, prompt, position : where
    engine_token, reference_token : int
    margin : float or None
        The scorer's logit gap between the two tokens at that context (None without logits).
    numerics : bool
        A near-tie (margin within the tolerance): reported as numerics, not a finding.
    engine_tail, reference_tail : list of int
        The two continuations from the divergence on (at most 16 tokens each).
    """

    arm: str
    job: int
    row: int
    prompt: int
    position: int
    engine_token: int
    reference_token: int
    margin: Optional[float]
    numerics: bool
    engine_tail: tuple
    reference_tail: tuple


@dataclasses.dataclass(frozen=True)
class StratumRow:
    """One stratum's numbers for the per-stratum table.

    Attributes
    ----------
    stratum : str
        ``"all"``, ``"arm single"``, ``"positions 16-63"``, ``"prompt 3"``, ...
    ordering : str
    num_tokens : int
    pvalue, pvalue_adjusted : float
    min_detectable_tv : float
    histogram : tuple of float
        The stratum's PIT counts per bin.
    band : tuple of float
        ``(low, high)``: the 99% range of one bin's count under uniformity (Binomial(n, 1/bins)),
        the acceptance band the reports draw.
    """

    stratum: str
    ordering: str
    num_tokens: int
    pvalue: float
    pvalue_adjusted: Optional[float]
    min_detectable_tv: float
    histogram: tuple
    band: tuple = (0.0, 0.0)


@dataclasses.dataclass(frozen=True)
class GenerationAuditResult:
    """What a generation audit measured.  Numbers only; :attr:`verdict` follows from them.

    Attributes
    ----------
    generator, scorer : str
    verdict : str
        ``"PASS"`` (nothing rejected, at the planned power), ``"FINDING"``, ``"INCONCLUSIVE"``
        (nothing rejected, power short of the plan), ``"ERROR"`` (no job could be scored, or more jobs failed
        than :attr:`allowed_failed_calls`; a FINDING on the jobs that ran stands).
    pvalue : float
        Holm's familywise p-value over the deciding tests (0 on a decisive violation).
    test : str
        The deciding test.
    alpha, power : float
    min_detectable_tv, requested_tv : float
        The smallest TV of the pooled PIT law (the order :attr:`power_ordering`, all tokens)
        detected with ``power`` by that order's all-tokens test, and the one asked for.
    num_tokens, num_continuations, num_jobs : int
        Engine tokens scored, continuations, generator calls.
    tokens_by_arm : dict of str -> int
    subtests : tuple of TestResult
        The whole family (Holm-adjusted), deciding or not.
    deciding : tuple of str
        The names of the tests that decide.
    decided_by : str
        ``"one-sample"`` (against the scorer), ``"two-sample"`` (against the reference, when the
        reference itself differs from the scorer beyond its noise: the numerics floor), ``"greedy"``
        (every law one-hot: the support check and, with a reference, the divergences decide).
    held_out_tv : tuple of HeldOutTV
        Lower confidence bounds on the engine's mean per-token TV to the scorer, per order.
    numerics_floor : tuple of HeldOutTV
        The same for the reference generator (empty without one): how far the scorer's numerics
        alone put a speculation-free engine.
    reference_rejected : bool or None
        Whether the reference's own one-sample tests rejected (None without a reference).
    zero_mass : tuple of ZeroMassToken
    divergences : tuple of Divergence
    strata : tuple of StratumRow
    surprisal_z : float
        The surprisal martingale's Z over all engine tokens.
    agreement : dict
        Repeated requests: pairs, agreeing pairs, expected, identical continuations.
    acceptance : dict
        The engine's counters where it reported them (tokens per target call), and the expected
        value for single-draft speculative sampling at the visited contexts where a draft scorer
        was given.
    greedy : bool
    stop_reason : str
        ``"planned"``, ``"e-process"``, ``"support"``, ``"max_tokens"``, ``"max_seconds"``, ``"interrupted"``.
    failures : tuple of str
        Jobs whose generator or scorer call failed (their arm's other jobs were kept).
    failed_calls : tuple of dict
        The same jobs in full: ``job``, ``arm``, ``error`` (the exception's type and the last line of its
        message: the engine's own exception where it raised one) and ``traceback`` (the whole of it).
    allowed_failed_calls : int
        How many failed jobs the audit allowed (``allow_failed_calls``) before its verdict is ERROR.
    requests : tuple of dict
        The audit's requests (each one's non-default fields and its ``kind``), given in turn to the rows; empty
        without requests (and then absent from :meth:`to_dict`, as are the next two).
    request_findings : tuple of dict
        The whole-request checks' findings (``job``, ``row``, ``check``, ``position``, ``what``), the first 50.
    determinism : dict, optional
        Where the generator declares it honours seeds and a request carries one: rows rerun in another batch
        composition (``checked``), how many gave other tokens (``differing``), which (``rows``), and ``passed``.
        Its own line: not part of the fidelity verdict.
    power_plan : dict, optional
        With ``rounds="auto"``: the tokens the all-tokens test needs for ``requested_tv`` at ``power``
        (``tokens_needed``, at ``alpha / family_size``), the rounds of every arm run first, the arm the further
        rounds ran (``extension_arm``: the fastest in engine tokens per second of generation, ``tokens_per_second``
        by arm), the rounds run (``extension_rounds``), whether the planned power was reached (``reached``), and
        the estimate made after the first rounds (``estimated_seconds``).  ``stop_reason`` says what ended the
        audit: ``power``, a budget (``max_tokens``, ``max_seconds``), or a stopping rule.
    conditions : tuple of dict
        One per serving condition (``docs/generation.md``, "Serving conditions"): ``name``, ``kind``, ``value``,
        ``jobs``, ``tokens`` (of its stratum), ``stats`` (the engine's counters over its counted calls, None when it
        reported none), ``reached`` (True, False, or None: not shown), ``how`` (in words), ``pvalue_adjusted``
        (the smallest of its stratum's tests, Holm-adjusted), ``tests``, ``status`` (``FINDING``, ``ERROR``: every
        call failed, ``NOT REACHED``, ``NOT SHOWN``, ``TOO FEW TOKENS``, ``PASS``) and ``failed_calls``.  A condition not reached keeps the verdict
        from PASS.  Empty without conditions (and then absent from :meth:`to_dict`).
    reference_sample : dict, optional
        With ``rounds="auto"`` and a reference (which runs on the first round of every arm, then only until its own test has
        its tokens, ``reference_tv``): the calls it ran on (``jobs`` of ``of_jobs``), its ``tokens``, the engine's
        tokens on those calls (``engine_tokens_paired``: what the two-sample tests compare), and the smallest TV
        between the scorer's law and the reference's that its own all-tokens test detects
        (``min_detectable_tv``): a scorer departing by less goes unseen by the reference's tests.
    seconds : dict of str -> float
        Wall time of generation, reference generation, scoring and the tests.
    num_bins : int
    incomplete : bool
        The audit was interrupted: the result covers the jobs that finished.
    num_processes : int
    logit_tolerance : float
        The logit margin below which a zero-mass token counts as numerics: ``logit_tol``, or, with
        a reference, the largest margin at which the reference itself emitted a zero-mass token
        (the numerics floor in logits) when that is larger.
    after_eos : tuple of dict
        Continuations that went on after the end-of-sequence token (job, row, where it was).
    power_ordering : str
        The PIT order :attr:`min_detectable_tv` is that of: ``"probability"`` when it was run, else
        the first of ``orderings``.  (At the same tokens and level every order's all-tokens test
        has the same minimum detectable TV; the order says where in [0, 1] a deviation must land.)
    """

    generator: str
    scorer: str
    verdict: str
    pvalue: float
    test: str
    alpha: float
    power: float
    min_detectable_tv: float
    requested_tv: float
    num_tokens: int
    num_continuations: int
    num_jobs: int
    tokens_by_arm: dict
    subtests: tuple
    deciding: tuple
    decided_by: str
    held_out_tv: tuple
    numerics_floor: tuple
    reference_rejected: Optional[bool]
    zero_mass: tuple
    divergences: tuple
    strata: tuple
    surprisal_z: float
    agreement: dict
    acceptance: dict
    greedy: bool
    stop_reason: str
    failures: tuple
    seconds: dict
    num_bins: int
    incomplete: bool = False
    num_processes: int = 1
    logit_tolerance: float = 0.0
    after_eos: tuple = ()
    power_ordering: str = "probability"
    failed_calls: tuple = ()
    allowed_failed_calls: int = 0
    requests: tuple = ()
    request_findings: tuple = ()
    determinism: Optional[dict] = None
    power_plan: Optional[dict] = None
    conditions: tuple = ()
    reference_sample: Optional[dict] = None

    @property
    def passed(self) -> bool:
        """Whether the verdict is PASS."""
        return self.verdict == "PASS"

    @property
    def inconclusive(self) -> bool:
        """Whether nothing was rejected but the power fell short of the plan."""
        return self.verdict == "INCONCLUSIVE"

    @property
    def num_failed_calls(self) -> int:
        """Jobs whose generator, reference or scorer call failed."""
        return len(self.failures)

    @property
    def num_calls(self) -> int:
        """Jobs run: those scored and those whose call failed."""
        return self.num_jobs + len(self.failures)

    @property
    def tv_lower(self) -> float:
        """The best lower bound on the engine's mean per-token TV over the orders."""
        return max((h.lower for h in self.held_out_tv), default=0.0)

    def to_dict(self) -> dict:
        """Plain JSON values: every field, the tests as dicts, ``passed``, ``tv_lower`` and ``num_failed_calls``."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _REQUEST_FIELDS and not self.requests:
                continue  # an audit without requests says nothing of them
            if field.name == "power_plan" and value is None:
                continue  # an audit of planned rounds has no plan of its power to report
            if field.name == "conditions" and not value:
                continue  # an audit without serving conditions says nothing of them
            if field.name == "reference_sample" and value is None:
                continue  # a planned audit runs its reference on every call
            if field.name == "subtests":
                value = [t.to_dict() for t in value]
            out[field.name] = _plain(value)
        out["passed"] = self.passed
        out["tv_lower"] = self.tv_lower
        out["num_failed_calls"] = self.num_failed_calls
        return out
