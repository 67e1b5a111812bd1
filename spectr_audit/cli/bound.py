"""``spectr-audit bound``: the optimal multi-draft acceptance alpha* (closed form, and the LP when small)."""

from __future__ import annotations

import json
import time

import torch

from spectr_audit import defaults
from spectr_audit.bounds.acceptance import optimal_acceptance, optimal_acceptance_lp, spectr_guarantee
from spectr_audit.cli._args import _UsageError, parse_model_spec
from spectr_audit.drafting.models import ContextFreeModel
from spectr_audit.errors import InvalidArgument

__all__ = ["command"]


def command(args) -> int:
    """Run ``spectr-audit bound``; its exit code."""
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
