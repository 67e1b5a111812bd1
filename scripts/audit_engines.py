"""Audit the real engines' tree verifiers at several sampling settings and print one table.

Usage::

    python scripts/audit_engines.py                         # every installed tree engine, the default table
    python scripts/audit_engines.py --engines eagle --samples 20000 --json

Each adapter (``spectr_audit.engines``: ``eagle``, ``medusa``, ``sglang-tree``) is audited on its
engine's shipped tree and two more, at each of its settings, by
:func:`spectr_audit.engines.tree_audit.tree_engine_audit`: exact where the adapter and the drafts
are deterministic (the TV is exact), statistical otherwise (``--samples`` steps, false-alarm rate
``--alpha``, seed ``--seed``).  One row per (adapter, tree, setting): the verdict, the p-value or
the exact TV, acceptance and accepted length against the best a lossless verifier achieves with
that tree and draft scheme.  Engines that are not installed are skipped with the reason.

The models: a context-free draft law and an order-1 Markov target law over 8 tokens (fixed
seeds), the raw laws the engines' logits processing is applied to.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# SGLang's kernels run under Triton's interpreter, which must be on before Triton is imported
os.environ.setdefault("TRITON_INTERPRET", "1")

from spectr_audit.contract.sampling import SamplingParams  # noqa: E402
from spectr_audit.contract.tree import DraftTree  # noqa: E402
import torch  # noqa: E402

from spectr_audit.drafting.models import ContextFreeModel, MarkovModel, random_markov  # noqa: E402
from spectr_audit.errors import InvalidArgument  # noqa: E402

VOCAB_SIZE = 8
DRAFT = [0.22, 0.18, 0.15, 0.13, 0.11, 0.09, 0.07, 0.05]

# name -> (module of its shipped trees, extra trees, settings)
ENGINES = {
    "eagle": (
        "spectr_audit.engines.eagle_tree",
        {"3 siblings": DraftTree.chains(3, 1), "fan-out 2-1": DraftTree.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0)])},
        [SamplingParams(temperature=0.0), SamplingParams(temperature=0.6), SamplingParams(),
         SamplingParams(top_k=5), SamplingParams(temperature=0.8, top_p=0.9)],
    ),
    "medusa": (
        "spectr_audit.engines.medusa_tree",
        {"cartesian [2, 2]": DraftTree.cartesian([2, 2]), "cartesian [3, 1, 1]": DraftTree.cartesian([3, 1, 1])},
        [SamplingParams(temperature=0.0), SamplingParams(temperature=0.6), SamplingParams(), SamplingParams(temperature=1.5)],
    ),
    "sglang-tree": (
        "spectr_audit.engines.sglang_tree",
        {},
        [SamplingParams(temperature=0.0), SamplingParams(temperature=0.6), SamplingParams(),
         SamplingParams(top_k=3), SamplingParams(temperature=0.8, top_p=0.9)],
    ),
}


def models():
    """The raw draft and target laws of every audit: the target is the draft law reweighted per context."""
    noise = random_markov(VOCAB_SIZE, 1, concentration=8.0, seed=12).table  # [(V + 1), V]
    rows = noise * torch.tensor(DRAFT, dtype=torch.float64)
    return ContextFreeModel(DRAFT), MarkovModel(rows / rows.sum(-1, keepdim=True), 1)


def audit_engine(name: str, samples: int, seed: int, alpha: float) -> list[dict]:
    """Every (tree, setting) row of one engine."""
    import importlib

    from spectr_audit.engines.tree_audit import tree_engine_audit
    from spectr_audit.registry import load_tree_verifier

    module_name, extra_trees, settings = ENGINES[name]
    verifier = load_tree_verifier(f"engine:{name}")
    trees = {**importlib.import_module(module_name).shipped_trees(), **extra_trees}
    draft, target = models()
    rows = []
    for tree_name, tree in trees.items():
        for params in settings:
            result = tree_engine_audit(verifier, draft, target, tree, params, num_samples=samples, seed=seed,
                                       alpha=alpha)
            rows.append({"engine": name, "tree_name": tree_name, **result.to_dict()})
    return rows


def _format(row: dict) -> str:
    setting = ", ".join(f"{k}={v}" for k, v in row["params"].items()) or "neutral (T=1)"
    if row["method"] == "exact":
        evidence = f"exact TV {row['tv']:.4f}"
    else:
        evidence = f"p={row['pvalue']:.3g}, TV {row['tv']:.3f} [{row['tv_lower']:.3f}, {row['tv_upper']:.3f}]"
    best_length = "-" if row["best_accepted_length"] is None else f"{row['best_accepted_length']:.3f}"
    return (f"{row['engine']:<12} {row['tree_name']:<22} {setting:<22} {row['draft_scheme']:<20} {row['verdict']:<13} "
            f"{evidence:<42} acc {row['acceptance']:.3f}/{row['best_acceptance']:.3f}  "
            f"len {row['accepted_length']:.3f}/{best_length}  {row['seconds']:.1f}s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--samples", type=int, default=6_000, help="steps of each statistical audit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alpha", type=float, default=1e-3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows, skipped = [], {}
    for name in args.engines:
        try:
            rows += audit_engine(name, args.samples, args.seed, args.alpha)
        except InvalidArgument as exc:
            if "optional extra" not in str(exc):
                raise
            skipped[name] = str(exc)
    if args.json:
        print(json.dumps({"rows": rows, "skipped": skipped}, indent=2))
        return 0
    print(f"{'engine':<12} {'tree':<22} {'setting':<22} {'draft scheme':<20} {'verdict':<13} {'evidence':<42} "
          f"acceptance / best, accepted length / best")
    for row in rows:
        print(_format(row))
    for name, reason in skipped.items():
        print(f"{name}: skipped ({reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
