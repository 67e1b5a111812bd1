"""Batch-1 verifiers in worker processes (spectr_audit/engines/workers.py).

Spawned workers take a few seconds each to import torch, so the module starts few pools.
"""

from __future__ import annotations

import pytest
import torch

from spectr_audit.engines.rng import seed_from
from spectr_audit.engines.workers import RowParallelVerifier, row_generator, verify_rows
from spectr_audit.errors import InvalidArgument, VerifierError
from spectr_audit.verifiers.speculative import SpeculativeSampling

from tests.engines._worker_helpers import DiesOnToken3, RaisesOnToken3, make_speculative

BATCH, DRAFT_LEN, VOCAB = 37, 2, 5
GEN = torch.Generator().manual_seed(3)
DRAFT_PROBS = torch.softmax(torch.randn(BATCH, 1, DRAFT_LEN, VOCAB, generator=GEN, dtype=torch.float64), -1)
TARGET_PROBS = torch.softmax(torch.randn(BATCH, 1, DRAFT_LEN + 1, VOCAB, generator=GEN, dtype=torch.float64), -1)
DRAFT_TOKENS = torch.multinomial(DRAFT_PROBS.reshape(-1, VOCAB), 1, generator=GEN).reshape(BATCH, 1, DRAFT_LEN)


def _run(verifier, seed=11):
    return verifier.verify(DRAFT_TOKENS, DRAFT_PROBS, TARGET_PROBS, torch.Generator().manual_seed(seed))


def _fields(out):
    return out.num_accepted.tolist(), out.draft_index.tolist(), out.next_token.tolist()


def test_identical_for_any_number_of_workers():
    in_process = _fields(_run(RowParallelVerifier(SpeculativeSampling, num_workers=0, chunk_size=5)))
    # each row uses its own generator, seeded from the call's seed and the row index
    seed = seed_from(torch.Generator().manual_seed(11))
    for b in (0, 17, BATCH - 1):
        alone = SpeculativeSampling().verify(DRAFT_TOKENS[b : b + 1], DRAFT_PROBS[b : b + 1], TARGET_PROBS[b : b + 1], row_generator(seed, b))
        assert [f[b] for f in in_process] == [f[0] for f in _fields(alone)]
    with RowParallelVerifier(SpeculativeSampling, num_workers=2, chunk_size=4) as two:
        assert _fields(_run(two)) == in_process
        assert _fields(_run(two, seed=12)) != in_process  # another seed, other draws
    with RowParallelVerifier("speculative", num_workers=1, chunk_size=16) as one:
        assert _fields(_run(one)) == in_process
    assert _fields(RowParallelVerifier(make_speculative, num_workers=0, chunk_size=64).verify(
        DRAFT_TOKENS, DRAFT_PROBS, TARGET_PROBS, torch.Generator().manual_seed(11))) == in_process


def test_a_dead_worker_is_a_clear_error():
    safe = DRAFT_TOKENS.clamp(max=2)
    draft_probs = DRAFT_PROBS.clone()
    draft_probs[..., :3] += 0.01  # tokens 0..2 keep positive draft mass
    draft_probs /= draft_probs.sum(-1, keepdim=True)
    dying = safe.clone()
    dying[20, 0, 0] = 3
    with RowParallelVerifier(DiesOnToken3, num_workers=1, chunk_size=8) as verifier:
        # Which pending chunk the broken pool reports first is a race (rows 8..15 may still be
        # waiting for their result when the worker dies on row 20): the message names one of them.
        with pytest.raises(VerifierError, match=r"dies-on-token-3: a worker process died while verifying rows (8\.\.15|16\.\.23)"):
            verifier.verify(dying, draft_probs, TARGET_PROBS, torch.Generator().manual_seed(0))
        # the pool is rebuilt: the next call works
        out = verifier.verify(safe, draft_probs, TARGET_PROBS, torch.Generator().manual_seed(0))
        assert out.num_accepted.shape == (BATCH,)


def test_worker_exception_names_the_rows():
    tokens = DRAFT_TOKENS.clone()
    tokens[5] = 3
    probs = DRAFT_PROBS.clone()
    probs[..., 3] += 0.01
    probs /= probs.sum(-1, keepdim=True)
    with pytest.raises(VerifierError, match=r"verifying rows 0\.\.9 in a worker raised ZeroDivisionError: token 3"):
        verify_rows(RaisesOnToken3, tokens, probs, TARGET_PROBS, torch.Generator().manual_seed(0), num_workers=1, chunk_size=10)


def test_bad_arguments():
    with pytest.raises(InvalidArgument, match="num_workers: expected an integer >= 0"):
        RowParallelVerifier(SpeculativeSampling, num_workers=-1)
    with pytest.raises(InvalidArgument, match="chunk_size: expected an integer >= 1"):
        RowParallelVerifier(SpeculativeSampling, chunk_size=0)
    with pytest.raises(InvalidArgument, match="factory: expected a verifier name"):
        RowParallelVerifier(3)
    wrapped = RowParallelVerifier(SpeculativeSampling, num_workers=0)
    assert wrapped.name == "speculative" and wrapped.max_drafts == 1 and not wrapped.has_exact_law
