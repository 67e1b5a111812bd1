"""``spectr-audit audit``: audit one verifier on one case (K drafts of L tokens, or a draft tree)."""

from __future__ import annotations

from spectr_audit.cli._args import _sampling_overrides, _UsageError, parse_model_spec
from spectr_audit.cli._output import _print_result_text
from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.registry import load_tree_verifier, load_verifier
from spectr_audit.reports.json_report import render_json
from spectr_audit.results import AuditReport
from spectr_audit.run.runner import AuditOptions, audit_case
from spectr_audit.run.suite import Case, tree_from_spec

__all__ = ["command"]


def _unsupported_drafts(verifier, num_drafts: int, draft_len: int) -> str:
    """The usage error of ``audit`` with a (K, L) the verifier does not take, naming the option at fault.

    Examples
    --------
    >>> from spectr_audit.registry import load_verifier
    >>> _unsupported_drafts(load_verifier("speculative"), 3, 1)
    "--num-drafts: verifier 'speculative' supports K = num_drafts in [1, 1]; got 3"
    """
    faults = []
    if not verifier.supports_num_drafts(num_drafts):
        faults.append(f"--num-drafts: verifier {verifier.name!r} supports K = num_drafts in {verifier.drafts_range()}; "
                      f"got {num_drafts}")
    if not verifier.supports_draft_len(draft_len):
        faults.append(f"--draft-len: verifier {verifier.name!r} supports L = draft_len in "
                      f"{verifier.draft_len_range()}; got {draft_len}")
    if not faults:  # each in range, not the pair (a verifier with its own supports rule)
        faults.append(f"--num-drafts, --draft-len: verifier {verifier.name!r} does not support K = {num_drafts} with "
                      f"L = {draft_len} (K in {verifier.drafts_range()}, L in {verifier.draft_len_range()})")
    return "; ".join(faults)


def _tree_case(args, draft_model, target_model, prefix):
    """``audit --tree``: the tree verifier (a chain verifier runs on chain trees) and the tree case."""
    tree = tree_from_spec(args.tree, "--tree")
    verifier = load_tree_verifier(args.verifier)
    verifier.check_supports_tree(tree)
    scheme = args.draft_scheme or verifier.draft_schemes[0]
    if scheme not in verifier.draft_schemes:
        raise _UsageError(f"--draft-scheme: {verifier.name!r} verifies drafts of the schemes "
                          f"{', '.join(verifier.draft_schemes)}; got {scheme!r}")
    case = Case(name=f"cli-tree/{scheme}", draft_model=draft_model, target_model=target_model,
                num_drafts=len(tree.children[0]), draft_len=tree.max_depth, prefix=prefix, tree=tree,
                draft_scheme=scheme, tree_spec=args.tree)
    return verifier, case


def command(args) -> int:
    """Run ``spectr-audit audit``; its exit code."""
    if args.tree is not None:
        if args.num_drafts is not None or args.draft_len is not None:
            raise _UsageError("--num-drafts, --draft-len: a tree case takes them from --tree (the root's children, "
                              "the depth); drop them")
    else:
        if args.draft_scheme is not None:
            raise _UsageError("--draft-scheme: only with --tree (a chain verifier declares its own draft scheme)")
        if args.num_drafts is None:
            raise _UsageError("--num-drafts: required (or --tree SPEC for a draft-tree case)")
        args.draft_len = 1 if args.draft_len is None else args.draft_len
        if args.num_drafts < 1:
            raise _UsageError(f"--num-drafts: must be >= 1, got {args.num_drafts}")
        if args.draft_len < 1:
            raise _UsageError(f"--draft-len: must be >= 1, got {args.draft_len}")
    sampling = _sampling_overrides(args)
    inputs = sampling.get("inputs", "probs")
    draft_model = parse_model_spec(args.draft, "--draft", args.max_memory, inputs=inputs)
    target_model = parse_model_spec(args.target, "--target", args.max_memory, inputs=inputs)
    if draft_model.vocab_size != target_model.vocab_size:
        raise _UsageError(f"--draft, --target: vocab sizes differ ({draft_model.vocab_size} vs {target_model.vocab_size})")
    try:
        prefix = tuple(int(t) for t in args.prefix.split(",") if t.strip())
    except ValueError:
        raise _UsageError(f"--prefix: expected comma-separated token ids, got {args.prefix!r}") from None
    if any(not 0 <= t < draft_model.vocab_size for t in prefix):
        raise _UsageError(f"--prefix: token ids must lie in [0, {draft_model.vocab_size})")
    if args.tree is not None:
        if sampling:
            raise _UsageError("--temperature, --top-k, --top-p, --min-p, --order, --logits: for chain cases; a tree "
                              "verifier is handed probabilities (give the processed laws as --draft and --target)")
        verifier, case = _tree_case(args, draft_model, target_model, prefix)
    else:
        verifier = load_verifier(args.verifier)
        if not verifier.supports(args.num_drafts, args.draft_len):
            raise _UsageError(_unsupported_drafts(verifier, args.num_drafts, args.draft_len))
        case = Case(name="cli", draft_model=draft_model, target_model=target_model, num_drafts=args.num_drafts,
                    draft_len=args.draft_len, prefix=prefix, **_cli_sampling(sampling))
    options = AuditOptions(seed=args.seed, alpha=args.alpha, max_samples=args.max_samples,
                           max_seconds=args.max_seconds, certify_tv=args.certify_tv, device=args.device,
                           max_memory=args.max_memory, verifier_timeout=args.verifier_timeout or None)
    result = audit_case(verifier, case, options)
    report = AuditReport(results=(result,), suite="cli")
    status = report.exit_status(args.fail_on_inconclusive or args.certify_tv is not None)
    if args.json:
        print(render_json(report))
    else:
        _print_result_text(result, status)
    return status


def _cli_sampling(sampling: dict) -> dict:
    """The ``params``, ``order`` and ``inputs`` of the ``audit`` case (none without sampling flags)."""
    if not sampling:
        return {}
    params = SamplingParams(**{key: sampling[key] for key in ("temperature", "top_k", "top_p", "min_p") if key in sampling})
    return {"params": params, "order": sampling.get("order", "vllm"), "inputs": sampling.get("inputs", "probs")}
