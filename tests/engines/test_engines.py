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
