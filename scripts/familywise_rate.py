"""The whole statistical audit's false-alarm rate: exact verifiers, wrapped as black boxes, over many seeds.

Every family (a G-test per depth, acceptance, block efficiency, the e-process, the stratified
test, the support check; Holm) runs as it does on an engine; the verifiers are exact, so every
FINDING is a false alarm.  Each audit runs at the default alpha = 1e-3; its familywise p-value
also gives its verdict at 0.01 and 0.05 (a rejection at a smaller alpha, early stops included,
is one at every larger alpha).  Reported: the rejections and their 95% Clopper-Pearson interval.

    python scripts/familywise_rate.py --seeds 1000 --out familywise.json
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time

import numpy as np
import torch
from scipy import stats

from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.contract.tree import DraftTree
from spectr_audit.drafting.models import ContextFreeModel, random_markov
from spectr_audit.registry import load_tree_verifier, load_verifier
from spectr_audit.statistical.audit import statistical_audit
from spectr_audit.statistical.calibration import as_black_box

#: EAGLE-1's shipped tree mc_sim_7b_63 (25 draft nodes, depth 5), as eagle.model.choices lists it.
MC_SIM_7B_63 = ast.literal_eval(
    "[[0],[1],[2],[3],[0,0],[0,1],[0,2],[1,0],[1,1],[2,0],[2,1],[3,0],[0,0,0],[0,0,1],[0,0,2],[0,1,0],[0,1,1],"
    "[0,2,0],[0,2,1],[1,0,0],[0,0,0,0],[0,0,0,1],[0,0,0,2],[0,0,0,0,0],[0,0,0,0,1]]")


def cases():
    """``(name, share of the seeds, audit(seed) -> result)``."""
    rng = np.random.default_rng(5)
    v8_draft = ContextFreeModel(torch.from_numpy(rng.dirichlet(np.ones(8))))
    v8_target = ContextFreeModel(torch.from_numpy(rng.dirichlet(np.ones(8))))
    eagle = DraftTree.from_paths([tuple(p) for p in MC_SIM_7B_63])
    markov_draft, markov_target = random_markov(5, seed=1), random_markov(5, seed=2)
    speculative, kseq, block = (as_black_box(load_verifier(n)) for n in ("speculative", "kseq", "block"))
    rrs_wor = as_black_box(load_tree_verifier("tree-rrs-wor"), tree=True)
    spectr = as_black_box(load_tree_verifier("tree-spectr"), tree=True)
    dirichlet_draft = ContextFreeModel(torch.from_numpy(rng.dirichlet(np.ones(3))))
    dirichlet_target = ContextFreeModel(torch.from_numpy(rng.dirichlet(np.ones(3))))
    return [
        ("speculative, V = 2 (0.6, 0.4 -> 0.3, 0.7), K = 1, 20,000 samples", 0.15,
         lambda seed: statistical_audit(speculative, ContextFreeModel([0.6, 0.4]), ContextFreeModel([0.3, 0.7]), 1,
                                        num_samples=20_000, seed=seed)),
        ("kseq, V = 8, K = 2, 100,000 samples (post-stratified, 64 tuples)", 0.15,
         lambda seed: statistical_audit(kseq, v8_draft, v8_target, 2, num_samples=100_000, seed=seed)),
        ("block verification, Markov V = 5, L = 2, 50,000 samples", 0.15,
         lambda seed: statistical_audit(block, markov_draft, markov_target, 1, 2, num_samples=50_000, seed=seed)),
        ("speculative, V = 8, T = 0.7 and top-p 0.8, 50,000 samples", 0.1,
         lambda seed: statistical_audit(speculative, v8_draft, v8_target, 1, num_samples=50_000, seed=seed,
                                        params=SamplingParams(temperature=0.7, top_p=0.8))),
        ("tree-rrs-wor, EAGLE mc_sim_7b_63, Markov V = 5, 200,000 samples", 0.3,
         lambda seed: statistical_audit(rrs_wor, markov_draft, markov_target, 4, 5, tree=eagle,
                                        draft_scheme="without_replacement", num_samples=200_000, seed=seed)),
        ("tree-spectr, cartesian 2 x 2, V = 3, 50,000 samples", 0.15,
         lambda seed: statistical_audit(spectr, dirichlet_draft, dirichlet_target, 2, 2,
                                        tree=DraftTree.cartesian([2, 2]), draft_scheme="iid", num_samples=50_000,
                                        seed=seed)),
    ]


def interval(count: int, total: int) -> list:
    if total == 0:
        return [float("nan"), float("nan")]
    ci = stats.binomtest(count, total).proportion_ci(0.95, method="exact")
    return [float(ci.low), float(ci.high)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=1000, help="audits in all, shared among the cases")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    levels = (0.05, 0.01, 0.001)
    summary, start = [], time.perf_counter()
    for name, share, audit in cases():
        count = max(1, round(share * args.seeds))
        pvalues, seconds, findings = [], time.perf_counter(), []
        for seed in range(args.first_seed, args.first_seed + count):
            result = audit(seed)
            pvalues.append(result.pvalue)
            if result.verdict == "FINDING":
                findings.append({"seed": seed, "test": result.test, "pvalue": result.pvalue})
        rejected = {a: int(sum(p <= a for p in pvalues)) for a in levels}
        row = {"case": name, "audits": count, "seconds": time.perf_counter() - seconds, "findings_at_1e-3": findings,
               "rejected": {str(a): rejected[a] for a in levels},
               "interval": {str(a): interval(rejected[a], count) for a in levels},
               "num_tests": result.num_tests}
        summary.append(row)
        print(json.dumps(row), flush=True)
    total = sum(r["audits"] for r in summary)
    overall = {str(a): sum(r["rejected"][str(a)] for r in summary) for a in levels}
    report = {"audits": total, "rejected": overall, "interval": {a: interval(c, total) for a, c in overall.items()},
              "seconds": time.perf_counter() - start, "cases": summary}
    print(json.dumps({k: v for k, v in report.items() if k != "cases"}), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
