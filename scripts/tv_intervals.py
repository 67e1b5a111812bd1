"""Tables of the statistical audit's TV estimates: intervals against exact TVs, coverage, certification costs.

Usage::

    python scripts/tv_intervals.py library [--samples 65536] [--seeds 20]
    python scripts/tv_intervals.py certify [--eps 0.05 0.02 0.01] [--seeds 3]

``library``: every broken verifier of :mod:`spectr_audit.verifiers.library.broken` on its standard
case (V = 8, Dirichlet draft seed 1 and target seed 2, K = 4 where it supports it), audited as a
black box with a fixed sample over many seeds: its exact TV on the audited partition (from its
exact law, coarsened to the cells), the mean estimate, the mean interval, and the coverage (the
fraction of intervals that contain the exact TV; the level is 1 - alpha = 0.999).  The e-process
stops a blatant slip early; its interval is then the one at the stopping point (valid there).

``certify``: samples and seconds ``--certify-tv EPS`` takes on the standard case for a correct
verifier (K-SEQ) and broken ones, with the outcome (certified, refuted, or uncertified when the
planned budget ran out), median over seeds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spectr_audit.exact.iteration import exact_iteration  # noqa: E402
from spectr_audit.registry import broken_names, load_broken, load_verifier  # noqa: E402
from spectr_audit.statistical.audit import statistical_audit  # noqa: E402
from spectr_audit.statistical.confidence import partition_tv  # noqa: E402
from spectr_audit.statistical.sampling import build_partition  # noqa: E402
from tests._models import DRAFT8, TARGET8  # noqa: E402


def standard_case(verifier) -> tuple[int, int]:
    """(K, L) of the library's standard case (as in tests/verifiers/test_broken_verifiers.py)."""
    num_drafts = 4 if verifier.supports(4, 1) or verifier.supports(4, 2) else 1
    return num_drafts, 1 if verifier.supports(num_drafts, 1) else 2


def library(args) -> None:
    print(f"{args.samples} samples per audit, {args.seeds} seeds, interval level 0.999, stratified design off\n")
    print("| verifier | K | L | exact TV (full) | exact TV on the partition | samples used (median) | mean estimate "
          "| mean interval | coverage | partition |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    total = covered = 0
    for name in args.only or broken_names():
        verifier = load_broken(name)
        num_drafts, draft_len = standard_case(verifier)
        exact = exact_iteration(verifier, DRAFT8, TARGET8, num_drafts, draft_len)
        partition = build_partition(TARGET8, draft_len + 1, args.samples)
        tv = partition_tv(exact.implied_law, partition)
        rows = [statistical_audit(verifier, DRAFT8, TARGET8, num_drafts, draft_len, num_samples=args.samples,
                                  stratify=False, seed=seed) for seed in range(args.seeds)]
        assert all(r.partition == partition.summary() for r in rows)
        hits = sum(r.tv_lower <= tv <= r.tv_upper for r in rows)
        total, covered = total + len(rows), covered + hits
        estimate = statistics.fmean(r.tv_estimate for r in rows)
        low, high = statistics.fmean(r.tv_lower for r in rows), statistics.fmean(r.tv_upper for r in rows)
        used = statistics.median(r.num_samples for r in rows)
        print(f"| {name} | {num_drafts} | {draft_len} | {exact.tv_distance:.4f} | {tv:.4f} | {used:,.0f} | {estimate:.4f} | "
              f"[{low:.4f}, {high:.4f}] | {hits}/{len(rows)} | {partition.num_cells} cells |", flush=True)
    print(f"\ncoverage: {covered}/{total} = {covered / total:.4f} (level 0.999)")


def certify(args) -> None:
    cases = [("kseq", load_verifier("kseq"))] + [(name, load_broken(name)) for name in args.broken]
    print("| verifier | exact TV | EPS | outcome | samples (median) | planned | seconds (median) |")
    print("|---|---|---|---|---|---|---|")
    for name, verifier in cases:
        num_drafts, draft_len = standard_case(verifier)
        tv = exact_iteration(verifier, DRAFT8, TARGET8, num_drafts, draft_len).tv_distance
        for eps in args.eps:
            rows, seconds = [], []
            for seed in range(args.seeds):
                start = time.perf_counter()
                rows.append(statistical_audit(verifier, DRAFT8, TARGET8, num_drafts, draft_len, certify_tv=eps,
                                              seed=seed))
                seconds.append(time.perf_counter() - start)
            outcomes = sorted({r.certification for r in rows})
            verdicts = sorted({r.verdict for r in rows})
            print(f"| {name} | {tv:.4f} | {eps:g} | {', '.join(outcomes)} ({', '.join(verdicts)}) | "
                  f"{statistics.median(r.num_samples for r in rows):,.0f} | {rows[0].planned_samples:,} | "
                  f"{statistics.median(seconds):.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("library")
    p.add_argument("--samples", type=int, default=1 << 16)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--only", nargs="*")
    p = sub.add_parser("certify")
    p.add_argument("--eps", type=float, nargs="+", default=[0.05, 0.02, 0.01])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--broken", nargs="*", default=["kseq-low-rho", "inflated-ratio", "always-accept"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    {"library": library, "certify": certify}[args.command](args)


if __name__ == "__main__":
    main()
