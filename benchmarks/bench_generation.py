"""The generation audit's own cost, as a fraction of the engine's generation time, measured in one run.

The engine is the project's KV-cached SmolLM2 decode loop (``spectr_audit.engine_adapters.smollm.SmolLMEngine``:
a layer-skip self-speculative draft, the target scoring the draft tree in one batched call) with
single-draft speculative sampling; the scorer is one causal pass of the target over each prompt
and continuation.  Printed: tokens, the seconds of generation, of scoring and of the tests, the
audit's overhead ``(scoring + tests) / generation`` and tokens audited per second.  With
``--toy`` the same for the toy loop of ``spectr_audit.generation.library`` (no model weights).

With ``--engine`` a factory of the end-to-end suite (``spectr_audit.engine_adapters.factories``) or
your own, and its ``--options`` as JSON: the same, and, where the engine gives a reference (itself
without speculation), the reference's generation seconds per token over the engine's: the
speedup speculation gave on this machine, both measured in the same run on the same requests.

    python benchmarks/bench_generation.py                 # SmolLM2 (the real-LM extra), 6 prompts x 32 tokens
    python benchmarks/bench_generation.py --toy --rounds 8
    python benchmarks/bench_generation.py --engine spectr_audit.engine_adapters.factories:vllm_engine \
        --options '{"method": "draft", "temperature": 0.0, "prompts": 8}'
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--engine", default=None, help="an engine factory, package.module:factory")
    parser.add_argument("--options", default="{}", help="the factory's keyword arguments, as JSON")
    args = parser.parse_args(argv)
    import torch

    from spectr_audit.generation import audit_generation

    torch.set_num_threads(args.threads)
    reference = None
    if args.engine:
        from spectr_audit.generation.engine_specs import load_generation_engine

        made = load_generation_engine(args.engine, options=json.loads(args.options))
        engine, scorer, vocab_size, reference = made.generate, made.score, made.vocab_size, made.reference
        prompts = made.prompts
    elif args.toy:
        from spectr_audit.generation.library import ToyPair, correct_engine

        pair = ToyPair(16, seed=0)
        engine, scorer, vocab_size = correct_engine(pair), pair.scorer(), 16
        prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2], [11, 3, 3, 1], [0, 1]]
    else:
        from spectr_audit.engine_adapters.smollm import SmolLMEngine, SmolLMScorer
        from spectr_audit.lm.smollm import load_smollm
        from spectr_audit.registry import load_verifier

        lm = load_smollm()
        engine = SmolLMEngine(lm, load_verifier("speculative"), draft_len=2)
        scorer, vocab_size = SmolLMScorer(lm), lm.vocab_size
        prompts = [lm.encode(text) for text in ("The capital of France is", "Once upon a time, there",
                                                "def add(a, b):", "In 1969, the first", "The quick brown fox",
                                                "My favourite food is")]
    start = time.perf_counter()
    result = audit_generation(engine, scorer, prompts, vocab_size=vocab_size, max_new_tokens=args.max_new_tokens,
                              rounds=args.rounds, batch_size=3, arms=("single", "ragged"), progress=False,
                              reference=reference)
    wall = time.perf_counter() - start
    seconds = result.seconds
    overhead = (seconds["scoring"] + seconds["tests"]) / seconds["generation"]
    print(json.dumps({"engine": result.generator, "tokens": result.num_tokens, "verdict": result.verdict,
                      "generation_s": round(seconds["generation"], 2), "scoring_s": round(seconds["scoring"], 2),
                      "tests_s": round(seconds["tests"], 3), "overhead": round(overhead, 4),
                      "tokens_audited_per_s": round(result.num_tokens / max(seconds["scoring"] + seconds["tests"],
                                                                            1e-9), 1),
                      "wall_s": round(wall, 1),
                      **({"reference_generation_s": round(seconds["reference"], 2),
                          "speedup": round(seconds["reference"] / max(seconds["generation"], 1e-9), 3)}
                         if reference is not None and seconds.get("reference") else {})}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
