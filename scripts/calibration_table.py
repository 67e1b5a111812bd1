"""The null rejection table of every test family of the audit (docs/audit/calibration.md).

Counts drawn from each partition's own null law (no verifier: the null holds by construction),
every family's p-value computed as the audit computes it, rejections counted at each level
(spectr_audit.statistical.calibration).

    python scripts/calibration_table.py                          # fast partitions, 2,000 draws
    python scripts/calibration_table.py --scale full --draws 20000 --out table.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from spectr_audit.statistical.calibration import (
    CELL_FAMILIES,
    acceptance_pvalues,
    audit_partitions,
    block_efficiency_pvalues,
    calibration_table,
    eprocess_pvalues,
    rejections,
    stratified_null,
    stratified_pvalues,
)
from spectr_audit.registry import load_verifier

STRATA = (("speculative", 8, 1, 20_000), ("kseq", 8, 2, 20_000), ("kseq", 8, 2, 200_000), ("rrs", 6, 3, 50_000),
          ("kseq", 4, 4, 50_000))
STRATIFIED_FAMILIES = ("stratified-pearson", "conditional-g", "conditional-pearson", "aggregated-pearson")


def _strata_rows(draws: int, alphas, seed: int) -> list:
    rng = np.random.default_rng(3)
    rows = []
    for name, vocab_size, num_drafts, num_samples in STRATA:
        null = stratified_null(load_verifier(name), rng.dirichlet(np.ones(vocab_size)),
                               rng.dirichlet(np.ones(vocab_size)), num_drafts)
        for family in STRATIFIED_FAMILIES:
            pvalues = stratified_pvalues(family, null, num_samples, draws, seed)
            rows += rejections(family, null.case, pvalues, alphas, num_cells=null.laws.shape[1],
                               num_samples=num_samples, min_expected=float("nan"))
    return rows


def _sequential_rows(draws: int, alphas, seed: int) -> list:
    rows = []
    schedule = [4096, 8192, 16384] + [32768] * 5  # the audit's doubling chunks, then full ones: 192,512 samples
    for case, partition, _ in [audit_partitions("fast")[i] for i in (2, 5, 7)]:
        pvalues = eprocess_pvalues(partition, schedule, max(draws // 10, 200), seed)
        rows += rejections("e-process", case.split(",")[0] + f", {sum(schedule):,} samples in {len(schedule)} looks",
                           pvalues, alphas, num_cells=partition.num_cells, num_samples=sum(schedule),
                           min_expected=float("nan"))
    for tails, num_samples in (((0.6, 0.3), 2_000), ((0.6, 0.3), 50_000), ((0.9, 0.8, 0.7, 0.6), 20_000)):
        pvalues = block_efficiency_pvalues(tails, num_samples, draws, seed)
        rows += rejections("block-efficiency", f"lengths at the bound, P(len > i) = {list(tails)}", pvalues, alphas,
                           num_cells=len(tails) + 1, num_samples=num_samples, min_expected=float("nan"))
    for alpha_star, num_samples in ((0.94, 20_000), (0.5, 2_000)):
        pvalues = acceptance_pvalues(alpha_star, num_samples, draws, seed)
        rows += rejections("acceptance", f"acceptance at alpha* = {alpha_star}", pvalues, alphas, num_cells=2,
                           num_samples=num_samples, min_expected=float("nan"))
    return rows


def markdown(rows) -> str:
    lines = ["| family | case | cells | n | smallest expected | alpha | rejected | rate [99% interval] | |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        low, high = r.interval()
        smallest = "" if r.min_expected != r.min_expected else f"{r.min_expected:.3g}"
        flag = "**above its level**" if r.exceeds() else "ok"
        lines.append(f"| {r.family} | {r.case} | {r.num_cells} | {r.num_samples:,} | {smallest} | {r.alpha:g} | "
                     f"{r.rejections} / {r.draws} | {r.rate:.2g} [{low:.2g}, {high:.2g}] | {flag} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=("fast", "full"), default="fast")
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--alphas", default="0.05,0.01,0.001")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the Markdown table here (and a .json beside it)")
    parser.add_argument("--parts", default="cells,strata,sequential")
    args = parser.parse_args(argv)
    alphas = tuple(float(a) for a in args.alphas.split(","))
    start = time.perf_counter()
    rows = []
    parts = args.parts.split(",")
    if "cells" in parts:
        rows += calibration_table(args.scale, draws=args.draws, alphas=alphas, seed=args.seed,
                                  families=CELL_FAMILIES + ("depth family",))
    if "strata" in parts:
        rows += _strata_rows(max(args.draws // 5, 400), alphas, args.seed)
    if "sequential" in parts:
        rows += _sequential_rows(args.draws, alphas, args.seed)
    text = markdown(rows)
    print(text)
    print(f"\n{len(rows)} rows, {sum(r.exceeds() for r in rows)} above their level, "
          f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
        with open(args.out.rsplit(".", 1)[0] + ".json", "w") as handle:
            json.dump([r.to_dict() for r in rows], handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
