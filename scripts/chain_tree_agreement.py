"""How closely the exact tree audit reproduces the exact chain audit on chains, bit for bit.

A chain of K drafts of length L is the tree ``DraftTree.chains(K, L)``: running every built-in exact
i.i.d. chain verifier (without a carried repair) on the chain cases of the built-in suites through
``exact.tree.exact_tree`` and through ``exact.iteration.exact_iteration`` tells how far a single exact
audit for both shapes would move the chain results (the golden records compare them bit for bit).

    python scripts/chain_tree_agreement.py [--suite default --suite edge-cases]
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch

from spectr_audit.contract.convert import as_tree_verifier
from spectr_audit.contract.correction import has_carried_correction
from spectr_audit.contract.tree import DraftTree
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.exact.tree import exact_tree
from spectr_audit.registry import builtin_verifiers
from spectr_audit.run.suite import load_suite

METRICS = ("tv_distance", "max_abs_error", "token_tv_distance", "acceptance", "block_efficiency", "prefix_cap_excess")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", action="append", help="built-in suite (repeatable; default: default, edge-cases)")
    args = parser.parse_args(argv)
    cases = [c for s in args.suite or ("default", "edge-cases") for c in load_suite(s).cases
             if c.tree is None and getattr(c, "params", None) is None]
    counts, worst, examples = collections.Counter(), 0.0, []
    for verifier in builtin_verifiers():
        if not verifier.has_exact_law or verifier.draft_scheme != "iid" or has_carried_correction(verifier):
            continue
        for case in cases:
            if not verifier.supports(case.num_drafts, case.draft_len):
                continue
            chain = exact_iteration(verifier, case.draft_model, case.target_model, case.num_drafts, case.draft_len,
                                    prefix=case.prefix)
            tree = exact_tree(as_tree_verifier(verifier), case.draft_model, case.target_model,
                              DraftTree.chains(case.num_drafts, case.draft_len), draft_scheme="iid", prefix=case.prefix)
            moved = [m for m in METRICS if getattr(chain, m) != getattr(tree, m)]
            same = (not moved and chain.worst_strings() == tree.worst_strings()
                    and torch.equal(chain.first_token_law, tree.first_token_law))
            counts["bit for bit" if same else "in the last bits"] += 1
            if not same:
                gap = max((abs(getattr(chain, m) - getattr(tree, m)) for m in METRICS), default=0.0)
                worst = max(worst, gap)
                if len(examples) < 5:
                    examples.append(f"  {verifier.name} on {case.name}: {', '.join(moved) or 'worst strings'} "
                                    f"(max |difference| {gap:.2g})")
    total = sum(counts.values())
    print(f"{total} (verifier, case) pairs: {counts['bit for bit']} agree bit for bit, {counts['in the last bits']} "
          f"differ, by at most {worst:.2g}")
    print("\n".join(examples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
