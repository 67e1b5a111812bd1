"""A slow, obviously-correct oracle of the history-dependent processors: plain Python, one position at a time.

:func:`processed` restates docs/sampling.md's "History-dependent processors" for one position (lists of
floats, ``list.count``, membership tests); :func:`laws` runs it over a row, teacher-forced, and hands each
position to :func:`tests.oracles.sampling.process_engine` for temperature and the filters.
"""

from __future__ import annotations

import math

from tests.oracles import sampling as sampling_oracle

INF = -math.inf

#: llama-cpp-python's chain after the penalties (restated, not imported): the filters on the unscaled logits,
#: temperature last, top-k exactly k, greedy only at temperature 0.
LLAMA_CPP = dict(steps=("top_k", "top_p", "min_p", "temperature"), top_k_ties="rank")


def _banned(words, history):
    out = []
    for word in words:
        prefix = list(word[:-1])
        if len(prefix) <= len(history) and (not prefix or list(history[len(history) - len(prefix):]) == prefix):
            out.append(word[-1])
    return out


def _repeat(value, penalty):
    return value / penalty if value > 0 else value * penalty


def processed(logits, prompt, emitted, request, engine, eos_token_id=None, allowed=None):
    """One position's logits after the processors: ``request`` a dict of Request fields, ``allowed`` the
    constraint's set of allowed tokens (``None``: no constraint)."""
    x = [float(v) for v in logits]
    vocab = range(len(x))
    rep = request.get("repetition_penalty", 1.0)
    freq = request.get("frequency_penalty", 0.0)
    pres = request.get("presence_penalty", 0.0)
    bias = dict(request.get("logit_bias", {}))
    stops = list(request.get("stop_token_ids", ()))
    if eos_token_id is not None:
        stops.append(eos_token_id)
    under_min = len(emitted) < request.get("min_tokens", 0)
    words = request.get("bad_words", ())

    def mask(tokens):
        for t in tokens:
            x[t] = INF

    if engine == "vllm":
        if allowed is not None:
            mask([t for t in vocab if t not in allowed])
        mask(_banned(words, emitted))
        if under_min:
            kept = {t: x[t] for t in stops}
            mask(stops)
            if request.get("constraint") is not None and all(v == INF for v in x):
                for t, v in kept.items():
                    x[t] = v
        for t in vocab:
            x[t] = x[t] + bias.get(t, 0.0)
        if rep != 1.0:
            for t in vocab:
                if t in prompt or t in emitted:
                    x[t] = _repeat(x[t], rep)
        for t in vocab:
            x[t] = x[t] - freq * emitted.count(t)
        for t in vocab:
            x[t] = x[t] - pres * (1.0 if t in emitted else 0.0)
    elif engine == "transformers":
        for t in vocab:
            x[t] = x[t] + bias.get(t, 0.0)
        if rep != 1.0:
            for t in vocab:
                if t in prompt or t in emitted:
                    x[t] = _repeat(x[t], rep)
        mask(_banned([w for w in words if not (len(w) == 1 and w[0] in stops)], list(prompt) + list(emitted)))
        if under_min:
            mask(stops)
        if allowed is not None:
            mask([t for t in vocab if t not in allowed])
    elif engine == "llama.cpp":
        for t in vocab:
            x[t] = x[t] + bias.get(t, 0.0)
        window = list(emitted)[-64:]
        for t in vocab:
            count = window.count(t)
            if count > 0:
                x[t] = _repeat(x[t], rep) - (freq * count + pres * 1.0)
        if allowed is not None:
            mask([t for t in vocab if t not in allowed])
    else:  # sglang
        for t in vocab:
            x[t] = x[t] - freq * emitted.count(t)
        if under_min:
            mask(stops)
        for t in vocab:
            x[t] = x[t] - pres * (1.0 if t in emitted else 0.0)
        if rep != 1.0:
            for t in vocab:
                if t in emitted:
                    x[t] = _repeat(x[t], rep)
        if allowed is not None:
            mask([t for t in vocab if t not in allowed])
        for t in vocab:
            x[t] = x[t] + bias.get(t, 0.0)
    return x


def laws(rows, prompt, continuation, request, engine, eos_token_id=None, allowed_sets=None):
    """Per position ``(processed logits, law)``; ``allowed_sets[t]`` the constraint's allowed set at ``t``."""
    out = []
    for t, row in enumerate(rows):
        allowed = None if allowed_sets is None else allowed_sets[t]
        x = processed(row, prompt, list(continuation[:t]), request, engine, eos_token_id, allowed)
        params = {k: request[k] for k in ("temperature", "top_k", "top_p", "min_p") if k in request}
        if all(v == INF for v in x):
            law = None
        elif engine == "llama.cpp":
            law = sampling_oracle.process(x, **params, **LLAMA_CPP)
        else:
            law = sampling_oracle.process_engine(x, engine, **params)
        out.append((x, law))
    return out


def stop_position(tokens, stop_ids, stop_strings, min_tokens, detokenize, order):
    """Where a row ends, one token at a time as an engine checks it: the first token that is a stop token, or
    whose own text finishes an occurrence of a stop string (under vLLM's order only once ``min_tokens`` tokens
    precede it); -1 when none does."""
    for t, token in enumerate(tokens):
        if token in stop_ids:
            return t
        if order == "vllm" and t < min_tokens:
            continue
        before, text = detokenize(tokens[:t]), detokenize(tokens[:t + 1])
        for s in stop_strings:
            ends = [i + len(s) for i in range(len(text) - len(s) + 1) if text[i:i + len(s)] == s]
            if any(end > len(before) for end in ends):
                return t
    return -1
