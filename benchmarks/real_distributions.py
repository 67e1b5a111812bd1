"""Real (draft, target) distribution rows for the performance benchmark.

The verifiers' benchmark should run on what a real engine feeds them: SmolLM2-135M's
next-token laws over its 49,152-token vocabulary, not only random Dirichlet rows (whose
shape, a few heavy tokens and a long flat tail, is different).  This module samples answers
to the shipped prompts from the target, records the draft's and the target's laws at each
position, and caches them as an ``.npz`` under the spectr-audit cache directory (nothing is
committed: the file is generated at run time when the optional extra is installed).

Use from the benchmark::

    from benchmarks.real_distributions import real_rows
    rows = real_rows()            # None when the extra is not installed
    if rows is not None:
        draft_probs, target_probs = rows["draft_probs"], rows["target_probs"]   # [N, 49152] float64

or from the shell (writes the file, prints its path, and with ``--bench`` times each
token-level verifier on the rows against one read of its inputs)::

    python benchmarks/real_distributions.py [--num-prompts 8] [--positions 4] [--bench]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

#: Rows cached by default: 8 prompts x 4 positions = 32 rows of 49,152 float64 (25 MB).
DEFAULT_NUM_PROMPTS = 8
DEFAULT_POSITIONS = 4


def _path(num_prompts: int, positions: int, temperature: float, seed: int, drafter: str) -> Path:
    from spectr_audit.lm.smollm import DEFAULT_SKIP_LAYERS, cache_dir

    key = json.dumps([num_prompts, positions, temperature, seed, drafter, list(DEFAULT_SKIP_LAYERS), 1])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir() / f"real-rows-{drafter}-{digest}.npz"


def real_rows(
    num_prompts: int = DEFAULT_NUM_PROMPTS,
    positions: int = DEFAULT_POSITIONS,
    *,
    temperature: float = 1.0,
    seed: int = 0,
    drafter: str = "layerskip",
    refresh: bool = False,
) -> Optional[dict]:
    """Real (draft, target) rows, generated once and cached; ``None`` without the extra.

    Parameters
    ----------
    num_prompts, positions : int
        Rows = ``num_prompts * positions`` contexts (consecutive positions of target-sampled
        answers to the first ``num_prompts`` shipped prompts).
    temperature : float
        Of both models.
    seed : int
    drafter : {"layerskip", "ngram"}
        The self-speculative layer-skip draft, or the context n-gram drafter.
    refresh : bool
        Regenerate even when cached.

    Returns
    -------
    dict or None
        ``draft_probs``, ``target_probs`` (``[N, V]`` float64), ``prompt_index``, ``position``
        (``[N]`` int64) and ``path`` (the ``.npz``).
    """
    from spectr_audit.lm.smollm import availability

    ok, _ = availability()
    if not ok:
        return None
    path = _path(num_prompts, positions, temperature, seed, drafter)
    if refresh or not path.is_file():
        _generate(path, num_prompts, positions, temperature, seed, drafter)
    with np.load(path) as data:
        rows = {name: data[name] for name in data.files}
    rows["path"] = path
    return rows


def _generate(path: Path, num_prompts: int, positions: int, temperature: float, seed: int, drafter: str) -> None:
    import torch

    from spectr_audit.lm.real_suite import load_prompts, sample_token_rows
    from spectr_audit.lm.smollm import PAD, NGramDrafter, load_smollm

    lm = load_smollm()
    prompts, template = load_prompts()
    ids = [lm.encode(template.format(text=p.text)) for p in prompts[:num_prompts]]
    rows = sample_token_rows(lm, ids, positions, temperature=temperature, generator=torch.Generator().manual_seed(seed))
    draft = rows.draft_probs
    if drafter == "ngram":
        width = max(len(c) for c in rows.contexts)
        contexts = torch.tensor([[PAD] * (width - len(c)) + list(c) for c in rows.contexts], dtype=torch.int64)
        draft = NGramDrafter(lm.vocab_size, temperature=temperature)(contexts)
    elif drafter != "layerskip":
        raise ValueError(f"drafter: expected 'layerskip' or 'ngram', got {drafter!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.stem + ".partial.npz")
    np.savez(partial, draft_probs=draft.numpy(), target_probs=rows.target_probs.numpy(),
             prompt_index=rows.prompt_index.numpy(), position=rows.position.numpy())
    partial.replace(path)


def _bench(rows: dict, repeats: int = 3) -> None:
    """Time token-level verifiers on the rows, against one read of draft_probs and target_probs."""
    import torch

    from spectr_audit.registry import load_verifier

    draft = torch.as_tensor(rows["draft_probs"])
    target = torch.as_tensor(rows["target_probs"])
    n, vocab_size = draft.shape
    gen = torch.Generator().manual_seed(0)
    read = torch.empty_like(draft)
    start = time.perf_counter()
    for _ in range(repeats):
        read.copy_(draft)
        read.copy_(target)
    floor = (time.perf_counter() - start) / repeats
    print(f"{n} rows x V={vocab_size}: one read of both inputs (a copy) {1e3 * floor:.1f} ms")
    for name, num_drafts in (("speculative", 1), ("kseq", 2), ("kseq", 8), ("rrs", 8)):
        verifier = load_verifier(name)
        tokens = torch.multinomial(draft, num_drafts, replacement=True, generator=gen).unsqueeze(-1)
        draft_probs = draft.unsqueeze(1).unsqueeze(1).expand(n, num_drafts, 1, vocab_size)
        target_probs = target.unsqueeze(1).unsqueeze(1).expand(n, num_drafts, 2, vocab_size)
        verifier._verify(tokens, draft_probs, target_probs, gen)
        start = time.perf_counter()
        for _ in range(repeats):
            verifier._verify(tokens, draft_probs, target_probs, gen)
        seconds = (time.perf_counter() - start) / repeats
        print(f"  {name:12s} K={num_drafts}: {1e3 * seconds:8.1f} ms  ({seconds / floor:6.1f}x the read)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS)
    parser.add_argument("--positions", type=int, default=DEFAULT_POSITIONS)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drafter", choices=("layerskip", "ngram"), default="layerskip")
    parser.add_argument("--refresh", action="store_true")
    parser.add_argument("--bench", action="store_true", help="time the token-level verifiers on the rows")
    args = parser.parse_args(argv)
    rows = real_rows(args.num_prompts, args.positions, temperature=args.temperature, seed=args.seed,
                     drafter=args.drafter, refresh=args.refresh)
    if rows is None:
        from spectr_audit.lm.smollm import availability

        print(f"real rows unavailable: {availability()[1]}", file=sys.stderr)
        return 2
    print(rows["path"])
    if args.bench:
        _bench(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
