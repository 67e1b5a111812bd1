"""Whole requests (:class:`~spectr_audit.contract.requests.Request`) in the engines' own terms.

:func:`transformers_generate_kwargs` turns a request into ``model.generate`` keywords: ``do_sample``,
``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ``bad_words_ids``, ``min_new_tokens``,
``sequence_bias`` (the logit bias, one-token sequences), the stop tokens as ``eos_token_id`` and the stop strings as
``stop_strings`` (with the tokenizer); transformers has
no presence or frequency penalty, so a request with one is refused naming the field.
:func:`vllm_sampling_fields` turns it into ``vllm.SamplingParams`` keywords (token ids as they are:
``stop_token_ids``, ``logit_bias``; bad words, which vLLM takes as strings, are refused here).
"""

from __future__ import annotations

from typing import Any, Optional

from spectr_audit.contract.requests import Request
from spectr_audit.errors import InvalidArgument

__all__ = ["transformers_generate_kwargs", "vllm_sampling_fields"]


def _check(request, tokenizer: bool = False) -> Request:
    if not isinstance(request, Request):
        raise InvalidArgument(f"request: expected a Request, got {type(request).__name__}")
    if request.constraint is not None:
        raise InvalidArgument("request.constraint: constraints are not passed to an engine by this adapter")
    if request.stop and not tokenizer:
        raise InvalidArgument("request.stop: stop strings need the engine's tokenizer; give stop_token_ids")
    return request


def transformers_generate_kwargs(request: Request, max_new_tokens: int, eos_token_id: Optional[int] = None,
                                 tokenizer: Any = None) -> dict:
    """``model.generate`` keywords for ``request`` (``max_new_tokens`` capped by its ``max_tokens``); stop strings
    go to ``stop_strings`` with the ``tokenizer`` they need."""
    request = _check(request, tokenizer is not None)
    if request.presence_penalty or request.frequency_penalty:
        raise InvalidArgument("request.presence_penalty, request.frequency_penalty: transformers' generate has no "
                              "presence or frequency penalty")
    cap = int(max_new_tokens) if request.max_tokens is None else min(int(max_new_tokens), request.max_tokens)
    kwargs: dict = {"max_new_tokens": cap}
    if request.greedy:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=request.temperature, top_k=request.top_k,
                      top_p=request.top_p)
        if request.min_p:
            kwargs["min_p"] = request.min_p
    if request.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = request.repetition_penalty
    if request.bad_words:
        kwargs["bad_words_ids"] = [list(word) for word in request.bad_words]
    if request.logit_bias:
        kwargs["sequence_bias"] = [[[token], bias] for token, bias in request.logit_bias]
    stops = list(request.stop_ids(eos_token_id))
    if stops:
        kwargs["eos_token_id"] = stops
    if request.min_tokens:
        kwargs["min_new_tokens"] = request.min_tokens
    if request.stop:
        kwargs.update(stop_strings=list(request.stop), tokenizer=tokenizer)
    return kwargs


def vllm_sampling_fields(request: Request, max_new_tokens: int) -> dict:
    """``vllm.SamplingParams`` keywords for ``request`` (``max_tokens`` capped by ``max_new_tokens``)."""
    request = _check(request)
    if request.bad_words:
        raise InvalidArgument("request.bad_words: vLLM takes bad words as strings (it tokenizes them); give them "
                              "to vLLM directly")
    cap = int(max_new_tokens) if request.max_tokens is None else min(int(max_new_tokens), request.max_tokens)
    fields = dict(temperature=request.temperature, top_k=request.top_k if request.top_k else 0,
                  top_p=request.top_p, min_p=request.min_p, repetition_penalty=request.repetition_penalty,
                  presence_penalty=request.presence_penalty, frequency_penalty=request.frequency_penalty,
                  min_tokens=request.min_tokens, max_tokens=cap)
    if request.logit_bias:
        fields["logit_bias"] = {token: bias for token, bias in request.logit_bias}
    if request.stop_token_ids:
        fields["stop_token_ids"] = list(request.stop_token_ids)
    if request.seed is not None:
        fields["seed"] = request.seed
    if request.logprobs is not None:
        fields["logprobs"] = request.logprobs
    return fields
