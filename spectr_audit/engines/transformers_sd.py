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
``torch.set_num_threads(1)``.  The adapter takes raw logits and sampling parameters (a
:class:`~spectr_audit.contract.logits.LogitsVerifier`): as ``_assisted_decoding`` does with
``do_sample=True``, both the candidate (assistant) logits and the target logits go through
transformers' own warpers first (``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``, ``MinPLogitsWarper``, chosen and ordered as ``_get_logits_processor``
does), and the warped logits are handed to ``_speculative_sampling``.  Given probabilities, the
adapter is handed ``log(probs)`` with neutral parameters (``softmax(log p) = p``; zero
probabilities become ``-inf``).  The bonus token is sampled inside.  Temperature 0 is
``do_sample=False``, where assisted generation compares argmaxes and never calls
``_speculative_sampling``: refused.
"""

from __future__ import annotations

import inspect

import torch

from spectr_audit.contract.logits import LogitsVerifier
from spectr_audit.contract.verifier import VerifyOutput
from spectr_audit.engines._base import EngineVerifier, engine_rng
from spectr_audit.errors import InvalidArgument

__all__ = ["TransformersSpeculativeSampling"]


class TransformersSpeculativeSampling(LogitsVerifier, EngineVerifier):
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
        from transformers.generation import logits_process

        self._warpers = logits_process
        self.dtype = dtype
        self.num_threads = num_threads
        self.engine_version = transformers.__version__

    def _processor(self, temperature: float, top_k: int, top_p: float, min_p: float):
        """transformers' warpers for one request, as ``_get_logits_processor`` builds them with ``do_sample=True``."""
        w = self._warpers
        processors = []
        if temperature != 1.0:
            processors.append(w.TemperatureLogitsWarper(temperature))
        if top_k != 0:
            processors.append(w.TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
        if top_p < 1.0:
            processors.append(w.TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
        if min_p > 0.0:
            processors.append(w.MinPLogitsWarper(min_p=min_p, min_tokens_to_keep=1))
        return w.LogitsProcessorList(processors)

    def _warped(self, logits: torch.Tensor, candidates: torch.Tensor, processor) -> torch.Tensor:
        """Each position's logits through the warpers (``logits [1, n, V]``; the ids are the context so far)."""
        if not len(processor):
            return logits
        rows = [processor(candidates[:, :i], logits[:, i, :]) for i in range(logits.shape[1])]
        return torch.stack(rows, dim=1)

    def _verify_logits(self, draft_tokens, draft_logits, target_logits, params, generator) -> VerifyOutput:
        batch_size, _, draft_len = draft_tokens.shape
        columns = [params.column(name, batch_size).tolist() for name in ("temperature", "top_k", "top_p", "min_p")]
        if any(t == 0 for t in columns[0]):
            raise InvalidArgument("params: temperature 0 is do_sample=False, where transformers' assisted generation "
                                  "compares argmaxes and does not call _speculative_sampling")
        # [batch_size, draft_len, vocab_size] and [batch_size, draft_len + 1, vocab_size]
        candidate_logits = draft_logits[:, 0].to(self.dtype).cpu()
        new_logits = target_logits[:, 0].to(self.dtype).cpu()
        candidates = draft_tokens[:, 0].cpu()
        processors: dict = {}
        num_accepted = torch.empty(batch_size, dtype=torch.int64)
        next_token = torch.empty(batch_size, dtype=torch.int64)
        with engine_rng(generator, self.num_threads):
            for row in range(batch_size):
                setting = tuple(column[row] for column in columns)
                if setting not in processors:
                    processors[setting] = self._processor(*setting)
                processor = processors[setting]
                ids = candidates[row : row + 1]
                valid_tokens, n_matches = self._fn(
                    ids,  # no prompt: the candidates are the last L ids
                    self._warped(candidate_logits[row : row + 1], ids, processor),
                    draft_len,
                    self._warped(new_logits[row : row + 1], ids, processor),
                    **self._extra,
                )
                n = int(n_matches)
                num_accepted[row] = n
                next_token[row] = int(valid_tokens[0, n])
        device = draft_tokens.device
        return VerifyOutput(num_accepted.to(device), torch.zeros_like(num_accepted).to(device), next_token.to(device))
