"""The generation audit's faces: one call that asserts, engines by spec, and the ``[[generation]]`` cases of suites.

* :func:`check_generation` (an engine author's few lines) and :func:`assert_generation_passed`
  run :func:`~spectr_audit.generation.audit_generation` (or take its result) and raise
  ``AssertionError`` with the verdict line and the deciding test unless the verdict is PASS
  (INCONCLUSIVE fails only with ``fail_on_inconclusive=True``);
* :func:`verdict_line` and :func:`failure_text`: what the CLI, the pytest plugin and the
  assertions print (:mod:`spectr_audit.generation.verdict`);
* :func:`load_generation_engine`: ``toy`` (the correct loop of
  :mod:`spectr_audit.generation.library`), ``toy:SLIP`` (one of its planted slips), ``toy-requests``
  and ``toy-requests:SLIP`` (the loop over whole requests and its slips,
  :mod:`spectr_audit.generation.library.request_slips`), or a user
  factory ``package.module:factory`` / ``path/file.py:factory`` returning a dict or an object with
  ``generate``, ``score``, ``vocab_size`` and optionally ``reference``, ``draft_score``,
  ``prompts``, ``eos_token_id``, ``name`` (:mod:`spectr_audit.generation.engine_specs`);
* :func:`read_prompts`: a prompts file (a JSON list of token-id lists, or one line of
  space-separated ids per prompt); :func:`read_requests`: a requests file (a JSON list of objects
  of :class:`~spectr_audit.contract.requests.Request`'s fields);
* :class:`GenerationCase`, :func:`parse_generation_cases`, :func:`run_generation_cases`: the
  ``[[generation]]`` tables of a suite TOML and their runner (:mod:`spectr_audit.generation.suite`;
  ``spectr-audit generation --suite NAME`` and :func:`spectr_audit.run.generation_suite.run_generation_suite`
  read the suite file).

Suite format (a suite may hold ``[[case]]`` verifier cases, ``[[generation]]`` cases, or both;
``spectr-audit run`` runs the former, ``spectr-audit generation --suite`` the latter)::

    [[generation]]
    name = "toy-correct"                  # letters, digits, '.', '_', '-' (its report folder)
    engine = "toy"                        # toy | toy:SLIP | toy-requests | toy-requests:SLIP |
                                          # package.module:factory | path/file.py:factory
    expected = "pass"                     # pass (PASS or INCONCLUSIVE) | finding; default: finding for
                                          # toy:SLIP, pass otherwise
    max_new_tokens = 16                   # the audit's options: max_new_tokens, batch_size, rounds, arms,
    rounds = 1                            # seed, alpha, power, min_detectable_tv, max_tokens, max_seconds,
    min_detectable_tv = 0.2               # timeout, greedy, logit_tol, allow_failed_calls (failed engine
                                          # calls allowed before the verdict is ERROR; default 0)
    prompts = [[1, 2, 3], [4, 5]]         # default: the engine's own (the toy's built-in prompts)
    reference = true                      # audit with the engine's reference generator (default: a
                                          # factory's when it gives one; not the toy's)
    requires = ["vllm"]                   # modules the engine needs: without one the case is skipped
    reference_tv = 0.04                   # rounds = "auto" with a reference: the TV its own test is sized for
    conditions = ["preemption", "draft-depth=5"]   # serving conditions run as arms of their own (the engine
                                          # makes the engine under each; "all": every one it offers)
    requests = [                          # whole requests, given to the rows in turn (keys: Request's
      {temperature = 0.0, repetition_penalty = 1.3, stop_token_ids = [3], logprobs = 2},   # fields;
      {temperature = 0.7, seed = 5, logit_bias = {"7" = -1.5}, bad_words = [[4, 4]]},     # checked on
    ]                                     # reading); default: the engine's own (toy-requests: every
                                          # feature on); not for toy / toy:SLIP, which take none
    logprob_tolerance = 0.1               # with requests: a returned log-probability's largest gap
    # toy only: vocab_size, toy_seed, draft_noise (a number, or "none": an unrelated draft),
    #           temperature, top_k, top_p (not for toy-requests: its requests carry them), eos_token_id
    # a constraint: only constraint = {automaton = {transitions = {"0" = {"1" = 1}}, accepting = [1],
    #           end_tokens = [0]}}; a regex or JSON schema needs Python (audit_generation(requests=...))
    # a factory: options = { ... } are passed to it as keyword arguments; vocab_size and
    #            eos_token_id fill in what it does not give; a relative file path is read from
    #            the suite file's folder first

Examples
--------
>>> from spectr_audit.generation.library import ToyPair, correct_engine
>>> pair = ToyPair(vocab_size=12, seed=0)
>>> result = check_generation(correct_engine(pair), pair.scorer(), [[1, 2, 3], [4, 5]], vocab_size=12,
...                           max_new_tokens=12)
>>> result.verdict in ("PASS", "INCONCLUSIVE")
True
"""

from __future__ import annotations

from typing import Any, Sequence

from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.engine_specs import FACTORY_KEYS  # noqa: F401 (re-exported)
from spectr_audit.generation.engine_specs import (
    TOY_EOS_TOKEN_ID,
    TOY_VOCAB_SIZE,
    GenerationEngine,
    audit_engine,
    generation_engine_names,
    load_generation_engine,
    read_prompts,
    read_requests,
    spec_kind,
    toy_prompts,
)
from spectr_audit.generation.cases import AUDIT_KEYS, CASE_KEYS, EXPECTED, TOY_KEYS  # noqa: F401 (re-exported)
from spectr_audit.generation.cases import GenerationCase, parse_generation_cases
from spectr_audit.generation.suite import (
    GenerationCaseResult,
    GenerationSuiteInterrupted,
    GenerationSuiteReport,
    run_generation_case,
    run_generation_cases,
    select_cases,
)
from spectr_audit.generation.verdict import detail_lines, write_reports  # noqa: F401 (re-exported)
from spectr_audit.generation.verdict import failure_text, result_json, status_of, verdict_line

__all__ = [
    "GenerationCase",
    "GenerationCaseResult",
    "GenerationEngine",
    "GenerationSuiteInterrupted",
    "GenerationSuiteReport",
    "TOY_EOS_TOKEN_ID",
    "TOY_VOCAB_SIZE",
    "assert_generation_passed",
    "audit_engine",
    "check_generation",
    "failure_text",
    "generation_engine_names",
    "load_generation_engine",
    "parse_generation_cases",
    "read_prompts",
    "read_requests",
    "result_json",
    "run_generation_case",
    "run_generation_cases",
    "select_cases",
    "spec_kind",
    "status_of",
    "toy_prompts",
    "verdict_line",
]


def _audit(*args: Any, **kwargs: Any) -> Any:
    from spectr_audit.generation import audit_generation

    kwargs.setdefault("progress", False)
    return audit_generation(*args, **kwargs)


def _is_result(obj: Any) -> bool:
    from spectr_audit.generation.results import GenerationAuditResult

    return isinstance(obj, GenerationAuditResult)


def assert_generation_passed(result_or_generate: Any, *args: Any, fail_on_inconclusive: bool = False,
                             **kwargs: Any) -> Any:
    """Raise ``AssertionError`` unless a generation audit passed; returns the result.

    Parameters
    ----------
    result_or_generate : GenerationAuditResult or generator
        A result of :func:`~spectr_audit.generation.audit_generation`, or its first argument: the
        audit then runs with ``*args`` and ``**kwargs`` (``score, prompts, vocab_size=...``, ...).
    fail_on_inconclusive : bool
        Fail an INCONCLUSIVE result too (nothing rejected, below the planned power).

    Raises
    ------
    AssertionError
        With the verdict line (verdict, deciding test, p-value), the rejected tests and the
        decisive tokens, on FINDING, ERROR, an incomplete result, and INCONCLUSIVE with the flag.

    Examples
    --------
    >>> from spectr_audit.generation.library import ToyPair, slip_engine
    >>> pair = ToyPair(vocab_size=12, seed=0)
    >>> assert_generation_passed(slip_engine("positions-by-block", pair), pair.scorer(), [[1, 2, 3], [4, 5]],
    ...                          vocab_size=12, max_new_tokens=16)
    Traceback (most recent call last):
    ...
    AssertionError: spectr-audit generation audit: FINDING: positions-by-block against toy target: ...
    """
    if _is_result(result_or_generate):
        if args or kwargs:
            raise InvalidArgument("assert_generation_passed: given a result, it takes no audit arguments "
                                  f"(got {', '.join([f'{len(args)} positional'] * bool(args) + sorted(kwargs))})")
        result = result_or_generate
    elif isinstance(result_or_generate, dict) or not (callable(result_or_generate)
                                                      or callable(getattr(result_or_generate, "generate", None))):
        raise InvalidArgument("result: expected a GenerationAuditResult (from audit_generation) or the audit's "
                              f"arguments (generate, score, prompts, vocab_size=...), got "
                              f"{type(result_or_generate).__name__}")
    else:
        result = _audit(result_or_generate, *args, **kwargs)
    message = failure_text(result, fail_on_inconclusive)
    if message is not None:
        raise AssertionError(message)
    return result


def check_generation(generate: Any, score: Any, prompts: Sequence[Sequence[int]], *, vocab_size: int,
                     fail_on_inconclusive: bool = False, **kwargs: Any) -> Any:
    """Audit ``generate`` against ``score`` and fail unless the verdict is PASS: an engine author's one call.

    Runs :func:`~spectr_audit.generation.audit_generation` (``**kwargs`` are its options:
    ``reference``, ``draft_score``, ``max_new_tokens``, ``rounds``, ``seed``, ``store``, ...; no
    progress bar unless ``progress=True``) and returns the result when it passed.

    Raises
    ------
    AssertionError
        With the report's verdict line (verdict, deciding test, p-value) and the evidence, on
        FINDING or ERROR, and on INCONCLUSIVE with ``fail_on_inconclusive=True``.

    Examples
    --------
    >>> from spectr_audit.generation.library import ToyPair, correct_engine
    >>> pair = ToyPair(vocab_size=12, seed=0)
    >>> check_generation(correct_engine(pair), pair.scorer(), [[1, 2, 3], [4, 5]], vocab_size=12,
    ...                  max_new_tokens=16, min_detectable_tv=0.5).verdict
    'PASS'
    """
    result = _audit(generate, score, prompts, vocab_size=vocab_size, **kwargs)
    message = failure_text(result, fail_on_inconclusive)
    if message is not None:
        raise AssertionError(message)
    return result
