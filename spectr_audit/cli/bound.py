"""``spectr-audit bound``: the optimal multi-draft acceptance alpha* (closed form, and the LP when small)."""

from __future__ import annotations

import argparse
import json
import time

from spectr_audit import defaults
from spectr_audit.cli._args import _add_resources, _UsageError, parse_model_spec

_BOUND_DESCRIPTION = """The optimal multi-draft acceptance alpha*: the largest P(the emitted token is among the
K drafts) that any exact verifier can reach when the K drafts are drawn i.i.d. from the draft
distribution p and the emitted token must follow the target q.  Computed in closed form,
alpha* = min over token sets T of q(T) + 1 - p(T)^K (docs/audit/bounds.md), and cross-checked by
the transport LP when it is small enough (lp_value).  Prints alpha*, the set T that
attains the minimum, SpecTr's guarantee factor 1 - (1 - 1/K)^K (K-SEQ reaches at least that
fraction of alpha*) and the single-draft acceptance sum min(p, q) for comparison."""

_BOUND_EPILOG = """examples:
  spectr-audit bound --draft 0.6,0.4 --target 0.3,0.7 --num-drafts 2      # alpha* = 0.94
  spectr-audit bound --draft dirichlet:vocab_size=1000,seed=1 --target dirichlet:vocab_size=1000,seed=2 \\
      --num-drafts 4 --json

exit codes:
  0  the bound was computed
  2  usage or input error (a message naming the argument)
  130  interrupted (Ctrl-C)"""


def _add_bound_parser(sub) -> None:
    """The parser of ``bound``: the draft, the target and K."""
    bound = sub.add_parser("bound", help="optimal multi-draft acceptance alpha* (closed form, and LP when small)",
                           description=_BOUND_DESCRIPTION, epilog=_BOUND_EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    bound.add_argument("--draft", required=True, metavar="PROBS",
                       help="the draft distribution p, comma-separated probabilities (e.g. 0.6,0.4) or "
                       "dirichlet:vocab_size=8,seed=1 (context-free only)")
    bound.add_argument("--target", required=True, metavar="PROBS", help="the target distribution q, same forms as --draft")
    bound.add_argument("--num-drafts", type=int, required=True, metavar="K", help="K, the i.i.d. drafts from p")
    bound.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    _add_resources(bound, timeout=False)


def _cmd_bound(args) -> int:
    import torch

    from spectr_audit.bounds.acceptance import optimal_acceptance, optimal_acceptance_lp, spectr_guarantee
    from spectr_audit.errors import InvalidArgument
    from spectr_audit.drafting.models import ContextFreeModel

    draft_model = parse_model_spec(args.draft, "--draft", args.max_memory)
    target_model = parse_model_spec(args.target, "--target", args.max_memory)
    if not isinstance(draft_model, ContextFreeModel) or not isinstance(target_model, ContextFreeModel):
        raise _UsageError("--draft, --target: bound needs context-free distributions")
    if draft_model.vocab_size != target_model.vocab_size:
        raise _UsageError(f"--draft, --target: vocab sizes differ ({draft_model.vocab_size} vs {target_model.vocab_size})")
    if args.num_drafts < 1:
        raise _UsageError(f"--num-drafts: must be >= 1, got {args.num_drafts}")
    start = time.perf_counter()
    closed = optimal_acceptance(draft_model.probs, target_model.probs, args.num_drafts)
    closed_seconds = time.perf_counter() - start
    out = {
        "num_drafts": args.num_drafts,
        "vocab_size": draft_model.vocab_size,
        "optimal_acceptance": closed.item(),
        "closed_form_seconds": closed_seconds,
        "spectr_guarantee_factor": spectr_guarantee(args.num_drafts),
        "single_draft_acceptance": float(torch.minimum(draft_model.probs, target_model.probs).sum()),
        "minimising_set": sorted(closed.argmin_set()),
    }
    try:
        lp = optimal_acceptance_lp(draft_model.probs, target_model.probs, args.num_drafts,
                                   max_variables=defaults.LP_MAX_VARIABLES)
        out.update(lp_value=lp.value, lp_status=lp.status, lp_solver=lp.solver, lp_variables=lp.num_variables)
    except InvalidArgument as exc:
        out.update(lp_value=None, lp_status=f"skipped: {exc}")
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for key, value in out.items():
            print(f"{key}: {value}")
    return 0
