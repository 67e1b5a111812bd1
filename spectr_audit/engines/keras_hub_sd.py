"""keras-hub's ``SpeculativeSampler`` (Keras 3 on the torch backend), driven by fixed-logit model callables.

Supported API (keras-hub 0.32, keras 3.15)::

    SpeculativeSampler(num_speculative_tokens=L, base_sampler=RandomSampler(), seed=s)(
        next, prompt [batch, max_length] int, index=start, mask=[batch, max_length] bool,
        draft_next=(prompt, cache, index) -> (logits [batch, V], hidden, cache),
        verify_next=(prompt, cache, index, k) -> (logits [batch, k + 1, V], cache))
        -> prompt with the generated tokens written from ``start`` on

The sampler drafts by itself: it calls ``draft_next`` L times and proposes the **argmax** of
each draft row ("Draft token: always greedy"), while accepting with the soft draft
probabilities.  The adapter hands it logits ``log(draft_probs)`` and ``log(target_probs)`` of
the drafted path (``draft_next`` at position ``start + i`` returns row i; ``verify_next``
returns the L + 1 target rows), so it reads the draft *model*, not the adapter's drawn draft
tokens.  That is faithful when the models are context-free (the rows do not depend on the
path) or when the sampler's proposals coincide with the drawn draft.  The sampler loops until
``max_length = start + L + 1`` is filled; the first iteration ends where the second
``verify_next`` call starts (or at ``max_length``).  Its emitted string ``e`` is reported as the
longest prefix shared with the drawn draft plus the next token of ``e`` (a stopping rule, so an
exact sampler would still pass).

``batched=False`` (default) verifies each row in its own call, the per-request rule; with
``batched=True`` all rows go in one call, where the sampler advances every row by the
batch's *minimum* accepted count and overwrites the other rows' accepted token at that position
with a residual draw.

Randomness: each call builds the sampler with a 31-bit ``seed`` drawn from the given generator
(Keras' ``SeedGenerator``), inside :func:`spectr_audit.engines._base.engine_rng`.

Installing: ``KERAS_BACKEND=torch``; keras-hub declares ``tensorflow-text`` (and so
TensorFlow), which the torch backend does not need: ``pip install keras && pip install
--no-deps "keras-hub>=0.32"``.
"""

from __future__ import annotations

import os

import torch

from spectr_audit.contract.verifier import VerifyOutput
from spectr_audit.engines._base import EngineVerifier, engine_rng, seed_from

__all__ = ["KerasHubSpeculativeSampler"]


class KerasHubSpeculativeSampler(EngineVerifier):
    """Audit ``keras_hub.samplers.SpeculativeSampler`` in its stochastic mode (K = 1, any L).

    Parameters
    ----------
    batched : bool
        One call for the whole batch (exposes the batch coupling) instead of one per row.
    num_threads : int or None
        ``torch.set_num_threads`` during the calls (default 1).
    """

    name = "keras-hub"
    description = "keras_hub.samplers.SpeculativeSampler with a RandomSampler base (Keras 3, torch backend)"
    engine = "keras-hub"
    max_drafts = 1

    def __init__(self, batched: bool = False, num_threads=1):
        os.environ.setdefault("KERAS_BACKEND", "torch")
        import keras
        import keras_hub
        from keras_hub.samplers import RandomSampler, SpeculativeSampler

        if keras.backend.backend() != "torch":
            raise ImportError(f"keras-hub adapter needs KERAS_BACKEND=torch, found {keras.backend.backend()!r}")
        self._sampler_cls, self._base_cls = SpeculativeSampler, RandomSampler
        self.batched = bool(batched)
        if self.batched:
            self.name = "keras-hub-batched"
        self.num_threads = num_threads
        self.engine_version = f"keras-hub {keras_hub.__version__}, keras {keras.__version__}"

    def _emitted(self, draft_logits, target_logits, draft_len, generator) -> torch.Tensor:
        """One sampler call on ``[n, L, V]`` / ``[n, L + 1, V]`` logits: ``[n, L + 1]`` tokens, -1 after the end."""
        rows = draft_logits.shape[0]
        start, max_length = 1, 1 + draft_len + 1
        verify_starts: list = []

        def draft_next(prompt, cache, index):
            return draft_logits[:, min(int(index) - start, draft_len - 1)], None, cache

        def verify_next(prompt, cache, index, k):
            verify_starts.append(int(index))
            return target_logits, cache

        def target_next(prompt, cache, index):  # not called: verify_next is given
            raise RuntimeError("keras-hub called the serial target fallback")

        sampler = self._sampler_cls(num_speculative_tokens=draft_len, base_sampler=self._base_cls(), seed=seed_from(generator) % 2**31)
        prompt = torch.zeros(rows, max_length, dtype=torch.int32)
        mask = torch.zeros(rows, max_length, dtype=torch.bool)
        mask[:, :start] = True
        out = sampler(target_next, prompt, index=start, mask=mask, draft_next=draft_next, verify_next=verify_next)
        end = verify_starts[1] if len(verify_starts) > 1 else max_length
        emitted = torch.full((rows, draft_len + 1), -1, dtype=torch.int64)
        emitted[:, : end - start] = torch.as_tensor(out)[:, start:end].to(torch.int64)
        return emitted

    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        batch_size, _, draft_len = draft_tokens.shape
        draft_logits = draft_probs[:, 0].float().log().cpu()  # [batch_size, draft_len, vocab_size]
        target_logits = target_probs[:, 0].float().log().cpu()  # [batch_size, draft_len + 1, vocab_size]
        with engine_rng(generator, self.num_threads):
            if self.batched:
                emitted = self._emitted(draft_logits, target_logits, draft_len, generator)
            else:
                emitted = torch.cat([
                    self._emitted(draft_logits[r : r + 1], target_logits[r : r + 1], draft_len, generator)
                    for r in range(batch_size)
                ])
        length = (emitted >= 0).sum(-1)  # 1 .. L + 1
        # longest prefix of e[:length - 1] shared with the drawn draft, then e's next token
        drafted = draft_tokens[:, 0].cpu()
        positions = torch.arange(draft_len)
        same = (emitted[:, :draft_len] == drafted) & (positions < (length - 1).unsqueeze(1))
        num_accepted = same.to(torch.int64).cumprod(-1).sum(-1)
        next_token = emitted.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
        device = draft_tokens.device
        return VerifyOutput(num_accepted.to(device), torch.zeros_like(num_accepted).to(device), next_token.to(device))
