"""Audits of real engines' verifiers through their adapters (spectr_audit.engines).

Each engine is an optional extra: its tests skip cleanly when it is not installed.  Every audit
is statistical with a fixed seed; the false-alarm rate of each exactness verdict is
``alpha = 1e-3`` (Holm over the audit's sub-tests), and of each optimality verdict likewise.
What to do when one fails: rerun with another seed; a repeated failure is a finding about the
engine (or its adapter), not noise.

The SGLang kernel runs under Triton's interpreter, which must be on before Triton is first
imported; vLLM imports Triton without it, so the SGLang audits run in a fresh interpreter
(``subprocess``), and they are slow (about 40 ms per verification): ``-m slow``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from spectr_audit.bounds.acceptance import optimal_acceptance
from spectr_audit.errors import InvalidArgument
from spectr_audit.drafting.models import ContextFreeModel
from spectr_audit.statistical.audit import statistical_audit

ALPHA = 1e-3
DRAFT = [0.1, 0.2, 0.3, 0.4]
TARGET = [0.4, 0.3, 0.2, 0.1]
ALPHA_STAR = optimal_acceptance(DRAFT, TARGET, 1).item()  # sum min(draft, target) = 0.6


def _engine(name, module, **kwargs):
    if module == "keras_hub":
        os.environ.setdefault("KERAS_BACKEND", "torch")  # keras-hub's default backend would need TensorFlow
    pytest.importorskip(module)
    from spectr_audit.engines import load_engine

    return load_engine(name, **kwargs)


def _audit(verifier, draft_len, num_samples, seed=0, draft=DRAFT, target=TARGET):
    claimed = optimal_acceptance(draft, target, 1).item()
    return statistical_audit(
        verifier, ContextFreeModel(draft), ContextFreeModel(target), 1, draft_len,
        num_samples=num_samples, seed=seed, alpha=ALPHA, stratify=False, claimed_acceptance=claimed,
    )


# name, module to import, constructor kwargs, draft lengths, samples, exact?, optimal acceptance?
ENGINE_CASES = [
    pytest.param("transformers", "transformers", {}, (1, 3), 6_000, True, True, id="transformers"),
    pytest.param("vllm", "vllm", {}, (1, 3), 100_000, True, True, id="vllm"),
    pytest.param("vllm-no-draft-probs", "vllm", {}, (1, 3), 100_000, True, False, id="vllm-no-draft-probs"),
    pytest.param("lmdeploy", "lmdeploy", {}, (1, 3), 100_000, True, True, id="lmdeploy"),
    pytest.param("lmdeploy-no-draft-probs", "lmdeploy", {}, (1, 3), 100_000, True, False, id="lmdeploy-no-draft-probs"),
    pytest.param("keras-hub", "keras_hub", {}, (1,), 300, False, False, id="keras-hub"),
]


@pytest.mark.parametrize("name, module, kwargs, draft_lens, num_samples, exact, optimal", ENGINE_CASES)
def test_engine_exactness_and_acceptance(name, module, kwargs, draft_lens, num_samples, exact, optimal):
    verifier = _engine(name, module, **kwargs)
    for draft_len in draft_lens:
        result = _audit(verifier, draft_len, num_samples)
        info = f"{name} L={draft_len}: p = {result.pvalue:.3g}, acceptance {result.acceptance:.4f} vs alpha* {ALPHA_STAR:.4f}"
        assert result.rejects() is not exact, info
        if exact:
            # an exact verifier can never beat alpha*; the optimality test says whether it reaches it
            assert result.acceptance_ci(confidence=1 - ALPHA)[0] <= ALPHA_STAR, info
            assert (result.optimality_pvalue > ALPHA) is optimal, info


@pytest.mark.parametrize(
    "name, module",
    [("transformers", "transformers"), ("vllm", "vllm"), ("lmdeploy", "lmdeploy"), ("keras-hub", "keras_hub")],
)
def test_engine_seeding_is_deterministic(name, module):
    """docs/historic-bugs.md entry 2: the same generator seed gives the same verdicts; the caller's RNG is untouched."""
    verifier = _engine(name, module)
    batch_size, draft_len = 32, 2
    gen = torch.Generator().manual_seed(5)
    draft_probs = torch.tensor(DRAFT, dtype=torch.float64).expand(batch_size, 1, draft_len, 4).clone()
    target_probs = torch.tensor(TARGET, dtype=torch.float64).expand(batch_size, 1, draft_len + 1, 4).clone()
    tokens = torch.multinomial(draft_probs.view(-1, 4), 1, generator=gen).view(batch_size, 1, draft_len)
    state = torch.random.get_rng_state()
    runs = [verifier.verify(tokens, draft_probs, target_probs, torch.Generator().manual_seed(s)) for s in (1, 1, 2)]
    assert torch.equal(torch.random.get_rng_state(), state)
    assert runs[0].emitted(tokens) == runs[1].emitted(tokens)
    assert runs[0].emitted(tokens) != runs[2].emitted(tokens)


def test_keras_hub_batch_coupling():
    """keras-hub advances every row by the batch's minimum accepted count: batched rows are not exact."""
    verifier = _engine("keras-hub", "keras_hub", batched=True)
    result = _audit(verifier, 1, 4_000, draft=[0.3, 0.7], target=[0.7, 0.3])
    assert result.rejects()


# An all-zero residual: a draft token of probability 1e-30 that the target never wants.  Exact
# verifiers must then emit a target sample; several engines emit a fixed token instead.
ZERO_RESIDUAL_CASES = [
    # drafted token, draft, target
    (0, [1e-30, 0.5, 0.5], [0.0, 0.5, 0.5]),
    (2, [0.5, 0.5, 1e-30], [0.5, 0.5, 0.0]),
]

ZERO_RESIDUAL_FINDINGS = {
    "vllm": "recovery argmax over an all-zero score row returns token 0",
    "lmdeploy": "recovery argmax over an all-zero score row returns token 0",
    "transformers": "p_prime.div_(p_prime.sum()) divides by 0: NaN, torch.multinomial raises (docs/historic-bugs.md entry 25)",
}


@pytest.mark.parametrize(
    "name, module",
    [("vllm", "vllm"), ("vllm-no-draft-probs", "vllm"), ("lmdeploy", "lmdeploy"), ("transformers", "transformers")],
)
def test_zero_residual_never_emits_a_zero_target_token(name, module):
    from spectr_audit.errors import VerifierError

    verifier = _engine(name, module)
    batch_size = 64
    failures = []
    for token, draft, target in ZERO_RESIDUAL_CASES:
        tokens = torch.full((batch_size, 1, 1), token, dtype=torch.int64)
        draft_probs = torch.tensor(draft, dtype=torch.float64).expand(batch_size, 1, 1, 3).clone()
        target_probs = torch.tensor(target, dtype=torch.float64).expand(batch_size, 1, 2, 3).clone()
        try:
            out = verifier.verify(tokens, draft_probs, target_probs, torch.Generator().manual_seed(0))
        except (RuntimeError, VerifierError) as exc:
            failures.append(f"raised {type(exc).__name__}: {exc}")
            continue
        first = torch.tensor([e[0] for e in out.emitted(tokens)])
        zero_mass = torch.tensor(target)[first] == 0
        if bool(zero_mass.any()) or len(set(first.tolist())) < 2:
            failures.append(f"case {token}: emitted first tokens {sorted(set(first.tolist()))}")
    if failures and name in ZERO_RESIDUAL_FINDINGS:
        pytest.xfail(f"{name}: {ZERO_RESIDUAL_FINDINGS[name]} ({'; '.join(failures)})")
    assert not failures


def test_unknown_engine():
    from spectr_audit.engines import engine_names, load_engine

    assert {"transformers", "vllm", "vllm-no-draft-probs", "lmdeploy", "keras-hub", "sglang"} <= set(engine_names())
    with pytest.raises(InvalidArgument, match="unknown engine"):
        load_engine("no-such-engine")


# --- SGLang: Triton interpreter, a fresh process ---------------------------------------------

_SGLANG_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from spectr_audit.engines import load_engine
    from spectr_audit.drafting.models import ContextFreeModel
    from spectr_audit.statistical.audit import statistical_audit
    draft, target, alpha_star, num_samples = json.loads(sys.argv[1])
    out = {}
    for name in ("sglang", "sglang-block"):
        verifier = load_engine(name)
        r = statistical_audit(verifier, ContextFreeModel(draft), ContextFreeModel(target), 1, 2,
                              num_samples=num_samples, seed=0, alpha=1e-3, stratify=False,
                              claimed_acceptance=alpha_star)
        out[name] = {"pvalue": r.pvalue, "rejects": r.rejects(), "acceptance": r.acceptance,
                     "block_efficiency": r.block_efficiency, "optimality_pvalue": r.optimality_pvalue}
    # an all-zero residual (see ZERO_RESIDUAL_CASES)
    tokens = torch.full((16, 1, 1), 2, dtype=torch.int64)
    dp = torch.tensor([0.5, 0.5, 1e-30], dtype=torch.float64).expand(16, 1, 1, 3).clone()
    tp = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64).expand(16, 1, 2, 3).clone()
    res = load_engine("sglang").verify(tokens, dp, tp, torch.Generator().manual_seed(0))
    out["zero_residual_first_tokens"] = sorted({e[0] for e in res.emitted(tokens)})
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_sglang_chain_and_block():
    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("triton") is None:
        pytest.skip("sglang (and triton) not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    args = json.dumps([DRAFT, TARGET, ALPHA_STAR, 1_500])
    proc = subprocess.run([sys.executable, "-c", _SGLANG_SCRIPT, args], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("sglang", "sglang-block"):
        assert not out[name]["rejects"], out[name]
        assert out[name]["optimality_pvalue"] > ALPHA, out[name]
    # block verification is at least as efficient as token-wise verification (in expectation)
    assert out["sglang-block"]["block_efficiency"] > out["sglang"]["block_efficiency"] - 0.1
    # Finding: with an all-zero residual the kernel falls back to token V - 1, here of target mass 0.
    assert out["zero_residual_first_tokens"] == [2]


# --- Sampling parameters: adapters that take logits (docs/sampling.md) -----------------------

SAMPLING_DRAFT_LOGITS = [1.2, 0.3, -0.5, 0.9, -1.4, 0.1]
SAMPLING_TARGET_LOGITS = [0.2, 1.1, 0.4, -0.8, 0.6, -0.3]
#: The settings each adapter that takes logits is audited at: a temperature below 1, top-k, top-p.
SAMPLING_SETTINGS = {"T=0.6": dict(temperature=0.6), "top-k=3": dict(top_k=3), "top-p=0.8": dict(top_p=0.8)}


def _sampling_audit(verifier, setting: dict, num_samples: int, order: str = "vllm", draft_len: int = 2):
    from spectr_audit.contract.sampling import SamplingParams
    from spectr_audit.drafting.processed import ContextFreeLogitsModel

    return statistical_audit(
        verifier, ContextFreeLogitsModel(SAMPLING_DRAFT_LOGITS), ContextFreeLogitsModel(SAMPLING_TARGET_LOGITS), 1,
        draft_len, params=SamplingParams(**setting), order=order, num_samples=num_samples, seed=0, alpha=ALPHA,
        stratify=False,
    )


def _min_p_ignored_tv(setting: dict, num_tokens: int) -> float:
    """Exact TV between the laws of num_tokens-token strings of the target processed with and without min-p
    (what a sampler without a min-p step emits when handed min-p, as the speculative sampling it runs is exact for
    its own target)."""
    from spectr_audit.contract.sampling import SamplingParams, process_logits

    logits = torch.tensor([SAMPLING_TARGET_LOGITS], dtype=torch.float64)
    with_min_p = process_logits(logits, SamplingParams(**setting), "vllm")[0]
    without = process_logits(logits, SamplingParams(**{k: v for k, v in setting.items() if k != "min_p"}), "vllm")[0]
    joint_with, joint_without = torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    for _ in range(num_tokens):
        joint_with = (joint_with.unsqueeze(-1) * with_min_p).reshape(-1)
        joint_without = (joint_without.unsqueeze(-1) * without).reshape(-1)
    return float((joint_with - joint_without).abs().sum() / 2)


@pytest.mark.parametrize("setting", list(SAMPLING_SETTINGS))
def test_vllm_sampler_exact_with_fixed_expand(setting):
    """vLLM's RejectionSampler.forward, handed logits and parameters, with the CPU expansion fixed: exact
    at a temperature below 1, top-k and top-p (L = 2, 20,000 samples, false-alarm rate 1e-3 each)."""
    verifier = _engine("vllm-sampler-fixed-expand", "vllm")
    result = _sampling_audit(verifier, SAMPLING_SETTINGS[setting], 20_000)
    assert not result.rejects(), f"{setting}: p = {result.pvalue:.3g}, TV ~{result.tv_estimate:.4f}"


def test_vllm_sampler_greedy_is_exact():
    """Temperature 0: vLLM's greedy rejection kernel and the argmax bonus give the argmax string (no uniforms)."""
    verifier = _engine("vllm-sampler", "vllm")
    result = _sampling_audit(verifier, dict(temperature=0.0), 2_000)
    assert not result.rejects() and result.tv_estimate == 0.0


@pytest.mark.xfail(strict=True, reason=(
    "vllm-cpu 0.32: the CPU replacement of the Triton expand_kernel (vllm.utils.cpu_triton_utils._expand_kernel_impl) "
    "casts its output to int64 and writes into that copy, so apply_sampling_constraints divides the target logits "
    "by uninitialised per-token temperatures; measured TV ~0.75 at T 0.6, L 2 (top-k reads garbage ids and crashes)"))
def test_vllm_sampler_as_shipped_on_cpu():
    verifier = _engine("vllm-sampler", "vllm")
    result = _sampling_audit(verifier, dict(temperature=0.6), 5_000)
    assert not result.rejects(), f"p = {result.pvalue:.3g}, TV ~{result.tv_estimate:.4f} [{result.tv_lower:.4f}, {result.tv_upper:.4f}]"


@pytest.mark.xfail(strict=True, reason="vllm-cpu 0.32's CPU expand_kernel leaves a float32 output untouched (it writes "
                                       "an int64 copy)")
def test_vllm_cpu_expand_kernel_writes_its_output():
    """The root cause, deterministically: a zeroed float32 output stays zero after the CPU expand kernel."""
    pytest.importorskip("vllm")
    from spectr_audit.engines.vllm_v1 import _import_vllm, expand_batch_to_tokens_fixed

    _import_vllm()
    from vllm.utils import cpu_triton_utils

    values = torch.tensor([0.5, 0.7, 0.0, 2.0])
    cu = torch.tensor([2, 4, 6, 8], dtype=torch.int32)
    output = torch.zeros(8)
    cpu_triton_utils._expand_kernel_impl(output, values, cu, 0, 1)
    assert torch.equal(output, expand_batch_to_tokens_fixed(values, cu, 8, 0, 1))


def _vllm_min_p_audit():
    verifier = _engine("vllm-sampler-fixed-expand", "vllm")
    return _sampling_audit(verifier, dict(temperature=0.8, min_p=0.2), 20_000)


def test_vllm_front_end_refuses_min_p_under_speculative_decoding():
    """vLLM 0.32 refuses min-p (and logit bias) at request validation when speculative decoding is on
    (vllm/sampling_params.py:1190, ``if self.min_p > _SAMPLING_EPS or self.logit_bias:`` in
    ``_validate_spec_decode``, which ``SamplingParams.verify`` calls at :913 for every request through
    vllm/v1/engine/input_processor.py:157-159).  A real request with min-p above 1e-5 never reaches the speculative
    sampler."""
    pytest.importorskip("vllm")
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams as VLLMSamplingParams

    speculative_config = object()  # any configured SpeculativeConfig: the check reads only whether there is one
    for refused in (dict(temperature=0.8, min_p=0.2), dict(logit_bias={0: 1.0})):
        with pytest.raises(VLLMValidationError, match="not yet supported with speculative decoding"):
            VLLMSamplingParams(**refused)._validate_spec_decode(speculative_config)
        VLLMSamplingParams(**refused)._validate_spec_decode(None)  # without speculative decoding: accepted
    VLLMSamplingParams(temperature=0.8, top_k=3, top_p=0.8)._validate_spec_decode(speculative_config)
    # the gap: min-p up to _SAMPLING_EPS = 1e-5 passes validation (and is not applied under speculative decoding)
    VLLMSamplingParams(temperature=0.8, min_p=1e-5)._validate_spec_decode(speculative_config)


def test_vllm_sampler_ignores_min_p_measured_tv():
    """Verifier level only: the adapter is handed min-p directly, which no served request can do (the front end
    refuses it: test_vllm_front_end_refuses_min_p_under_speculative_decoding).  The sampler as configured for
    speculative decoding has no min-p step (build_logitsprocs, vllm/v1/sample/logits_processor/__init__.py:208-216),
    so the emitted law is the target without min-p.  The audit rejects, and its 99.9% TV interval holds the exact
    TV of that law (0.2828 at T 0.8, min-p 0.2, L 2; the partition's TV is at most that)."""
    setting = dict(temperature=0.8, min_p=0.2)
    exact_tv = _min_p_ignored_tv(setting, 3)
    assert exact_tv == pytest.approx(0.2828, abs=1e-4)
    result = _vllm_min_p_audit()
    assert result.rejects()
    assert result.tv_lower <= exact_tv and result.tv_upper >= 0.05, (result.tv_lower, result.tv_upper, exact_tv)


@pytest.mark.xfail(strict=True, reason="verifier level, not a served-request defect: vLLM 0.32's sampler has no min-p "
                                       "step under speculative decoding (logits_processor/__init__.py:208-216), so the "
                                       "adapter handed min-p 0.2 directly is off by an exact TV of 0.2828 against the vllm "
                                       "order at T 0.8, L 2 (test_vllm_sampler_ignores_min_p_measured_tv); real requests "
                                       "with min-p are refused at validation (sampling_params.py:1190)")
def test_vllm_sampler_min_p_is_applied():
    result = _vllm_min_p_audit()
    assert not result.rejects(), f"p = {result.pvalue:.3g}, TV ~{result.tv_estimate:.4f}"


@pytest.mark.parametrize("setting", list(SAMPLING_SETTINGS) + ["min-p=0.2"])
def test_transformers_warpers_are_exact(setting):
    """transformers' _speculative_sampling after its own warpers, in transformers' order: exact at a temperature
    below 1, top-k, top-p and min-p (L = 2, 3,000 samples: a batch-1 loop; false-alarm rate 1e-3 each)."""
    verifier = _engine("transformers", "transformers")
    values = SAMPLING_SETTINGS.get(setting, dict(temperature=0.8, min_p=0.2))
    result = _sampling_audit(verifier, values, 3_000, order="transformers")
    assert not result.rejects(), f"{setting}: p = {result.pvalue:.3g}, TV ~{result.tv_estimate:.4f}"


def test_transformers_refuses_greedy():
    """Temperature 0 is do_sample=False, where assisted generation never calls _speculative_sampling."""
    from spectr_audit.contract.sampling import SamplingParams

    verifier = _engine("transformers", "transformers")
    logits = torch.tensor(SAMPLING_DRAFT_LOGITS, dtype=torch.float64).expand(2, 1, 1, 6)
    with pytest.raises(InvalidArgument, match="do_sample=False"):
        verifier.verify_logits(torch.zeros(2, 1, 1, dtype=torch.int64), logits, logits.expand(2, 1, 2, 6),
                               SamplingParams(temperature=0.0), torch.Generator().manual_seed(0))


def test_logits_adapters_are_listed_as_taking_logits():
    from spectr_audit.registry import describe, find

    pytest.importorskip("vllm")
    assert describe(find("vllm-sampler"))["takes_logits"] is True
    assert describe(find("vllm"))["takes_logits"] is False
    assert describe(find("vllm-sampler"))["exact_law"] is False
