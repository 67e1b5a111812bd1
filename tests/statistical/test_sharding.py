"""Sampling sharded over torch.distributed: the same counts and verdicts for 1 and 2 processes.

The audits run in 2 local gloo processes (``spawn_local``, localhost) and in this process; every
count (their digest), statistic, p-value, interval and stopping point must be equal, bit for
bit.  The designs cover the ordered path (the main design, replayed chunk by chunk through the
e-process and the certification, stopping in the middle of a round) and the summed one (the
stratified design).
"""

from __future__ import annotations

import math

import pytest
import torch

from spectr_audit.drafting.models import ContextFreeModel
from spectr_audit.errors import InvalidArgument
from spectr_audit.statistical import sharding
from spectr_audit.statistical.sharding import chunk_generator, chunk_seed, run_chunks, spawn_local

DRAFT = ContextFreeModel([0.1, 0.2, 0.3, 0.4])
TARGET = ContextFreeModel([0.4, 0.3, 0.2, 0.1])

#: (verifier, K, keyword arguments): a planned stratified audit (summed path), an e-process stop
#: mid-round on a broken verifier, a certification that stops when certified, and a budget cut.
AUDITS = (
    ("kseq", 2, dict(num_samples=12_000)),
    ("broken:always-accept", 2, dict(num_samples=60_000)),
    ("kseq", 2, dict(certify_tv=0.1)),
    ("speculative", 1, dict(max_samples=9_000, stratify=False)),
)

#: Fields that depend on the machine, not on the counts.
_TIMING = ("seconds", "verifications_per_second", "num_processes")


def _audits() -> list[dict]:
    from spectr_audit.registry import load_verifier
    from spectr_audit.statistical.audit import statistical_audit

    out = []
    for name, num_drafts, kwargs in AUDITS:
        result = statistical_audit(load_verifier(name), DRAFT, TARGET, num_drafts, 1, seed=7, chunk_size=1024, **kwargs)
        summary = {k: v for k, v in result.to_dict().items() if k not in _TIMING}
        summary["num_processes"] = result.num_processes
        out.append(summary)
    return out


def test_chunk_streams_are_indexed_by_seed_stream_and_chunk():
    seeds = {chunk_seed(seed, stream, index) for seed in range(3) for stream in range(3) for index in range(50)}
    assert len(seeds) == 450 and all(0 <= s < 2**63 for s in seeds)
    first = torch.rand(4, generator=chunk_generator(5, 1, 3))
    assert torch.equal(first, torch.rand(4, generator=chunk_generator(5, 1, 3)))
    assert not torch.equal(first, torch.rand(4, generator=chunk_generator(5, 1, 4)))


def test_run_chunks_alone_consumes_in_order_and_stops_after_the_chunk_that_asks():
    seen = []

    def compute(index, offset, size):
        return torch.tensor([float(index), float(offset), float(size)])

    def consume(index, offset, size, stats):
        seen.append(tuple(int(x) for x in stats))
        return "enough" if index == 2 else None

    assert run_chunks([4, 4, 8, 8], compute, consume) == (16, "enough")
    assert seen == [(0, 0, 4), (1, 4, 4), (2, 8, 8)]
    assert run_chunks([3, 5], compute, lambda *a: None) == (8, "planned")


def test_one_and_two_gloo_processes_give_bit_identical_audits():
    pytest.importorskip("torch.distributed")
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    alone = _audits()
    sharded = spawn_local(_audits, 2)
    assert [a["num_processes"] for a in alone] == [1] * len(AUDITS)
    assert [a["num_processes"] for a in sharded] == [2] * len(AUDITS)
    for one, two, (name, _, kwargs) in zip(alone, sharded, AUDITS):
        one.pop("num_processes"), two.pop("num_processes")
        assert one == two, (name, kwargs)
    # the cases do what they are there for
    stratified, stopped, certified, budget = alone
    assert any(t["name"] == "stratified-pearson" for t in stratified["subtests"])
    assert stopped["stop_reason"] == "e-process" and stopped["num_samples"] < 60_000
    assert certified["certification"] == "certified" and certified["stop_reason"] == "certified"
    assert budget["stop_reason"] == "max_samples" and budget["num_samples"] == 9_000
    assert budget["verdict"] == "INCONCLUSIVE" and math.isfinite(budget["tv_estimate"])


def test_audits_in_one_process_ignore_an_uninitialised_group_and_reject_bad_values():
    assert sharding.current_shards("auto") is None and sharding.current_shards(False) is None
    with pytest.raises(InvalidArgument, match="distributed: True needs"):
        sharding.current_shards(True)
    with pytest.raises(InvalidArgument, match="num_processes"):
        spawn_local(_audits, 0)
