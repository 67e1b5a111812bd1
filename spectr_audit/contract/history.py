"""The law of each emitted token under a whole request, given the row's own history (teacher-forced).

:func:`process_request` takes the target's raw logits at every position of one row, the prompt, the
continuation and the row's :class:`~spectr_audit.contract.requests.Request`, and returns the law an engine
samples from at each position: the history-dependent processors applied over ``prompt +
continuation[:t]`` in the engine's own order, the constraint's mask after ``continuation[:t]``, then
temperature, top-k, top-p and min-p (:func:`~spectr_audit.contract.sampling.process_logits`).
:func:`process_request_step` is the same for one next token (an engine's decode step).

The engines' orders, read in their source as installed (docs/sampling.md, "History-dependent processors",
cites each line):

============  =====================================================================================
engine        before temperature, in order
============  =====================================================================================
vllm          the grammar mask, bad words (over the emitted tokens only), min_tokens (stop tokens
              masked; for a request with a constraint, put back when nothing else is left), logit bias,
              repetition penalty (tokens of the prompt or the output), frequency and presence
              penalties (output only)
transformers  logit bias (``sequence_bias``), repetition penalty (prompt and output), bad words
              (over prompt and output), ``min_new_tokens``; no presence or frequency penalty
sglang        frequency and presence penalties and ``min_new_tokens`` (additive), repetition penalty
              (output tokens only), the grammar mask, logit bias; no bad words
llama.cpp     logit bias, then repetition, frequency and presence penalties over the last 64 emitted
              tokens (one pass: ``x / r`` or ``x * r``, minus ``count * f + [count > 0] * c``), the
              grammar mask; no bad words, no ``min_tokens``; then top-k, top-p, min-p and temperature
              *last* (:data:`LLAMA_CPP_SAMPLING`), greedy only at temperature 0
============  =====================================================================================

The repetition penalty divides a logit above 0 by the penalty and multiplies the others (vLLM's
``logits > 0``; transformers' and SGLang's ``score < 0`` agree, since 0 is unchanged either way).  A
constraint masks what its state disallows before temperature in every engine.  A request without any
history-dependent field gives exactly ``process_logits(logits, request.sampling_params(), order)`` (for
``"llama.cpp"``, ``order`` :data:`LLAMA_CPP_SAMPLING`).

Examples
--------
>>> import torch
>>> from spectr_audit.contract.requests import Request
>>> logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
>>> laws = process_request(logits, [2], [0, 1], Request(temperature=0.0, repetition_penalty=4.0))
>>> laws.probs.tolist()   # once emitted, token 0's logit 2.0 becomes 0.5, below token 1's 1.0
[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import torch

from spectr_audit.contract.requests import ConstraintViolation, Request
from spectr_audit.contract.sampling import ProcessingOrder, process_logits
from spectr_audit.errors import InvalidArgument

__all__ = ["HISTORY_ENGINES", "LLAMA_CPP_PENALTY_LAST_N", "LLAMA_CPP_SAMPLING", "RequestLaws", "process_request", "process_request_step"]

#: The engines whose order of the history-dependent processors :func:`process_request` follows.
HISTORY_ENGINES = ("vllm", "transformers", "sglang", "llama.cpp")

#: llama-cpp-python's sampler chain after the penalties and the grammar (``Llama._init_sampler``): top-k (exactly
#: k, by rank), typical (off), top-p (keeps the token whose mass ahead is below p, over the renormalised
#: survivors), min-p, then temperature, then the draw; temperature 0 is llama.cpp's greedy sampler (the first
#: maximum).  Tokens tied at the top-k boundary are ordered by llama.cpp's sort, which does not specify them.
LLAMA_CPP_SAMPLING = ProcessingOrder(
    "llama.cpp", ("top_k", "top_p", "min_p", "temperature"), top_k_ties="rank",
    description="llama-cpp-python Llama._init_sampler: penalties, grammar, top-k, typical, top-p, min-p, temp, dist",
)

#: How many of the last accepted tokens llama.cpp's penalties read (``Llama(last_n_tokens_size=64)``); its
#: sampler accepts the sampled tokens only, so the window holds emitted tokens, never the prompt.
LLAMA_CPP_PENALTY_LAST_N = 64


def _sampling_order(order: str):
    return LLAMA_CPP_SAMPLING if order == "llama.cpp" else order


@dataclasses.dataclass(frozen=True)
class RequestLaws:
    """What :func:`process_request` returns for one row of ``T`` emitted tokens.

    Attributes
    ----------
    probs : torch.Tensor
        ``[T, V]`` float64: the law of token ``t`` given the prompt and ``continuation[:t]``, as the engine
        samples it (the constraint's mask applied).
    raw_logprobs : torch.Tensor
        ``[T, V]`` float64: the log-softmax of the raw logits (what an engine returns as "raw" logprobs).
    processed_logprobs : torch.Tensor
        ``[T, V]`` float64: ``log(probs)`` (``-inf`` where a token cannot be drawn).
    processed_logits : torch.Tensor
        ``[T, V]`` float64: the logits after the history-dependent processors and the constraint, before
        temperature (a greedy row's argmax is taken on them).
    constraint_violation : int or None
        The first position whose emitted token the constraint did not allow (the constraint is not applied
        after it); ``None`` when every token was allowed or there is no constraint.
    masked_logprobs : torch.Tensor or None
        ``[T, V]`` float64: the log-softmax of the raw logits over the tokens the constraint allows (vLLM masks
        the logits by the grammar before it reads its "raw" logprobs); ``None`` stands for ``raw_logprobs`` (no
        constraint).
    """

    probs: torch.Tensor
    raw_logprobs: torch.Tensor
    processed_logprobs: torch.Tensor
    processed_logits: torch.Tensor
    constraint_violation: Optional[int] = None
    masked_logprobs: Optional[torch.Tensor] = None

    @property
    def raw_masked_logprobs(self) -> torch.Tensor:
        """``masked_logprobs``, or ``raw_logprobs`` where the request has no constraint."""
        return self.raw_logprobs if self.masked_logprobs is None else self.masked_logprobs


def _check_order(order: Any, request: Request) -> str:
    if not isinstance(order, str) or order not in HISTORY_ENGINES:
        raise InvalidArgument(f"order: the history-dependent processors follow one of {HISTORY_ENGINES}, got "
                              f"{order!r}")
    if order == "transformers" and (request.presence_penalty or request.frequency_penalty):
        raise InvalidArgument("request.presence_penalty, request.frequency_penalty: transformers' generate has no "
                              "presence or frequency penalty")
    if order == "sglang" and request.bad_words:
        raise InvalidArgument("request.bad_words: SGLang's sampling parameters have no bad words")
    if order == "llama.cpp" and request.bad_words:
        raise InvalidArgument("request.bad_words: llama.cpp's sampler chain has no bad words")
    if order == "llama.cpp" and request.min_tokens:
        raise InvalidArgument("request.min_tokens: llama.cpp's sampler chain has no minimum length")
    return order


def _check_tokens(name: str, tokens: Sequence[int], vocab_size: int) -> list:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise InvalidArgument(f"{name}: expected a list of token ids, got {type(tokens).__name__}")
    out = []
    for token in tokens:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidArgument(f"{name}: token ids must be integers in [0, {vocab_size}), got {token!r}")
        out.append(int(token))
    return out


def _bans(words: Sequence[tuple], history: Sequence[int]) -> list:
    """The last tokens of the bad words whose other tokens end ``history``."""
    banned = []
    for word in words:
        n = len(word)
        if n - 1 > len(history):
            continue
        if n == 1 or tuple(history[len(history) - (n - 1):]) == tuple(word[:-1]):
            banned.append(word[-1])
    return banned


def _repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


class _History:
    """One row's running counts as tokens are emitted: the state the processors read."""

    def __init__(self, request: Request, order: str, prompt: Sequence[int], vocab_size: int,
                 eos_token_id: Optional[int]):
        self.request = request
        self.order = order
        self.vocab_size = vocab_size
        self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool)
        if prompt:
            self.prompt_seen[torch.tensor(list(prompt))] = True
        self.counts = torch.zeros(vocab_size, dtype=torch.float64)
        self.prompt = list(prompt)
        self.emitted: list = []
        self.stop_ids = [t for t in request.stop_ids(eos_token_id) if t < vocab_size]
        self.bias = torch.zeros(vocab_size, dtype=torch.float64)
        for token, value in request.logit_bias:
            if token < vocab_size:
                self.bias[token] = value

    def push(self, token: int) -> None:
        self.emitted.append(token)
        self.counts[token] += 1

    def apply(self, logits: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Logits ``[V]`` (float64) after the history-dependent processors and the constraint's ``mask``."""
        r = self.request
        x = logits.clone()
        inf = -math.inf
        out_seen = self.counts > 0
        under_min = len(self.emitted) < r.min_tokens
        if self.order == "vllm":
            if mask is not None:  # the grammar's bitmask comes before the sampler
                x = x.masked_fill(~mask, inf)
            if r.bad_words:
                for token in _bans(r.bad_words, self.emitted):
                    x[token] = inf
            if under_min and self.stop_ids:
                before = x[self.stop_ids]
                x[self.stop_ids] = inf
                if r.constraint is not None and bool((x == inf).all()):
                    x[self.stop_ids] = before  # a structured request: the stop tokens come back rather than nothing
            if r.logit_bias:
                x = x + self.bias
            if r.repetition_penalty != 1.0:
                x = _repetition(x, self.prompt_seen | out_seen, r.repetition_penalty)
            if r.frequency_penalty:
                x = x - r.frequency_penalty * self.counts
            if r.presence_penalty:
                x = x - r.presence_penalty * out_seen.double()
        elif self.order == "transformers":
            if r.logit_bias:
                x = x + self.bias
            if r.repetition_penalty != 1.0:
                x = _repetition(x, self.prompt_seen | out_seen, r.repetition_penalty)
            if r.bad_words:
                # generate hands NoBadWordsLogitsProcessor its end-of-sequence ids (the stop tokens), and it drops
                # a one-token bad word equal to one of them (generation/utils.py:1488-1491, logits_process.py:1472-1482)
                words = [w for w in r.bad_words if not (len(w) == 1 and w[0] in self.stop_ids)]
                for token in _bans(words, self.prompt + self.emitted):
                    x[token] = inf
            if under_min and self.stop_ids:
                x[self.stop_ids] = inf
            if mask is not None:
                x = x.masked_fill(~mask, inf)
        elif self.order == "llama.cpp":
            if r.logit_bias:
                x = x + self.bias
            if r.repetition_penalty != 1.0 or r.frequency_penalty or r.presence_penalty:
                window = torch.zeros(self.vocab_size, dtype=torch.float64)
                for token in self.emitted[-LLAMA_CPP_PENALTY_LAST_N:]:
                    window[token] += 1
                seen = window > 0
                x = _repetition(x, seen, r.repetition_penalty)
                x = x - (r.frequency_penalty * window + r.presence_penalty * seen.double())
            if mask is not None:
                x = x.masked_fill(~mask, inf)
        else:  # sglang
            if r.frequency_penalty:
                x = x - r.frequency_penalty * self.counts
            if under_min and self.stop_ids:
                x[self.stop_ids] = inf
            if r.presence_penalty:
                x = x - r.presence_penalty * out_seen.double()
            if r.repetition_penalty != 1.0:
                x = _repetition(x, out_seen, r.repetition_penalty)
            if mask is not None:
                x = x.masked_fill(~mask, inf)
            if r.logit_bias:
                x = x + self.bias
        return x


def _law(x: torch.Tensor, request: Request, order: str, where: str) -> torch.Tensor:
    if bool((x == -math.inf).all()):
        raise InvalidArgument(f"{where}: the request masks every token (its constraint, min_tokens and bad words "
                              f"leave nothing to draw)")
    return process_logits(x.unsqueeze(0), request.sampling_params(), _sampling_order(order))[0]


def process_request(logits: torch.Tensor, prompt: Sequence[int], continuation: Sequence[int], request: Request,
                    order: str = "vllm", *, eos_token_id: Optional[int] = None) -> RequestLaws:
    """The laws of one row's emitted tokens under ``request``, teacher-forced.

    Parameters
    ----------
    logits : torch.Tensor
        ``[T, V]`` raw target logits, row ``t`` the next-token logits given ``prompt + continuation[:t]``;
        ``T == len(continuation)``.
    prompt, continuation : sequences of token ids
    request : Request
    order : str
        One of :data:`HISTORY_ENGINES`.
    eos_token_id : int, optional
        The end-of-sequence token, a stop token besides ``request.stop_token_ids`` (for ``min_tokens``).

    Raises
    ------
    InvalidArgument
        Naming the argument: logits of the wrong shape or with NaN / +inf, ids outside the vocabulary, a
        field the engine's order does not have, a position where the request masks every token.
    """
    if not isinstance(request, Request):
        raise InvalidArgument(f"request: expected a Request, got {type(request).__name__}")
    order = _check_order(order, request)
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() != 2:
        raise InvalidArgument(f"logits: expected a [T, vocab_size] floating-point tensor, got "
                              f"{getattr(logits, 'shape', type(logits).__name__)}")
    vocab_size = logits.shape[1]
    prompt = _check_tokens("prompt", prompt, vocab_size)
    continuation = _check_tokens("continuation", continuation, vocab_size)
    if logits.shape[0] != len(continuation):
        raise InvalidArgument(f"logits: {logits.shape[0]} rows for a continuation of {len(continuation)} tokens")
    if bool(torch.isnan(logits).any()) or bool((logits == math.inf).any()):
        raise InvalidArgument("logits: must be finite or -inf (found NaN or +inf)")
    request.check_vocab(vocab_size)
    raw = logits.detach().double().cpu()
    history = _History(request, order, prompt, vocab_size, eos_token_id)
    constraint = request.constraint
    state = constraint.start() if constraint is not None else None
    violation = None
    processed = torch.empty_like(raw)
    probs = torch.empty_like(raw)
    masked = raw.clone() if constraint is not None else None
    for t, token in enumerate(continuation):
        mask = None
        if constraint is not None and violation is None:
            mask = constraint.allowed(state, vocab_size)
            masked[t] = raw[t].masked_fill(~mask, -math.inf)
        processed[t] = history.apply(raw[t], mask)
        probs[t] = _law(processed[t], request, order, f"continuation position {t}")
        if constraint is not None and violation is None:
            try:
                state = constraint.advance(state, token)
            except ConstraintViolation:
                violation = t
        history.push(token)
    if len(continuation) == 0:
        empty = raw.new_zeros((0, vocab_size))
        return RequestLaws(empty, empty, empty, empty, None)
    with torch.no_grad():
        raw_logprobs = torch.log_softmax(raw, dim=-1)
        processed_logprobs = torch.log(probs)
        masked_logprobs = None if masked is None else torch.log_softmax(masked, dim=-1)
    return RequestLaws(probs, raw_logprobs, processed_logprobs, processed, violation, masked_logprobs)


def process_request_step(logits: torch.Tensor, prompt: Sequence[int], emitted: Sequence[int], request: Request,
                         order: str = "vllm", *, eos_token_id: Optional[int] = None,
                         constraint_state: Any = None) -> torch.Tensor:
    """The law ``[V]`` (float64) of the next token after ``prompt + emitted`` under ``request``.

    ``logits`` is ``[V]`` (or ``[B, V]``: ``B`` candidates sharing that history, e.g. a draft tree's
    siblings).  ``constraint_state`` is the constraint's state after ``emitted`` (replayed when ``None``).
    Equal, position by position, to :func:`process_request`.
    """
    if not isinstance(request, Request):
        raise InvalidArgument(f"request: expected a Request, got {type(request).__name__}")
    order = _check_order(order, request)
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() not in (1, 2):
        raise InvalidArgument(f"logits: expected a [vocab_size] or [B, vocab_size] floating-point tensor, got "
                              f"{getattr(logits, 'shape', type(logits).__name__)}")
    vocab_size = logits.shape[-1]
    prompt = _check_tokens("prompt", prompt, vocab_size)
    emitted = _check_tokens("emitted", emitted, vocab_size)
    history = _History(request, order, prompt, vocab_size, eos_token_id)
    for token in emitted:
        history.push(token)
    mask = None
    if request.constraint is not None:
        state = constraint_state if constraint_state is not None else request.constraint.state_after(emitted)
        mask = request.constraint.allowed(state, vocab_size)
    rows = logits.detach().double().cpu().reshape(-1, vocab_size)
    out = torch.stack([_law(history.apply(row, mask), request, order, "logits") for row in rows])
    return out.reshape(logits.shape).to(logits.device)
