"""SmolLM2 as a generation engine and its scorer: the project's own KV-cached decode loop under the generation audit.

:class:`SmolLMEngine` is a speculative generation loop over :class:`~spectr_audit.lm.smollm.TreeSession`
(per-row KV caches for the target and its layer-skip draft, K drafts of L tokens drafted level by
level, every node scored by the target in one batched call) with any chain verifier of the
project as the verification rule: each iteration drafts, verifies, and commits the emitted
tokens ``draft_tokens[draft_index, :num_accepted] + [next_token]``.  :class:`SmolLMReference`
samples the target without speculation.  :class:`SmolLMScorer` is the truth: one causal forward
pass over each prompt and continuation, the target's law at every emitted position (float64,
``softmax(logits / T)``).  All three satisfy the contract of :mod:`spectr_audit.generation`.

Examples
--------
>>> from spectr_audit.lm.smollm import load_smollm                     # doctest: +SKIP
>>> from spectr_audit.registry import load_verifier                    # doctest: +SKIP
>>> from spectr_audit.generation import audit_generation               # doctest: +SKIP
>>> lm = load_smollm()                                                 # doctest: +SKIP
>>> engine = SmolLMEngine(lm, load_verifier("speculative"), draft_len=2)  # doctest: +SKIP
>>> result = audit_generation(engine, SmolLMScorer(lm), prompts, vocab_size=lm.vocab_size)  # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from spectr_audit.contract.convert import as_verifier
from spectr_audit.contract.correction import CorrectionChain
from spectr_audit.contract.randomness import sample_categorical, uniform
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.contract import GenerationOutput
from spectr_audit.lm.smollm import DEFAULT_SKIP_LAYERS, SmolLM, TreeSession

__all__ = ["SmolLMEngine", "SmolLMReference", "SmolLMScorer"]


def _limits(max_new_tokens, count: int) -> list:
    return list(max_new_tokens) if isinstance(max_new_tokens, Sequence) else [int(max_new_tokens)] * count


class SmolLMEngine:
    """Speculative generation with SmolLM2 and a chain verifier of the contract, KV-cached.

    Parameters
    ----------
    lm : SmolLM
    verifier : Verifier
        Any verifier of :mod:`spectr_audit.contract.verifier` that supports K and L; a verifier
        that carries a next-iteration correction (:mod:`spectr_audit.contract.correction`) has
        it applied to the following iterations' target, as its contract asks of a loop.
    num_drafts, draft_len : int
        K and L.
    temperature : float
    skip_layers : sequence of int
        The draft view's skipped layers.
    draft_temperature : float, optional
        The draft view's temperature when it differs from the target's (a sharper draft).
    """

    per_row_max_new_tokens = True

    def __init__(self, lm: SmolLM, verifier, *, num_drafts: int = 1, draft_len: int = 2, temperature: float = 1.0,
                 skip_layers: Sequence[int] = DEFAULT_SKIP_LAYERS, draft_temperature: Optional[float] = None):
        verifier = as_verifier(verifier)
        verifier.check_supports(num_drafts, draft_len)
        if temperature <= 0 or not math.isfinite(temperature):
            raise InvalidArgument(f"temperature: expected a finite number > 0, got {temperature!r}")
        self.lm, self.verifier = lm, verifier
        self.num_drafts, self.draft_len = int(num_drafts), int(draft_len)
        if draft_temperature is not None and not (draft_temperature > 0 and math.isfinite(draft_temperature)):
            raise InvalidArgument(f"draft_temperature: expected a finite number > 0, got {draft_temperature!r}")
        self.temperature = float(temperature)
        self.draft_temperature = None if draft_temperature is None else float(draft_temperature)
        self.skip_layers = tuple(skip_layers)
        drafted = "" if draft_temperature is None else f", draft T = {draft_temperature:g}"
        self.name = (f"SmolLM2 decode loop, {verifier.name} (K = {num_drafts}, L = {draft_len}, T = {temperature:g}"
                     f"{drafted})")

    def generate(self, prompts, max_new_tokens, seed):
        limits = _limits(max_new_tokens, len(prompts))
        session = TreeSession(self.lm, prompts, skip_layers=self.skip_layers, temperature=self.temperature,
                              draft_temperature=self.draft_temperature)
        generator = torch.Generator().manual_seed(int(seed) % (1 << 62))
        out = [[] for _ in prompts]
        accepted = [0] * len(prompts)
        calls = [0] * len(prompts)
        chain = CorrectionChain()
        first = True
        while any(len(o) < limit for o, limit in zip(out, limits)):
            tree = session.draft_tree(self.num_drafts, self.draft_len, generator)
            target, seen = tree.target_probs, ()
            if chain.corrections:  # the repairs older iterations' verdicts asked of this iteration's target
                target, seen = chain.adjust(tree.draft_tokens, tree.draft_probs, target)
            # inputs checked on the first iteration (a session's laws are valid by construction after it)
            result = self.verifier.verify(tree.draft_tokens, tree.draft_probs, target, generator,
                                          validate=first)
            first = False
            if chain.corrections or result.correction is not None:
                chain = chain.advance(tree.draft_tokens, tree.draft_probs, seen, result.num_accepted,
                                      result.draft_index, result.next_token, new=result.correction)
            num_accepted, draft_index, next_token = (result.num_accepted.tolist(), result.draft_index.tolist(),
                                                      result.next_token.tolist())
            emitted = []
            for row in range(len(prompts)):
                left = limits[row] - len(out[row])
                if left <= 0:
                    emitted.append([])
                    continue
                tokens = tree.draft_tokens[row, draft_index[row], :num_accepted[row]].tolist() + [next_token[row]]
                tokens = tokens[:left]
                out[row].extend(tokens)
                accepted[row] += min(num_accepted[row], len(tokens))
                calls[row] += 1
                emitted.append(tokens)
            session.commit(emitted)
        return GenerationOutput(out, accepted=accepted, target_calls=calls)


class SmolLMReference:
    """SmolLM2's target sampled without speculation (the reference generator), KV-cached."""

    per_row_max_new_tokens = True

    def __init__(self, lm: SmolLM, *, temperature: float = 1.0):
        self.lm, self.temperature = lm, float(temperature)
        self.name = f"SmolLM2 without speculation (T = {temperature:g})"

    def generate(self, prompts, max_new_tokens, seed):
        limits = _limits(max_new_tokens, len(prompts))
        session = TreeSession(self.lm, prompts, temperature=self.temperature)
        generator = torch.Generator().manual_seed(int(seed) % (1 << 62))
        out = [[] for _ in prompts]
        for _ in range(max(limits)):
            _, target = session.root_laws()
            tokens = sample_categorical(target, uniform(generator, (len(prompts),), target.device)).tolist()
            for row, token in enumerate(tokens):
                if len(out[row]) < limits[row]:
                    out[row].append(int(token))
            session.commit([[t] for t in tokens])
        return out


class SmolLMScorer:
    """The target's law at every emitted position: one causal pass per batch (float64, ``softmax(logits / T)``).

    Parameters
    ----------
    lm : SmolLM
    temperature : float
    skip_layers : sequence of int
        Score with a layer-skip view instead (the draft scorer: ``skip_layers=DEFAULT_SKIP_LAYERS``).
    max_rows : int
        Rows per forward pass.
    """

    def __init__(self, lm: SmolLM, *, temperature: float = 1.0, skip_layers: Sequence[int] = (), max_rows: int = 8):
        self.lm, self.temperature = lm, float(temperature)
        self.layers = lm.layer_indices(skip_layers)
        self.max_rows = int(max_rows)
        self.name = f"SmolLM2 target (T = {temperature:g})" if not skip_layers else "SmolLM2 layer-skip draft"

    @torch.inference_mode()
    def score(self, prompts, continuations):
        out: list = [None] * len(prompts)
        for start in range(0, len(prompts), self.max_rows):
            rows = range(start, min(start + self.max_rows, len(prompts)))
            sequences = [list(prompts[r]) + list(continuations[r]) for r in rows]
            width = max(len(s) for s in sequences)
            tokens = torch.tensor([s + [0] * (width - len(s)) for s in sequences], dtype=torch.int64)
            valid = torch.arange(width).unsqueeze(0) < torch.tensor([len(s) for s in sequences]).unsqueeze(1)
            causal = torch.ones(width, width, dtype=torch.bool).tril()
            attend = (causal & valid.unsqueeze(1)) | torch.eye(width, dtype=torch.bool)
            positions = torch.arange(width).unsqueeze(0).expand(len(sequences), -1)
            index_rows, index_cols = [], []
            for i, r in enumerate(rows):
                first = len(prompts[r]) - 1
                index_rows += [i] * len(continuations[r])
                index_cols += list(range(first, first + len(continuations[r])))
            if not index_rows:
                for r in rows:
                    out[r] = torch.zeros(0, self.lm.vocab_size, dtype=torch.float64)
                continue
            logits = self.lm.forward(tokens, positions, attend, self.layers,
                                     logit_index=(torch.tensor(index_rows), torch.tensor(index_cols)))
            laws = torch.softmax(logits.double() / self.temperature, dim=-1)
            offset = 0
            for r in rows:
                n = len(continuations[r])
                out[r] = laws[offset:offset + n]
                offset += n
        return out
