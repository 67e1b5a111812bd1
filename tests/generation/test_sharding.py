"""The generation audit sharded over torch.distributed: 1 and 2 processes give the same result.

The audits run in this process and sharded over 2: in the default stage 2 threads whose exchanges
(gather, broadcast) go through a barrier instead of torch.distributed (the audit's own loop,
stopping rules and store, with the records pickled as ``all_gather_object`` does), in the slow
stage 2 local gloo processes (``spawn_local``; starting them costs 10-20 s).  Process w runs
job ``round * 2 + w`` of each round of the schedule; the records are exchanged and every process
consumes them in job order through the same stopping rules, so the verdict, the p-value, every
sub-test and the token counts are equal, bit for bit, whatever the number of processes; the jobs
after a stopping point in the same round are dropped.  The cases: a planned audit (reference and
draft scorer), an e-process stop in the middle of a round, a token budget, a job that fails, and a
store written by rank 0 then resumed in one process.
"""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.generation import audit as audit_module
from spectr_audit.generation import GenerationInterrupted, audit_generation
from spectr_audit.generation.library import ToyPair, correct_engine
from spectr_audit.statistical.sharding import spawn_local

VOCAB = 10
PAIR = ToyPair(vocab_size=VOCAB, seed=8, eos_token_id=4)
SHARP = ToyPair(vocab_size=VOCAB, seed=8, eos_token_id=4, params=SamplingParams(temperature=0.5))
PROMPTS = [[1, 2, 3], [5, 6], [7, 8, 9, 1]]
SETTINGS = dict(vocab_size=VOCAB, max_new_tokens=10, batch_size=2, progress=False, eos_token_id=4)


def _failing_ragged(prompts, max_new_tokens, seed):
    if isinstance(max_new_tokens, list):  # per-row limits: the ragged arm's calls only
        raise RuntimeError("no ragged batches")
    return correct_engine(PAIR).generate(prompts, max_new_tokens, seed)


_failing_ragged.per_row_max_new_tokens = True


def _cases(store: str = None) -> list:
    return [
        ("planned", correct_engine(PAIR), dict(rounds=2, reference=PAIR.reference(), draft_score=PAIR.draft_scorer())),
        ("e-process", correct_engine(SHARP), dict(rounds=6, seed=5)),  # stops mid-round (19 jobs)
        ("max_tokens", correct_engine(PAIR), dict(rounds=3, max_tokens=251)),
        ("failure", _failing_ragged, dict(rounds=1)),
        ("store", correct_engine(PAIR), dict(rounds=2, store=store)),
    ]


def _summary(result) -> dict:
    out = result.to_dict()
    out.pop("seconds")
    return out


def _audits(store: str = None) -> list:
    torch.set_num_threads(1)
    return [_summary(audit_generation(engine, PAIR.scorer(), PROMPTS, **SETTINGS, **{"seed": 3, **extra}))
            for _, engine, extra in _cases(store)]


class _Hub:
    """What the threads of one simulated group share."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.slots = [None] * world_size


class _ThreadGroup:
    """A rank of a group of threads: the audit's ``_Collective`` interface over a barrier."""

    def __init__(self, hub: _Hub, rank: int):
        self.hub, self.rank, self.world_size = hub, rank, hub.world_size

    def gather(self, payload):
        self.hub.barrier.wait()
        self.hub.slots[self.rank] = pickle.dumps(payload)  # what all_gather_object sends
        self.hub.barrier.wait()
        out = [pickle.loads(blob) for blob in self.hub.slots]
        self.hub.barrier.wait()
        return out

    def broadcast(self, payload):
        return self.gather(payload)[0]


def _threaded(fn, world_size: int, *args) -> list:
    """``fn(*args)`` on ``world_size`` threads joined in a simulated group; every rank's value."""
    hub, local = _Hub(world_size), threading.local()
    values, errors = [None] * world_size, []

    def run(rank):
        local.group = _ThreadGroup(hub, rank)
        try:
            values[rank] = fn(*args)
        except BaseException as exc:  # reported below
            errors.append(exc)
            hub.barrier.abort()

    original = audit_module._collective
    audit_module._collective = lambda distributed: getattr(local, "group", None) or original(distributed)
    try:
        threads = [threading.Thread(target=run, args=(rank,), name=f"rank-{rank}") for rank in range(world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        audit_module._collective = original
    if errors:
        raise errors[0]
    return values


def _check(alone: list, sharded: list, tmp_path, store: str) -> None:
    assert [a["num_processes"] for a in alone] == [1] * len(alone)
    assert [a["num_processes"] for a in sharded] == [2] * len(sharded)
    for one, two, (name, _, _) in zip(alone, sharded, _cases()):
        one, two = dict(one), dict(two)
        one.pop("num_processes"), two.pop("num_processes")
        assert (one["verdict"], one["pvalue"], one["num_tokens"]) == (two["verdict"], two["pvalue"],
                                                                       two["num_tokens"]), name
        assert one == two, name
    planned, stopped, budget, failure, _ = alone
    # the cases do what they are there for
    assert planned["stop_reason"] == "planned" and planned["num_jobs"] == 20
    assert stopped["stop_reason"] == "e-process" and stopped["num_jobs"] % 2 == 1  # mid-round
    assert budget["stop_reason"] == "max_tokens" and budget["num_tokens"] >= 251 and budget["num_jobs"] % 2 == 1
    assert len(failure["failures"]) == 2 and failure["tokens_by_arm"]["ragged"] == 0
    # rank 0 wrote every job to its store: resumed in one process, nothing is left to run
    resumed = audit_generation(lambda *a: 1 / 0, PAIR.scorer(), PROMPTS, store=store, resume=True,
                               per_row_max_new_tokens=True, name="toy speculative", **SETTINGS, rounds=2, seed=3)
    assert resumed.failures == () and _summary(resumed) == alone[-1]


def test_one_and_two_ranks_give_the_same_audit(tmp_path):
    alone = _audits(str(tmp_path / "alone.sqlite"))
    values = _threaded(_audits, 2, str(tmp_path / "sharded.sqlite"))
    assert values[0] == values[1]  # every rank gets the same result
    _check(alone, values[0], tmp_path, str(tmp_path / "sharded.sqlite"))


def test_a_refused_resumption_is_refused_on_every_rank(tmp_path):
    path = str(tmp_path / "audit.sqlite")
    audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, store=path, **SETTINGS, seed=3)

    def resume_other_seed():
        try:
            audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, store=path, resume=True, **SETTINGS,
                             seed=4)
        except Exception as exc:  # noqa: BLE001 - compared below
            return str(exc)

    messages = _threaded(resume_other_seed, 2)
    assert messages[0] == messages[1] and "seed differ" in messages[0]


def test_ctrl_c_in_one_rank_interrupts_every_rank_at_the_same_job(tmp_path):
    path = str(tmp_path / "audit.sqlite")

    def interrupted_in_rank_1():
        calls = {"n": 0}
        engine = correct_engine(PAIR)

        def generate(prompts, max_new_tokens, seed):
            calls["n"] += 1
            if threading.current_thread().name == "rank-1" and calls["n"] == 3:  # job 5 of the schedule
                raise KeyboardInterrupt
            return engine.generate(prompts, max_new_tokens, seed)

        generate.per_row_max_new_tokens = True
        try:
            audit_generation(generate, PAIR.scorer(), PROMPTS, store=path, **SETTINGS, seed=3, rounds=2)
        except GenerationInterrupted as exc:
            return _summary(exc.result)

    values = _threaded(interrupted_in_rank_1, 2)
    assert values[0] == values[1] and values[0]["incomplete"] and values[0]["num_jobs"] == 5
    resumed = audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, store=path, resume=True, **SETTINGS,
                               seed=3, rounds=2)
    full = audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, **SETTINGS, seed=3, rounds=2)
    assert _summary(resumed) == _summary(full)


@pytest.mark.slow
def test_one_and_two_gloo_processes_give_the_same_audit(tmp_path):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    alone = _audits(str(tmp_path / "alone.sqlite"))
    sharded = spawn_local(_audits, 2, str(tmp_path / "sharded.sqlite"))
    _check(alone, sharded, tmp_path, str(tmp_path / "sharded.sqlite"))
