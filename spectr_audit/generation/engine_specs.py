"""Generation engines by spec: ``toy``, ``toy:SLIP``, ``toy-requests``, ``toy-requests:SLIP``, a user factory,
resolved and audited; prompts files and requests files.

:func:`load_generation_engine` resolves a spec to a :class:`GenerationEngine` (the toy loop of
:mod:`spectr_audit.generation.library`, one of its planted slips, the toy loop over whole requests of
:mod:`spectr_audit.generation.library.request_slips` or one of its slips, or what a factory
``package.module:factory`` / ``path/file.py:factory`` returns); :func:`audit_engine` audits it;
:func:`read_prompts` reads a prompts file, :func:`read_requests` a requests file, and :func:`requests_from_data`
builds the requests of a suite case or a requests file.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from spectr_audit._arguments import check_int_at_least
from spectr_audit.errors import InvalidArgument

__all__ = [
    "FACTORY_KEYS",
    "GenerationEngine",
    "TOY_EOS_TOKEN_ID",
    "TOY_VOCAB_SIZE",
    "audit_engine",
    "generation_engine_names",
    "load_generation_engine",
    "read_prompts",
    "read_requests",
    "requests_from_data",
    "spec_kind",
    "toy_prompts",
]

#: The toy engine's vocabulary unless one is given (:class:`~spectr_audit.generation.library.ToyPair`'s default).
TOY_VOCAB_SIZE = 16
#: The end-of-sequence id a toy slip that needs one (``eos-inside-block``) is audited with.
TOY_EOS_TOKEN_ID = 0
#: The keys a factory's dict may hold (an object: the same attributes).
FACTORY_KEYS = ("generate", "score", "vocab_size", "reference", "draft_score", "prompts", "eos_token_id", "name",
                "conditions")
#: The serving conditions the toy engines offer (``--conditions all``).
TOY_CONDITIONS = ("prefix-cache", "chunked-prefill", "preemption", "concurrency", "draft-depth=1", "draft-depth=2",
                  "draft-depth=3", "draft-depth=4", "draft-depth=5", "long-context")
#: Keyword arguments of :func:`load_generation_engine` that only the toy engine takes.
_TOY_ONLY = ("toy_seed", "draft_noise", "temperature", "top_k", "top_p")
#: The whole-request toy engine's vocabulary and continuation length unless given: those its slips' budgets were
#: measured at (docs/generation.md, "Planted slips in the whole request").
TOY_REQUESTS_VOCAB_SIZE = 12
TOY_REQUESTS_MAX_NEW_TOKENS = 24


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
    #: The requests the engine is audited with unless the caller gives some (the whole-request toy's built-in
    #: mixes); None: none.
    requests: Optional[list] = None
    #: Whether the engine takes requests: False for the toy (its scorer returns laws), True for the whole-request
    #: toy, None for a factory's (the audit reads its generator's ``accepts_requests``).
    accepts_requests: Optional[bool] = None
    #: The serving conditions it offers: a mapping of condition names to the engine under each, or a callable
    #: ``make(name)`` returning it (its ``names`` attribute: the names ``all`` means); None: none.
    conditions: Any = None
    #: The conditions an audit runs unless told which (a serving slip's own).
    default_conditions: tuple = ()

    def offered_conditions(self) -> tuple:
        """The condition names ``all`` means: the mapping's keys, or the maker's ``names``."""
        if isinstance(self.conditions, dict):
            return tuple(self.conditions)
        return tuple(getattr(self.conditions, "names", ()) or ())

    def conditions_for(self, names: Optional[Sequence[str]], argument: str = "conditions") -> Optional[dict]:
        """``{name: the engine under it}`` for ``names`` (None: the default conditions; ``all``: every one
        offered), made once; None when there are none."""
        from spectr_audit.generation.conditions import parse_condition

        names = self.default_conditions if names is None else tuple(names)
        if not names:
            return None
        if self.conditions is None:
            raise InvalidArgument(f"{argument}: the engine {self.name!r} offers no serving conditions (its factory "
                                  f"gives no 'conditions': a mapping of condition names to the engine under each, or "
                                  f"a callable make(name))")
        if "all" in names:
            names = self.offered_conditions()
            if not names:
                raise InvalidArgument(f"{argument}: 'all': the engine {self.name!r} does not list the conditions it "
                                      f"offers (give a mapping, or a maker with a 'names' attribute); name them")
        out = {}
        for name in names:
            parse_condition(name, argument)
            if isinstance(self.conditions, dict):
                if name not in self.conditions:
                    raise InvalidArgument(f"{argument}: the engine {self.name!r} does not offer {name!r}; it offers "
                                          f"{', '.join(self.conditions) or 'none'}")
                out[name] = self.conditions[name]
                continue
            try:
                out[name] = self.conditions(name)
            except InvalidArgument:
                raise
            except Exception as exc:
                raise InvalidArgument(f"{argument}: making the engine under {name!r} raised "
                                      f"{type(exc).__name__}: {exc}") from exc
        return out


def spec_kind(spec: str) -> str:
    """``"toy"`` (``toy``, ``toy:SLIP``), ``"toy-requests"`` (``toy-requests``, ``toy-requests:SLIP``) or
    ``"factory"`` (anything else: an import string, checked when it is loaded).

    >>> [spec_kind(s) for s in ("toy", "toy:shared-stream", "toy-requests:seed-ignored", "pkg.mod:make")]
    ['toy', 'toy', 'toy-requests', 'factory']
    """
    spec = spec.strip()
    if spec == "toy-requests" or spec.startswith("toy-requests:"):
        return "toy-requests"
    if spec == "toy" or spec.startswith("toy:"):
        return "toy"
    return "factory"


def toy_prompts(vocab_size: int = TOY_VOCAB_SIZE) -> list:
    """The toy engine's built-in prompts: six, of one to four tokens, two alike in length (ids below ``vocab_size``).

    >>> toy_prompts(16)
    [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2, 2], [3], [10, 11, 12]]
    """
    base = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2, 2], [3], [10, 11, 12]]
    return [[t % vocab_size for t in p] for p in base]


def generation_engine_names() -> list:
    """Every built-in engine spec: ``toy`` and ``toy:SLIP`` for each planted slip, ``toy-requests`` and
    ``toy-requests:SLIP`` for each slip in the whole request, with what each needs.

    Returns a list of dicts ``{"spec", "expected", "needs"}``.
    """
    from spectr_audit.generation.library import SLIPS
    from spectr_audit.generation.library.request_slips import REQUEST_SLIPS

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
    from spectr_audit.generation.library.serving import SERVING_SLIPS

    for name, serving in SERVING_SLIPS.items():
        rows.append({"spec": f"toy:{name}", "expected": "finding",
                     "needs": f"{serving.needs} (audited under the conditions {', '.join(_slip_conditions(serving))})"})
    rows.append({"spec": "toy-requests", "expected": "pass",
                 "needs": "the correct speculative loop over whole requests (one request per row); without requests, "
                          "every feature on: penalties, logit bias, bad words, min_tokens, stop tokens, max_tokens, a "
                          "constraint, seeds, logprobs, greedy beside sampled rows"})
    for name, slip in REQUEST_SLIPS.items():
        mix = f"(without requests: feature_requests({slip.requests!r}))"
        if slip.check == "determinism":
            needs = (f"planted slip that only the determinism line shows, each row's law being right (a suite case "
                     f"expects pass): {slip.truth} {mix}")
        else:
            by = "the tests of the law" if slip.check == "law" else f"the {slip.check} check"
            needs = f"{slip.truth}; found by {by} {mix}"
        rows.append({"spec": f"toy-requests:{name}", "expected": _request_slip_expected(slip), "needs": needs})
    return rows


def _request_slip_expected(slip: Any) -> str:
    """What a suite case of a request slip expects: a FINDING, but ``pass`` for one that only the determinism line
    shows (a per-request seed ignored changes no row's law)."""
    return "pass" if slip.check == "determinism" else "finding"


def _suggest(text: str, names: Sequence[str]) -> str:
    close = difflib.get_close_matches(text, list(names), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _toy_engine(slip_name: Optional[str], spec: str, *, argument: str, vocab_size: Optional[int],
                toy_seed: Optional[int], draft_noise: Any, temperature: Any, top_k: Any, top_p: Any,
                eos_token_id: Optional[int]) -> GenerationEngine:
    from spectr_audit.contract.sampling import SamplingParams
    from spectr_audit.generation.library import SLIPS, ToyPair, correct_engine, slip_engine
    from spectr_audit.generation.library.serving import SERVING_SLIPS

    slip = serving = None
    if slip_name is not None:
        if slip_name in SERVING_SLIPS:
            serving = SERVING_SLIPS[slip_name]
        elif slip_name not in SLIPS:
            names = list(SLIPS) + list(SERVING_SLIPS)
            raise InvalidArgument(f"{argument}: {spec!r}: no toy slip {slip_name!r}{_suggest(slip_name, names)}; "
                                  f"the slips: {', '.join(names)}")
        else:
            slip = SLIPS[slip_name]
    vocab = TOY_VOCAB_SIZE if vocab_size is None else check_int_at_least("vocab_size", vocab_size, 2)
    seed, noise = _pair_seed_and_noise(toy_seed, draft_noise)
    fields = dict(slip.params) if slip is not None else {}
    fields.update({k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
                   if v is not None})
    params = SamplingParams(**fields) if fields else None
    eos = eos_token_id if eos_token_id is not None else (TOY_EOS_TOKEN_ID if slip is not None and slip.eos else None)
    _check_eos(eos, vocab)
    pair = ToyPair(vocab, seed=seed, draft_noise=noise, params=params, eos_token_id=eos)
    if serving is not None:  # the slip's loop, correct outside its condition
        engine = serving.engine(pair)
    else:
        engine = correct_engine(pair) if slip is None else slip_engine(slip_name, pair)
    if serving is not None:
        description = (f"toy serving slip {slip_name}: {serving.needs} (conditions "
                       f"{', '.join(_slip_conditions(serving))})")
    else:
        description = "the correct toy speculative loop" if slip is None else f"toy slip {slip_name}: {slip.needs}"
    return GenerationEngine(
        name=spec, generate=engine, score=pair.scorer(), vocab_size=vocab, reference=pair.reference(),
        draft_score=pair.draft_scorer(), prompts=toy_prompts(vocab), eos_token_id=eos,
        max_new_tokens=None if slip is None else slip.max_new_tokens,
        expected="pass" if slip is None and serving is None else "finding",
        description=description, reference_by_default=False, accepts_requests=False,
        conditions=_ToyConditions(pair, None if serving is None else slip_name),
        default_conditions=() if serving is None else _slip_conditions(serving))


def _slip_conditions(serving: Any) -> tuple:
    """The conditions a serving slip is audited under unless told otherwise: its own; a depth slip's, the depths
    swept from 1 to 5 (each a stratum: the depths it does not show at stand beside those it does)."""
    if serving.condition == "draft-depth":
        return tuple(f"draft-depth={d}" for d in range(1, 6))
    return (serving.condition,)


class _ToyConditions:
    """The toy's serving conditions: ``make(name)`` is the serving loop over the pair configured for the condition
    (:func:`~spectr_audit.generation.library.serving.serving_engine`), with the serving slip where one is given;
    each call makes a loop of its own (a prefix cache of its own)."""

    names = TOY_CONDITIONS

    def __init__(self, pair: Any, slip: Optional[str]):
        self.pair, self.slip = pair, slip

    def __call__(self, name: str) -> Any:
        from spectr_audit.generation.library.serving import serving_engine

        return serving_engine(self.pair, name, slip=self.slip)


def _pair_seed_and_noise(toy_seed: Optional[int], draft_noise: Any) -> tuple:
    """The toy pair's weights' seed and draft noise, checked (``"default"``: 0.3; None: an unrelated draft)."""
    seed = 0 if toy_seed is None else toy_seed
    check_int_at_least("toy_seed", seed, 0)
    noise = 0.3 if draft_noise == "default" else draft_noise
    if noise is not None and (isinstance(noise, bool) or not isinstance(noise, (int, float))
                              or not 0 <= noise < math.inf):
        raise InvalidArgument(f"draft_noise: expected a number >= 0 or none (an unrelated draft), got {draft_noise!r}")
    return seed, None if noise is None else float(noise)


def _check_eos(eos: Optional[int], vocab: int) -> None:
    if eos is not None:
        check_int_at_least("eos_token_id", eos, 0)
        if eos >= vocab:
            raise InvalidArgument(f"eos_token_id: {eos} is not a token id of the vocabulary [0, {vocab})")


def _toy_requests_engine(slip_name: Optional[str], spec: str, *, argument: str, vocab_size: Optional[int],
                         toy_seed: Optional[int], draft_noise: Any, temperature: Any, top_k: Any, top_p: Any,
                         eos_token_id: Optional[int]) -> GenerationEngine:
    from spectr_audit.generation.library.request_slips import (
        REQUEST_SLIPS,
        RequestSpecEngine,
        feature_requests,
        request_prompts,
    )
    from spectr_audit.generation.library.toy import ToyPair

    slip = None
    if slip_name is not None:
        if slip_name not in REQUEST_SLIPS:
            raise InvalidArgument(f"{argument}: {spec!r}: no request slip {slip_name!r}"
                                  f"{_suggest(slip_name, REQUEST_SLIPS)}; the request slips: "
                                  f"{', '.join(REQUEST_SLIPS)}")
        slip = REQUEST_SLIPS[slip_name]
    sampling = [name for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
                if value is not None]
    if sampling:
        raise InvalidArgument(f"{', '.join(sampling)}: not for {spec!r}: its requests carry the sampling parameters "
                              "(give requests, each with its own temperature, top_k, top_p)")
    vocab = TOY_REQUESTS_VOCAB_SIZE if vocab_size is None else check_int_at_least("vocab_size", vocab_size, 2)
    seed, noise = _pair_seed_and_noise(toy_seed, draft_noise)
    eos = TOY_EOS_TOKEN_ID if eos_token_id is None else eos_token_id
    _check_eos(eos, vocab)
    requests = feature_requests("every" if slip is None else slip.requests, vocab)
    for i, request in enumerate(requests):
        try:
            request.check_vocab(vocab, f"requests[{i}]")
        except InvalidArgument as exc:
            raise InvalidArgument(f"vocab_size: {vocab} is too small for {spec!r}, whose built-in requests name "
                                  f"larger token ids ({exc})") from None
    pair = ToyPair(vocab, seed=seed, draft_noise=noise, eos_token_id=eos)
    engine = (RequestSpecEngine if slip is None else slip.engine)(pair)
    if slip is not None:
        engine.name = slip_name  # as the toy slips are named: the verdict line says which slip
    return GenerationEngine(
        name=spec, generate=engine, score=pair.logits_scorer(), vocab_size=vocab, prompts=request_prompts(vocab),
        eos_token_id=eos, max_new_tokens=TOY_REQUESTS_MAX_NEW_TOKENS,
        expected="pass" if slip is None else _request_slip_expected(slip),
        description=("the correct toy speculative loop over whole requests" if slip is None
                     else f"request slip {slip_name}: {slip.truth}"),
        reference_by_default=False, requests=requests, accepts_requests=True)


def _factory_field(made: Any, key: str) -> Any:
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
    missing = [k for k in ("generate", "score") if _factory_field(made, k) is None]
    if missing:
        raise InvalidArgument(f"{argument}: the factory {spec!r} returned a {type(made).__name__} without "
                              f"{' and '.join(missing)}; it must give generate, score and vocab_size "
                              f"(optional: reference, draft_score, prompts, eos_token_id)")
    given = _factory_field(made, "vocab_size")
    if given is None and vocab_size is None:
        raise InvalidArgument(f"{argument}: the factory {spec!r} gives no vocab_size; add it to what the factory "
                              "returns (or give vocab_size)")
    if given is not None:
        check_int_at_least(f"{argument}: {spec!r} vocab_size", given, 2)
        if vocab_size is not None and vocab_size != given:
            raise InvalidArgument(f"vocab_size: {vocab_size} given, but the factory {spec!r} says {given}")
    vocab = given if given is not None else check_int_at_least("vocab_size", vocab_size, 2)
    eos = eos_token_id if eos_token_id is not None else _factory_field(made, "eos_token_id")
    if eos is not None:
        check_int_at_least("eos_token_id", eos, 0)
    prompts = _factory_field(made, "prompts")
    name = _factory_field(made, "name")
    conditions = _factory_field(made, "conditions")
    if conditions is not None and not (isinstance(conditions, dict) or callable(conditions)):
        raise InvalidArgument(f"{argument}: the factory {spec!r} returned conditions of type "
                              f"{type(conditions).__name__}; expected a dict of condition names to generators, or a "
                              f"callable make(name) returning the generator under that condition")
    return GenerationEngine(
        name=str(name) if name else spec, generate=_factory_field(made, "generate"), score=_factory_field(made, "score"),
        vocab_size=vocab, reference=_factory_field(made, "reference"), draft_score=_factory_field(made, "draft_score"),
        prompts=None if prompts is None else list(prompts), eos_token_id=eos, description=f"factory {spec}",
        conditions=conditions)


def load_generation_engine(spec: str, *, vocab_size: Optional[int] = None, toy_seed: Optional[int] = None,
                           draft_noise: Any = "default", temperature: Optional[float] = None,
                           top_k: Optional[int] = None, top_p: Optional[float] = None,
                           eos_token_id: Optional[int] = None, options: Optional[dict] = None,
                           argument: str = "engine", base: Optional[Union[str, Path]] = None) -> GenerationEngine:
    """Resolve an engine spec: ``toy``, ``toy:SLIP``, ``toy-requests``, ``toy-requests:SLIP``,
    ``package.module:factory`` or ``path/file.py:factory``.

    ``toy-requests`` is the correct speculative loop over whole requests
    (:class:`~spectr_audit.generation.library.request_slips.RequestSpecEngine`), ``toy-requests:SLIP`` one of its
    slips (:data:`~spectr_audit.generation.library.request_slips.REQUEST_SLIPS`); each comes with the requests it is
    audited with unless others are given (every feature on for the correct loop, the slip's own mix for a slip),
    six two-token prompts, 24 new tokens and the end of sequence 0.

    Parameters
    ----------
    spec : str
    vocab_size : int, optional
        The toy's vocabulary (default 16; ``toy-requests`` 12); for a factory, what it does not give itself.
    toy_seed, draft_noise, temperature, top_k, top_p : optional
        The toy model pair: its weights' seed, the draft's perturbation (None: an unrelated
        draft) and the sampling parameters (a slip's own parameters are the default; not for
        ``toy-requests``, whose requests carry them).
    eos_token_id : int, optional
        The engine's end-of-sequence id (a toy slip that needs one gets 0, ``toy-requests`` 0).
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
    if spec == "toy-requests:":
        from spectr_audit.generation.library.request_slips import REQUEST_SLIPS

        raise InvalidArgument(f"{argument}: 'toy-requests:' names no slip; the request slips: "
                              f"{', '.join(REQUEST_SLIPS)}")
    if spec_kind(spec) == "toy-requests":
        if options:
            raise InvalidArgument("options: only for a factory engine; toy-requests takes vocab_size, toy_seed, "
                                  "draft_noise, eos_token_id")
        return _toy_requests_engine(None if spec == "toy-requests" else spec[len("toy-requests:"):], spec,
                                    argument=argument, vocab_size=vocab_size, toy_seed=toy_seed,
                                    draft_noise=draft_noise, temperature=temperature, top_k=top_k, top_p=top_p,
                                    eos_token_id=eos_token_id)
    if spec == "toy" or spec.startswith("toy:"):
        if options:
            raise InvalidArgument("options: only for a factory engine; the toy takes vocab_size, toy_seed, draft_noise, "
                                  "temperature, top_k, top_p, eos_token_id")
        return _toy_engine(None if spec == "toy" else spec[4:], spec, argument=argument, vocab_size=vocab_size,
                           toy_seed=toy_seed, draft_noise=draft_noise, temperature=temperature, top_k=top_k,
                           top_p=top_p, eos_token_id=eos_token_id)
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


def _read_text(path: Path, argument: str) -> str:
    """A text file's contents; an ``InvalidArgument`` naming ``argument`` and the file when it cannot be read."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise InvalidArgument(f"{argument}: cannot read {str(path)!r}: {reason}") from None


def read_prompts(path: Union[str, Path], argument: str = "--prompts") -> list:
    """Read prompts from a file: a JSON list of token-id lists, or one prompt per line (space-separated ids;
    blank lines and lines starting with ``#`` are skipped).

    Raises ``InvalidArgument`` naming ``argument``, the file and the line.
    """
    path = Path(path)
    text = _read_text(path, argument)
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


def requests_from_data(data: Any, where: str) -> tuple:
    """The requests of a suite case's ``requests`` or a requests file: a non-empty list of tables of
    :class:`~spectr_audit.contract.requests.Request` fields, each built (and so checked) here, before any engine runs.

    Errors read ``{where}: requests[i].field: ...``.  Stop strings are read; the audit refuses them unless the
    engine gives its detokenizer (its generator's ``detokenize``); a grammar constraint needs Python
    (:meth:`Request.from_dict <spectr_audit.contract.requests.Request.from_dict>`).
    """
    if isinstance(data, (str, bytes)) or not isinstance(data, (list, tuple)) or not data:
        raise InvalidArgument(f"{where}: requests: expected a non-empty list of tables of Request fields, e.g. "
                              f"[{{\"temperature\": 0.0, \"logprobs\": 2}}, {{\"temperature\": 0.7, \"seed\": 5}}], "
                              f"got {data!r:.80}")
    from spectr_audit.contract.requests import Request

    out = []
    for i, table in enumerate(data):
        try:
            request = Request.from_dict(table, f"requests[{i}]")
        except InvalidArgument as exc:
            raise InvalidArgument(f"{where}: {exc}") from None
        out.append(request)
    return tuple(out)


def read_requests(path: Union[str, Path], argument: str = "--requests") -> tuple:
    """Read a requests file: a JSON list of objects of :class:`~spectr_audit.contract.requests.Request` fields.

    Raises ``InvalidArgument`` naming ``argument``, the file, the request's index and the field.
    """
    path = Path(path)
    text = _read_text(path, argument)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{argument}: {str(path)!r} is not valid JSON: {exc}") from None
    return requests_from_data(data, f"{argument}: {str(path)!r}")


def _prune(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if v is not None}


def audit_engine(engine: GenerationEngine, prompts: Optional[Sequence[Sequence[int]]] = None, *,
                 reference: Optional[bool] = None, requests: Any = None, conditions: Optional[Sequence[str]] = None,
                 **kwargs: Any) -> Any:
    """Run :func:`~spectr_audit.generation.audit_generation` on a resolved engine: its own prompts unless given;
    its reference generator when ``reference`` is True (None: the engine's :attr:`~GenerationEngine.reference_by_default`);
    ``requests`` or the engine's own (:attr:`~GenerationEngine.requests`); ``conditions``: serving condition names
    (``all``: every one the engine offers; None: the engine's defaults), made by the engine
    (:meth:`GenerationEngine.conditions_for`); options that are None keep the audit's defaults.

    Raises
    ------
    InvalidArgument
        Requests given to an engine that does not take them (naming it), or the audit's own.
    """
    if requests is not None and engine.accepts_requests is False:
        raise InvalidArgument(f"requests: the engine {engine.name!r} does not take requests (its generator does not "
                              "declare accepts_requests and its scorer returns laws, not raw logits); the toy loop "
                              "over whole requests is 'toy-requests'")
    if reference is None:
        reference = engine.reference_by_default
    elif reference and engine.reference is None:
        raise InvalidArgument(f"reference: the engine {engine.name!r} has no reference generator (the same engine "
                              "with speculation off); leave reference unset")
    prompts = prompts if prompts is not None else engine.prompts
    if prompts is None:
        raise InvalidArgument(f"prompts: the engine {engine.name!r} gives none; give prompts (--prompts FILE)")
    options = _prune(kwargs)
    made = engine.conditions_for(conditions)
    if made:
        options["conditions"] = made
    requests = requests if requests is not None else engine.requests
    if requests is not None:
        options["requests"] = list(requests)
    if engine.max_new_tokens is not None:
        options.setdefault("max_new_tokens", engine.max_new_tokens)
    if engine.eos_token_id is not None:
        options.setdefault("eos_token_id", engine.eos_token_id)
    options.setdefault("progress", False)
    from spectr_audit.generation import audit_generation

    return audit_generation(engine.generate, engine.score, prompts, vocab_size=engine.vocab_size,
                            reference=engine.reference if reference else None, draft_score=engine.draft_score,
                            **options)
