"""Slow oracle for the exact single-iteration audit: every ordered draft tuple, one at a time.

The audit (:func:`spectr_audit.exact.iteration.exact_iteration`) enumerates the draft sequences once,
batches the tuples and accumulates the laws with tensor operations; this oracle walks every tuple in
plain Python and asks the verifier for one tuple's law at a time.
"""

from __future__ import annotations

import itertools

import torch

__all__ = ["brute_force_iteration"]


def _cond(model, context):
    return model(torch.tensor([list(context)], dtype=torch.int64).reshape(1, -1))[0].tolist()


def brute_force_iteration(verifier, draft_model, target_model, num_drafts, draft_len, prefix):
    """E(s), F(w), B(u) by brute force: every ordered tuple, one output_probs call each.

    Returns ``(emitted, implied, caps, target_joint)``: dicts from token tuples to the emitted law
    E(s), the implied law F(w) of the strings completed with the target, the prefix law B(u), and
    the function giving the target's joint probability of a string after ``prefix``.
    """
    vocab_size = draft_model.vocab_size
    seqs = []
    for seq in itertools.product(range(vocab_size), repeat=draft_len):
        prob = 1.0
        for i, tok in enumerate(seq):
            prob *= _cond(draft_model, prefix + seq[:i])[tok]
        if prob > 0:
            seqs.append((seq, prob))
    emitted = {}
    for combo in itertools.product(seqs, repeat=num_drafts):
        weight = 1.0
        for _, prob in combo:
            weight *= prob
        tokens = torch.tensor([[list(s) for s, _ in combo]], dtype=torch.int64)
        dp = torch.tensor([[[_cond(draft_model, prefix + s[:i]) for i in range(draft_len)] for s, _ in combo]], dtype=torch.float64)
        tp = torch.tensor([[[_cond(target_model, prefix + s[:i]) for i in range(draft_len + 1)] for s, _ in combo]], dtype=torch.float64)
        law = verifier.output_probs(tokens, dp, tp)[0]
        for k in range(num_drafts):
            for n in range(draft_len + 1):
                for y in range(vocab_size):
                    s = combo[k][0][:n] + (y,)
                    emitted[s] = emitted.get(s, 0.0) + weight * float(law[k, n, y])

    def target_joint(w, start=0):
        prob = 1.0
        for i in range(start, len(w)):
            prob *= _cond(target_model, prefix + w[:i])[w[i]]
        return prob

    implied = {}
    for w in itertools.product(range(vocab_size), repeat=draft_len + 1):
        implied[w] = sum(emitted.get(w[:m], 0.0) * target_joint(w, m) for m in range(1, draft_len + 2))
    caps = {}
    for m in range(1, draft_len + 2):
        for u in itertools.product(range(vocab_size), repeat=m):
            caps[u] = sum(v for s, v in emitted.items() if s[:m] == u)
    return emitted, implied, caps, target_joint
