"""Benchmarks of the statistical audit: throughput, the broken-verifier table, the false-alarm rate.

Usage::

    python benchmarks/bench_montecarlo.py throughput [--threads 1] [--samples 2097152]
    python benchmarks/bench_montecarlo.py library [--json out.json]
    python benchmarks/bench_montecarlo.py false-alarms [--runs 1000] [--samples 4096]

``throughput`` times the Monte-Carlo loop (drafting, verification, completion, counting) on
the standard K-SEQ case (V = 8, K = 4, L = 1, context-free Dirichlet models), with the
stratified design off, and breaks one chunk down by stage; a no-op verifier shows the
harness's own ceiling.  ``library`` audits every broken verifier on the library's standard
case (tests/verifiers/test_broken_verifiers.py): exact TV, the samples a doubling search needed to flag
it, and the default-budget audit's p-value.  ``false-alarms`` counts rejections of correct
verifiers at the default alpha.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from spectr_audit.contract.verifier import FunctionVerifier, Verifier
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.drafting.models import ContextFreeModel, random_markov
from spectr_audit.statistical.sampling import (
    build_partition,
    complete_with_target,
    default_chunk_size,
    draw_drafts,
    emitted_strings,
    verify_batch,
)
from spectr_audit.registry import load_verifier
from spectr_audit.statistical.audit import statistical_audit
from spectr_audit.registry import broken_names, load_broken

DRAFT8 = ContextFreeModel(np.random.default_rng(1).dirichlet(np.ones(8)))
TARGET8 = ContextFreeModel(np.random.default_rng(2).dirichlet(np.ones(8)))


#: Correct verifiers audited at the default budget: (name, K, L).
CORRECT_CASES = [("speculative", 1, 1), ("kseq", 4, 1), ("rrs", 4, 1), ("rrs-wor", 4, 1), ("block", 1, 2),
                 ("spectr-tree", 2, 2)]


def standard_case(verifier: Verifier) -> tuple[int, int]:
    """(K, L) of the library's standard case (same rule as tests/verifiers/test_broken_verifiers.py)."""
    num_drafts = 4 if verifier.supports(4, 1) or verifier.supports(4, 2) else 1
    return num_drafts, 1 if verifier.supports(num_drafts, 1) else 2


def _noop(draft_tokens, draft_probs, target_probs, generator):
    """Accepts every draft 0 token and emits token 0: the harness's own cost."""
    batch_size = draft_tokens.shape[0]
    zeros = torch.zeros(batch_size, dtype=torch.int64, device=draft_tokens.device)
    return torch.ones_like(zeros), zeros, zeros


def throughput(args) -> dict:
    torch.set_num_threads(args.threads)
    out = {"threads": args.threads, "samples": args.samples}
    for name in ("kseq", "noop"):
        verifier = (FunctionVerifier(_noop, name="noop", max_draft_len=1) if name == "noop"
                    else load_verifier(name))
        statistical_audit(verifier, DRAFT8, TARGET8, 4, 1, num_samples=1 << 14, stratify=False, seed=1)  # warm-up
        result = statistical_audit(verifier, DRAFT8, TARGET8, 4, 1, num_samples=args.samples, stratify=False,
                                   sequential=False, seed=0, chunk_size=args.chunk)
        out[name] = {"verifications_per_second": result.verifications_per_second, "seconds": result.seconds}
        # one chunk, stage by stage
        generator = torch.Generator().manual_seed(0)
        partition = build_partition(TARGET8, 2, args.samples)
        size = args.chunk or default_chunk_size(4, 1, 8)
        stages = {"rows": size}
        start = time.perf_counter()
        batch = draw_drafts(DRAFT8, TARGET8, 4, 1, size, generator)
        stages["draft"] = time.perf_counter() - start
        start = time.perf_counter()
        output = verify_batch(verifier, batch, generator, validate_inputs=False)
        stages["verify"] = time.perf_counter() - start
        start = time.perf_counter()
        strings, lengths = emitted_strings(batch.draft_tokens, output, 2)
        strings = complete_with_target(strings, lengths, TARGET8, generator)
        stages["emit+complete"] = time.perf_counter() - start
        start = time.perf_counter()
        torch.bincount(partition.cells_of(strings), minlength=partition.num_cells)
        stages["count"] = time.perf_counter() - start
        out[name]["one_chunk_seconds"] = stages
    print(json.dumps(out, indent=2))
    return out


def samples_to_flag(verifier, num_drafts, draft_len, seed=0, start=1 << 7, stop=1 << 22, refine=3) -> dict:
    """Smallest main-design size at which the default audit (seed ``seed``) rejects.

    Doubling from ``start``, then ``refine`` bisection steps between the last size that passed
    (or half the first size) and the first that rejected (resolution 1/8 of that interval).  One seed: the number is
    itself random, of the order of the size the test needs for power ~1/2.
    """

    def audit(n):
        return statistical_audit(verifier, DRAFT8, TARGET8, num_drafts, draft_len, num_samples=n, seed=seed)

    low, n = 0, start
    while n <= stop:
        result = audit(n)
        if result.rejects():
            break
        low, n = n, n * 2
    else:
        return {"num_samples": None}
    high, best = n, result
    low = low or n // 2
    for _ in range(refine):
        mid = (low + high) // 2
        result = audit(mid)
        if result.rejects():
            high, best = mid, result
        else:
            low = mid
    return {"num_samples": best.num_samples, "main_design": high, "pvalue": best.pvalue, "test": best.test}


def library(args) -> list:
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.only or broken_names():
        verifier = load_broken(name)
        num_drafts, draft_len = standard_case(verifier)
        exact = exact_iteration(verifier, DRAFT8, TARGET8, num_drafts, draft_len)
        needed = samples_to_flag(verifier, num_drafts, draft_len)
        default = statistical_audit(verifier, DRAFT8, TARGET8, num_drafts, draft_len, seed=0)
        row = {
            "verifier": name, "K": num_drafts, "L": draft_len, "exact_tv": exact.tv_distance,
            "samples_needed": needed["num_samples"], "needed_pvalue": needed.get("pvalue"),
            "needed_test": needed.get("test"),
            "default_pvalue": default.pvalue, "default_test": default.test, "default_samples": default.num_samples,
            "default_stop": default.stop_reason, "default_seconds": default.seconds,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    for name, num_drafts, draft_len in ([] if args.only else CORRECT_CASES):
        verifier = load_verifier(name)
        result = statistical_audit(verifier, DRAFT8, TARGET8, num_drafts, draft_len, seed=0)
        row = {"verifier": name, "K": num_drafts, "L": draft_len, "exact_tv": 0.0,
               "default_pvalue": result.pvalue, "default_test": result.test, "default_samples": result.num_samples,
               "min_detectable_tv": result.min_detectable_tv, "default_seconds": result.seconds}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    return rows


def false_alarms(args) -> dict:
    torch.set_num_threads(args.threads)
    cases = [("speculative", DRAFT8, TARGET8, 1, 1, ()), ("rrs", DRAFT8, TARGET8, 2, 1, ()),
             ("speculative", random_markov(4, 1, seed=1), random_markov(4, 1, seed=2), 1, 2, (1,))]
    alarms, runs = 0, 0
    start = time.perf_counter()
    for index, (name, draft_model, target_model, num_drafts, draft_len, prefix) in enumerate(cases):
        verifier = load_verifier(name)
        for seed in range(args.runs):
            result = statistical_audit(verifier, draft_model, target_model, num_drafts, draft_len, prefix=prefix,
                                       num_samples=args.samples, seed=100_000 * (index + 1) + seed)
            alarms += result.rejects()
            runs += 1
    out = {"alpha": 1e-3, "runs": runs, "alarms": alarms, "rate": alarms / runs, "samples": args.samples,
           "seconds": time.perf_counter() - start}
    print(json.dumps(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("throughput")
    p.add_argument("--samples", type=int, default=1 << 21)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--chunk", type=int, default=None, help="rows per verifier call (default: the audit's)")
    p = sub.add_parser("library")
    p.add_argument("--json")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", nargs="*", help="broken verifiers to run (default: all, and the correct ones)")
    p = sub.add_parser("false-alarms")
    p.add_argument("--runs", type=int, default=1000)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    {"throughput": throughput, "library": library, "false-alarms": false_alarms}[args.command](args)


if __name__ == "__main__":
    main()
