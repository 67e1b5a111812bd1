"""Samples to a verdict on EAGLE's shipped depth-5 tree (mc_sim_7b_63), Markov V = 5 models.

``find``: EAGLE-1's own ``evaluate_posterior`` at T = 0.5 (lossy from the third token on) through
``tree_engine_audit``, at growing sample sizes and several seeds: the fraction of FINDINGs.
``plan``: what the statistical audit plans for an exact tree verifier on the same tree before it
can say PASS (tree-rrs-wor, audited as a black box), and the samples a ``certify_tv`` run takes.

Run it under another checkout (``PYTHONPATH=<checkout>``) to compare versions on the same samples:
the sampling code is the same, only the tests differ.

    python scripts/samples_to_verdict.py find --sizes 10000,20000,40000,80000 --seeds 3
    python scripts/samples_to_verdict.py plan --certify 0.05
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time

MC_SIM_7B_63 = ("[[0],[1],[2],[3],[0,0],[0,1],[0,2],[1,0],[1,1],[2,0],[2,1],[3,0],[0,0,0],[0,0,1],[0,0,2],[0,1,0],"
                "[0,1,1],[0,2,0],[0,2,1],[1,0,0],[0,0,0,0],[0,0,0,1],[0,0,0,2],[0,0,0,0,0],[0,0,0,0,1]]")


def _case():
    from spectr_audit.contract.tree import DraftTree
    from spectr_audit.drafting.models import random_markov

    tree = DraftTree.from_paths([tuple(p) for p in ast.literal_eval(MC_SIM_7B_63)])
    return tree, random_markov(5, seed=1), random_markov(5, seed=2)


def find(sizes, seeds, temperature) -> None:
    from spectr_audit.contract.sampling import SamplingParams
    from spectr_audit.engines.eagle_tree import EagleTreeVerifier
    from spectr_audit.engines.tree_audit import tree_engine_audit

    tree, draft, target = _case()
    verifier = EagleTreeVerifier()
    for size in sizes:
        start, verdicts = time.perf_counter(), []
        for seed in range(seeds):
            result = tree_engine_audit(verifier, draft, target, tree, SamplingParams(temperature=temperature),
                                       num_samples=size, seed=seed, method="statistical", bound_lp=False)
            deciding = min(result.tests, key=lambda t: t.pvalue_adjusted)
            verdicts.append({"seed": seed, "pvalue": result.pvalue, "finding": result.pvalue <= 1e-3,
                             "test": deciding.name})
        print(json.dumps({"samples": size, "findings": sum(v["finding"] for v in verdicts), "seeds": seeds,
                          "seconds": round(time.perf_counter() - start, 1), "runs": verdicts}), flush=True)


def plan(certify) -> None:
    from spectr_audit.registry import load_tree_verifier
    from spectr_audit.statistical.audit import statistical_audit

    tree, draft, target = _case()
    try:
        from spectr_audit.statistical.calibration import as_black_box

        verifier = as_black_box(load_tree_verifier("tree-rrs-wor"), tree=True)
    except ImportError:  # a checkout without it: the same wrapper, written out
        from spectr_audit.contract.tree_verifier import TreeVerifier

        inner = load_tree_verifier("tree-rrs-wor")

        class BlackBox(TreeVerifier):
            name = "tree-rrs-wor (black box)"
            draft_schemes = inner.draft_schemes

            def _verify_tree(self, *args):
                return inner._verify_tree(*args)

        verifier = BlackBox()
    result = statistical_audit(verifier, draft, target, 4, 5, tree=tree, draft_scheme="without_replacement",
                               max_samples=4096, seed=0)
    print(json.dumps({"planned_for_pass": result.planned_samples, "num_tests": result.num_tests,
                      "min_detectable_tv_at_4096": result.min_detectable_tv}), flush=True)
    if certify:
        start = time.perf_counter()
        result = statistical_audit(verifier, draft, target, 4, 5, tree=tree, draft_scheme="without_replacement",
                                   certify_tv=certify, seed=0)
        print(json.dumps({"certify_tv": certify, "certification": result.certification,
                          "samples": result.num_samples, "planned": result.planned_samples,
                          "tv_upper": result.tv_upper, "partition": result.partition,
                          "seconds": round(time.perf_counter() - start, 1)}), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("find")
    one.add_argument("--sizes", default="10000,20000,40000,80000")
    one.add_argument("--seeds", type=int, default=3)
    one.add_argument("--temperature", type=float, default=0.5)
    two = sub.add_parser("plan")
    two.add_argument("--certify", type=float, default=None)
    args = parser.parse_args(argv)
    if args.command == "find":
        find([int(s) for s in args.sizes.split(",")], args.seeds, args.temperature)
    else:
        plan(args.certify)
    return 0


if __name__ == "__main__":
    sys.exit(main())
