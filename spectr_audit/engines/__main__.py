"""Audit one real engine's verifier from the command line.

Usage::

    python -m spectr_audit.engines vllm --draft-len 3 --samples 100000
    TRITON_INTERPRET=1 python -m spectr_audit.engines sglang --samples 1500 --draft-len 2

Prints one JSON object: the engine and its version, the exactness verdict (``pvalue``,
``rejects`` at ``alpha``, ``num_samples``, ``seed``) and the acceptance against the optimum
(``acceptance`` with a 99.9% interval, ``optimal_acceptance`` = alpha*, ``optimality_pvalue``
of "acceptance below alpha*").  Exit status 0 when exactness is not rejected, 1 when it is,
2 on a usage error.  Default case: draft (0.1, 0.2, 0.3, 0.4), target (0.4, 0.3, 0.2, 0.1),
alpha* = 0.6.
"""

from __future__ import annotations

import argparse
import json
import sys

from spectr_audit import defaults
from spectr_audit.engines import engine_names, load_engine
from spectr_audit.errors import InvalidArgument


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spectr_audit.engines", description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=engine_names())
    parser.add_argument("--draft", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4], help="draft distribution")
    parser.add_argument("--target", type=float, nargs="+", default=[0.4, 0.3, 0.2, 0.1], help="target distribution")
    parser.add_argument("--draft-len", type=int, default=1)
    parser.add_argument("--samples", type=int, default=defaults.CHECK_SAMPLES)
    parser.add_argument("--seed", type=int, default=defaults.SEED)
    parser.add_argument("--alpha", type=float, default=defaults.ALPHA)
    args = parser.parse_args(argv)

    from spectr_audit.bounds.acceptance import optimal_acceptance
    from spectr_audit.drafting.models import ContextFreeModel
    from spectr_audit.statistical.audit import statistical_audit

    try:
        verifier = load_engine(args.engine)
        alpha_star = optimal_acceptance(args.draft, args.target, 1).item()
        result = statistical_audit(
            verifier, ContextFreeModel(args.draft), ContextFreeModel(args.target), 1, args.draft_len,
            num_samples=args.samples, seed=args.seed, alpha=args.alpha, stratify=False, claimed_acceptance=alpha_star,
        )
    except InvalidArgument as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    low, high = result.acceptance_ci(confidence=0.999)
    print(json.dumps({
        "engine": verifier.name,
        "engine_version": verifier.engine_version,
        "draft_len": args.draft_len,
        "pvalue": result.pvalue,
        "test": result.test,
        "rejects": result.rejects(),
        "alpha": result.alpha,
        "num_samples": result.num_samples,
        "seed": args.seed,
        "acceptance": result.acceptance,
        "acceptance_ci_999": [low, high],
        "optimal_acceptance": alpha_star,
        "optimality_pvalue": result.optimality_pvalue,
        "block_efficiency": result.block_efficiency,
    }, indent=2))
    return 1 if result.rejects() else 0


if __name__ == "__main__":
    sys.exit(main())
