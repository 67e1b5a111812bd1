"""SGLang's chain verifier, ``chain_speculative_sampling_triton``, run by Triton's interpreter on CPU.

Supported signature (sglang 0.5.23, ``sglang.kernels.ops.speculative.reject_sampling``)::

    chain_speculative_sampling_triton(
        predicts,              # [batch_size * (L + 1)] int32, out: emitted tokens at their tree slots
        accept_index,          # [batch_size, L + 1] int32, out: slots of the emitted tokens, -1 after
        accept_token_num,      # [batch_size] int32, out: accepted draft tokens
        candidates,            # [batch_size, L + 1] int64: slot 0 = the last verified token, then the drafts
        retrive_index,         # [batch_size, L + 1] int64: global slot of each candidate
        retrive_next_token, retrive_next_sibling,   # unused by the chain kernel
        uniform_samples,       # [batch_size, L] float32 acceptance coins
        uniform_samples_for_final_sampling,         # [batch_size] float32
        target_probs,          # [batch_size, L + 1, V] float32
        draft_probs,           # [batch_size, L, V] float32
        threshold_single, threshold_acc, deterministic,              # unused by the chain kernel
        *, block_verification=False)   # True: block verification (Sun et al., Algorithm 2)

The kernel is Triton; on a CPU it runs under ``TRITON_INTERPRET=1``, which this adapter sets
before importing it.  The variable only takes effect if Triton was not imported yet in the
process (vLLM, for one, imports it): the adapter refuses to run otherwise, so start Python with
``TRITON_INTERPRET=1`` or build the adapter first.  The interpreter is
slow (about 25 ms per row): audit with a small budget.  The coins are drawn by the adapter with
``torch.rand`` on the seeded RNG, as SGLang's caller does.

Installing: the ``sglang`` wheel's dependencies are CUDA packages; the kernel needs only
``triton``: ``pip install triton && pip install --no-deps sglang``.
"""

from __future__ import annotations

import os

import torch

from spectr_audit.contract.verifier import VerifyOutput
from spectr_audit.engines._base import EngineVerifier, engine_rng
from spectr_audit.errors import VerifierError

__all__ = ["SGLangChainVerifier", "SGLangBlockVerifier"]


class SGLangChainVerifier(EngineVerifier):
    """Audit SGLang's chain verifier (K = 1, any L), token by token or as block verification.

    Parameters
    ----------
    block_verification : bool
        The kernel's ``block_verification`` mode (default False: token-wise).
    """

    name = "sglang"
    description = "SGLang chain_speculative_sampling_triton (token-wise), Triton interpreter"
    engine = "sglang"
    max_drafts = 1

    def __init__(self, block_verification: bool = False):
        os.environ.setdefault("TRITON_INTERPRET", "1")
        import triton.language as tl

        if type(tl.sum).__name__ != "InterpretedFunction":
            raise ImportError(
                "sglang adapter: Triton was imported before TRITON_INTERPRET=1 was set, so its kernels "
                "cannot run on this CPU; start Python with TRITON_INTERPRET=1"
            )
        import sglang
        from sglang.kernels.ops.speculative.reject_sampling import chain_speculative_sampling_triton

        self._fn = chain_speculative_sampling_triton
        self.block_verification = bool(block_verification)
        if self.block_verification:
            self.name = "sglang-block"
            self.description = "SGLang chain_speculative_sampling_triton (block verification), Triton interpreter"
        self.engine_version = sglang.__version__

    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        batch_size, _, draft_len = draft_tokens.shape
        num_slots = draft_len + 1
        candidates = torch.zeros(batch_size, num_slots, dtype=torch.int64)
        candidates[:, 1:] = draft_tokens[:, 0].cpu()
        retrive_index = torch.arange(batch_size * num_slots, dtype=torch.int64).view(batch_size, num_slots)
        predicts = torch.full((batch_size * num_slots,), -1, dtype=torch.int32)
        accept_index = torch.full((batch_size, num_slots), -1, dtype=torch.int32)
        accept_token_num = torch.zeros(batch_size, dtype=torch.int32)
        target = target_probs[:, 0].float().contiguous().cpu()  # [batch_size, L + 1, V]
        draft = draft_probs[:, 0].float().contiguous().cpu()  # [batch_size, L, V]
        with engine_rng(generator):
            coins = torch.rand(batch_size, draft_len, dtype=torch.float32)
            final_coins = torch.rand(batch_size, dtype=torch.float32)
            self._fn(
                predicts, accept_index, accept_token_num, candidates, retrive_index, None, None,
                coins, final_coins, target, draft, 1.0, 1.0, True,
                block_verification=self.block_verification,
            )
        num_accepted = accept_token_num.to(torch.int64)
        slots = accept_index.to(torch.int64).gather(1, num_accepted.unsqueeze(1)).squeeze(1)
        if bool((slots < 0).any()):
            raise VerifierError("sglang: accept_index has no slot for the final token")
        next_token = predicts.to(torch.int64)[slots]
        device = draft_tokens.device
        return VerifyOutput(num_accepted.to(device), torch.zeros_like(num_accepted).to(device), next_token.to(device))


class SGLangBlockVerifier(SGLangChainVerifier):
    """SGLang's chain kernel in its ``block_verification=True`` mode."""

    def __init__(self):
        super().__init__(block_verification=True)
