"""How closely the exact tree audit reproduces the exact chain audit on chains, bit for bit.

A chain of K drafts of length L is the tree ``DraftTree.chains(K, L)``: running every built-in exact
i.i.d. chain verifier (without a carried repair) on the chain cases of the built-in suites through
``exact.tree.exact_tree`` and through ``exact.iteration.exact_iteration`` tells how far a single exact
audit for both shapes would move the chain results (the golden records compare them bit for bit).

``--golden`` measures the same on the golden records themselves: it reruns the recorded suites
(``scripts/record_golden.py``) with the runner's exact chain audit routed through the tree path (each chain
verifier converted to its tree form on ``DraftTree.chains(K, L)``; verifiers that carry a repair, or draft
otherwise than ``iid`` / ``without_replacement``, keep the chain path) and counts the recorded values that
move, by field, and the verdicts and check outcomes among them.

    python scripts/chain_tree_agreement.py [--suite default --suite edge-cases]
    python scripts/chain_tree_agreement.py --golden
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

from spectr_audit.contract.convert import as_tree_verifier
from spectr_audit.contract.correction import has_carried_correction
from spectr_audit.contract.tree import DraftTree
from spectr_audit.drafting.processed import bind_params
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.exact.tree import exact_tree
from spectr_audit.registry import builtin_verifiers
from spectr_audit.run import checks
from spectr_audit.run.suite import load_suite

METRICS = ("tv_distance", "max_abs_error", "token_tv_distance", "acceptance", "block_efficiency", "prefix_cap_excess")


def _through_the_tree(counts: collections.Counter):
    """``exact_iteration`` with the chain verifier's step audited by ``exact_tree`` on ``DraftTree.chains(K, L)``."""
    chain_path = checks.exact_iteration

    def audit(verifier, draft_model, target_model, num_drafts, draft_len, *, prefix=(), params=None, order="vllm"):
        bound = (bind_params(verifier, draft_model, target_model, params, order, prefix) if params is not None
                 else (verifier, draft_model, target_model))
        if has_carried_correction(bound[0]) or bound[0].draft_scheme not in ("iid", "without_replacement"):
            counts["kept on the chain path"] += 1
            return chain_path(verifier, draft_model, target_model, num_drafts, draft_len, prefix=prefix, params=params,
                              order=order)
        counts["routed through the tree path"] += 1
        return exact_tree(as_tree_verifier(bound[0]), bound[1], bound[2], DraftTree.chains(num_drafts, draft_len),
                          draft_scheme=bound[0].draft_scheme, prefix=prefix)

    return audit


def _recorded_and_now(line: str):
    """The two numbers of a ``differences`` line about a float, or ``(None, None)``."""
    recorded, _, now = line.partition(": recorded ")[2].partition(", now ")
    try:
        return float(recorded), float(now)
    except ValueError:
        return None, None


def golden(argv_suites) -> int:
    """The golden records' values that move when the exact chain audit runs through the tree path."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import record_golden  # noqa: E402  (a script beside this one)

    routes: collections.Counter = collections.Counter()
    checks.exact_iteration = _through_the_tree(routes)
    for suite in argv_suites or record_golden.SUITES:
        path = record_golden.record_path(suite)
        if not path.exists():
            print(f"{suite}: no record for this machine's CPU kernels ({path})")
            continue
        recorded = json.loads(path.read_text())["report"]
        found = record_golden.differences(recorded, record_golden.results(suite))
        fields = collections.Counter(line.split(":")[0].rsplit("/", 1)[-1].split("[")[0] for line in found)
        outcomes = [line for line in found if line.split(":")[0].endswith(("/passed", "/verdict", "/status"))]
        moved = len({line.split("/")[1] for line in found})
        numeric = [abs(float(a) - float(b)) for a, b in (_recorded_and_now(line) for line in found if "/worst_" not in line)
                   if a is not None]
        picked = len({line.split("/worst_")[0] for line in found
                      if "/worst_prefix" in line or ("/worst_strings" in line and ("/string[" in line or "entries" in line))})
        print(f"{suite}: {len(found)} values move in {moved} of {len(recorded['results'])} results; verdicts and check "
              f"outcomes among them: {len(outcomes)}")
        print(f"  largest move of a number (outside the worst strings): {max(numeric, default=0.0):.3g}; results whose "
              f"listed worst strings or worst prefix are other strings: {picked}")
        print("  by field: " + ", ".join(f"{name} {n}" for name, n in fields.most_common()))
        for line in outcomes[:10]:
            print("  " + line)
    print("; ".join(f"{n} exact chain audits {how}" for how, n in routes.items()))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", action="append", help="built-in suite (repeatable; default: default, edge-cases)")
    parser.add_argument("--golden", action="store_true",
                        help="count the golden records' values that move with the exact chain audit on the tree path")
    args = parser.parse_args(argv)
    if args.golden:
        return golden(args.suite)
    # One torch thread, as the golden records: a parallel reduction's last bits depend on the thread count.
    torch.set_num_threads(1)
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
