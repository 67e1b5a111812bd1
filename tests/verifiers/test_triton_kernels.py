"""spectr_audit.verifiers.triton_kernels: every kernel against its eager twin, the lazy draw, the switch.

The kernels run on CUDA, or on a CPU under Triton's interpreter.  Without a GPU,
``test_kernels_under_the_interpreter`` runs this file again in a subprocess with ``TRITON_INTERPRET=1``
(the variable must be set before the kernels are first loaded); there the other tests run the
kernels on CPU tensors, on small random cases (the interpreter is slow).

Exactness: each token's value is computed with the eager twin's IEEE operations, so a block's sum
is positive exactly when the eager one is, and the lazy draw equals the contract's two-level draw
given the same block sums; the sums themselves are compared to float rounding.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spectr_audit.contract.randomness import _sample_two_level, block_sums, sample_categorical
from spectr_audit.verifiers import triton_kernels
from spectr_audit.verifiers.compiled import _kseq_low_sums_eager

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET", "") == "1"
ON_CUDA = torch.cuda.is_available() and not INTERPRETED
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")

kernels_here = pytest.mark.skipif(
    not HAS_TRITON or not (INTERPRETED or ON_CUDA),
    reason="the kernels run on CUDA or under TRITON_INTERPRET=1 (test_kernels_under_the_interpreter runs them)",
)
SMALL = settings(max_examples=20, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture
def triton_on():
    saved = triton_kernels._override
    triton_kernels.use_triton(True)
    assert triton_kernels.triton_enabled(DEVICE)
    yield
    triton_kernels._override = saved


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
@pytest.mark.skipif(INTERPRETED or ON_CUDA, reason="the kernel tests run in this process")
def test_kernels_under_the_interpreter():
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
         "-k", "not under_the_interpreter"],
        capture_output=True, text=True, timeout=900, cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout, run.stdout[-2000:]


def _rows(seed: int, shape, dtype, zeros: float = 0.1):
    """Random distributions ``shape`` (last dim V) with some exact zeros, on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2.5 * torch.randn(*shape, generator=gen, dtype=torch.float64)
    probs = torch.softmax(logits, -1) * (torch.rand(*shape, generator=gen, dtype=torch.float64) >= zeros)
    probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-300)
    return probs.to(dtype).to(DEVICE)


def _close(kernel: torch.Tensor, eager: torch.Tensor) -> None:
    tol = 1e-5 if eager.dtype == torch.float32 else 1e-12
    torch.testing.assert_close(kernel, eager, rtol=tol, atol=tol * 1e-2)
    # every token's value is the eager one: a block sums to > 0 exactly when one of its values is > 0
    assert torch.equal(kernel > 0, eager > 0)


cases = st.tuples(
    st.integers(1, 3), st.integers(1, 3), st.integers(1, 1800), st.sampled_from([torch.float32, torch.float64]),
    st.integers(0, 2**31 - 1),
)


@kernels_here
@SMALL
@given(case=cases, unit=st.booleans())
def test_difference_block_sums_match_the_eager_twin(triton_on, case, unit):
    outer, inner, vocab_size, dtype, seed = case
    draft = _rows(seed, (outer, inner, vocab_size), dtype)
    target = _rows(seed + 1, (outer, inner + 1, vocab_size), dtype)[:, :inner]  # a strided view, as the levels are
    gen = torch.Generator().manual_seed(seed + 2)
    weight = torch.exp(2 * torch.randn(outer, inner, generator=gen, dtype=torch.float64)).to(DEVICE)
    target_scale, draft_scale = (torch.ones_like(weight), -torch.ones_like(weight)) if unit else (
        weight.clamp(max=1.0), -1 / weight.clamp(min=1.0))
    residual = triton_kernels.difference_residual(target, draft, target_scale, draft_scale, with_signed=True)
    x, y = target_scale.to(dtype).unsqueeze(-1), draft_scale.to(dtype).unsqueeze(-1)
    signed = target * x + draft * y
    _close(residual.block_sums, block_sums(signed.clamp(min=0)))
    torch.testing.assert_close(residual.signed_sums, block_sums(signed), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(residual.totals(), signed.clamp(min=0).double().sum(-1), rtol=1e-5, atol=1e-6)


@kernels_here
@SMALL
@given(case=cases, num_drafts=st.integers(2, 8))
def test_kseq_beta_and_residual_match_the_eager_twins(triton_on, case, num_drafts):
    from spectr_audit.verifiers.compiled import _kseq_beta_eager, _kseq_excess_eager

    rows, _, vocab_size, dtype, seed = case
    draft, target = _rows(seed, (rows, vocab_size), dtype), _rows(seed + 1, (rows, vocab_size), dtype)
    gen = torch.Generator().manual_seed(seed + 2)
    rho = (1 + (num_drafts - 1) * torch.rand(rows, 1, generator=gen, dtype=torch.float64)).to(dtype).to(DEVICE)
    scale = (1.5 * torch.rand(rows, 1, generator=gen, dtype=torch.float64)).to(dtype).to(DEVICE)
    beta = triton_kernels.kseq_beta(draft, target, rho)
    torch.testing.assert_close(beta, _kseq_beta_eager(draft, target, rho), rtol=1e-5, atol=1e-7)
    excess = triton_kernels.kseq_excess_residual(draft, target, rho, scale)
    _close(excess.block_sums.squeeze(1), block_sums(_kseq_excess_eager(draft, target, rho, scale)))


@kernels_here
@SMALL
@given(case=cases, candidates=st.integers(1, 3))
def test_low_sums_match_the_eager_twin(triton_on, case, candidates):
    rows, _, vocab_size, dtype, seed = case
    draft, target = _rows(seed, (rows, vocab_size), dtype, zeros=0.2), _rows(seed + 1, (rows, vocab_size), dtype)
    gen = torch.Generator().manual_seed(seed + 2)
    thresholds = (1 + 7 * torch.rand(rows, candidates, generator=gen, dtype=torch.float64)).to(dtype).to(DEVICE)
    # the same masks bit for bit (q <= c p in the rows' dtype): float64 sums differ only in their order
    torch.testing.assert_close(triton_kernels.kseq_low_sums(draft, target, thresholds),
                               _kseq_low_sums_eager(draft, target, thresholds), rtol=1e-12, atol=1e-15)


@kernels_here
@SMALL
@given(case=cases)
def test_the_lazy_draw_is_the_two_level_draw(triton_on, case):
    rows, _, vocab_size, dtype, seed = case
    draft, target = _rows(seed, (rows, vocab_size), dtype), _rows(seed + 1, (rows, vocab_size), dtype)
    ones = torch.ones(rows, dtype=dtype, device=DEVICE)
    residual = triton_kernels.difference_residual(target, draft, ones, -ones)
    values = (target - draft).clamp(min=0)
    u = torch.rand(rows, generator=torch.Generator().manual_seed(seed + 3), dtype=torch.float64).to(DEVICE)
    drawn, total = residual.sample_with_total(u)
    sums = residual.block_sums.squeeze(1)
    if vocab_size > 2 * triton_kernels.CATEGORICAL_BLOCK:  # the contract's two-level draw, given the same sums
        assert torch.equal(drawn, _sample_two_level(values, u, sums))
    has_mass = total > 0
    # never a token of zero residual mass
    assert bool((values.gather(-1, drawn.unsqueeze(-1)).squeeze(-1)[has_mass] > 0).all())
    assert torch.equal(has_mass, values.sum(-1) > 0)


@kernels_here
@pytest.mark.parametrize("name,num_drafts,draft_len", [
    ("speculative", 1, 3), ("kseq", 4, 1), ("spectr-tree", 3, 2), ("block", 1, 3), ("greedy-block", 1, 2),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_samplers_with_the_kernels_draw_what_the_eager_samplers_draw(triton_on, name, num_drafts, draft_len, dtype):
    """The same uniforms give the same verdicts, but where a draw lands within rounding of a block boundary."""
    from spectr_audit.registry import load_verifier

    batch_size, vocab_size = 48, 1100
    gen = torch.Generator().manual_seed(11)
    target = torch.softmax(2 * torch.randn(batch_size, num_drafts, draft_len + 1, vocab_size, generator=gen), -1)
    draft = torch.softmax(0.7 * target.log() + torch.randn(target.shape, generator=gen), -1)[:, :, :draft_len]
    tokens = sample_categorical(draft, torch.rand(draft.shape[:-1], generator=gen, dtype=torch.float64))
    draft, target, tokens = draft.to(dtype).to(DEVICE), target.to(dtype).to(DEVICE), tokens.to(DEVICE)
    verifier = load_verifier(name)
    fused = verifier.verify(tokens, draft, target, torch.Generator().manual_seed(5))
    triton_kernels.use_triton(False)
    eager = verifier.verify(tokens, draft, target, torch.Generator().manual_seed(5))
    same = ((fused.num_accepted == eager.num_accepted) & (fused.draft_index == eager.draft_index)
            & (fused.next_token == eager.next_token))
    assert same.double().mean() >= 0.98, (name, same.double().mean())
    assert not triton_kernels._failed


@kernels_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_sort_free_rho_solve_with_the_low_sums_kernel(triton_on, dtype):
    from spectr_audit.verifiers import compiled
    from spectr_audit.verifiers.rho_star import _kseq_gap, kseq_rho_star, kseq_rho_star_sampler

    draft, target = _rows(7, (6, 1500), dtype, zeros=0.05), _rows(8, (6, 1500), dtype, zeros=0.0)
    k = torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0, 8.0], dtype=torch.float64, device=DEVICE)
    saved = compiled._enabled
    compiled.use_compiled(True)  # the solve's fused path, whose low sums are the Triton kernel's here
    try:
        fused = kseq_rho_star_sampler(draft, target, k)
    finally:
        compiled._enabled = saved
    d64, t64 = draft.double(), target.double()
    d64, t64 = d64 / d64.sum(-1, keepdim=True), t64 / t64.sum(-1, keepdim=True)
    exact = kseq_rho_star(d64, t64, k)
    assert bool((_kseq_gap(d64, t64, fused, k) >= -1e-15).all())  # valid
    assert bool((fused >= exact * (1 - 1e-12)).all() and (fused <= exact * (1 + 1e-4)).all())


def test_off_on_a_cpu_and_switchable(monkeypatch):
    saved = triton_kernels._override
    try:
        triton_kernels.use_triton(None)
        monkeypatch.setattr(triton_kernels, "_available", True)
        monkeypatch.delenv("SPECTR_AUDIT_TRITON", raising=False)
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        assert triton_kernels.triton_enabled(torch.device("cuda"))  # on by default where a GPU is
        assert not triton_kernels.triton_enabled(torch.device("cpu"))  # never on a CPU by default
        monkeypatch.setenv("SPECTR_AUDIT_TRITON", "0")
        assert not triton_kernels.triton_enabled(torch.device("cuda"))
        triton_kernels.use_triton(True)  # the call wins over the environment
        assert triton_kernels.triton_enabled(torch.device("cuda"))
        assert not triton_kernels.triton_enabled(torch.device("cpu"))  # a CPU needs the interpreter as well
        triton_kernels.use_triton(False)
        assert not triton_kernels.triton_enabled(torch.device("cuda"))
        monkeypatch.setattr(triton_kernels, "_available", False)
        triton_kernels.use_triton(True)
        assert not triton_kernels.triton_enabled(torch.device("cuda"))  # no Triton: the eager code
    finally:
        triton_kernels._override = saved


def test_a_failing_kernel_falls_back_to_its_eager_twin_with_one_warning(monkeypatch):
    def broken():
        raise RuntimeError("no compiler for this GPU")

    monkeypatch.setattr(triton_kernels, "triton_enabled", lambda device: True)
    monkeypatch.setattr(triton_kernels, "_kernels", broken)
    monkeypatch.setattr(triton_kernels, "_failed", set())
    draft, target = torch.tensor([[0.5, 0.25, 0.25]]), torch.tensor([[0.2, 0.2, 0.6]])
    ones = torch.ones(1)
    with pytest.warns(RuntimeWarning, match=r"row_block_sums\[0\] runs eagerly.*no compiler for this GPU"):
        first = triton_kernels.difference_residual(target, draft, ones, -ones)
    second = triton_kernels.difference_residual(target, draft, ones, -ones)  # no second warning
    for residual in (first, second):
        torch.testing.assert_close(residual.block_sums.squeeze(1), torch.tensor([[0.35]]))
        torch.testing.assert_close(residual.materialise(), torch.tensor([[0.0, 0.0, 0.35]]))
    thresholds = torch.tensor([[1.0, 2.0]])
    with pytest.warns(RuntimeWarning, match="kseq_low_sums runs eagerly"):
        low = triton_kernels.kseq_low_sums(draft, target, thresholds)
    # at c = 1 and c = 2 tokens 0 and 1 are low (q/p = 0.4, 0.8), token 2 is not (q/p = 2.4)
    torch.testing.assert_close(low, torch.tensor([[[0.75, 0.75], [0.4, 0.4]]], dtype=torch.float64))
