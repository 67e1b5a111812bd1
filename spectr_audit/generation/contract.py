"""The generation contract: a generator (the engine under audit), a scorer (the truth), and what they return.

A **generator** is ``generate(prompts, max_new_tokens, seed) -> continuations``: ``prompts`` a list
of token-id lists (a batch; the same prompt may repeat), ``max_new_tokens`` an int (or one per
row, where the engine takes per-request limits), ``seed`` an int; it returns one token-id list
per prompt, at most ``max_new_tokens`` long (shorter when the engine stopped at an end of
sequence).  It may return a :class:`GenerationOutput` instead, with the engine's own counters
(accepted draft tokens, target calls).  It is a black box: an engine with speculation on, at
some sampling setting.

A **scorer** is ``score(prompts, continuations) -> laws``: for each continuation a
``[len_i, vocab_size]`` tensor, row t the target model's law of token t given the prompt and the
continuation's first t tokens (teacher-forced), after the same sampling parameters the engine
used.  It runs the target without speculation and is the truth.  A scorer may instead return
raw logits, wrapped as :class:`ScoredLogits` with the :class:`~spectr_audit.contract.sampling.SamplingParams`
and processing order; the audit then processes them with
:func:`~spectr_audit.contract.sampling.process_logits` (and keeps the logits for greedy margins).

Optionally a **reference generator** (the same engine with speculation off) and a **draft
scorer** (the draft model's law at the same positions).  docs/generation.md states the contract
and what the audit concludes from it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from spectr_audit.contract.sampling import ProcessingOrder, SamplingParams, process_logits
from spectr_audit.errors import InvalidArgument, SpectrAuditError

__all__ = [
    "GenerationContractError",
    "GenerationOutput",
    "ScoredLogits",
    "Generator",
    "Scorer",
    "ScorerOutput",
    "as_generator",
    "as_scorer",
    "check_prompts",
]


class GenerationContractError(SpectrAuditError):
    """A generator or scorer under audit raised, or returned something that breaks the contract.

    The message names the component (``generator``, ``reference``, ``scorer``, ``draft scorer``),
    the case (arm and batch) and what was wrong.
    """


#: What a GenerationOutput's log-probabilities may be (``GenerationOutput.logprobs_mode``).
LOGPROBS_MODES = ("raw", "raw-masked", "processed")


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
    """What a generator may return instead of a bare list of continuations.

    Attributes
    ----------
    continuations : list of list of int
    accepted : list of int, optional
        Draft tokens the engine accepted, per continuation (its own counter).
    target_calls : list of int, optional
        Target forward passes (verification steps), per continuation.
    logprobs : list of list of float, optional
        Per continuation, the log-probability the engine reports for each emitted token.
    top_logprobs : list of list of dict, optional
        Per continuation and position, ``{token id: log-probability}`` of the engine's top-n list.
    finish_reasons : list of str, optional
        Per continuation, why it ended: ``"stop"`` (an end-of-sequence or stop token) or ``"length"``.
    completion_tokens : list of int, optional
        Per continuation, the usage count the engine reports.
    logprobs_mode : str
        ``"raw"`` (the log-softmax of the raw logits), ``"raw-masked"`` (of the raw logits over the tokens a
        request's constraint allows, as vLLM returns them under structured outputs; ``"raw"`` without one) or
        ``"processed"`` (of the law the engine samples from).
    stats : dict, optional
        What the engine's serving state did during this call, as counters ``{name: int >= 0}``: the
        conditions of the audit read them (:data:`~spectr_audit.generation.conditions.STAT_NAMES`:
        ``cached_tokens``, ``chunked_prompts``, ``preemptions``, ``joined_running``, ``draft_depth``); other
        names are kept and reported.
    """

    continuations: list
    accepted: Optional[list] = None
    target_calls: Optional[list] = None
    logprobs: Optional[list] = None
    top_logprobs: Optional[list] = None
    finish_reasons: Optional[list] = None
    completion_tokens: Optional[list] = None
    logprobs_mode: str = "raw"
    stats: Optional[dict] = None


@dataclasses.dataclass(frozen=True)
class ScoredLogits:
    """Raw target logits per continuation ``[len_i, vocab_size]``, processed by the audit.

    Attributes
    ----------
    logits : list of torch.Tensor
    params : SamplingParams
        The engine's sampling setting (one setting for the batch, or one value per continuation).
    order : str or ProcessingOrder
        Whose processing conventions apply (default ``"vllm"``).
    """

    logits: list
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    order: Union[str, ProcessingOrder] = "vllm"


def check_prompts(prompts: Any, vocab_size: Optional[int] = None, argument: str = "prompts") -> list:
    """A non-empty list of non-empty token-id lists (ids in ``[0, vocab_size)`` when it is known)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise InvalidArgument(f"{argument}: expected a non-empty list of token-id lists, got {type(prompts).__name__}")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence) or len(prompt) == 0:
            raise InvalidArgument(f"{argument}[{i}]: expected a non-empty list of token ids, got {prompt!r:.80}")
        ids = []
        for token in prompt:
            if isinstance(token, bool) or not isinstance(token, int) and not (
                    isinstance(token, float) and token.is_integer()):
                raise InvalidArgument(f"{argument}[{i}]: token ids must be integers, found {token!r}")
            token = int(token)
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise InvalidArgument(f"{argument}[{i}]: token id {token} outside [0, {vocab_size})")
            ids.append(token)
        out.append(ids)
    return out


def _call(component: str, case: str, fn: Callable, *args):
    try:
        return fn(*args)
    except (KeyboardInterrupt, SystemExit):
        raise
    except GenerationContractError:
        raise
    except Exception as exc:  # a third party's failure becomes a named error; the audit keeps other arms
        raise GenerationContractError(f"{component} raised on {case}: {type(exc).__name__}: {exc}") from exc


class Generator:
    """A generator under audit, wrapped: its calls checked against the contract.

    Parameters
    ----------
    fn : callable
        ``fn(prompts, max_new_tokens, seed)``; or an object with a ``generate`` method.
    name : str, optional
    per_row_max_new_tokens : bool
        Whether ``max_new_tokens`` may be a list (one per row); the audit's ragged arm then lets
        rows finish at different times by their own limits, not only by end of sequence.
    """

    def __init__(self, fn: Any, name: Optional[str] = None, per_row_max_new_tokens: Optional[bool] = None,
                 component: str = "generator", argument: Optional[str] = None, accepts_requests: Optional[bool] = None,
                 seeded: Optional[bool] = None):
        method = getattr(fn, "generate", None)
        self._fn = method if callable(method) else fn
        if not callable(self._fn):
            raise InvalidArgument(f"{argument or component}: expected a callable generate(prompts, max_new_tokens, "
                                  f"seed) or an object with a generate method, got {type(fn).__name__}")
        self.name = name or getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__
        self.per_row_max_new_tokens = bool(per_row_max_new_tokens if per_row_max_new_tokens is not None
                                           else getattr(fn, "per_row_max_new_tokens", False))
        self.accepts_requests = bool(accepts_requests if accepts_requests is not None
                                     else getattr(fn, "accepts_requests", False))
        self.seeded = bool(seeded if seeded is not None else getattr(fn, "seeded", False))
        self.component = component

    def __call__(self, prompts: list, max_new_tokens, seed: int, *, vocab_size: int, case: str,
                 requests: Optional[list] = None) -> GenerationOutput:
        if requests is not None and self.accepts_requests:
            raw = _call(self.component, case, lambda: self._fn(prompts, max_new_tokens, seed, requests=requests))
        else:
            raw = _call(self.component, case, self._fn, prompts, max_new_tokens, seed)
        output = raw if isinstance(raw, GenerationOutput) else GenerationOutput(raw)
        continuations = output.continuations
        if isinstance(continuations, (torch.Tensor, np.ndarray)):
            continuations = continuations.tolist()
        if not isinstance(continuations, Sequence) or len(continuations) != len(prompts):
            got = len(continuations) if isinstance(continuations, Sequence) else type(continuations).__name__
            raise GenerationContractError(f"{self.component} on {case}: expected {len(prompts)} continuations (one per "
                                          f"prompt), got {got}")
        limits = max_new_tokens if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * len(prompts)
        checked = []
        for i, (row, limit) in enumerate(zip(continuations, limits)):
            if isinstance(row, (torch.Tensor, np.ndarray)):
                row = row.tolist()
            if not isinstance(row, Sequence) or isinstance(row, (str, bytes)):
                raise GenerationContractError(f"{self.component} on {case}, row {i}: expected a list of token ids, got "
                                              f"{type(row).__name__}")
            if len(row) > limit:
                raise GenerationContractError(f"{self.component} on {case}, row {i}: {len(row)} tokens, more than "
                                              f"max_new_tokens = {limit}")
            ids = []
            for token in row:
                if (isinstance(token, (bool, np.bool_)) or not isinstance(token, numbers.Integral)
                        or not 0 <= token < vocab_size):
                    raise GenerationContractError(f"{self.component} on {case}, row {i}: token {token!r} is not an id "
                                                  f"in [0, {vocab_size})")
                ids.append(int(token))
            checked.append(ids)
        counters = {}
        for field in ("accepted", "target_calls"):
            values = getattr(output, field)
            if values is None:
                counters[field] = None
                continue
            if isinstance(values, (torch.Tensor, np.ndarray)):
                values = values.tolist()
            if not isinstance(values, Sequence) or len(values) != len(prompts):
                got = len(values) if isinstance(values, Sequence) else type(values).__name__
                raise GenerationContractError(f"{self.component} on {case}: {field} has {got} entries for "
                                              f"{len(prompts)} prompts")
            if any(isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral) or v < 0 for v in values):
                raise GenerationContractError(f"{self.component} on {case}: {field} must be non-negative integers, "
                                              f"got {list(values)!r:.80}")
            counters[field] = [int(v) for v in values]
        extra = (_request_fields(self.component, case, output, checked, requests)
                 if requests is not None and self.accepts_requests else {})
        return GenerationOutput(checked, **counters, **extra, stats=_check_stats(self.component, case, output.stats))


def _check_stats(component: str, case: str, stats: Any) -> Optional[dict]:
    """The engine's serving counters: a mapping of names to integers >= 0 (None: none reported)."""
    if stats is None:
        return None
    if not isinstance(stats, Mapping):
        raise GenerationContractError(f"{component} on {case}: stats must be a mapping of counter names to integers, "
                                      f"got {type(stats).__name__}")
    out = {}
    for name, value in stats.items():
        if not isinstance(name, str) or not name:
            raise GenerationContractError(f"{component} on {case}: stats: counter names must be strings, got {name!r}")
        if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
            value = value.item()
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < 0:
            raise GenerationContractError(f"{component} on {case}: stats[{name!r}] must be an integer >= 0, got "
                                          f"{value!r}")
        out[name] = int(value)
    return out


def _per_row(component: str, case: str, field: str, values: Any, rows: list) -> Optional[list]:
    if values is None:
        return None
    if isinstance(values, (torch.Tensor, np.ndarray)):
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != len(rows):
        got = len(values) if isinstance(values, Sequence) else type(values).__name__
        raise GenerationContractError(f"{component} on {case}: {field} has {got} entries for {len(rows)} rows")
    return list(values)


def _request_fields(component: str, case: str, output: GenerationOutput, rows: list, requests: list) -> dict:
    """The whole-request fields of ``output``, checked against the rows and what each row's request asked."""
    logprobs = _per_row(component, case, "logprobs", output.logprobs, rows)
    top = _per_row(component, case, "top_logprobs", output.top_logprobs, rows)
    finish = _per_row(component, case, "finish_reasons", output.finish_reasons, rows)
    usage = _per_row(component, case, "completion_tokens", output.completion_tokens, rows)
    if output.logprobs_mode not in LOGPROBS_MODES:
        raise GenerationContractError(f"{component} on {case}: logprobs_mode must be one of {LOGPROBS_MODES}, got "
                                      f"{output.logprobs_mode!r}")
    for i, (row, request) in enumerate(zip(rows, requests)):
        if request.logprobs is not None and (logprobs is None or logprobs[i] is None):
            raise GenerationContractError(f"{component} on {case}, row {i}: the request asked for logprobs and the "
                                          f"engine returned none (field logprobs)")
        if request.logprobs and (top is None or top[i] is None):
            raise GenerationContractError(f"{component} on {case}, row {i}: the request asked for the top "
                                          f"{request.logprobs} logprobs and the engine returned none (field "
                                          f"top_logprobs)")
        if finish is None or finish[i] is None:
            raise GenerationContractError(f"{component} on {case}, row {i}: no finish reason (field finish_reasons)")
        if not isinstance(finish[i], str):
            raise GenerationContractError(f"{component} on {case}, row {i}: finish_reasons must be strings, got "
                                          f"{finish[i]!r}")
        if logprobs is not None and logprobs[i] is not None:
            values = logprobs[i]
            if isinstance(values, (torch.Tensor, np.ndarray)):
                values = values.tolist()
            if not isinstance(values, Sequence) or len(values) != len(row):
                raise GenerationContractError(f"{component} on {case}, row {i}: logprobs must hold one value per "
                                              f"emitted token ({len(row)})")
            if any(isinstance(v, bool) or not isinstance(v, numbers.Real) or math.isnan(v) for v in values):
                raise GenerationContractError(f"{component} on {case}, row {i}: logprobs must be numbers, not NaN")
            logprobs[i] = [float(v) for v in values]
        if top is not None and top[i] is not None:
            if not isinstance(top[i], Sequence) or len(top[i]) != len(row) or any(
                    not isinstance(d, dict) for d in top[i]):
                raise GenerationContractError(f"{component} on {case}, row {i}: top_logprobs must hold one "
                                              f"{{token: logprob}} dict per emitted token ({len(row)})")
            short = next((t for t, d in enumerate(top[i]) if len(d) < (request.logprobs or 0)), None)
            if short is not None:
                raise GenerationContractError(f"{component} on {case}, row {i}: top_logprobs at position {short} "
                                              f"holds {len(top[i][short])} entries; the request asked for the top "
                                              f"{request.logprobs}")
        if usage is not None and usage[i] is not None and (
                isinstance(usage[i], bool) or not isinstance(usage[i], numbers.Integral) or usage[i] < 0):
            raise GenerationContractError(f"{component} on {case}, row {i}: completion_tokens must be an integer "
                                          f">= 0, got {usage[i]!r}")
    return dict(logprobs=logprobs, top_logprobs=top, finish_reasons=finish, completion_tokens=usage,
                logprobs_mode=output.logprobs_mode)


class ScorerOutput(NamedTuple):
    """What a wrapped scorer returns: the laws, and for a logits scorer the logits, each row's sampling parameters
    and the processing order (None for a laws scorer)."""

    laws: list
    logits: Optional[list]
    params: Optional[list]
    order: Any


class Scorer:
    """A scorer, wrapped: its laws checked (shapes, finite, each row a distribution) and processed when logits.

    Parameters
    ----------
    fn : callable
        ``fn(prompts, continuations)`` returning a list of ``[len_i, vocab_size]`` tensors of
        probabilities, or :class:`ScoredLogits`; or an object with a ``score`` method.
    vocab_size : int
    """

    def __init__(self, fn: Any, vocab_size: int, name: Optional[str] = None, component: str = "scorer",
                 argument: Optional[str] = None):
        method = getattr(fn, "score", None)
        self._fn = method if callable(method) else fn
        if not callable(self._fn):
            raise InvalidArgument(f"{argument or component}: expected a callable score(prompts, continuations) or an "
                                  f"object with a score method, got {type(fn).__name__}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise InvalidArgument(f"vocab_size: expected an integer >= 2, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.name = name or getattr(fn, "name", None) or getattr(fn, "__name__", None) or type(fn).__name__
        self.component = component

    def __call__(self, prompts: list, continuations: list, *, case: str) -> "ScorerOutput":
        """Per continuation its float64 laws ``[len_i, V]`` and, for a logits scorer, its raw logits, each
        continuation's sampling parameters and the processing order (for the numerics margins of zero-mass
        tokens; None for a laws scorer)."""
        raw = _call(self.component, case, self._fn, prompts, continuations)
        logits, row_params, order = None, None, None
        if isinstance(raw, ScoredLogits):
            try:
                row_params = [_row_params(raw.params, i, len(continuations)) for i in range(len(continuations))]
            except InvalidArgument as exc:  # the scorer's parameters, not the caller's arguments
                raise GenerationContractError(f"{self.component} on {case}, row 0: its logits could not be "
                                              f"processed: {exc}") from exc
            order = raw.order
            logits = self._tensors(raw.logits, continuations, case, "logits")
            laws = []
            for i, row in enumerate(logits):
                if not row.numel():
                    laws.append(row.double())
                    continue
                largest = row.amax()  # NaN where the row holds a NaN, +inf where it holds +inf
                if bool(torch.isnan(largest)) or bool(largest == torch.inf):
                    raise GenerationContractError(f"{self.component} on {case}, row {i}: logits must be finite or "
                                                  f"-inf (found NaN or +inf)")
                try:
                    params = _row_params(raw.params, i, len(continuations))
                    laws.append(process_logits(row.double().unsqueeze(0), params, raw.order)[0])
                except InvalidArgument as exc:  # the scorer's parameters or logits, not the caller's arguments
                    raise GenerationContractError(f"{self.component} on {case}, row {i}: its logits could not be "
                                                  f"processed: {exc}") from exc
        else:
            laws = self._tensors(raw, continuations, case, "laws")
        laws = [law.double() for law in laws]
        for i, law in enumerate(laws):
            if law.numel() == 0:
                continue
            # processed logits are non-negative by construction, and NaN or inf shows in their sums
            if logits is None and (not bool(torch.isfinite(law).all()) or bool((law < 0).any())):
                raise GenerationContractError(f"{self.component} on {case}, row {i}: laws must be finite and "
                                              f"non-negative")
            sums = law.sum(-1)
            worst = float((sums - 1).abs().max())
            if not worst <= 1e-4:  # NaN too
                raise GenerationContractError(f"{self.component} on {case}, row {i}: a law sums to "
                                              f"{float(sums[(sums - 1).abs().argmax()]):.6g}, not 1")
        return ScorerOutput([law.cpu() for law in laws], None if logits is None else [x.cpu() for x in logits],
                            row_params, order)

    def _tensors(self, values, continuations, case, what) -> list:
        """One ``[len_i, vocab_size]`` tensor per continuation, or a named contract error."""
        if isinstance(values, torch.Tensor) and values.dim() == 3:
            values = list(values)  # a padded [batch, len, V] tensor: fine when every length matches
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) != len(continuations):
            got = len(values) if isinstance(values, Sequence) else type(values).__name__
            raise GenerationContractError(f"{self.component} on {case}: expected {len(continuations)} {what} tensors "
                                          f"(one per continuation), got {got}")
        tensors = []
        for i, (value, row) in enumerate(zip(values, continuations)):
            try:
                tensor = torch.as_tensor(value)
            except Exception as exc:  # not numbers at all
                raise GenerationContractError(f"{self.component} on {case}, row {i}: expected a [{len(row)}, "
                                              f"{self.vocab_size}] tensor of {what}, got "
                                              f"{type(value).__name__}") from exc
            if tensor.dtype == torch.bool or tensor.is_complex():
                raise GenerationContractError(f"{self.component} on {case}, row {i}: {what} must be real numbers, got "
                                              f"{tensor.dtype}")
            if tensor.dim() != 2 or tensor.shape[0] != len(row) or (len(row) and tensor.shape[1] != self.vocab_size):
                raise GenerationContractError(f"{self.component} on {case}, row {i}: expected {what} of shape "
                                              f"[{len(row)}, {self.vocab_size}], got {list(tensor.shape)}")
            tensors.append(tensor)
        return tensors


def _row_params(params: SamplingParams, row: int, batch: int) -> SamplingParams:
    """The scalar parameters of one continuation (a batch's per-row tensors indexed at ``row``)."""
    fields = {}
    for name in ("temperature", "top_k", "top_p", "min_p"):
        value = getattr(params, name)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if value.numel() != batch:
                raise InvalidArgument(f"params.{name}: {value.numel()} values for {batch} continuations")
            value = value[row].item()
        elif isinstance(value, torch.Tensor):
            value = value.item()
        fields[name] = value
    return SamplingParams(**fields)


def as_generator(obj: Any, name: Optional[str] = None, component: str = "generator",
                 per_row_max_new_tokens: Optional[bool] = None, argument: Optional[str] = None,
                 accepts_requests: Optional[bool] = None, seeded: Optional[bool] = None) -> Generator:
    """A :class:`Generator` from a callable or an object with ``generate`` (a :class:`Generator` as it is).

    ``accepts_requests``: the generator takes ``requests=`` (one :class:`~spectr_audit.contract.requests.Request`
    per row) and returns the whole-request fields of :class:`GenerationOutput`; ``seeded``: it honours each
    request's seed whatever the batch.  Both default to the attributes of the same names on ``obj``.
    """
    if isinstance(obj, Generator):
        return obj
    return Generator(obj, name=name, per_row_max_new_tokens=per_row_max_new_tokens, component=component,
                     argument=argument, accepts_requests=accepts_requests, seeded=seeded)


def as_scorer(obj: Any, vocab_size: int, name: Optional[str] = None, component: str = "scorer",
              argument: Optional[str] = None) -> Scorer:
    """A :class:`Scorer` from a callable or an object with ``score`` (a :class:`Scorer` as it is)."""
    if isinstance(obj, Scorer):
        if obj.vocab_size != vocab_size:
            raise InvalidArgument(f"{argument or component}: a Scorer for vocab_size {obj.vocab_size}, the audit's is "
                                  f"{vocab_size}")
        return obj
    return Scorer(obj, vocab_size, name=name, component=component, argument=argument)

