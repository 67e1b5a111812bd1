"""SpecTr-GBV's sampler: its shortcuts read the same numbers as the plain computations they replace.

The sampler of ``spectr-gbv-published`` computes the children's covers only where a test reads them
(on the CPU), folds the full-draft rows' target into the residual's formula, gathers rows from a flat
view, and hands the carried correction of ``spectr-gbv-published-alg2`` a two-token tree with only
the probabilities it reads.  Each is checked here against the plain form, value for value.
"""

from __future__ import annotations

import pytest
import torch

from spectr_audit.contract.correction import JointResidualCorrection
from spectr_audit.contract.randomness import uniform
from spectr_audit.registry import load_verifier
from spectr_audit.verifiers import spectr_gbv


def _tree(batch_size, num_drafts, draft_len, vocab_size, seed, *, zeros=False, shared=False):
    """Peaked random rows and drafts drawn from them; optionally zeros in the rows and two identical drafts."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch_size, num_drafts, draft_len + 1, vocab_size)
    target = torch.softmax(3 * torch.randn(shape, generator=gen), -1)
    draft = torch.softmax(0.7 * target.log() + torch.randn(shape, generator=gen), -1)[:, :, :draft_len]
    if zeros:
        target = torch.where(torch.rand(shape, generator=gen) < 0.3, torch.zeros_like(target), target)
        target = target / target.sum(-1, keepdim=True)
        draft = torch.where(torch.rand(draft.shape, generator=gen) < 0.3, torch.zeros_like(draft), draft)
        draft[..., 0] += 1e-3
        draft = draft / draft.sum(-1, keepdim=True)
    if shared and num_drafts > 1:
        draft[:, -1], target[:, -1] = draft[:, 0], target[:, 0]
    tokens = torch.multinomial(draft.reshape(-1, vocab_size), 1, generator=gen).reshape(batch_size, num_drafts, draft_len)
    if shared and num_drafts > 1:
        tokens[:, -1] = tokens[:, 0]
    return tokens, draft.contiguous(), target.contiguous()


CASES = [(1, 2, 5), (2, 2, 3), (2, 4, 7), (3, 3, 11), (2, 4, 600), (4, 3, 40)]


@pytest.mark.parametrize("num_drafts,draft_len,vocab_size", CASES)
@pytest.mark.parametrize("zeros,shared", [(False, False), (True, True)])
def test_lazy_scan_is_the_full_scan(num_drafts, draft_len, vocab_size, zeros, shared):
    """Covers computed only where a test reads them: the scan ends in the same state, row for row."""
    batch_size = 64
    tokens, draft_probs, target_probs = _tree(batch_size, num_drafts, draft_len, vocab_size, 3, zeros=zeros, shared=shared)
    draft_joint, target_joint = spectr_gbv._joints(tokens, draft_probs, target_probs)
    same_prefix = spectr_gbv._same_prefix(tokens)
    for seed in range(4):
        u = uniform(torch.Generator().manual_seed(seed), (batch_size, num_drafts * draft_len + 1), torch.device("cpu"))
        lazy = spectr_gbv._scan(draft_probs, target_probs, draft_joint, target_joint, same_prefix, u, lazy=True)
        full = spectr_gbv._scan(draft_probs, target_probs, draft_joint, target_joint, same_prefix, u, lazy=False)
        for name in ("tau", "sel", "done", "rejected"):
            assert torch.equal(getattr(lazy, name), getattr(full, name)), name


@pytest.mark.parametrize("draft_dtype,target_dtype", [(torch.float16, torch.float32), (torch.float64, torch.bfloat16)])
def test_lazy_scan_with_mixed_dtypes(draft_dtype, target_dtype):
    """Rows gathered for a subset keep each tensor's own dtype (the draft's and the target's may differ)."""
    tokens, draft_probs, target_probs = _tree(64, 3, 3, 50, 9, shared=True)
    draft_probs, target_probs = draft_probs.to(draft_dtype), target_probs.to(target_dtype)
    draft_joint, target_joint = spectr_gbv._joints(tokens, draft_probs, target_probs)
    same_prefix = spectr_gbv._same_prefix(tokens)
    u = uniform(torch.Generator().manual_seed(1), (64, 10), torch.device("cpu"))
    lazy = spectr_gbv._scan(draft_probs, target_probs, draft_joint, target_joint, same_prefix, u, lazy=True)
    full = spectr_gbv._scan(draft_probs, target_probs, draft_joint, target_joint, same_prefix, u, lazy=False)
    assert torch.equal(lazy.tau, full.tau) and torch.equal(lazy.sel, full.sel)


@pytest.mark.parametrize("num_drafts,draft_len,vocab_size", CASES)
def test_cover_of_a_subset_of_rows_is_the_same_numbers(num_drafts, draft_len, vocab_size):
    """A row's children's cover does not depend on the rows computed with it (chunks, index lists)."""
    tokens, draft_probs, target_probs = _tree(40, num_drafts, draft_len, vocab_size, 5, zeros=True)
    draft_joint, target_joint = spectr_gbv._joints(tokens, draft_probs, target_probs)
    rows = torch.tensor([3, 4, 17, 39])
    for level in range(1, draft_len):
        args = (draft_probs[:, 0, level], target_probs[:, 0, level], draft_joint[:, 0, level], target_joint[:, 0, level])
        every = spectr_gbv._cover_sums(*args, num_drafts)
        assert torch.equal(spectr_gbv._cover_sums(*args, num_drafts, rows), every[rows])


def test_gather_rows_is_plain_indexing():
    """Rows by index_select on a flat view, on contiguous tensors and on a view of a wider one."""
    _, draft_probs, target_probs = _tree(9, 3, 4, 13, 7)
    gen = torch.Generator().manual_seed(0)
    rows, drafts = torch.randint(0, 9, (20,), generator=gen), torch.randint(0, 3, (20,), generator=gen)
    levels = torch.randint(0, 4, (20,), generator=gen)
    for probs in (draft_probs, target_probs, target_probs[:, :, :4], target_probs[:, :, 1:], target_probs.transpose(0, 1)):
        assert torch.equal(spectr_gbv._gather_rows(probs, rows % probs.shape[0], drafts % probs.shape[1], levels),
                           probs[rows % probs.shape[0], drafts % probs.shape[1], levels])


@pytest.mark.parametrize("num_drafts", [1, 2, 3, 5])
def test_residual_of_a_full_draft_row_is_its_target_row(num_drafts):
    """Joints (0, 1) make the published residual the target row exactly: one formula serves every row."""
    gen = torch.Generator().manual_seed(num_drafts)
    draft = torch.softmax(3 * torch.randn(6, 50, generator=gen), -1)
    target = torch.softmax(3 * torch.randn(6, 50, generator=gen), -1)
    target[:, :7] = 0
    ones = torch.ones(6, dtype=torch.float64)
    assert torch.equal(spectr_gbv._residual_sampler(draft, target, 0 * ones, ones, num_drafts), target.double())


@pytest.mark.parametrize("draft_len", [2, 3, 4])
@pytest.mark.parametrize("zeros", [False, True])
def test_alg2_correction_from_the_emitted_probabilities_is_the_contracts(draft_len, zeros):
    """The two-token tree handed to the correction gives what the whole tree gives (NaN where it does)."""
    verifier = load_verifier("spectr-gbv-published-alg2")
    tokens, draft_probs, target_probs = _tree(48, 2, draft_len, 9, 11, zeros=zeros)
    for seed in range(3):
        out = verifier.verify(tokens, draft_probs, target_probs, torch.Generator().manual_seed(seed))
        direct = JointResidualCorrection.after_emission(
            tokens, draft_probs, target_probs, out.num_accepted, out.draft_index, out.next_token,
            horizon=draft_len, exponent=2)
        assert (out.correction is None) == (direct is None)
        if direct is None:
            continue
        assert (out.correction.horizon, out.correction.exponent) == (direct.horizon, direct.exponent)
        assert torch.equal(out.correction.active, direct.active)
        assert torch.equal(out.correction.depth, direct.depth)
        torch.testing.assert_close(out.correction.ratio, direct.ratio, rtol=0, atol=0, equal_nan=True)
