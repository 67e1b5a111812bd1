"""The ``[[generation]]`` tables of suites, validated into :class:`GenerationCase` s.

The format is in :mod:`spectr_audit.generation.checks`; :mod:`spectr_audit.run.suite` reads a suite's
tables through :func:`parse_generation_cases`, and :mod:`spectr_audit.generation.suite` runs the
cases.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any, Optional, Union

from spectr_audit._arguments import check_int_at_least, check_number
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.engine_specs import (
    _request_slip_expected,
    _suggest,
    requests_from_data,
    spec_kind,
)

__all__ = ["AUDIT_KEYS", "CASE_KEYS", "EXPECTED", "GenerationCase", "TOY_KEYS", "parse_generation_cases"]


#: The audit's options a case may set.
AUDIT_KEYS = ("max_new_tokens", "batch_size", "rounds", "arms", "seed", "alpha", "power", "min_detectable_tv",
              "max_tokens", "max_seconds", "timeout", "greedy", "logit_tol", "allow_failed_calls", "logprob_tolerance",
              "conditions", "reference_tv")
TOY_KEYS = ("vocab_size", "toy_seed", "draft_noise", "temperature", "top_k", "top_p", "eos_token_id")
CASE_KEYS = ("name", "description", "engine", "expected", "options", "prompts", "reference",
             "requires", "requests") + TOY_KEYS + AUDIT_KEYS
#: The toy keys that are sampling parameters: for ``toy-requests`` the requests carry them.
_SAMPLING_KEYS = ("temperature", "top_k", "top_p")
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
    requests : tuple of :class:`~spectr_audit.contract.requests.Request`, optional
        The whole request of each row, in turn (None: the engine's own, if any).
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
    requests: Optional[tuple] = dataclasses.field(default=None, hash=False)

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
                "audit_options": dict(self.audit_options), "requires": list(self.requires),
                "requests": None if self.requests is None else [r.describe() for r in self.requests]}


def _number(value: Any, where: str, key: str, low: float, high: float, low_open: bool, high_open: bool) -> float:
    return check_number(f"{where}: {key}", value, low, high, low_open=low_open, high_open=high_open)


def _integer(value: Any, where: str, key: str, minimum: int) -> int:
    return check_int_at_least(f"{where}: {key}", value, minimum)


def _check_case_value(key: str, value: Any, where: str) -> Any:
    from spectr_audit.generation.designs import ARMS

    if key == "rounds" and value == "auto":
        return value  # rounds until the planned power
    if key in ("max_new_tokens", "batch_size", "rounds", "max_tokens"):
        return _integer(value, where, key, 1)
    if key in ("seed", "toy_seed", "top_k", "eos_token_id", "allow_failed_calls"):
        return _integer(value, where, key, 0)
    if key == "vocab_size":
        return _integer(value, where, key, 2)
    if key in ("alpha", "power", "min_detectable_tv", "reference_tv"):
        return _number(value, where, key, 0, 1, True, True)
    if key in ("max_seconds", "timeout"):
        return _number(value, where, key, 0, math.inf, True, True)
    if key == "logit_tol":
        return _number(value, where, key, 0, math.inf, False, True)
    if key == "logprob_tolerance":
        return _number(value, where, key, 0, math.inf, True, True)
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
    if key == "conditions":
        from spectr_audit.generation.conditions import parse_condition

        if not isinstance(value, list) or not value:
            raise InvalidArgument(f"{where}: conditions: expected a non-empty list of condition names (or ['all']), "
                                  f"got {value!r}")
        for name in value:
            if name != "all":
                parse_condition(name, f"{where}: conditions")
        return tuple(value)
    if key == "arms":
        if not isinstance(value, list) or not value or any(a not in ARMS for a in value):
            raise InvalidArgument(f"{where}: arms: expected a non-empty list drawn from {list(ARMS)}, got {value!r}")
        return tuple(value)
    raise AssertionError(key)  # pragma: no cover - every key of CASE_KEYS is handled


def parse_generation_cases(raw: Any, source: str = "suite", base: Optional[Union[str, Path]] = None) -> tuple:
    """Validate the ``[[generation]]`` tables of a suite and build its :class:`GenerationCase` s.

    Errors name the source, the table (``generation[i] ('name')``) and the key (``requests[j].field`` for a
    request's field).
    """
    from spectr_audit.generation.library import SLIPS
    from spectr_audit.generation.library.request_slips import REQUEST_SLIPS
    from spectr_audit.generation.library.serving import SERVING_SLIPS

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
            raise InvalidArgument(f"{where}: engine: expected 'toy', 'toy:SLIP', 'toy-requests', 'toy-requests:SLIP', "
                                  f"'package.module:factory' or 'path/file.py:factory', got {engine!r}")
        engine = engine.strip()
        kind = spec_kind(engine)
        toy = kind != "factory"
        default_expected = "pass"
        if kind == "toy" and engine != "toy":
            if engine[4:] not in SLIPS and engine[4:] not in SERVING_SLIPS:
                names = list(SLIPS) + list(SERVING_SLIPS)
                raise InvalidArgument(f"{where}: engine: no toy slip {engine[4:]!r}{_suggest(engine[4:], names)}; "
                                      f"the slips: {', '.join(names)}")
            default_expected = "finding"
        if kind == "toy-requests" and engine != "toy-requests":
            slip = engine[len("toy-requests:"):]
            if slip not in REQUEST_SLIPS:
                raise InvalidArgument(f"{where}: engine: no request slip {slip!r}{_suggest(slip, REQUEST_SLIPS)}; the "
                                      f"request slips: {', '.join(REQUEST_SLIPS)}")
            default_expected = _request_slip_expected(REQUEST_SLIPS[slip])
        if not toy and ":" not in engine:
            raise InvalidArgument(f"{where}: engine: {engine!r} is neither 'toy', 'toy:SLIP', 'toy-requests', "
                                  "'toy-requests:SLIP' nor an import string 'package.module:factory' or "
                                  "'path/file.py:factory'")
        expected = table.get("expected", default_expected)
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
                if kind == "toy-requests" and key in _SAMPLING_KEYS:
                    raise InvalidArgument(f"{where}: {key}: not for {engine!r}: its requests carry the sampling "
                                          f"parameters; give requests = [{{{key} = ...}}, ...]")
                engine_options[key] = _check_case_value(key, table[key], where)
        requests = None
        if "requests" in table:
            if kind == "toy":
                raise InvalidArgument(f"{where}: requests: the engine {engine!r} does not take requests (its "
                                      "generator does not declare accepts_requests and its scorer returns laws, not "
                                      "raw logits); the toy loop over whole requests is engine = 'toy-requests'")
            requests = requests_from_data(table["requests"], where)
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
                                    requires=tuple(requires), requests=requests))
    return tuple(cases)
