"""Benchmarks of the statistical audit: throughput, the broken-verifier table, the false-alarm rate.

Usage::

    python benchmarks/bench_montecarlo.py throughput [--threads 1] [--samples 2097152] [--processes 1 2]
    python benchmarks/bench_montecarlo.py library [--json out.json]
    python benchmarks/bench_montecarlo.py false-alarms [--runs 1000] [--samples 4096]

``throughput`` times the Monte-Carlo loop (drafting, verification, completion, counting) on
the standard K-SEQ case (V = 8, K = 4, L = 1, context-free Dirichlet models), with the
stratified design off, in 1 and 2 local gloo processes (the sharded audit of
:mod:`spectr_audit.statistical.sharding`; the counts' digests must agree), and breaks one chunk
down by stage; a no-op verifier shows the harness's own ceiling.  Wall-time rates depend on
what else the machine runs; the rate per CPU-second does much less.  ``library`` audits every broken verifier on the library's standard
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


def _verifier(name: str) -> Verifier:
    return FunctionVerifier(_noop, name="noop", max_draft_len=1) if name == "noop" else load_verifier(name)


def timed_audit(name: str, samples: int, repeats: int = 3, chunk: int = None) -> dict:
    """Best of ``repeats`` audits of ``samples`` at V = 8, K = 4 (stratified design and e-process off).

    Run in every process of a ``torch.distributed`` group (:func:`spectr_audit.statistical.sharding.spawn_local`),
    it times the sharded audit: wall time from a barrier to the end, CPU time summed over the processes.
    """
    import torch.distributed as dist

    sharded = dist.is_available() and dist.is_initialized()
    verifier = _verifier(name)
    statistical_audit(verifier, DRAFT8, TARGET8, 4, 1, num_samples=1 << 15, stratify=False, seed=1)  # warm-up
    best = None
    for _ in range(repeats):
        if sharded:
            dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        result = statistical_audit(verifier, DRAFT8, TARGET8, 4, 1, num_samples=samples, stratify=False,
                                   sequential=False, seed=0, chunk_size=chunk)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if sharded:
            times = torch.tensor([wall, cpu], dtype=torch.float64)
            dist.all_reduce(times[:1], op=dist.ReduceOp.MAX)
            dist.all_reduce(times[1:])
            wall, cpu = float(times[0]), float(times[1])
        row = {"processes": result.num_processes, "verifications_per_second": samples / wall,
               "per_cpu_second": samples / cpu, "seconds": wall, "counts_digest": result.counts_digest}
        if best is None or row["verifications_per_second"] > best["verifications_per_second"]:
            best = row
    return best


def _stages(verifier, size: int, repeats: int = 20) -> dict:
    """One chunk, stage by stage: the median CPU milliseconds of each stage over ``repeats`` chunks."""
    generator = torch.Generator().manual_seed(0)
    partition = build_partition(TARGET8, 2, 1 << 21)
    buffers: dict = {}
    times: dict = {}
    for _ in range(repeats):
        marks = [time.process_time()]
        batch = draw_drafts(DRAFT8, TARGET8, 4, 1, size, generator, buffers=buffers)
        marks.append(time.process_time())
        output = verify_batch(verifier, batch, generator, validate_inputs=False)
        marks.append(time.process_time())
        strings, lengths = emitted_strings(batch.draft_tokens, output, 2)
        strings = complete_with_target(strings, lengths, TARGET8, generator)
        marks.append(time.process_time())
        torch.bincount(partition.cells_of(strings), minlength=partition.num_cells)
        marks.append(time.process_time())
        for stage, (a, b) in zip(("draft", "verify", "emit+complete", "count"), zip(marks, marks[1:])):
            times.setdefault(stage, []).append(1e3 * (b - a))
    return {"rows": size, **{stage: float(np.median(values)) for stage, values in times.items()}}


def throughput(args) -> dict:
    """Verifications per second (wall, and per CPU-second) for 1 and 2 processes, K-SEQ and the harness alone."""
    from spectr_audit.statistical.sharding import spawn_local

    torch.set_num_threads(args.threads)
    out = {"threads": args.threads, "samples": args.samples, "rows": []}
    print("| verifier | processes | verifications/s (wall) | per CPU-second | seconds | counts digest |")
    print("|---|---|---|---|---|---|")
    for name in ("kseq", "noop"):
        for processes in args.processes:
            if processes == 1:
                row = timed_audit(name, args.samples, args.repeats, args.chunk)
            else:
                row = spawn_local(timed_audit, processes, name, args.samples, args.repeats, args.chunk,
                                  threads=args.threads)
            row["verifier"] = "harness alone (no-op verifier)" if name == "noop" else name
            out["rows"].append(row)
            print(f"| {row['verifier']} | {row['processes']} | {row['verifications_per_second']:,.0f} | "
                  f"{row['per_cpu_second']:,.0f} | {row['seconds']:.2f} | {row['counts_digest'][:12]} |", flush=True)
        out[f"{name}_one_chunk_cpu_ms"] = _stages(_verifier(name), args.chunk or default_chunk_size(4, 1, 8))
    digests = {}
    for row in out["rows"]:
        digests.setdefault(row["verifier"], set()).add(row["counts_digest"])
    out["bit_identical_across_processes"] = all(len(d) == 1 for d in digests.values())
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=2))
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
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="process counts to time (gloo, local)")
    p.add_argument("--repeats", type=int, default=3, help="best of this many audits per row")
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
