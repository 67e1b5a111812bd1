"""HuggingFace transformers' ``_speculative_sampling`` (assisted generation with a sampling assistant).

Supported signature (transformers >= 5.0; checked on 5.19 and 5.24)::

    _speculative_sampling(candidate_input_ids,   # [1, prompt_len + L] int64: prompt, then the L candidates
                          candidate_logits,      # [1, L, V] assistant logits at the candidates
                          candidate_length,      # int L
                          new_logits,            # [1, L + 1, V] target logits (the last row: bonus)
                          assistant_ensemble_weight=None)  # None: lossless mode
        -> (valid_tokens [1, n + 1], n_matches)

The 4.45 - 4.57 signature ended in ``is_done_candidate`` instead; it is detected and given
``False``.  Versions 4.41.0 - 4.44.2 forced a greedy assistant (transformers #32867): the
function itself is unchanged there, the bug is in the candidate generator, which this adapter
does not run (see ``spectr_audit.verifiers.library.historic.GreedyDraftSoftQBug``).

Layout: the function handles one sequence (batch 1), so the adapter loops over rows under
``torch.set_num_threads(1)``.  Probabilities are passed as logits ``log(probs)`` in float32
(``softmax(log p) = p``; zero probabilities become ``-inf``).  The bonus token is sampled inside.
"""

from __future__ import annotations

import inspect

import torch

from spectr_audit.contract.verifier import VerifyOutput
from spectr_audit.engines._base import EngineVerifier, engine_rng
from spectr_audit.errors import InvalidArgument

__all__ = ["TransformersSpeculativeSampling"]


class TransformersSpeculativeSampling(EngineVerifier):
    """Audit ``transformers.generation.utils._speculative_sampling`` (K = 1, any L).

    Parameters
    ----------
    dtype : torch.dtype
        Precision of the logits handed to transformers (default float32, as models return).
    num_threads : int or None
        ``torch.set_num_threads`` during the call (default 1: ~50x faster for batch-1 loops on a
        small machine); ``None`` leaves the setting alone.

    Notes
    -----
    Randomness: ``torch.rand_like`` and ``torch.multinomial`` on the global RNG, seeded from the
    given generator (see :mod:`spectr_audit.engines`).

    Examples
    --------
    >>> import torch
    >>> v = TransformersSpeculativeSampling()            # doctest: +SKIP
    >>> draft_probs = torch.tensor([[[[0.6, 0.4]]]])     # doctest: +SKIP
    >>> target_probs = torch.tensor([[[[0.3, 0.7], [0.5, 0.5]]]])  # doctest: +SKIP
    >>> v.verify(torch.tensor([[[0]]]), draft_probs, target_probs, torch.Generator().manual_seed(0))  # doctest: +SKIP
    """

    name = "transformers"
    description = "transformers.generation.utils._speculative_sampling (assisted generation, lossless mode)"
    engine = "transformers"
    max_drafts = 1

    def __init__(self, dtype: torch.dtype = torch.float32, num_threads=1):
        import transformers
        from transformers.generation.utils import _speculative_sampling

        if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise InvalidArgument(f"dtype: expected a floating torch dtype, got {dtype!r}")
        self._fn = _speculative_sampling
        params = list(inspect.signature(_speculative_sampling).parameters)
        if params[:4] != ["candidate_input_ids", "candidate_logits", "candidate_length", "new_logits"]:
            raise InvalidArgument(
                f"transformers {transformers.__version__}: unsupported _speculative_sampling signature {params}"
            )
        self._extra = {"is_done_candidate": False} if "is_done_candidate" in params else {}
        self.dtype = dtype
        self.num_threads = num_threads
        self.engine_version = transformers.__version__

    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        batch_size, _, draft_len = draft_tokens.shape
        # [batch_size, draft_len, vocab_size] and [batch_size, draft_len + 1, vocab_size]
        candidate_logits = draft_probs[:, 0].to(self.dtype).log()
        new_logits = target_probs[:, 0].to(self.dtype).log()
        candidates = draft_tokens[:, 0].cpu()
        num_accepted = torch.empty(batch_size, dtype=torch.int64)
        next_token = torch.empty(batch_size, dtype=torch.int64)
        with engine_rng(generator, self.num_threads):
            for row in range(batch_size):
                valid_tokens, n_matches = self._fn(
                    candidates[row : row + 1],  # no prompt: the candidates are the last L ids
                    candidate_logits[row : row + 1],
                    draft_len,
                    new_logits[row : row + 1],
                    **self._extra,
                )
                n = int(n_matches)
                num_accepted[row] = n
                next_token[row] = int(valid_tokens[0, n])
        device = draft_tokens.device
        return VerifyOutput(num_accepted.to(device), torch.zeros_like(num_accepted).to(device), next_token.to(device))
