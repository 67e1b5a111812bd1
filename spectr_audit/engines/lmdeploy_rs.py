"""lmdeploy's portable rejection sampler (``lmdeploy.pytorch.backends.default.rejection_sampling``).

Supported signature (lmdeploy 0.18)::

    DefaultRejectionSamplingImpl().forward(
        target_logits,      # [batch_size, L, V] processed target logits
        draft_token_ids,    # [batch_size, L] int64
        bonus_token_ids,    # [batch_size] sampled by the caller
        *, is_greedy=None,  # None: every row samples
        draft_probs=None)   # [batch_size, L, V], or None (target-only acceptance)
        -> (output_token_ids [batch_size, L + 1] with -1 placeholders, num_rejected_tokens, last_token_ids)

A padded (not ragged) batch; the bonus token is passed in, so the adapter draws it from the
target's bonus row on the seeded RNG (the bonus law audited is the adapter's).  Target
probabilities go in as logits ``log(probs)``; the sampler takes ``softmax`` in float32.

Installing: lmdeploy 0.18 declares ``torch<=2.12.1``; with torch 2.13 install it without its
(CUDA) dependencies, plus the one the import chain needs:
``pip install --no-deps "lmdeploy>=0.18" && pip install mmengine-lite``.
"""

from __future__ import annotations

import torch

from spectr_audit.contract.verifier import VerifyOutput
from spectr_audit.engines._base import EngineVerifier, engine_rng
from spectr_audit.errors import VerifierError

__all__ = ["LMDeployRejectionSampler", "LMDeployRejectionSamplerNoDraftProbs"]


class LMDeployRejectionSampler(EngineVerifier):
    """Audit lmdeploy's portable torch rejection sampler (K = 1, any L).

    Parameters
    ----------
    use_draft_probs : bool
        Pass the draft probabilities (default), or ``None`` (target-only acceptance: exact,
        acceptance ``sum target * draft``).
    """

    name = "lmdeploy"
    description = "lmdeploy DefaultRejectionSamplingImpl (portable torch rejection sampler)"
    engine = "lmdeploy"
    max_drafts = 1

    def __init__(self, use_draft_probs: bool = True):
        import lmdeploy.version
        from lmdeploy.pytorch.backends.default.rejection_sampling import DefaultRejectionSamplingImpl

        self._impl = DefaultRejectionSamplingImpl()
        self.use_draft_probs = bool(use_draft_probs)
        if not self.use_draft_probs:
            self.name = "lmdeploy-no-draft-probs"
            self.description = "lmdeploy DefaultRejectionSamplingImpl with draft_probs=None"
        self.engine_version = lmdeploy.version.__version__

    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        _, _, draft_len = draft_tokens.shape
        device = draft_tokens.device
        target = target_probs[:, 0].float()  # [batch_size, draft_len + 1, vocab_size]
        draft = draft_probs[:, 0].float().contiguous() if self.use_draft_probs else None
        with engine_rng(generator):
            bonus = torch.multinomial(target[:, draft_len], 1).squeeze(1)  # [batch_size]
            out, _, _ = self._impl.forward(
                target[:, :draft_len].log().contiguous(), draft_tokens[:, 0].contiguous(), bonus,
                is_greedy=None, draft_probs=draft,
            )
        out = out.to(torch.int64)  # [batch_size, draft_len + 1], -1 placeholders
        emitted = (out >= 0).sum(-1)
        if bool((emitted < 1).any()) or bool(((out >= 0).cumprod(-1).sum(-1) != emitted).any()):
            raise VerifierError("lmdeploy: output_token_ids has a placeholder before an emitted token")
        num_accepted = emitted - 1
        next_token = out.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
        return VerifyOutput(num_accepted.to(device), torch.zeros_like(num_accepted), next_token.to(device))


class LMDeployRejectionSamplerNoDraftProbs(LMDeployRejectionSampler):
    """Audit lmdeploy's portable rejection sampler with ``draft_probs=None`` (target-only acceptance)."""

    def __init__(self):
        super().__init__(use_draft_probs=False)
