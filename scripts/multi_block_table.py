"""Block efficiency of multi-draft block verification against the other rules and the block LP.

Usage::

    python scripts/multi_block_table.py            # the paper's example and 20 random small cases
    python scripts/multi_block_table.py --cases 5 --seed 3 --json table.json

One row per case: the exact single-iteration block efficiency (``E[len(emitted string)]``, from
:func:`spectr_audit.exact.iteration.exact_iteration`) of

* ``multi-block``: multi-draft block verification (docs/rules/multi-block.md);
* ``spectr-tree``: the SpecTr draft tree, K-SEQ at every node;
* ``block``: block verification with one draft (K = 1);
* ``simple``: the simple exact construction (block verification along the lead draft, the correction
  drawn by recursive rejection over the other surviving drafts' next tokens, and a fresh block
  verification along a survivor whose next token was emitted), defined below;

then the unmodified-continuation block LP (the best any verifier exact with the plain target can
reach, :func:`spectr_audit.bounds.block_lp.block_lp`), the repair-allowed LP, the ratio
``multi-block / LP``, and the new rule's exactness (``max |F - q|``, its implied law against the
target).  The first case is the block-verification paper's example (context-free p = (2/3, 1/3),
q = (1/3, 2/3), K = 2, L = 2); the random cases are context-free Dirichlet(1) or order-1 Markov pairs
with V in {2, 3}, K in {2, 3}, L in {2, 3}, small enough for the LP, drawn from ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from spectr_audit.bounds.block_lp import block_lp
from spectr_audit.contract.verifier import Verifier
from spectr_audit.drafting.models import ContextFreeModel, random_markov
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.registry import load_verifier

#: Largest number of ordered draft tuples a random case may have (the LP has ~ tuples * K (L + 1) V variables).
MAX_TUPLES = 1000


def _block_stops(tokens, start, draft_row, target_row):
    """Block verification along ``tokens`` from depth ``start``: [(tau, P(tau), unnormalised correction or None)]."""
    draft_len = len(tokens)
    weights = [1.0]
    for i in range(start, draft_len):
        prefix, x = tuple(tokens[:i]), tokens[i]
        weights.append(min(1.0, weights[-1] * target_row(prefix)[x] / draft_row(prefix)[x]))
    levels = draft_len - start
    pass_probs, rows = [0.0] * (levels + 1), [None] * (levels + 1)
    for j in range(levels):
        prefix = tuple(tokens[: start + j])
        rows[j] = [max(weights[j] * q - p, 0.0) for p, q in zip(draft_row(prefix), target_row(prefix))]
        if j > 0:
            r = sum(rows[j])
            pass_probs[j] = 1.0 if r + 1 - weights[j] == 0 else r / (r + 1 - weights[j])
    pass_probs[levels] = weights[levels]
    stops, after = [], 1.0
    for j in range(levels, 0, -1):  # the last passing level
        stops.append((start + j, pass_probs[j] * after, rows[j] if j < levels else None))
        after *= 1 - pass_probs[j]
    stops.append((start, after, rows[0]))
    return stops


def _rejection_law(residual, draft, tokens):
    """Output law of recursive rejection sampling of ``tokens`` (in order) against ``residual``."""
    out, reach = [0.0] * len(draft), 1.0
    for y in tokens:
        accept = min(1.0, residual[y] / draft[y]) if draft[y] > 0 else 0.0
        out[y] += reach * accept
        reach *= 1 - accept
        rest = [max(r - p, 0.0) for r, p in zip(residual, draft)]
        total = sum(rest)
        residual = [r / total for r in rest] if total > 0 else residual
    return [o + reach * r for o, r in zip(out, residual)]


class SimpleConstruction(Verifier):
    """The simple exact multi-draft construction, with its exact law (plain Python, one row at a time).

    Block verification along the lead (smallest-index) draft gives tau; below L the correction is
    drawn by recursive rejection of the other drafts through ``x^tau`` (their next tokens, in draft
    order) against block verification's residual; if the drawn token is some of those drafts' next
    token, block verification starts afresh along the first of them, one level down.  The lead draft
    is not followed again: its tokens past tau decided tau.
    """

    name = "simple"
    description = "block verification along one draft, correction by recursive rejection over the survivors"

    def _output_probs(self, draft_tokens, draft_probs, target_probs):
        batch_size, num_drafts, draft_len = draft_tokens.shape
        out = torch.zeros(batch_size, num_drafts, draft_len + 1, draft_probs.shape[-1], dtype=torch.float64)
        for b in range(batch_size):
            drafts = draft_tokens[b].tolist()
            rows = {}
            for k in range(num_drafts):
                for depth in range(draft_len + 1):
                    key = tuple(drafts[k][:depth])
                    if key not in rows:
                        draft_row = draft_probs[b, k, depth].tolist() if depth < draft_len else None
                        rows[key] = (k, draft_row, target_probs[b, k, depth].tolist())
            first = lambda prefix: rows[prefix][0]  # noqa: E731 (the canonical draft of a prefix)

            def walk(members, start, mass):
                lead = min(members)
                tokens = drafts[lead]
                for tau, prob, wanted in _block_stops(tokens, start, lambda u: rows[u][1], lambda u: rows[u][2]):
                    if prob == 0:
                        continue
                    prefix = tuple(tokens[:tau])
                    if wanted is None:
                        out[b, first(prefix), tau] += mass * prob * torch.tensor(rows[prefix][2], dtype=torch.float64)
                        continue
                    total = sum(wanted)
                    residual = [w / total for w in wanted] if total > 0 else rows[prefix][2]
                    others = [k for k in members if k != lead and tuple(drafts[k][:tau]) == prefix]
                    law = _rejection_law(residual, rows[prefix][1], [drafts[k][tau] for k in others])
                    for y, value in enumerate(law):
                        if value == 0:
                            continue
                        followers = [k for k in others if drafts[k][tau] == y]
                        if followers:
                            walk(followers, tau + 1, mass * prob * value)
                        else:
                            out[b, first(prefix), tau, y] += mass * prob * value

            walk(list(range(num_drafts)), 0, 1.0)
        return out


def random_cases(count: int, seed: int) -> list[dict]:
    """``count`` small random cases (context-free or Markov; V, K, L in {2, 3}) within MAX_TUPLES tuples."""
    rng = np.random.default_rng(seed)
    cases = []
    while len(cases) < count:
        vocab_size, num_drafts, draft_len = (int(rng.choice([2, 3])) for _ in range(3))
        if (vocab_size**draft_len) ** num_drafts > MAX_TUPLES:
            continue
        kind = str(rng.choice(["context-free", "markov"]))
        seeds = [int(s) for s in rng.integers(0, 2**31, size=2)]
        if kind == "markov":
            draft, target = (random_markov(vocab_size, 1, seed=s) for s in seeds)
        else:
            draft, target = (ContextFreeModel(np.random.default_rng(s).dirichlet(np.ones(vocab_size))) for s in seeds)
        cases.append(dict(name=f"{kind} V={vocab_size} seeds={seeds[0]},{seeds[1]}", draft=draft, target=target,
                          num_drafts=num_drafts, draft_len=draft_len))
    return cases


def table_rows(cases: list[dict]) -> list[dict]:
    rules = {name: load_verifier(name) for name in ("multi-block", "spectr-tree", "block")}
    rules["simple"] = SimpleConstruction()
    rows = []
    for case in cases:
        draft, target, num_drafts, draft_len = case["draft"], case["target"], case["num_drafts"], case["draft_len"]
        row = {"case": case["name"], "num_drafts": num_drafts, "draft_len": draft_len}
        for name, verifier in rules.items():
            k = 1 if name == "block" else num_drafts
            audit = exact_iteration(verifier, draft, target, k, draft_len)
            row[name] = audit.block_efficiency
            row[f"{name}_max_abs_error"] = audit.max_abs_error
        lp = block_lp(draft, target, num_drafts, draft_len)
        row["lp"], row["repair_lp"] = lp.unmodified_value, lp.repair_value
        row["ratio"] = row["multi-block"] / row["lp"]
        rows.append(row)
        print(_format(row), flush=True)
    return rows


HEADER = ("| case | K | L | multi-block | SpecTr tree | block (K=1) | simple | block LP | repair LP | "
          "multi-block / LP | max abs(F - q) |\n|---|---|---|---|---|---|---|---|---|---|---|")


def _format(row: dict) -> str:
    return (f"| {row['case']} | {row['num_drafts']} | {row['draft_len']} | {row['multi-block']:.4f} | "
            f"{row['spectr-tree']:.4f} | {row['block']:.4f} | {row['simple']:.4f} | {row['lp']:.4f} | "
            f"{row['repair_lp']:.4f} | {100 * row['ratio']:.1f}% | {row['multi-block_max_abs_error']:.1e} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=20, help="random cases after the paper's example (default 20)")
    parser.add_argument("--seed", type=int, default=2024, help="seed of the random cases (default 2024)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    paper = dict(name="paper example (context-free)", draft=ContextFreeModel([2 / 3, 1 / 3]),
                 target=ContextFreeModel([1 / 3, 2 / 3]), num_drafts=2, draft_len=2)
    print(HEADER, flush=True)
    rows = table_rows([paper] + random_cases(args.cases, args.seed))
    print()
    for name in ("multi-block", "spectr-tree", "simple"):
        ratios = [r[name] / r["lp"] for r in rows]
        print(f"{name} / LP: min {100 * min(ratios):.1f}%, mean {100 * np.mean(ratios):.1f}% over {len(rows)} cases")
    below = [r["case"] for r in rows if r["multi-block"] < r["spectr-tree"] - 1e-12]
    print(f"multi-block below the SpecTr tree: {below or 'none'}; "
          f"largest max abs(F - q) of multi-block: {max(r['multi-block_max_abs_error'] for r in rows):.1e}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
