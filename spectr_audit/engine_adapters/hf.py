"""transformers as the scorer (teacher-forced target laws) and as a generator (``generate``).

:class:`TransformersScorer` runs the target once per batch over each prompt and its continuation
and returns the raw logits at every emitted position as
:class:`~spectr_audit.generation.contract.ScoredLogits` with the engine's sampling parameters and
processing order: the audit processes them with the project's ``process_logits`` (and keeps the
logits for greedy margins).  It computes in float64 unless told otherwise.

:class:`TransformersGenerator` calls ``model.generate`` on token-id prompts: plain sampling or
greedy, assisted decoding (``assistant_model=``) or prompt lookup
(``prompt_lookup_num_tokens=``).  One request per call of ``generate`` per row (transformers'
assisted decoding takes batch size 1), each seeded with ``torch.manual_seed`` from the audit's
seed and the row, since ``generate`` draws from torch's global generator.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Optional, Sequence

import torch

from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.engine_adapters.requests import transformers_generate_kwargs
from spectr_audit.generation.contract import GenerationOutput, ScoredLogits

__all__ = ["TransformersGenerator", "TransformersScorer", "load_causal_lm"]


def load_causal_lm(path, dtype=torch.float32):
    """``AutoModelForCausalLM.from_pretrained(path)`` in ``dtype``, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=dtype)
    return model.eval()


class TransformersScorer:
    """The target's logits at every emitted position, teacher-forced, as ``ScoredLogits``.

    Parameters
    ----------
    model : a transformers causal LM (or a path, loaded in ``dtype``)
    params : SamplingParams
        The engine's sampling setting (the audit applies it to the logits).
    order : str
        Whose processing conventions (``"vllm"``, ``"transformers"``, ...).
    dtype : torch.dtype
        Computation dtype (float64 by default: the truth, whatever the engine's numerics).
    max_rows : int
        Rows per forward pass at most.
    max_logits_bytes : int
        A pass's logits at most this many bytes (one row per pass where a single row passes it).
    """

    def __init__(self, model: Any, params: Optional[SamplingParams] = None, order: str = "vllm",
                 dtype: torch.dtype = torch.float64, max_rows: int = 8, max_logits_bytes: int = 16 << 20):
        if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
            self.model = load_causal_lm(model, dtype)
        else:  # a copy: the engine under audit keeps its own weights and dtype
            self.model = copy.deepcopy(model).to(dtype).eval()
        self.params = params or SamplingParams()
        self.order, self.dtype, self.max_rows = order, dtype, int(max_rows)
        self.max_logits_bytes = int(max_logits_bytes)
        # only the positions scored go through the output layer, where the model can be told so
        self._keeps = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.name = f"transformers {type(self.model).__name__} ({str(dtype).replace('torch.', '')})"

    @torch.inference_mode()
    def score(self, prompts, continuations):
        """Rows of similar lengths share a forward pass: each row's prompt and continuation right-padded to the
        longest, with an attention mask, so every row keeps the positions it has alone (0, 1, ... from its first
        token) and no row attends to padding; the logits at the continuation's positions, in the scorer's dtype.

        A pass takes at most ``max_rows`` rows, and fewer where its logits would pass ``max_logits_bytes``: at a
        large vocabulary a pass's logits are tens of megabytes, which the allocator returns to the system when
        freed, and faulting them in again on every pass cost more than the pass (several times more beside a
        vLLM engine on the same machine).  Where the model takes ``logits_to_keep``, the output layer runs on
        the positions from the earliest continuation on only."""
        out: list = [None] * len(prompts)
        vocab_size = self.model.config.vocab_size
        rows = [r for r in range(len(prompts)) if continuations[r]]
        for r in range(len(prompts)):
            if not continuations[r]:
                out[r] = torch.zeros(0, vocab_size, dtype=torch.float64)
        # rows of similar lengths share a pass (less padding)
        rows.sort(key=lambda r: len(prompts[r]) + len(continuations[r]))
        start = 0
        while start < len(rows):
            group = self._group(rows[start:start + max(1, self.max_rows)], prompts, continuations, vocab_size)
            start += len(group)
            sequences = [list(prompts[r]) + list(continuations[r]) for r in group]
            width = max(len(seq) for seq in sequences)
            ids = torch.zeros(len(group), width, dtype=torch.int64)
            mask = torch.zeros(len(group), width, dtype=torch.int64)
            for i, seq in enumerate(sequences):
                ids[i, :len(seq)] = torch.tensor(seq, dtype=torch.int64)
                mask[i, :len(seq)] = 1
            # the first position read: the last prompt token of the row with the shortest prompt
            offset = min(len(prompts[r]) - 1 for r in group) if self._keeps else 0
            extra = {"logits_to_keep": width - offset} if self._keeps else {}
            logits = self.model(input_ids=ids, attention_mask=mask, **extra).logits.double()
            for i, r in enumerate(group):
                first = len(prompts[r]) - 1 - offset
                out[r] = logits[i, first:first + len(continuations[r])].clone()
        return ScoredLogits(out, self.params, self.order)

    def _group(self, candidates: list, prompts, continuations, vocab_size: int) -> list:
        """The longest prefix of ``candidates`` (at least one row) whose pass keeps its logits within budget."""
        bytes_per = vocab_size * torch.finfo(self.dtype).bits // 8
        for size in range(len(candidates), 1, -1):
            group = candidates[:size]
            width = max(len(prompts[r]) + len(continuations[r]) for r in group)
            kept = width - (min(len(prompts[r]) - 1 for r in group) if self._keeps else 0)
            if size * kept * bytes_per <= self.max_logits_bytes:
                return group
        return candidates[:1]


class TransformersGenerator:
    """transformers' ``generate`` on token-id prompts, one row at a time, seeded per row.

    Parameters
    ----------
    model : a transformers causal LM
    params : SamplingParams
        Temperature 0 is greedy (``do_sample=False``); top-k / top-p as transformers' warpers.
    assistant_model : optional
        Assisted (speculative) decoding with this draft model.
    prompt_lookup_num_tokens : int, optional
        Prompt-lookup decoding.
    num_assistant_tokens : int, optional
        The draft depth of assisted decoding (a constant schedule).
    tokenizer : optional
        The model's tokenizer: requests with stop strings (``stop_strings``), and the audit's ``detokenize``.
    prefill_chunk_size : int, optional
        ``generate``'s ``prefill_chunk_size``: the prompt prefilled this many tokens per forward pass where
        transformers chunks it.
    assistant_confidence_threshold : float, optional
        The assistant stops drafting within a step once its most likely token's probability falls below this
        (transformers' ``ConfidenceCriteria``; None: transformers' default, 0.4 in 5.x; 0: off, so every step drafts
        ``num_assistant_tokens``).

    Every call reports, as ``GenerationOutput.stats``, what the target's forward passes show (read by a forward
    hook, not from the settings): ``chunked_prompts``, the rows whose prompt the first pass did not cover whole, and
    ``draft_depth``, the most tokens one verification pass checked beyond the committed ones.
    """

    per_row_max_new_tokens = True

    def __init__(self, model: Any, params: Optional[SamplingParams] = None, *, assistant_model: Any = None,
                 prompt_lookup_num_tokens: Optional[int] = None, num_assistant_tokens: Optional[int] = None,
                 tokenizer: Any = None, prefill_chunk_size: Optional[int] = None,
                 assistant_confidence_threshold: Optional[float] = None):
        self.model, self.params = model, params or SamplingParams()
        self.tokenizer = tokenizer
        if tokenizer is not None:  # the audit's detokenize (stop strings): the tokenizer's own decode
            self.detokenize = tokenizer.decode
        self.assistant_model = assistant_model
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        self.num_assistant_tokens = num_assistant_tokens
        self.prefill_chunk_size = prefill_chunk_size
        self.assistant_confidence_threshold = assistant_confidence_threshold
        how = ("assisted" if assistant_model is not None else
               "prompt lookup" if prompt_lookup_num_tokens else "plain")
        self.name = f"transformers generate ({how}, {self.params.describe() or 'neutral'})"

    def _kwargs(self, max_new_tokens: int) -> dict:
        temperature = float(self.params.temperature)
        # no min_new_tokens: it suppresses the end-of-sequence token, a constraint the scorer's law does
        # not have; a row that ends early is a shorter continuation
        kwargs: dict = {"max_new_tokens": int(max_new_tokens), "pad_token_id": 0}
        if temperature == 0:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=temperature, top_k=int(self.params.top_k) or 0,
                          top_p=float(self.params.top_p))
        if self.assistant_model is not None:
            kwargs["assistant_model"] = self.assistant_model
            if self.num_assistant_tokens:
                self.assistant_model.generation_config.num_assistant_tokens = self.num_assistant_tokens
                self.assistant_model.generation_config.num_assistant_tokens_schedule = "constant"
            # set on every call: generators of other depths may share the assistant model
            self.assistant_model.generation_config.assistant_confidence_threshold = self.assistant_confidence_threshold
        if self.prompt_lookup_num_tokens:
            kwargs["prompt_lookup_num_tokens"] = int(self.prompt_lookup_num_tokens)
        if self.prefill_chunk_size:
            kwargs["prefill_chunk_size"] = int(self.prefill_chunk_size)
        return kwargs

    #: ``generate`` takes ``requests=`` (whole requests, one per row) and honours each request's seed.
    accepts_requests = True
    seeded = True

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens, seed, requests=None):
        limits = list(max_new_tokens) if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * len(prompts)
        if requests is not None:
            return self._generate_requests(prompts, limits, seed, requests)
        out, counters = [], _Counters()
        for row, (prompt, limit) in enumerate(zip(prompts, limits)):
            torch.manual_seed((int(seed) * 1_000_003 + row) % (1 << 62))
            ids = torch.tensor([list(prompt)], dtype=torch.int64)
            with _ForwardTrace(self.model) as trace:
                result = self.model.generate(ids, attention_mask=torch.ones_like(ids), **self._kwargs(limit))
            counters.add(trace.lengths, len(prompt))
            out.append(result[0, ids.shape[1]:].tolist()[:limit])
        return GenerationOutput(out, stats=counters.stats())

    def _generate_requests(self, prompts, limits, seed, requests) -> GenerationOutput:
        """Each row under its own request: the raw logprobs of its tokens (``output_logits``), the top-n where
        asked, its finish reason and usage; a row with a seed is drawn from that seed alone."""
        rows, logprobs, tops, finishes, counters = [], [], [], [], _Counters()
        eos = self.model.generation_config.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        for row, (prompt, limit, request) in enumerate(zip(prompts, limits, requests)):
            kwargs = self._kwargs(limit)
            for key in ("do_sample", "temperature", "top_k", "top_p"):
                kwargs.pop(key, None)
            kwargs.update(transformers_generate_kwargs(request, limit, eos, self.tokenizer))
            torch.manual_seed(request.seed if request.seed is not None else (int(seed) * 1_000_003 + row) % (1 << 62))
            ids = torch.tensor([list(prompt)], dtype=torch.int64)
            with _ForwardTrace(self.model) as trace:
                result = self.model.generate(ids, attention_mask=torch.ones_like(ids), return_dict_in_generate=True,
                                             output_logits=True, **kwargs)
            counters.add(trace.lengths, len(prompt))
            tokens = result.sequences[0, ids.shape[1]:].tolist()[:kwargs["max_new_tokens"]]
            raw = [torch.log_softmax(step[0].double(), -1) for step in result.logits][:len(tokens)]
            rows.append(tokens)
            logprobs.append([float(lp[t]) for lp, t in zip(raw, tokens)] if request.logprobs is not None else None)
            if request.logprobs:
                tops.append([{int(i): float(v) for i, v in zip(*reversed(lp.topk(request.logprobs)))} for lp in raw])
            else:
                tops.append(None)
            # generate returns no finish reason: a row stopped when its last token ends it (a stop token, or the
            # token completing a stop string as StopStringCriteria matches it)
            ended = request.stop_position(tokens, eos, getattr(self, "detokenize", None), "transformers")
            finishes.append("stop" if tokens and ended == len(tokens) - 1 else "length")
        return GenerationOutput(rows, logprobs=logprobs, top_logprobs=tops, finish_reasons=finishes,
                                completion_tokens=[len(r) for r in rows], stats=counters.stats())


class _ForwardTrace:
    """The input lengths of a model's forward passes while the context is open (a forward pre-hook)."""

    def __init__(self, model: Any):
        self.model, self.lengths = model, []

    def __enter__(self) -> "_ForwardTrace":
        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if isinstance(ids, torch.Tensor):
                self.lengths.append(int(ids.shape[-1]))

        self.handle = self.model.register_forward_pre_hook(hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


class _Counters:
    """The serving counters of one call from the target's forward passes, row by row: a row's prompt is chunked
    when the first pass took less than the whole prompt; a pass's draft depth is the tokens it took beyond the
    prompt (the first pass to cross the prompt's end) or beyond the one committed token it re-reads (a later
    pass)."""

    def __init__(self):
        self.chunked, self.depth = 0, 0

    def add(self, lengths: Sequence[int], prompt_length: int) -> None:
        processed = 0
        for k, n in enumerate(lengths):
            if processed < prompt_length:
                if k == 0 and n < prompt_length:
                    self.chunked += 1
                processed += n
                self.depth = max(self.depth, processed - prompt_length)
            else:
                self.depth = max(self.depth, n - 1)

    def stats(self) -> dict:
        return {"chunked_prompts": self.chunked, "draft_depth": self.depth}
