"""The generation audit's faces: one call that asserts, engines by spec, and the ``[[generation]]`` cases of suites.

* :func:`check_generation` (an engine author's few lines) and :func:`assert_generation_passed`
  run :func:`~spectr_audit.generation.audit_generation` (or take its result) and raise
  ``AssertionError`` with the verdict line and the deciding test unless the verdict is PASS
  (INCONCLUSIVE fails only with ``fail_on_inconclusive=True``);
* :func:`verdict_line` and :func:`failure_text`: what the CLI, the pytest plugin and the
  assertions print;
* :func:`load_generation_engine`: ``toy`` (the correct loop of
  :mod:`spectr_audit.generation.library`), ``toy:SLIP`` (one of its planted slips), or a user
  factory ``package.module:factory`` / ``path/file.py:factory`` returning a dict or an object with
  ``generate``, ``score``, ``vocab_size`` and optionally ``reference``, ``draft_score``,
  ``prompts``, ``eos_token_id``, ``name``;
* :func:`read_prompts`: a prompts file (a JSON list of token-id lists, or one line of
  space-separated ids per prompt);
* :class:`GenerationCase`, :func:`parse_generation_cases`, :func:`run_generation_suite`: the
  ``[[generation]]`` tables of a suite TOML (``spectr-audit generation --suite NAME``).

Suite format (a suite may hold ``[[case]]`` verifier cases, ``[[generation]]`` cases, or both;
``spectr-audit run`` runs the former, ``spectr-audit generation --suite`` the latter)::

    [[generation]]
    name = "toy-correct"                  # letters, digits, '.', '_', '-' (its report folder)
    engine = "toy"                        # toy | toy:SLIP | package.module:factory | path/file.py:factory
    expected = "pass"                     # pass (PASS or INCONCLUSIVE) | finding; default: finding for
                                          # toy:SLIP, pass otherwise
    max_new_tokens = 16                   # the audit's options: max_new_tokens, batch_size, rounds, arms,
    rounds = 1                            # seed, alpha, power, min_detectable_tv, max_tokens, max_seconds,
    min_detectable_tv = 0.2               # timeout, greedy, logit_tol
    prompts = [[1, 2, 3], [4, 5]]         # default: the engine's own (the toy's built-in prompts)
    reference = true                      # audit with the engine's reference generator (default: a
                                          # factory's when it gives one; not the toy's)
    requires = ["vllm"]                   # modules the engine needs: without one the case is skipped
    # toy only: vocab_size, toy_seed, draft_noise (a number, or "none": an unrelated draft),
    #           temperature, top_k, top_p, eos_token_id
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

import dataclasses
import difflib
import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from spectr_audit.errors import InvalidArgument

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
    "result_json",
    "run_generation_case",
    "run_generation_suite",
    "select_cases",
    "status_of",
    "toy_prompts",
    "verdict_line",
]

#: The toy engine's vocabulary unless one is given (:class:`~spectr_audit.generation.library.ToyPair`'s default).
TOY_VOCAB_SIZE = 16
#: The end-of-sequence id a toy slip that needs one (``eos-inside-block``) is audited with.
TOY_EOS_TOKEN_ID = 0
#: The keys a factory's dict may hold (an object: the same attributes).
FACTORY_KEYS = ("generate", "score", "vocab_size", "reference", "draft_score", "prompts", "eos_token_id", "name")
#: Keyword arguments of :func:`load_generation_engine` that only the toy engine takes.
_TOY_ONLY = ("toy_seed", "draft_noise", "temperature", "top_k", "top_p")


# ---------------------------------------------------------------------------------------------
# What a result says, in a line and in a failure message
# ---------------------------------------------------------------------------------------------


def _p(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return "-"
    return "0 (decisive)" if value == 0 else f"{value:.3g}"


def _num(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return "-"
    return f"{value:.3g}"


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def verdict_line(result: Any, exit_code: Optional[int] = None) -> str:
    """The first line of every face: verdict, engine, deciding test and p-value, tokens, and power where it fell short.

    Examples
    --------
    >>> from types import SimpleNamespace as R
    >>> verdict_line(R(verdict="FINDING", generator="shared-stream", scorer="toy target", pvalue=2.6e-4, alpha=1e-3,
    ...              test="independence / within a batch", num_tokens=848, num_jobs=16, incomplete=False,
    ...              stop_reason="planned", min_detectable_tv=0.12, requested_tv=0.02), 1)
    "FINDING: shared-stream against toy target: test 'independence / within a batch', p = 0.00026 (alpha 0.001); 848 tokens in 16 jobs: exit 1"
    """
    verdict = result.verdict + (" (INCOMPLETE)" if getattr(result, "incomplete", False) else "")
    line = (f"{verdict}: {result.generator} against {result.scorer}: test {result.test!r}, p = {_p(result.pvalue)} "
            f"(alpha {result.alpha:g}); {_count(result.num_tokens, 'token')} in {_count(result.num_jobs, 'job')}")
    if result.verdict == "INCONCLUSIVE":
        line += (f"; min detectable TV {_num(result.min_detectable_tv)} above the planned "
                 f"{_num(result.requested_tv)}")
    elif result.verdict == "PASS":
        line += f"; min detectable TV {_num(result.min_detectable_tv)}"
    if result.stop_reason not in ("planned", "e-process", "support"):
        line += f"; stopped: {result.stop_reason}"
    return line if exit_code is None else f"{line}: exit {exit_code}"


def _fails(result: Any, fail_on_inconclusive: bool) -> bool:
    if getattr(result, "incomplete", False):
        return True
    return result.verdict in ("FINDING", "ERROR") or (fail_on_inconclusive and result.verdict == "INCONCLUSIVE")


def detail_lines(result: Any, limit: int = 5) -> list:
    """The lines under the verdict line: how it was decided, the rejected tests, decisive tokens, failures."""
    lines = [f"decided by: {result.decided_by} ({len(result.subtests)} tests, Holm; stop: {result.stop_reason}); "
             f"TV lower bound {_num(result.tv_lower)}; min detectable TV {_num(result.min_detectable_tv)} "
             f"(planned {_num(result.requested_tv)})"]
    rejected = sorted((t for t in result.subtests if t.pvalue_adjusted is not None and t.pvalue_adjusted <= result.alpha),
                      key=lambda t: t.pvalue_adjusted)
    for test in rejected[:limit]:
        lines.append(f"rejected: {test.name}: p = {_p(test.pvalue_adjusted)} (Holm-adjusted): {test.detail}")
    if len(rejected) > limit:
        lines.append(f"rejected: {len(rejected) - limit} more tests")
    zero = [z for z in result.zero_mass if not z.numerics]
    for z in zero[:limit]:
        margin = "" if z.margin is None else f", {z.margin:.3g} logits below the kept tokens"
        lines.append(f"zero-mass token: {z.token} at position {z.position} of prompt {z.prompt} (arm {z.arm}, job "
                     f"{z.job}, row {z.row}){margin}")
    for item in list(result.after_eos)[:limit]:
        lines.append(f"past end-of-sequence: job {item.get('job')}, row {item.get('row')}: the end-of-sequence token "
                     f"at position {item.get('position')} is not the last")
    for d in [d for d in result.divergences if not d.numerics][:limit]:
        lines.append(f"greedy divergence: prompt {d.prompt} at position {d.position} (arm {d.arm}): engine "
                     f"{d.engine_token}, reference {d.reference_token}, margin {_num(d.margin)}")
    for failure in list(result.failures)[:limit]:
        lines.append(f"failed job: {failure}")
    if result.verdict == "INCONCLUSIVE":
        lines.append("nothing rejected, but too few tokens for the planned power: raise max_new_tokens, rounds or "
                     "the prompts, or plan a larger min_detectable_tv")
    if getattr(result, "incomplete", False):
        lines.append("INCOMPLETE: the audit was interrupted; the result covers the jobs that finished")
    return lines


def failure_text(result: Any, fail_on_inconclusive: bool = False) -> Optional[str]:
    """Why ``result`` fails an assertion (the verdict line, the deciding test, the evidence), or None when it passes.

    FINDING, ERROR and an incomplete result fail; INCONCLUSIVE fails only with ``fail_on_inconclusive``.
    """
    if not _fails(result, fail_on_inconclusive):
        return None
    return "spectr-audit generation audit: " + verdict_line(result) + "".join(
        "\n  " + line for line in detail_lines(result))


def status_of(result: Any, fail_on_inconclusive: bool = False) -> int:
    """The exit code of one audit: 0 PASS (and INCONCLUSIVE without the flag), 1 FINDING or ERROR, 3 INCONCLUSIVE
    with the flag, 130 incomplete (interrupted)."""
    if getattr(result, "incomplete", False):
        return 130
    if result.verdict in ("FINDING", "ERROR"):
        return 1
    if result.verdict == "INCONCLUSIVE" and fail_on_inconclusive:
        return 3
    return 0


def result_json(result: Any) -> str:
    """The result as JSON text: the generation report's JSON when :mod:`spectr_audit.reports.generation` has it,
    else ``result.to_dict()`` with the version and kind."""
    module = _generation_reports()
    if module is not None and hasattr(module, "render_generation_json"):
        return module.render_generation_json(result).rstrip("\n")
    if module is not None and hasattr(module, "generation_json"):
        data = module.generation_json(result)
        return data if isinstance(data, str) else json.dumps(data, indent=2)
    from spectr_audit import __version__

    return json.dumps({"spectr_audit_version": __version__, "kind": "generation-audit", **result.to_dict()}, indent=2)


def _generation_reports():
    """:mod:`spectr_audit.reports.generation` when it is installed (None otherwise)."""
    import importlib
    import importlib.util

    try:
        if importlib.util.find_spec("spectr_audit.reports.generation") is None:
            return None
    except (ImportError, ValueError):
        return None
    return importlib.import_module("spectr_audit.reports.generation")


def write_reports(result: Any, out: Union[str, Path]) -> list:
    """Write the result's reports into the folder ``out`` (report.json, and .md, .html, JUnit where
    :mod:`spectr_audit.reports.generation` writes them); returns the paths written."""
    from spectr_audit._files import write_text_atomic

    out = Path(out)
    module = _generation_reports()
    if module is not None and hasattr(module, "write_generation_report"):
        before = {p: p.stat().st_mtime_ns for p in out.iterdir()} if out.is_dir() else {}
        written = module.write_generation_report(result, out)
        if isinstance(written, (str, Path)):
            written = [written]
        elif isinstance(written, dict):
            written = list(written.values())
        paths = [Path(p) for p in (written or [])]
        if not paths:  # it returned nothing: what it wrote or rewrote
            paths = sorted(p for p in out.iterdir() if p.is_file() and before.get(p) != p.stat().st_mtime_ns)
        return paths
    return [write_text_atomic(out / "report.json", result_json(result) + "\n")]


# ---------------------------------------------------------------------------------------------
# The one-call API
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Engines by spec
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class GenerationEngine:
    """What an engine spec resolves to: the contract's callables and what the audit needs besides.

    Attributes
    ----------
    name : str
        The spec.
    generate, score : callable or object
    vocab_size : int
    reference, draft_score : optional
    prompts : list of token-id lists, optional
        The engine's own prompts (the toy's built-in ones).
    eos_token_id : int, optional
    max_new_tokens : int, optional
        What the engine asks for (a toy slip's continuation length), unless the caller sets one.
    expected : str
        ``"finding"`` for a planted slip, ``"pass"`` otherwise.
    description : str
    reference_by_default : bool
        Whether an audit uses ``reference`` unless told otherwise: a factory's, yes; the toy's,
        no (its scorer is exact, so the reference's two-sample tests add only time).
    """

    name: str
    generate: Any
    score: Any
    vocab_size: int
    reference: Any = None
    draft_score: Any = None
    prompts: Optional[list] = None
    eos_token_id: Optional[int] = None
    max_new_tokens: Optional[int] = None
    expected: str = "pass"
    description: str = ""
    reference_by_default: bool = True


def toy_prompts(vocab_size: int = TOY_VOCAB_SIZE) -> list:
    """The toy engine's built-in prompts: six, of one to four tokens, two alike in length (ids below ``vocab_size``).

    >>> toy_prompts(16)
    [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2, 2], [3], [10, 11, 12]]
    """
    base = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2, 2], [3], [10, 11, 12]]
    return [[t % vocab_size for t in p] for p in base]


def generation_engine_names() -> list:
    """Every built-in engine spec: ``toy`` and ``toy:SLIP`` for each planted slip, with what each needs.

    Returns a list of dicts ``{"spec", "expected", "needs"}``.
    """
    from spectr_audit.generation.library import SLIPS

    rows = [{"spec": "toy", "expected": "pass",
             "needs": "the correct speculative loop over the toy model pair (PASS at enough tokens)"}]
    for name, slip in SLIPS.items():
        extra = []
        if slip.params:
            extra.append(", ".join(f"{k}={v}" for k, v in slip.params.items()))
        if slip.max_new_tokens != 32:
            extra.append(f"max_new_tokens={slip.max_new_tokens}")
        if slip.eos:
            extra.append(f"eos_token_id={TOY_EOS_TOKEN_ID}")
        rows.append({"spec": f"toy:{name}", "expected": "finding",
                     "needs": slip.needs + (f" (audited with {'; '.join(extra)})" if extra else "")})
    return rows


def _suggest(text: str, names: Sequence[str]) -> str:
    close = difflib.get_close_matches(text, list(names), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return value


def _toy_engine(slip_name: Optional[str], spec: str, argument: str, vocab_size: Optional[int], toy_seed: Optional[int],
                draft_noise: Any, temperature: Any, top_k: Any, top_p: Any, eos_token_id: Optional[int]) -> GenerationEngine:
    from spectr_audit.contract.sampling import SamplingParams
    from spectr_audit.generation.library import SLIPS, ToyPair, correct_engine, slip_engine

    slip = None
    if slip_name is not None:
        if slip_name not in SLIPS:
            raise InvalidArgument(f"{argument}: {spec!r}: no toy slip {slip_name!r}{_suggest(slip_name, SLIPS)}; "
                                  f"the slips: {', '.join(SLIPS)}")
        slip = SLIPS[slip_name]
    vocab = TOY_VOCAB_SIZE if vocab_size is None else _check_int(vocab_size, "vocab_size", 2)
    seed = 0 if toy_seed is None else toy_seed
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InvalidArgument(f"toy_seed: expected an integer >= 0, got {toy_seed!r}")
    noise = 0.3 if draft_noise == "default" else draft_noise
    if noise is not None and (isinstance(noise, bool) or not isinstance(noise, (int, float))
                              or not 0 <= noise < math.inf):
        raise InvalidArgument(f"draft_noise: expected a number >= 0 or none (an unrelated draft), got {draft_noise!r}")
    fields = dict(slip.params) if slip is not None else {}
    fields.update({k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
                   if v is not None})
    params = SamplingParams(**fields) if fields else None
    eos = eos_token_id if eos_token_id is not None else (TOY_EOS_TOKEN_ID if slip is not None and slip.eos else None)
    if eos is not None:
        _check_int(eos, "eos_token_id", 0)
        if eos >= vocab:
            raise InvalidArgument(f"eos_token_id: {eos} is not a token id of the vocabulary [0, {vocab})")
    pair = ToyPair(vocab, seed=seed, draft_noise=None if noise is None else float(noise), params=params,
                   eos_token_id=eos)
    engine = correct_engine(pair) if slip is None else slip_engine(slip_name, pair)
    return GenerationEngine(
        name=spec, generate=engine, score=pair.scorer(), vocab_size=vocab, reference=pair.reference(),
        draft_score=pair.draft_scorer(), prompts=toy_prompts(vocab), eos_token_id=eos,
        max_new_tokens=None if slip is None else slip.max_new_tokens,
        expected="pass" if slip is None else "finding",
        description="the correct toy speculative loop" if slip is None else f"toy slip {slip_name}: {slip.needs}",
        reference_by_default=False)


def _member(made: Any, key: str) -> Any:
    """A factory result's field: a dict's key, or an object's attribute (its own bound method: the object itself,
    so that the contract reads its attributes, ``per_row_max_new_tokens`` and ``name``)."""
    if isinstance(made, dict):
        return made.get(key)
    value = getattr(made, key, None)
    if key in ("generate", "score") and getattr(value, "__self__", None) is made:
        return made
    return value


def _factory_engine(spec: str, argument: str, vocab_size: Optional[int], eos_token_id: Optional[int],
                    options: Optional[dict], base: Optional[Path]) -> GenerationEngine:
    from spectr_audit.registry import load_object

    target, _, attr = spec.rpartition(":")
    looks_like_path = target.endswith(".py") or "/" in target or "\\" in target
    if looks_like_path and base is not None and not Path(target).is_absolute() and (base / target).is_file():
        spec_to_load = f"{base / target}:{attr}"
    else:
        spec_to_load = spec
    obj = load_object(spec_to_load, argument)
    if isinstance(obj, dict) or (not isinstance(obj, type) and hasattr(obj, "generate") and hasattr(obj, "score")):
        if options:
            raise InvalidArgument(f"options: {spec!r} is not a factory (a callable) but an engine itself; drop options")
        made = obj
    elif callable(obj):
        try:
            made = obj(**(options or {}))
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            raise InvalidArgument(f"{argument}: the factory {spec!r} raised {type(exc).__name__}: {exc}") from exc
    else:
        raise InvalidArgument(f"{argument}: {spec!r} is a {type(obj).__name__}, not a factory (a callable returning a "
                              f"dict or an object with generate and score)")
    if isinstance(made, dict):
        unknown = sorted(set(made) - set(FACTORY_KEYS))
        if unknown:
            raise InvalidArgument(f"{argument}: the factory {spec!r} returned unknown key(s) {unknown}; expected "
                                  f"some of {', '.join(FACTORY_KEYS)}")
    missing = [k for k in ("generate", "score") if _member(made, k) is None]
    if missing:
        raise InvalidArgument(f"{argument}: the factory {spec!r} returned a {type(made).__name__} without "
                              f"{' and '.join(missing)}; it must give generate, score and vocab_size "
                              f"(optional: reference, draft_score, prompts, eos_token_id)")
    given = _member(made, "vocab_size")
    if given is None and vocab_size is None:
        raise InvalidArgument(f"{argument}: the factory {spec!r} gives no vocab_size; add it to what the factory "
                              "returns (or give vocab_size)")
    if given is not None:
        _check_int(given, f"{argument}: {spec!r} vocab_size", 2)
        if vocab_size is not None and vocab_size != given:
            raise InvalidArgument(f"vocab_size: {vocab_size} given, but the factory {spec!r} says {given}")
    vocab = given if given is not None else _check_int(vocab_size, "vocab_size", 2)
    eos = eos_token_id if eos_token_id is not None else _member(made, "eos_token_id")
    if eos is not None:
        _check_int(eos, "eos_token_id", 0)
    prompts = _member(made, "prompts")
    name = _member(made, "name")
    return GenerationEngine(
        name=str(name) if name else spec, generate=_member(made, "generate"), score=_member(made, "score"),
        vocab_size=vocab, reference=_member(made, "reference"), draft_score=_member(made, "draft_score"),
        prompts=None if prompts is None else list(prompts), eos_token_id=eos, description=f"factory {spec}")


def load_generation_engine(spec: str, *, vocab_size: Optional[int] = None, toy_seed: Optional[int] = None,
                           draft_noise: Any = "default", temperature: Optional[float] = None,
                           top_k: Optional[int] = None, top_p: Optional[float] = None,
                           eos_token_id: Optional[int] = None, options: Optional[dict] = None,
                           argument: str = "engine", base: Optional[Union[str, Path]] = None) -> GenerationEngine:
    """Resolve an engine spec: ``toy``, ``toy:SLIP``, ``package.module:factory`` or ``path/file.py:factory``.

    Parameters
    ----------
    spec : str
    vocab_size : int, optional
        The toy's vocabulary (default 16); for a factory, what it does not give itself.
    toy_seed, draft_noise, temperature, top_k, top_p : optional
        The toy model pair: its weights' seed, the draft's perturbation (None: an unrelated
        draft) and the sampling parameters (a slip's own parameters are the default).
    eos_token_id : int, optional
        The engine's end-of-sequence id (a toy slip that needs one gets 0).
    options : dict, optional
        Keyword arguments of a factory.
    argument : str
        How errors name the spec (``--engine`` on the command line).
    base : path, optional
        A folder a relative ``file.py`` is looked up in first (a suite file's).

    Raises
    ------
    InvalidArgument
        Naming ``argument``: an unknown slip (with a near match), a bad import string, a factory
        that raises or returns something without ``generate``, ``score`` or ``vocab_size``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidArgument(f"{argument}: expected 'toy', 'toy:SLIP', 'package.module:factory' or "
                              f"'path/file.py:factory', got {spec!r}")
    spec = spec.strip()
    if spec == "toy:":
        from spectr_audit.generation.library import SLIPS

        raise InvalidArgument(f"{argument}: 'toy:' names no slip; the slips: {', '.join(SLIPS)}")
    if spec == "toy" or spec.startswith("toy:"):
        if options:
            raise InvalidArgument("options: only for a factory engine; the toy takes vocab_size, toy_seed, draft_noise, "
                                  "temperature, top_k, top_p, eos_token_id")
        return _toy_engine(None if spec == "toy" else spec[4:], spec, argument, vocab_size, toy_seed,
                           draft_noise, temperature, top_k, top_p, eos_token_id)
    given = [name for name, value in (("toy_seed", toy_seed), ("draft_noise", None if draft_noise == "default" else 0),
                                      ("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
             if value is not None]
    if given:
        raise InvalidArgument(f"{', '.join(given)}: only for the toy engine; a factory's engine has its own model and "
                              "sampling setting")
    if ":" not in spec or not spec.rpartition(":")[0] or not spec.rpartition(":")[2]:
        hint = _suggest(spec, ["toy"]) if ":" not in spec else ""
        raise InvalidArgument(f"{argument}: {spec!r} is neither 'toy', 'toy:SLIP' nor an import string "
                              f"'package.module:factory' or 'path/file.py:factory'{hint}")
    return _factory_engine(spec, argument, vocab_size, eos_token_id, options, None if base is None else Path(base))


def read_prompts(path: Union[str, Path], argument: str = "--prompts") -> list:
    """Read prompts from a file: a JSON list of token-id lists, or one prompt per line (space-separated ids;
    blank lines and lines starting with ``#`` are skipped).

    Raises ``InvalidArgument`` naming ``argument``, the file and the line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise InvalidArgument(f"{argument}: cannot read {str(path)!r}: {reason}") from None
    stripped = text.strip()
    if not stripped:
        raise InvalidArgument(f"{argument}: {str(path)!r} is empty; expected a JSON list of token-id lists or one "
                              "line of space-separated token ids per prompt")
    if stripped.startswith("["):
        try:
            prompts = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{argument}: {str(path)!r} is not valid JSON: {exc}") from None
        if not isinstance(prompts, list) or not all(isinstance(p, list) for p in prompts):
            raise InvalidArgument(f"{argument}: {str(path)!r}: expected a JSON list of token-id lists, e.g. "
                                  "[[1, 2, 3], [4, 5]]")
        for i, prompt in enumerate(prompts):
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
                raise InvalidArgument(f"{argument}: {str(path)!r}: prompt {i} is not a non-empty list of token ids "
                                      f"(integers >= 0): {prompt!r:.80}")
        return prompts
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            ids = [int(t) for t in line.replace(",", " ").split()]
        except ValueError:
            raise InvalidArgument(f"{argument}: {str(path)!r} line {number}: expected space-separated token ids, got "
                                  f"{line!r:.80}") from None
        if any(t < 0 for t in ids):
            raise InvalidArgument(f"{argument}: {str(path)!r} line {number}: token ids must be >= 0")
        prompts.append(ids)
    return prompts


def _prune(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if v is not None}


def audit_engine(engine: GenerationEngine, prompts: Optional[Sequence[Sequence[int]]] = None, *,
                 reference: Optional[bool] = None, **kwargs: Any) -> Any:
    """Run :func:`~spectr_audit.generation.audit_generation` on a resolved engine: its own prompts unless given;
    its reference generator when ``reference`` is True (None: the engine's :attr:`~GenerationEngine.reference_by_default`);
    options that are None keep the audit's defaults."""
    if reference is None:
        reference = engine.reference_by_default
    prompts = prompts if prompts is not None else engine.prompts
    if prompts is None:
        raise InvalidArgument(f"prompts: the engine {engine.name!r} gives none; give prompts (--prompts FILE)")
    options = _prune(kwargs)
    if engine.max_new_tokens is not None:
        options.setdefault("max_new_tokens", engine.max_new_tokens)
    if engine.eos_token_id is not None:
        options.setdefault("eos_token_id", engine.eos_token_id)
    options.setdefault("progress", False)
    from spectr_audit.generation import audit_generation

    return audit_generation(engine.generate, engine.score, prompts, vocab_size=engine.vocab_size,
                            reference=engine.reference if reference else None, draft_score=engine.draft_score,
                            **options)


# ---------------------------------------------------------------------------------------------
# [[generation]] cases of suites
# ---------------------------------------------------------------------------------------------

#: The audit's options a case may set.
AUDIT_KEYS = ("max_new_tokens", "batch_size", "rounds", "arms", "seed", "alpha", "power", "min_detectable_tv",
              "max_tokens", "max_seconds", "timeout", "greedy", "logit_tol")
TOY_KEYS = ("vocab_size", "toy_seed", "draft_noise", "temperature", "top_k", "top_p", "eos_token_id")
CASE_KEYS = ("name", "description", "engine", "expected", "options", "prompts", "reference",
             "requires") + TOY_KEYS + AUDIT_KEYS
EXPECTED = ("pass", "finding")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclasses.dataclass(frozen=True)
class GenerationCase:
    """One ``[[generation]]`` table: an engine spec, what its verdict should be, and the audit's options.

    Attributes
    ----------
    name, description, engine : str
    expected : str
        ``"pass"`` (PASS, or INCONCLUSIVE listed as such) or ``"finding"``.
    prompts : tuple of tuple of int, optional
    reference : bool or None
        Audit with the engine's reference generator (None: a factory's if it gives one; not the toy's).
    engine_options : dict
        The toy's keys (``vocab_size``, ``toy_seed``, ...) and a factory's ``options``.
    audit_options : dict
        Keyword arguments of :func:`~spectr_audit.generation.audit_generation`.
    base : str
        The folder of the suite file (a relative factory path is looked up there first).
    requires : tuple of str
        Modules the engine needs (``vllm``, ``transformers``); a case whose module is missing is
        skipped, and the suite report says so.
    """

    name: str
    engine: str
    expected: str = "pass"
    description: str = ""
    prompts: Optional[tuple] = None
    reference: Optional[bool] = None
    engine_options: dict = dataclasses.field(default_factory=dict, hash=False)
    audit_options: dict = dataclasses.field(default_factory=dict, hash=False)
    base: str = ""
    requires: tuple = ()

    def missing(self) -> list:
        """The modules of :attr:`requires` that are not installed."""
        import importlib.util

        out = []
        for module in self.requires:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                out.append(module)
        return out

    def to_dict(self) -> dict:
        return {"name": self.name, "engine": self.engine, "expected": self.expected, "description": self.description,
                "prompts": None if self.prompts is None else [list(p) for p in self.prompts],
                "reference": self.reference, "engine_options": dict(self.engine_options),
                "audit_options": dict(self.audit_options), "requires": list(self.requires)}


def _number(value: Any, where: str, key: str, low: float, high: float, low_open: bool, high_open: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise InvalidArgument(f"{where}: {key}: expected a number in {lo}{low:g}, {_hi_text(high)}{hi}, got {value!r}")
    return float(value)


def _hi_text(high: float) -> str:
    return "inf" if high == math.inf else f"{high:g}"


def _integer(value: Any, where: str, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(f"{where}: {key}: expected an integer >= {minimum}, got {value!r}")
    return value


def _check_case_value(key: str, value: Any, where: str) -> Any:
    from spectr_audit.generation.designs import ARMS

    if key in ("max_new_tokens", "batch_size", "rounds", "max_tokens"):
        return _integer(value, where, key, 1)
    if key in ("seed", "toy_seed", "top_k", "eos_token_id"):
        return _integer(value, where, key, 0)
    if key == "vocab_size":
        return _integer(value, where, key, 2)
    if key in ("alpha", "power", "min_detectable_tv"):
        return _number(value, where, key, 0, 1, True, True)
    if key in ("max_seconds", "timeout"):
        return _number(value, where, key, 0, math.inf, True, True)
    if key == "logit_tol":
        return _number(value, where, key, 0, math.inf, False, True)
    if key == "temperature":
        return _number(value, where, key, 0, math.inf, False, True)
    if key == "top_p":
        return _number(value, where, key, 0, 1, True, False)
    if key == "draft_noise":
        if value == "none":
            return None
        return _number(value, where, key, 0, math.inf, False, True)
    if key in ("greedy", "reference"):
        if not isinstance(value, bool):
            raise InvalidArgument(f"{where}: {key}: expected true or false, got {value!r}")
        return value
    if key == "arms":
        if not isinstance(value, list) or not value or any(a not in ARMS for a in value):
            raise InvalidArgument(f"{where}: arms: expected a non-empty list drawn from {list(ARMS)}, got {value!r}")
        return tuple(value)
    raise AssertionError(key)  # pragma: no cover - every key of CASE_KEYS is handled


def parse_generation_cases(raw: Any, source: str = "suite", base: Optional[Union[str, Path]] = None) -> tuple:
    """Validate the ``[[generation]]`` tables of a suite and build its :class:`GenerationCase` s.

    Errors name the source, the table (``generation[i] ('name')``) and the key.
    """
    from spectr_audit.generation.library import SLIPS

    if not isinstance(raw, list) or not raw or not all(isinstance(t, dict) for t in raw):
        raise InvalidArgument(f"{source}: generation: expected [[generation]] tables")
    cases, seen = [], set()
    for i, table in enumerate(raw):
        where = f"{source} generation[{i}]" + (f" ({table['name']!r})" if "name" in table else "")
        unknown = sorted(set(table) - set(CASE_KEYS))
        if unknown:
            raise InvalidArgument(f"{where}: unknown key(s) {unknown}{_suggest(unknown[0], CASE_KEYS)}; allowed: "
                                  f"{sorted(CASE_KEYS)}")
        name = table.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidArgument(f"{where}: name: expected letters, digits, '.', '_' or '-' (it names the case's "
                                  f"report folder), got {name!r}")
        if name in seen:
            raise InvalidArgument(f"{where}: name: duplicate case name {name!r}")
        seen.add(name)
        engine = table.get("engine")
        if not isinstance(engine, str) or not engine.strip():
            raise InvalidArgument(f"{where}: engine: expected 'toy', 'toy:SLIP', 'package.module:factory' or "
                                  f"'path/file.py:factory', got {engine!r}")
        engine = engine.strip()
        toy = engine == "toy" or engine.startswith("toy:")
        if toy and engine != "toy" and engine[4:] not in SLIPS:
            raise InvalidArgument(f"{where}: engine: no toy slip {engine[4:]!r}{_suggest(engine[4:], SLIPS)}; the "
                                  f"slips: {', '.join(SLIPS)}")
        if not toy and ":" not in engine:
            raise InvalidArgument(f"{where}: engine: {engine!r} is neither 'toy', 'toy:SLIP' nor an import string "
                                  "'package.module:factory' or 'path/file.py:factory'")
        expected = table.get("expected", "finding" if toy and engine != "toy" else "pass")
        if expected not in EXPECTED:
            raise InvalidArgument(f"{where}: expected: expected one of {list(EXPECTED)}, got {expected!r}")
        description = table.get("description", "")
        if not isinstance(description, str):
            raise InvalidArgument(f"{where}: description: expected a string, got {description!r}")
        prompts = table.get("prompts")
        if prompts is not None:
            if not isinstance(prompts, list) or not prompts or not all(
                    isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                      for t in p) for p in prompts):
                raise InvalidArgument(f"{where}: prompts: expected a non-empty list of non-empty token-id lists, got "
                                      f"{prompts!r:.80}")
            prompts = tuple(tuple(p) for p in prompts)
        engine_options = {}
        for key in TOY_KEYS:
            if key in table:
                if not toy and key not in ("vocab_size", "eos_token_id"):
                    raise InvalidArgument(f"{where}: {key}: only for a toy engine; a factory takes options = {{...}}")
                engine_options[key] = _check_case_value(key, table[key], where)
        if "options" in table:
            if toy:
                raise InvalidArgument(f"{where}: options: only for a factory engine; the toy takes "
                                      f"{', '.join(TOY_KEYS)}")
            if not isinstance(table["options"], dict):
                raise InvalidArgument(f"{where}: options: expected a table of the factory's keyword arguments")
            engine_options["options"] = dict(table["options"])
        audit_options = {key: _check_case_value(key, table[key], where) for key in AUDIT_KEYS if key in table}
        reference = _check_case_value("reference", table["reference"], where) if "reference" in table else None
        requires = table.get("requires", [])
        if isinstance(requires, str):
            requires = [requires]
        if not isinstance(requires, list) or not all(isinstance(m, str) and re.match(r"^[A-Za-z_][\w.]*$", m)
                                                     for m in requires):
            raise InvalidArgument(f"{where}: requires: expected a list of module names, e.g. [\"vllm\"], got "
                                  f"{requires!r}")
        cases.append(GenerationCase(name=name, engine=engine, expected=expected, description=description,
                                    prompts=prompts, reference=reference, engine_options=engine_options,
                                    audit_options=audit_options, base="" if base is None else str(base),
                                    requires=tuple(requires)))
    return tuple(cases)


@dataclasses.dataclass(frozen=True)
class GenerationCaseResult:
    """A case's result against what it expected."""

    case: str
    engine: str
    expected: str
    result: Any
    #: The generator's ``repro_spec`` (engines that can write a standalone reproduction), and the prompts audited.
    repro_spec: Optional[dict] = None
    prompts: Optional[tuple] = None

    @property
    def as_expected(self) -> bool:
        """A ``finding`` case gave FINDING; a ``pass`` case PASS or INCONCLUSIVE; neither when incomplete."""
        if getattr(self.result, "incomplete", False):
            return False
        if self.expected == "finding":
            return self.result.verdict == "FINDING"
        return self.result.verdict in ("PASS", "INCONCLUSIVE")

    @property
    def inconclusive(self) -> bool:
        return self.expected == "pass" and self.result.verdict == "INCONCLUSIVE"

    def line(self) -> str:
        mark = "as expected" if self.as_expected else "NOT as expected"
        return f"{self.case}: {verdict_line(self.result)} (expected {self.expected}: {mark})"

    def to_dict(self) -> dict:
        return {"case": self.case, "engine": self.engine, "expected": self.expected, "as_expected": self.as_expected,
                "result": self.result.to_dict()}


@dataclasses.dataclass(frozen=True)
class GenerationSuiteReport:
    """The results of a suite's ``[[generation]]`` cases, in order; ``incomplete`` says why a run stopped early;
    ``skipped`` holds ``(case, reason)`` for the cases not run (a module they require is missing)."""

    suite: str
    results: tuple
    planned: int
    incomplete: Optional[str] = None
    skipped: tuple = ()

    @property
    def unexpected(self) -> list:
        return [r for r in self.results if not r.as_expected]

    @property
    def inconclusive(self) -> list:
        return [r for r in self.results if r.inconclusive]

    @property
    def passed(self) -> bool:
        return self.incomplete is None and not self.unexpected

    def exit_status(self, fail_on_inconclusive: bool = False) -> int:
        """130 incomplete, 1 a case not as expected, 3 only inconclusive ones with the flag, else 0."""
        if self.incomplete is not None:
            return 130
        if self.unexpected:
            return 1
        return 3 if fail_on_inconclusive and self.inconclusive else 0

    def to_dict(self) -> dict:
        from spectr_audit import __version__

        return {"spectr_audit_version": __version__, "kind": "generation-suite", "suite": self.suite,
                "passed": self.passed, "planned": self.planned, "completed": len(self.results),
                "incomplete": self.incomplete, "results": [r.to_dict() for r in self.results],
                "skipped": [{"case": case, "reason": reason} for case, reason in self.skipped]}


class GenerationSuiteInterrupted(KeyboardInterrupt):
    """Ctrl-C during a generation suite; ``report`` holds the finished cases (and the interrupted one's partial
    result), marked incomplete."""

    def __init__(self, report: GenerationSuiteReport):
        super().__init__(f"generation suite interrupted after {len(report.results)} of {report.planned} cases")
        self.report = report


def run_generation_case(case: GenerationCase, *, store: Optional[Union[str, Path]] = None, resume: bool = False,
                        with_engine: bool = False, **overrides: Any) -> Any:
    """Audit one case: its engine resolved, its options with ``overrides`` (None keeps the case's) on top.

    Returns the result, or ``(result, engine, prompts)`` with ``with_engine=True``.
    """
    where = f"generation case {case.name!r}"
    options = dict(case.engine_options)
    factory_options = options.pop("options", None)
    engine = load_generation_engine(case.engine, argument=f"{where}: engine", options=factory_options,
                                    base=case.base or None, **options)
    audit_options = {**case.audit_options, **_prune(overrides)}
    prompts = None if case.prompts is None else [list(p) for p in case.prompts]
    if prompts is None and engine.prompts is None:
        raise InvalidArgument(f"{where}: prompts: the engine {case.engine!r} gives none; add prompts = [[...], ...]")
    result = audit_engine(engine, prompts, reference=case.reference, store=None if store is None else str(store),
                          resume=resume, **audit_options)
    return (result, engine, prompts if prompts is not None else engine.prompts) if with_engine else result


def select_cases(cases: Sequence[GenerationCase], patterns: Optional[Sequence[str]]) -> tuple:
    """The cases whose name matches one of the shell-style ``patterns`` (all of them when None), in suite order.

    Raises
    ------
    InvalidArgument
        A pattern that matches no case.
    """
    import fnmatch

    if patterns is None:
        return tuple(cases)
    names = [c.name for c in cases]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise InvalidArgument(f"case: {pattern!r} matches no case{_suggest(pattern, names)}; the cases: "
                                  f"{', '.join(names)}")
    return tuple(c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in patterns))


def run_generation_suite(suite: Any, *, store_dir: Optional[Union[str, Path]] = None, resume: bool = False,
                         on_result: Optional[Callable[[GenerationCaseResult], None]] = None,
                         on_start: Optional[Callable[[GenerationCase], None]] = None,
                         select: Optional[Sequence[str]] = None,
                         **overrides: Any) -> GenerationSuiteReport:
    """Run every ``[[generation]]`` case of ``suite`` (a name, a path or a :class:`~spectr_audit.run.suite.Suite`).

    ``store_dir``: a folder with one SQLite store per case (``<case>.sqlite``; ``resume=True``
    continues those that exist and starts the others).  ``overrides`` (``seed``, ``alpha``, ``max_tokens``, ``max_seconds``,
    ``timeout``, ``progress``) replace every case's own.  ``on_start(case)`` and
    ``on_result(case_result)`` are called around each case.  ``select``: shell-style patterns of
    the case names to run (default all).  A case whose ``requires`` lists a module that is not
    installed is skipped (the report's ``skipped``).

    Raises
    ------
    InvalidArgument
        A suite without ``[[generation]]`` cases, or a case whose engine cannot be resolved.
    GenerationSuiteInterrupted
        On Ctrl-C, carrying the finished cases.
    """
    from spectr_audit.generation import GenerationInterrupted
    from spectr_audit.run.suite import Suite, load_suite

    suite_obj = suite if isinstance(suite, Suite) else load_suite(suite)
    cases = tuple(getattr(suite_obj, "generation", ()))
    if not cases:
        raise InvalidArgument(f"suite: {suite_obj.name!r} has no [[generation]] cases (its [[case]] tables are "
                              "verifier cases: spectr-audit run --suite)")
    cases = select_cases(cases, select)
    skipped = tuple((c.name, f"needs {', '.join(c.missing())}: not installed") for c in cases if c.missing())
    cases = tuple(c for c in cases if not c.missing())
    if store_dir is not None:
        Path(store_dir).mkdir(parents=True, exist_ok=True)
    results: list = []
    for case in cases:
        if on_start is not None:
            on_start(case)
        store = None if store_dir is None else Path(store_dir) / f"{case.name}.sqlite"
        try:
            # resuming a suite: the cases it had not reached start afresh
            result, engine, prompts = run_generation_case(
                case, store=store, resume=resume and store is not None and store.exists(), with_engine=True,
                **overrides)
        except GenerationInterrupted as exc:
            if exc.result is not None:
                results.append(GenerationCaseResult(case.name, case.engine, case.expected, exc.result))
            raise GenerationSuiteInterrupted(GenerationSuiteReport(suite_obj.name, tuple(results), len(cases),
                                                                   "interrupted (SIGINT)", skipped)) from None
        except KeyboardInterrupt:
            raise GenerationSuiteInterrupted(GenerationSuiteReport(suite_obj.name, tuple(results), len(cases),
                                                                   "interrupted (SIGINT)", skipped)) from None
        entry = GenerationCaseResult(case.name, case.engine, case.expected, result,
                                     getattr(engine.generate, "repro_spec", None),
                                     None if prompts is None else tuple(tuple(p) for p in prompts))
        results.append(entry)
        if on_result is not None:
            on_result(entry)
    return GenerationSuiteReport(suite_obj.name, tuple(results), len(cases), skipped=skipped)
