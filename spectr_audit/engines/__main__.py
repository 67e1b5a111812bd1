"""Audit one real engine's verifier from the command line.

Usage::

    python -m spectr_audit.engines vllm --draft-len 3 --samples 100000
    TRITON_INTERPRET=1 python -m spectr_audit.engines sglang --samples 1500 --draft-len 2

Prints one JSON object: the engine and its version, the exactness verdict (``pvalue``,
``rejects`` at ``alpha``, ``num_samples``, ``seed``) and the acceptance against the optimum
(``acceptance`` with a 99.9% interval, ``optimal_acceptance`` = alpha*, ``optimality_pvalue``
of "acceptance below alpha*"), the ``verdict`` (``exact``, ``INCONCLUSIVE`` when nothing was
rejected below the planned power, ``CERTIFIED`` with ``--certify-tv``, ``FINDING``) and the TV
estimate on the partition with its interval.  ``--samples N`` runs N samples; ``--max-samples``
and ``--max-seconds`` cap them.  Exit status 0 when exactness is not rejected, 1 when it is (or a
certificate is refuted), 2 on a usage error, 3 with ``--fail-on-inconclusive`` (or
``--certify-tv``) when the verdict is INCONCLUSIVE.  Default case: draft (0.1, 0.2, 0.3, 0.4), target (0.4, 0.3, 0.2, 0.1),
alpha* = 0.6.
"""

from __future__ import annotations

import argparse
import json
import sys

from spectr_audit import defaults
from spectr_audit.bounds.acceptance import optimal_acceptance
from spectr_audit.contract.tree_verifier import TreeVerifier
from spectr_audit.drafting.models import ContextFreeModel
from spectr_audit.engines import engine_names, load_engine
from spectr_audit.errors import InvalidArgument
from spectr_audit.registry import find
from spectr_audit.statistical.audit import statistical_audit


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spectr_audit.engines", description=__doc__.splitlines()[0])
    parser.add_argument("engine", choices=engine_names())
    parser.add_argument("--draft", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4], help="draft distribution")
    parser.add_argument("--target", type=float, nargs="+", default=[0.4, 0.3, 0.2, 0.1], help="target distribution")
    parser.add_argument("--draft-len", type=int, default=1)
    parser.add_argument("--samples", type=int, default=None,
                        help=f"samples to run (default {defaults.CHECK_SAMPLES}; with --certify-tv: planned for it)")
    parser.add_argument("--seed", type=int, default=defaults.SEED)
    parser.add_argument("--alpha", type=float, default=defaults.ALPHA)
    parser.add_argument("--max-samples", type=int, default=None, help="cap on the samples (default: --samples)")
    parser.add_argument("--max-seconds", type=float, default=None, help="wall-time budget of the sampling")
    parser.add_argument("--certify-tv", type=float, default=None, metavar="EPS",
                        help="certify TV <= EPS on the partition (the sample is planned for it unless --samples)")
    parser.add_argument("--fail-on-inconclusive", action="store_true", help="exit 3 on an INCONCLUSIVE verdict")
    args = parser.parse_args(argv)

    adapter = find(f"engine:{args.engine}").load()
    if isinstance(adapter, type) and issubclass(adapter, TreeVerifier):
        # tree engines take logits and sampling parameters: audited on trees, at settings
        print(f"error: {args.engine} verifies draft trees; audit it with "
              f"python scripts/audit_engines.py --engines {args.engine}", file=sys.stderr)
        return 2

    try:
        verifier = load_engine(args.engine)
        alpha_star = optimal_acceptance(args.draft, args.target, 1).item()
        result = statistical_audit(
            verifier, ContextFreeModel(args.draft), ContextFreeModel(args.target), 1, args.draft_len,
            num_samples=(args.samples if args.samples is not None
                         else None if args.certify_tv is not None else defaults.CHECK_SAMPLES),
            max_samples=args.max_samples, max_seconds=args.max_seconds, certify_tv=args.certify_tv,
            seed=args.seed, alpha=args.alpha, stratify=False, claimed_acceptance=alpha_star,
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
        "verdict": result.verdict,
        "tv_estimate": result.tv_estimate,
        "tv_interval": [result.tv_lower, result.tv_upper],
        "tv_confidence": result.tv_confidence,
        "partition": result.partition,
        "min_detectable_tv": result.min_detectable_tv,
        "requested_tv": result.requested_tv,
        "power_at_requested_tv": result.power_at_requested_tv,
        "stop_reason": result.stop_reason,
        "certify_tv": result.certify_tv,
        "certification": result.certification,
    }, indent=2))
    if result.verdict == "FINDING":
        return 1
    if result.inconclusive and (args.fail_on_inconclusive or args.certify_tv is not None):
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
