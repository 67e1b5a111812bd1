"""Serving conditions: engine settings the generation audit runs as arms of their own, each a stratum, each shown
reached or said not reached.

The designs are checked against what each condition must reach (a follow-up call after a cache hit, prompts
tiled past the chunk budget or the context length, many rows in one call); the audit's plumbing against a
recording engine (the follow-up's prompts are the first pass's rows followed by what they emitted, the counters
the engine reports are summed per condition); the verdict against conditions not reached (never a PASS); the
toy's planted serving slips are found under their condition and the correct loop under the same is not.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from spectr_audit.errors import InvalidArgument
from spectr_audit.generation import audit_generation
from spectr_audit.generation.analysis import largest_family
from spectr_audit.generation.conditions import condition_reached, parse_condition, tiled
from spectr_audit.generation.contract import GenerationContractError, GenerationOutput, as_generator
from spectr_audit.generation.designs import ARMS, plan_jobs
from spectr_audit.generation.engine_specs import TOY_CONDITIONS, audit_engine, load_generation_engine
from spectr_audit.generation.library import ToyPair, correct_engine
from spectr_audit.generation.library.serving import serving_engine
from spectr_audit.generation.records import JobRecord
from spectr_audit.generation.request import GenerationRequest
from spectr_audit.generation.verdict import detail_lines, verdict_line

VOCAB = 12
PAIR = ToyPair(VOCAB, seed=0)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2, 2], [3], [10, 11]]

# name -> (kind, value), as parse_condition reads it
NAMES = {
    "prefix-cache": ("prefix-cache", None),
    "chunked-prefill": ("chunked-prefill", 64),
    "chunked-prefill=256": ("chunked-prefill", 256),
    "preemption": ("preemption", None),
    "concurrency": ("concurrency", None),
    "draft-depth=1": ("draft-depth", 1),
    "draft-depth=7": ("draft-depth", 7),
    "long-context": ("long-context", 1000),
    "long-context=4096": ("long-context", 4096),
}
BAD_NAMES = ["", "prefix", "draft-depth", "draft-depth=0", "preemption=3", "long-context=1", "draft-depth=x", 3]


@pytest.mark.parametrize("name", NAMES)
def test_condition_names_read_as_their_kind_and_value(name):
    condition = parse_condition(name)
    assert (condition.kind, condition.value) == NAMES[name]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_bad_condition_name_is_refused_naming_the_argument(name):
    with pytest.raises(InvalidArgument, match="^conditions: "):
        parse_condition(name)


# (condition, counters, long tokens) -> reached
REACHED = [
    ("preemption", {"preemptions": 3}, 0, True),
    ("preemption", {"preemptions": 0}, 0, False),
    ("preemption", {"cached_tokens": 5}, 0, None),
    ("preemption", None, 0, None),
    ("prefix-cache", {"cached_tokens": 1}, 0, True),
    ("chunked-prefill", {"chunked_prompts": 0}, 0, False),
    ("concurrency", {"joined_running": 2}, 0, True),
    ("draft-depth=4", {"draft_depth": 4}, 0, True),
    ("draft-depth=4", {"draft_depth": 3}, 0, False),
    ("long-context", None, 12, True),
    ("long-context", {"preemptions": 9}, 0, False),
]


@pytest.mark.parametrize("name, stats, long_tokens, expected", REACHED)
def test_a_condition_is_reached_only_when_the_counters_show_it(name, stats, long_tokens, expected):
    reached, words = condition_reached(parse_condition(name), stats, long_tokens)
    assert reached is expected and words


def _plan(names, per_row=False, rounds=1):
    conditions = [parse_condition(n) for n in names]
    return plan_jobs(PROMPTS, batch_size=4, rounds=rounds, max_new_tokens=8, seed=3, per_row_max_new_tokens=per_row,
                     conditions=conditions)


def test_each_condition_runs_on_the_design_that_reaches_its_state():
    jobs = [j for j in _plan(["prefix-cache", "chunked-prefill=20", "preemption", "concurrency", "draft-depth=2",
                              "long-context=50"]) if j.is_condition]
    by = {}
    for job in jobs:
        by.setdefault(job.arm, []).append(job)
    # prefix caching: every row twice, the second half the follow-ups of the first
    for job in by["prefix-cache"]:
        half = len(job.prompts) // 2
        assert job.follow_up and job.prompt_ids[:half] == job.prompt_ids[half:] and job.prompts[:half] == job.prompts[half:]
    assert sorted(i for j in by["prefix-cache"] for i in j.prompt_ids[: len(j.prompt_ids) // 2]) == list(range(6))
    # chunked prefill: every other row tiled past the chunk budget, the others as they are
    for job in by["chunked-prefill=20"]:
        for k, (i, rows) in enumerate(zip(job.prompt_ids, job.prompts)):
            assert rows == (tiled(PROMPTS[i], 20) if k % 2 == 0 else tuple(PROMPTS[i]))
    # preemption and concurrency: many rows in one call
    for name in ("preemption", "concurrency"):
        assert len(by[name]) == 1 and len(by[name][0].prompts) >= 8
    # a draft depth: the ragged arm's batches
    ragged = [j.prompt_ids for j in _plan([]) if j.arm == "ragged"]
    assert [j.prompt_ids for j in by["draft-depth=2"]] == ragged
    # long contexts: every prompt tiled to the context length
    for job in by["long-context=50"]:
        assert all(len(rows) == 50 and rows[: len(PROMPTS[i])] == tuple(PROMPTS[i])
                   for i, rows in zip(job.prompt_ids, job.prompts))


def test_conditions_run_after_the_arms_in_every_round_with_seeds_of_their_own():
    jobs = _plan(["preemption", "draft-depth=3"], rounds=2)
    assert [j.index for j in jobs] == list(range(len(jobs)))
    for r in range(2):
        arms = [j.arm for j in jobs if j.round == r]
        first_condition = next(k for k, a in enumerate(arms) if a not in ARMS)
        assert all(a in ARMS for a in arms[:first_condition]) and all(a not in ARMS for a in arms[first_condition:])
    assert len({j.seed for j in jobs}) == len(jobs)
    assert [j.case for j in jobs if j.arm == "preemption"][0].startswith("condition preemption, round 0")


class Recording:
    """The correct toy loop, recording its calls and reporting the counters it is given."""

    per_row_max_new_tokens = True

    def __init__(self, stats=None):
        self.engine, self.calls, self.stats = correct_engine(PAIR), [], stats

    def __call__(self, prompts, max_new_tokens, seed):
        out = self.engine.generate(prompts, max_new_tokens, seed)
        self.calls.append(([list(p) for p in prompts], out.continuations))
        return GenerationOutput(out.continuations, stats=None if self.stats is None else dict(self.stats))


def _audit(conditions, **options):
    settings = dict(vocab_size=VOCAB, max_new_tokens=8, progress=False, arms=("single",))
    settings.update(options)
    return audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, conditions=conditions, **settings)


def test_a_follow_up_call_extends_each_row_by_what_the_first_call_emitted():
    engine = Recording({"cached_tokens": 7})
    result = _audit({"prefix-cache": engine})
    assert len(engine.calls) == 2 * result.conditions[0]["jobs"]
    for (prompts, emitted), (follow_ups, _) in zip(engine.calls[::2], engine.calls[1::2]):
        assert follow_ups == [p + c for p, c in zip(prompts, emitted)]
    # the counters of the follow-ups are summed; the stratum holds the follow-ups' tokens only
    row = result.conditions[0]
    assert row["stats"] == {"cached_tokens": 7 * row["jobs"]} and row["reached"] is True
    assert row["tokens"] == sum(len(c) for _, emitted in engine.calls[1::2] for c in emitted)


def test_a_condition_not_reached_keeps_the_verdict_from_pass():
    result = _audit({"preemption": Recording({"preemptions": 0}), "concurrency": Recording()},
                    min_detectable_tv=0.9)
    status = {c["name"]: c["status"] for c in result.conditions}
    assert status == {"preemption": "NOT REACHED", "concurrency": "NOT SHOWN"}
    assert result.verdict == "INCONCLUSIVE" and result.min_detectable_tv <= 0.9
    line = verdict_line(result)
    assert "conditions not shown reached: preemption, concurrency" in line and "above the planned" not in line
    assert any(d.startswith("condition preemption: NOT REACHED") for d in detail_lines(result))
    # reached, the same audit passes
    reached = _audit({"preemption": Recording({"preemptions": 2}), "concurrency": Recording({"joined_running": 1})},
                     min_detectable_tv=0.9, max_new_tokens=32)
    assert reached.verdict == "PASS" and {c["status"] for c in reached.conditions} == {"PASS"}


def test_long_contexts_are_counted_by_the_audit():
    result = _audit({"long-context=40": Recording()}, max_new_tokens=6)
    row = result.conditions[0]
    assert row["reached"] is True and row["how"].startswith(f"{row['tokens']} tokens at positions >= 40")


def test_a_condition_generator_must_report_counters_as_integers():
    bad = as_generator(lambda p, m, s: GenerationOutput([[1]] * len(p), stats={"preemptions": -1}))
    with pytest.raises(GenerationContractError, match=r"stats\['preemptions'\] must be an integer >= 0"):
        bad([[1]], 2, 0, vocab_size=VOCAB, case="x")
    with pytest.raises(GenerationContractError, match="stats must be a mapping"):
        as_generator(lambda p, m, s: GenerationOutput([[1]] * len(p), stats=[1]))([[1]], 2, 0, vocab_size=VOCAB,
                                                                                   case="x")


def test_bad_conditions_are_refused_before_any_engine_call():
    with pytest.raises(InvalidArgument, match="conditions: expected a mapping"):
        _audit(["preemption"])
    with pytest.raises(InvalidArgument, match=r"conditions\['preemption'\]: expected the engine"):
        _audit({"preemption": 3})
    with pytest.raises(InvalidArgument, match="conditions: unknown condition 'preempt'"):
        _audit({"preempt": Recording()})


# the toy's serving slips at the budgets docs/generation.md states (rounds of the slip's own conditions)
SLIP_BUDGETS = {"preempt-drops-last-step": 1, "stale-prefix-block": 16, "long-context-offset": 64}


@pytest.mark.parametrize("slip", SLIP_BUDGETS)
def test_a_serving_slip_is_found_in_its_condition_and_the_correct_loop_is_not(slip):
    engine = load_generation_engine(f"toy:{slip}")
    result = audit_engine(engine, rounds=SLIP_BUDGETS[slip])
    condition = engine.default_conditions[0]
    assert result.verdict == "FINDING" and result.test.endswith(f"/ condition {condition}"), verdict_line(result)
    assert result.conditions[0]["status"] == "FINDING" and result.conditions[0]["reached"] is True
    correct = audit_engine(load_generation_engine("toy"), rounds=SLIP_BUDGETS[slip], conditions=[condition])
    assert correct.verdict != "FINDING", verdict_line(correct)


@pytest.mark.slow
def test_the_depth_slip_is_found_at_depth_5_only():
    result = audit_engine(load_generation_engine("toy:deep-draft-offset"), rounds=64)
    status = {c["name"]: c["status"] for c in result.conditions}
    assert result.verdict == "FINDING" and status["draft-depth=5"] == "FINDING"
    assert all(status[f"draft-depth={d}"] == "PASS" for d in (1, 2, 3))


def test_the_family_plan_counts_the_conditions_strata():
    request = GenerationRequest.build(correct_engine(PAIR), PAIR.scorer(), PROMPTS, vocab_size=VOCAB,
                                      conditions={"preemption": Recording(), "prefix-cache": Recording()},
                                      max_new_tokens=32, batch_size=4, rounds=1, arms=("single", "ragged"), seed=0,
                                      alpha=1e-3, power=0.8, min_detectable_tv=0.1, orderings=None,
                                      position_buckets=(16, 64), zero_mass_tol=0.0, logit_tol=1.0, max_tokens=None,
                                      max_seconds=None, timeout=None, eos_token_id=None, allow_failed_calls=0)
    plan = largest_family(request)
    assert "condition preemption" in plan.strata and "condition prefix-cache" in plan.strata
    result = audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, vocab_size=VOCAB, max_new_tokens=32,
                              arms=("single", "ragged"), progress=False,
                              conditions={"preemption": Recording(), "prefix-cache": Recording()})
    built = {t.name for t in result.subtests}
    assert built <= set(plan.tests()) | {"support"}
    assert {"pit probability / condition preemption", "surprisal / condition prefix-cache"} <= built


def test_the_counters_survive_the_store_and_a_resumed_audit_reads_them(tmp_path):
    from spectr_audit.generation.records import SourceRecord, TokenColumns

    source = SourceRecord(*(np.zeros(0, dtype=np.int64) for _ in range(5)), TokenColumns.empty(("probability",)))
    rec = JobRecord(source, np.zeros(1), np.zeros(1), np.zeros(3), stats={"preemptions": 4, "draft_depth": 2})
    assert JobRecord.from_stored(rec.to_stored()).stats == {"preemptions": 4, "draft_depth": 2}
    assert JobRecord.from_stored(JobRecord(source, np.zeros(1), np.zeros(1), np.zeros(3)).to_stored()).stats is None
    path = tmp_path / "audit.sqlite"
    first = _audit({"preemption": Recording({"preemptions": 3})}, store=str(path))
    resumed = _audit({"preemption": Recording({"preemptions": 3})}, store=str(path), resume=True)
    assert resumed.conditions == first.conditions and resumed.conditions[0]["stats"] == {
        "preemptions": 3 * first.conditions[0]["jobs"]}


def test_the_toy_offers_every_condition_and_a_factory_its_own():
    toy = load_generation_engine("toy")
    made = toy.conditions_for(["all"])
    assert tuple(made) == TOY_CONDITIONS
    assert made["draft-depth=5"].draft_len == 5 and made["prefix-cache"].prefix_cache
    with pytest.raises(InvalidArgument, match="conditions: unknown condition"):
        toy.conditions_for(["prefetch"])
    factory = load_generation_engine("tests.generation.test_conditions:_factory")
    assert set(factory.conditions_for(["preemption"])) == {"preemption"}
    with pytest.raises(InvalidArgument, match="does not offer 'prefix-cache'; it offers preemption"):
        factory.conditions_for(["prefix-cache"])
    bare = load_generation_engine("tests.generation.test_conditions:_bare_factory")
    with pytest.raises(InvalidArgument, match="offers no serving conditions"):
        bare.conditions_for(["preemption"])
    assert bare.conditions_for(None) is None


def _factory():
    return {"generate": correct_engine(PAIR), "score": PAIR.scorer(), "vocab_size": VOCAB, "prompts": PROMPTS,
            "conditions": {"preemption": serving_engine(PAIR, "preemption")}}


def _bare_factory():
    return {"generate": correct_engine(PAIR), "score": PAIR.scorer(), "vocab_size": VOCAB, "prompts": PROMPTS}


def test_the_command_line_runs_conditions_and_says_what_each_reached(capsys, tmp_path):
    from spectr_audit.cli import main

    code = main(["generation", "--engine", "toy", "--conditions", "preemption,draft-depth=2", "--out",
                 str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "condition preemption: PASS" in out and "condition draft-depth=2: PASS" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert [c["name"] for c in report["conditions"]] == ["preemption", "draft-depth=2"]
    markdown = (tmp_path / "report.md").read_text()
    assert "## Serving conditions" in markdown and "| preemption | PASS |" in markdown
    assert 'id="conditions"' in (tmp_path / "report.html").read_text()
    assert main(["generation", "--engine", "toy:preempt-drops-last-step"]) == 1
    assert "condition preemption: FINDING" in capsys.readouterr().out
    assert main(["generation", "--engine", "toy", "--conditions", "preempt"]) == 2
    assert "conditions: unknown condition 'preempt'" in capsys.readouterr().err


def test_a_suite_case_takes_conditions():
    from spectr_audit.generation.cases import parse_generation_cases

    case = parse_generation_cases([{"name": "c", "engine": "toy", "conditions": ["preemption", "draft-depth=5"]}],
                                  "suite.toml")[0]
    assert case.audit_options["conditions"] == ("preemption", "draft-depth=5")
    with pytest.raises(InvalidArgument, match=r"suite.toml generation\[0\] \('c'\): conditions: unknown condition"):
        parse_generation_cases([{"name": "c", "engine": "toy", "conditions": ["prefetch"]}], "suite.toml")
    slip = parse_generation_cases([{"name": "s", "engine": "toy:stale-prefix-block"}], "suite.toml")[0]
    assert slip.expected == "finding"


class Dying:
    """An engine under a condition that fails on every call (an engine core that dies)."""

    per_row_max_new_tokens = True

    def __call__(self, prompts, max_new_tokens, seed):
        raise RuntimeError("EngineDeadError: the engine core died")


def test_a_condition_whose_every_call_fails_says_so():
    result = _audit({"chunked-prefill": Dying(), "preemption": Recording({"preemptions": 1})},
                    max_new_tokens=32, min_detectable_tv=0.9)
    row = {c["name"]: c for c in result.conditions}["chunked-prefill"]
    assert row["status"] == "ERROR" and row["failed_calls"] == len([f for f in result.failures if "chunked" in f])
    assert row["how"].startswith(f"every call failed ({row['failed_calls']}); the first:") and "engine core died" in row["how"]
    assert result.verdict == "ERROR"  # no failed call allowed
    allowed = _audit({"chunked-prefill": Dying(), "preemption": Recording({"preemptions": 1})},
                     max_new_tokens=32, min_detectable_tv=0.9, allow_failed_calls=10)
    assert allowed.verdict == "INCONCLUSIVE" and "chunked-prefill" in verdict_line(allowed)
