"""The sample store: an interrupted or crashed audit resumes to exactly the uninterrupted one's result.

Ctrl-C is planted as a ``KeyboardInterrupt`` raised from inside the generator after ``k`` calls:
:func:`audit_generation` then raises :class:`GenerationInterrupted` whose ``.result`` covers the
``k`` finished jobs and is marked incomplete.  Resumed with ``store=path, resume=True`` (and a
generator that is not interrupted) the audit runs only the other jobs and reaches the very same
result as an uninterrupted run with the same seed: verdict, p-value, every sub-test, token counts
(everything but the timings).  Resuming with other settings is refused.
"""

from __future__ import annotations

import sqlite3

import pytest

from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.errors import InvalidArgument
from spectr_audit.generation import GenerationInterrupted, audit_generation
from spectr_audit.generation.library import ToyPair, correct_engine

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 12
PAIR = ToyPair(vocab_size=VOCAB, seed=4, eos_token_id=5)
#: the same target sampled at temperature 0.5: too sharp for PAIR's scorer, and the e-process stops early
SHARP = ToyPair(vocab_size=VOCAB, seed=4, eos_token_id=5, params=SamplingParams(temperature=0.5))
#: greedy (temperature 0): the audit detects it from the laws, on the replayed jobs too
GREEDY = ToyPair(vocab_size=VOCAB, seed=4, eos_token_id=5, params=SamplingParams(temperature=0.0))
PROMPTS = [[1, 2, 3], [4, 6], [7, 8, 9, 10]]
SETTINGS = dict(vocab_size=VOCAB, max_new_tokens=12, batch_size=2, rounds=2, seed=11, progress=False,
                eos_token_id=5)
#: 3 single + 2 equal + 2 ragged + 3 repeated jobs per round, 2 rounds
NUM_JOBS = 20


def _summary(result) -> dict:
    out = result.to_dict()
    out.pop("seconds")
    return out


class Interrupting:
    """The engine, with Ctrl-C (or another exception) raised from inside its ``call``-th call."""

    per_row_max_new_tokens = True

    def __init__(self, engine, call: int, error: type = KeyboardInterrupt):
        self.engine, self.call, self.error, self.calls = engine, call, error, 0
        self.name = engine.name

    def generate(self, prompts, max_new_tokens, seed):
        self.calls += 1
        if self.calls == self.call:
            raise self.error()
        return self.engine.generate(prompts, max_new_tokens, seed)


class Counting(Interrupting):
    def __init__(self, engine):
        super().__init__(engine, call=-1)


def _stored_jobs(path) -> set:
    with sqlite3.connect(str(path)) as db:
        return {row[0] for row in db.execute("SELECT job FROM jobs")}


CASES = {
    # (engine, extra settings): a correct loop with every arm and an end of sequence; an engine the
    # e-process stops early (the resumed audit must stop at the same job); reference and draft scorer
    "correct": (lambda: correct_engine(PAIR), {}),
    "e-process stop": (lambda: correct_engine(SHARP), dict(rounds=6)),
    "reference and draft": (lambda: correct_engine(PAIR), dict(reference=PAIR.reference(),
                                                               draft_score=PAIR.draft_scorer())),
    "greedy": (lambda: correct_engine(GREEDY), dict(reference=GREEDY.reference(), scorer=GREEDY.scorer())),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("k", [2, 9])
def test_an_interrupted_audit_resumes_to_the_uninterrupted_result(tmp_path, case, k):
    make, extra = CASES[case]
    settings = {**SETTINGS, **extra}
    scorer = settings.pop("scorer", PAIR.scorer())
    full = audit_generation(make(), scorer, PROMPTS, **settings)
    assert not full.incomplete and full.num_jobs > k
    assert full.greedy == (case == "greedy")
    path = tmp_path / "audit.sqlite"
    with pytest.raises(GenerationInterrupted) as caught:
        audit_generation(Interrupting(make(), call=k + 1), scorer, PROMPTS, store=str(path), **settings)
    partial = caught.value.result
    assert partial.incomplete and partial.stop_reason == "interrupted"
    assert partial.num_jobs == k and _stored_jobs(path) == set(range(k))
    assert 0 < partial.num_tokens < full.num_tokens
    counting = Counting(make())
    resumed = audit_generation(counting, scorer, PROMPTS, store=str(path), resume=True, **settings)
    assert counting.calls == full.num_jobs - k  # only the jobs the first run did not finish
    assert (resumed.verdict, resumed.pvalue, resumed.test, resumed.num_tokens) == \
        (full.verdict, full.pvalue, full.test, full.num_tokens)
    assert _summary(resumed) == _summary(full)
    # resuming a finished audit runs nothing and gives the same result again
    again = audit_generation(Interrupting(make(), call=1, error=AssertionError), scorer, PROMPTS,
                             store=str(path), resume=True, **settings)
    assert _summary(again) == _summary(full)


def test_the_e_process_case_does_stop_early():
    make, extra = CASES["e-process stop"]
    result = audit_generation(make(), PAIR.scorer(), PROMPTS, **{**SETTINGS, **extra})
    assert result.verdict == "FINDING" and result.stop_reason == "e-process"
    assert 9 < result.num_jobs < NUM_JOBS * 3  # after the interruptions above, before the plan's end


def test_a_crash_inside_the_generator_keeps_the_finished_jobs(tmp_path):
    full = audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, **SETTINGS)
    path = tmp_path / "audit.sqlite"
    # an exception of the engine: its job fails, the others are scored and stored
    crashed = audit_generation(Interrupting(correct_engine(PAIR), call=4, error=RuntimeError), PAIR.scorer(),
                               PROMPTS, store=str(path), **SETTINGS)
    assert len(crashed.failures) == 1 and crashed.failures[0].startswith("job 3 (equal): generator raised")
    assert _stored_jobs(path) == set(range(NUM_JOBS)) - {3}
    counting = Counting(correct_engine(PAIR))
    resumed = audit_generation(counting, PAIR.scorer(), PROMPTS, store=str(path), resume=True, **SETTINGS)
    assert counting.calls == 1 and resumed.failures == ()  # the failed job, retried
    assert _summary(resumed) == _summary(full)
    # an exception that ends the process (SystemExit) leaves the finished jobs in the store
    path = tmp_path / "exit.sqlite"
    with pytest.raises(SystemExit):
        audit_generation(Interrupting(correct_engine(PAIR), call=7, error=SystemExit), PAIR.scorer(), PROMPTS,
                         store=str(path), **SETTINGS)
    assert _stored_jobs(path) == set(range(6))
    resumed = audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, store=str(path), resume=True,
                               **SETTINGS)
    assert _summary(resumed) == _summary(full)


OTHER_SETTINGS = [
    ("seed", dict(seed=12)),
    ("max_new_tokens", dict(max_new_tokens=8)),
    ("rounds", dict(rounds=3)),
    ("arms", dict(arms=("single", "ragged"))),
    ("alpha", dict(alpha=0.01)),
    ("eos_token_id", dict(eos_token_id=None)),
    ("prompts", dict(prompts=PROMPTS[:2])),
    ("reference", dict(reference=PAIR.reference())),
    ("draft_scorer", dict(draft_score=PAIR.draft_scorer())),
    ("per_row_max_new_tokens", dict(per_row_max_new_tokens=False)),
]


@pytest.mark.parametrize("differs, change", OTHER_SETTINGS, ids=[name for name, _ in OTHER_SETTINGS])
def test_resuming_with_other_settings_is_refused(tmp_path, differs, change):
    path = tmp_path / "audit.sqlite"
    with pytest.raises(GenerationInterrupted):
        audit_generation(Interrupting(correct_engine(PAIR), call=3), PAIR.scorer(), PROMPTS, store=str(path),
                         **SETTINGS)
    settings = {**SETTINGS, "prompts": PROMPTS, **change}
    prompts = settings.pop("prompts")
    with pytest.raises(InvalidArgument, match=rf"^resume: the store .* \(.*{differs}.*differ\)"):
        audit_generation(correct_engine(PAIR), PAIR.scorer(), prompts, store=str(path), resume=True, **settings)
    assert _stored_jobs(path) == {0, 1}  # the refused resumption left the store as it was


def test_resume_needs_a_store_and_a_fresh_start_replaces_it(tmp_path):
    with pytest.raises(InvalidArgument, match="^resume: nothing to resume"):
        audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, store=str(tmp_path / "none.sqlite"),
                         resume=True, **SETTINGS)
    path = tmp_path / "audit.sqlite"
    with pytest.raises(GenerationInterrupted):
        audit_generation(Interrupting(correct_engine(PAIR), call=3), PAIR.scorer(), PROMPTS, store=str(path),
                         **SETTINGS)
    # without resume an existing store is started afresh (other settings are fine then)
    other = {**SETTINGS, "seed": 99}
    pair = ToyPair(vocab_size=VOCAB, seed=4, eos_token_id=5, params=SamplingParams(temperature=0.8))
    result = audit_generation(correct_engine(pair), pair.scorer(), PROMPTS, store=str(path), **other)
    assert not result.incomplete and _stored_jobs(path) == set(range(NUM_JOBS))
