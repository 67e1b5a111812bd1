"""spectr_audit.verifiers.compiled: off by default, the same numbers as the eager code, a clean fallback."""

from __future__ import annotations

import pytest
import torch

from spectr_audit.verifiers import compiled
from spectr_audit.verifiers.rho_star import _kseq_gap, kseq_rho_star, kseq_rho_star_sampler


@pytest.fixture
def restore_switch():
    saved = compiled._enabled
    yield
    compiled._enabled = saved


def test_off_by_default_and_switchable(monkeypatch, restore_switch):
    compiled._enabled = None
    monkeypatch.delenv("SPECTR_AUDIT_COMPILE", raising=False)
    assert not compiled.compiled_enabled()
    monkeypatch.setenv("SPECTR_AUDIT_COMPILE", "1")
    assert compiled.compiled_enabled()
    compiled.use_compiled(False)  # the function call wins over the environment
    assert not compiled.compiled_enabled()


def test_a_failing_compile_falls_back_to_eager_with_one_warning(monkeypatch):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler here")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(compiled, "_cache", {})
    monkeypatch.setattr(compiled, "_failed", set())
    draft = torch.tensor([[0.5, 0.5]])
    target = torch.tensor([[0.2, 0.8]])
    with pytest.warns(RuntimeWarning, match=r"kseq_beta runs eagerly.*no C\+\+ compiler here"):
        first = compiled.kseq_beta(draft, target, torch.tensor([[2.0]]))
    second = compiled.kseq_beta(draft, target, torch.tensor([[2.0]]))  # no second warning, same eager result
    assert first.item() == pytest.approx(0.5) and second.item() == pytest.approx(0.5)


def _rows(seed: int, n: int, vocab_size: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(2.5 * torch.randn(n, vocab_size, generator=gen, dtype=torch.float64), -1)
    draft = torch.softmax(0.7 * target.log() + torch.randn(n, vocab_size, generator=gen, dtype=torch.float64), -1)
    draft[0, :5] = 0.0  # zero-mass draft tokens: ratios inf and nan must stay "high"
    draft = draft / draft.sum(-1, keepdim=True)
    return draft.to(dtype), target.to(dtype)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_fused_kernels_match_their_eager_twins(seed):
    draft, target = _rows(seed, 7, 3000)
    thresholds = 1 + 3 * torch.rand(7, 2, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(
        compiled.kseq_low_sums(draft, target, thresholds),
        compiled._kseq_low_sums_eager(draft, target, thresholds), rtol=1e-5, atol=1e-5,
    )
    rho = thresholds[:, :1]
    torch.testing.assert_close(compiled.kseq_beta(draft, target, rho), compiled._kseq_beta_eager(draft, target, rho))
    scale = torch.rand(7, 1, generator=torch.Generator().manual_seed(seed + 100)) + 0.5
    torch.testing.assert_close(
        compiled.kseq_excess(draft, target, rho, scale), compiled._kseq_excess_eager(draft, target, rho, scale)
    )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_rho_is_valid_and_close_to_the_exact_solve(dtype, restore_switch):
    draft, target = _rows(7, 16, 5000, dtype)
    k = torch.tensor([float(1 + i % 8) for i in range(16)], dtype=torch.float64)
    compiled.use_compiled(True)
    fused = kseq_rho_star_sampler(draft, target, k)
    compiled.use_compiled(False)
    eager = kseq_rho_star_sampler(draft, target, k)
    d64, t64 = draft.double(), target.double()
    d64, t64 = d64 / d64.sum(-1, keepdim=True), t64 / t64.sum(-1, keepdim=True)
    exact = kseq_rho_star(d64, t64, k)
    assert bool((_kseq_gap(d64, t64, fused, k) >= -1e-15).all())
    assert bool((fused >= exact * (1 - 1e-12)).all() and (fused <= exact * (1 + 1e-4)).all())
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name,num_drafts,draft_len", [("kseq", 4, 1), ("spectr-tree", 3, 2)])
def test_fused_samplers_follow_the_exact_law(name, num_drafts, draft_len, restore_switch):
    """As tests/verifiers/test_large_vocab_samplers.py, with the fused kernels on (false-alarm rate 1e-3 per case)."""
    from tests.verifiers.test_large_vocab_samplers import REPS, VOCAB_SIZE, _case, _pooled_pvalue

    from spectr_audit.registry import load_verifier

    verifier = load_verifier(name)
    tokens, draft_probs, target_probs = _case(num_drafts, draft_len, seed=17 + num_drafts + draft_len)
    law = verifier.output_probs(tokens, draft_probs, target_probs)[0]
    rep = lambda t: t.expand(REPS, *t.shape[1:]).contiguous()
    compiled.use_compiled(True)
    out = verifier.verify(rep(tokens), rep(draft_probs), rep(target_probs), torch.Generator().manual_seed(5))
    cells = (out.draft_index * (draft_len + 1) + out.num_accepted) * VOCAB_SIZE + out.next_token
    counts = torch.bincount(cells, minlength=law.numel()).double()
    assert _pooled_pvalue(counts, law.reshape(-1) * REPS) > 1e-3, name
