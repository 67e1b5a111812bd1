"""``rounds="auto"``: an audit that runs until its planned power (or a budget), and says which.

The first two rounds run every arm (the agreement tests need them); further rounds run the arm that emitted the
most engine tokens per second of generation, until the all-tokens test has the tokens its minimum detectable TV
needs at its share of alpha in the largest family the planned jobs can give.  Stopping on a token count keeps the
randomized PITs i.i.d. uniform under a correct engine (each is uniform given the past), so the false-alarm rate is
that of a planned audit; a slip is still found.
"""

from __future__ import annotations

import pytest

from spectr_audit.errors import InvalidArgument
from spectr_audit.generation import audit_generation
from spectr_audit.generation.engine_specs import toy_prompts
from spectr_audit.generation.library import ToyPair, correct_engine, slip_engine
from spectr_audit.generation.statistical_tests import NUM_BINS
from spectr_audit.generation.verdict import detail_lines, verdict_line
from spectr_audit.statistical.power import required_samples

VOCAB = 32
PAIR = ToyPair(VOCAB, seed=1)
PROMPTS = toy_prompts(VOCAB)


def _audit(engine=None, **options):
    return audit_generation(engine or correct_engine(PAIR), PAIR.scorer(), PROMPTS, vocab_size=VOCAB, rounds="auto",
                            progress=False, **options)


def test_it_runs_until_the_planned_power_and_no_further():
    result = _audit(min_detectable_tv=0.07)
    plan = result.power_plan
    assert result.verdict == "PASS" and result.stop_reason == "power" and plan["reached"]
    # the tokens needed are the G-test's at the family's share of alpha, and the family built is never larger
    assert plan["tokens_needed"] == required_samples(0.07, NUM_BINS, result.alpha / plan["family_size"], result.power)
    assert len(result.subtests) <= plan["family_size"]
    assert result.min_detectable_tv <= 0.07
    # it stopped at the first job that reached the count
    largest_call = 4 * 32
    assert plan["tokens_needed"] <= result.num_tokens < plan["tokens_needed"] + largest_call
    assert "stopped at the planned power" in verdict_line(result)


def test_the_further_rounds_run_the_fastest_arm_and_the_others_keep_their_first_rounds():
    result = _audit(min_detectable_tv=0.06)
    plan = result.power_plan
    rates = plan["tokens_per_second"]
    assert plan["extension_arm"] == max(rates, key=rates.get) and plan["extension_rounds"] >= 1
    two_rounds = audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, vocab_size=VOCAB, rounds=2,
                                  progress=False)
    for arm, tokens in result.tokens_by_arm.items():
        if arm != plan["extension_arm"]:
            assert tokens == two_rounds.tokens_by_arm[arm], arm
        else:
            assert tokens > two_rounds.tokens_by_arm[arm]


def test_a_budget_ends_it_before_the_power_and_says_so():
    result = _audit(min_detectable_tv=0.05, max_tokens=3000)
    assert result.stop_reason == "max_tokens" and not result.power_plan["reached"]
    assert result.verdict == "INCONCLUSIVE" and result.min_detectable_tv > 0.05
    assert "stopped: max_tokens before the planned power" in verdict_line(result)


def test_a_slip_is_still_found():
    result = _audit(slip_engine("positions-by-block", PAIR), min_detectable_tv=0.05)
    assert result.verdict == "FINDING"


def test_a_planned_audit_reports_no_power_plan():
    result = audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, vocab_size=VOCAB, progress=False)
    assert result.power_plan is None and "power_plan" not in result.to_dict()


@pytest.mark.parametrize("rounds", ["Auto", "automatic", 0, 1.5, True, None])
def test_bad_rounds_are_named(rounds):
    with pytest.raises(InvalidArgument, match=r"^rounds: expected an integer >= 1 or 'auto'"):
        audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, vocab_size=VOCAB, rounds=rounds,
                         progress=False)


def test_a_resumed_audit_plans_the_same_rounds(tmp_path):
    store = str(tmp_path / "store.sqlite")
    first = _audit(min_detectable_tv=0.07, store=store)
    resumed = audit_generation(lambda *a: 1 / 0, PAIR.scorer(), PROMPTS, vocab_size=VOCAB, rounds="auto",
                               min_detectable_tv=0.07, progress=False, store=store, resume=True,
                               name=first.generator, per_row_max_new_tokens=True)
    one, two = first.to_dict(), resumed.to_dict()
    for summary in (one, two):
        summary.pop("seconds")
    assert one == two


def test_the_command_line_says_the_plan_first(capsys):
    from spectr_audit.cli import main

    code = main(["generation", "--engine", "toy", "--rounds", "auto", "--min-detectable-tv", "0.08"])
    captured = capsys.readouterr()
    assert code == 0
    lines = captured.err.splitlines()
    assert lines[0].startswith("spectr-audit generation: plan: min detectable TV 0.08 at power")
    assert "stopped at the planned power" in captured.out.splitlines()[0]


def test_a_suite_case_takes_rounds_auto():
    from spectr_audit.generation.cases import parse_generation_cases

    case = parse_generation_cases([{"name": "c", "engine": "toy", "rounds": "auto", "min_detectable_tv": 0.1}],
                                  "suite.toml")[0]
    assert case.audit_options["rounds"] == "auto"
    with pytest.raises(InvalidArgument, match="rounds: expected an integer >= 1"):
        parse_generation_cases([{"name": "c", "engine": "toy", "rounds": "sometimes"}], "suite.toml")


def test_the_summary_and_the_report_say_how_the_power_was_reached(tmp_path):
    from spectr_audit.generation.verdict import detail_lines, write_reports

    result = _audit(min_detectable_tv=0.07)
    plan = result.power_plan
    line = next(line for line in detail_lines(result) if line.startswith("rounds until the power: "))
    assert f"{plan['tokens_needed']} tokens for TV 0.07" in line and line.endswith("; reached")
    assert f"then {plan['extension_rounds']} of {plan['extension_arm']}" in line or plan["extension_arm"] is None
    write_reports(result, tmp_path)
    assert f"| rounds until the power | {plan['tokens_needed']} tokens" in (tmp_path / "report.md").read_text()
    planned = audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, vocab_size=VOCAB, progress=False)
    assert not any(line.startswith("rounds until the power") for line in detail_lines(planned))


class Counting:
    """The toy reference, counting its calls."""

    per_row_max_new_tokens = True

    def __init__(self):
        self.reference, self.calls = PAIR.reference(), 0

    def __call__(self, prompts, max_new_tokens, seed):
        self.calls += 1
        return self.reference(prompts, max_new_tokens, seed)


def test_the_reference_runs_only_until_its_own_test_has_its_tokens():
    reference = Counting()
    result = _audit(min_detectable_tv=0.05, reference=reference)
    plan, sample = result.power_plan, result.reference_sample
    # the reference sized for twice the TV: about a quarter of the engine's tokens
    assert plan["reference_tv"] == 0.1
    assert plan["reference_tokens_needed"] == required_samples(0.1, NUM_BINS, result.alpha / plan["family_size"],
                                                               result.power)
    assert sample["tokens"] >= plan["reference_tokens_needed"] and sample["jobs"] < sample["of_jobs"]
    assert reference.calls == sample["jobs"] and sample["of_jobs"] == result.num_jobs
    # the two-sample tests compare the engine's tokens of those calls only
    two = next(t for t in result.subtests if t.name == "two-sample probability / all")
    assert two.num_samples == sample["tokens"] + sample["engine_tokens_paired"]
    assert sample["engine_tokens_paired"] < result.num_tokens
    # the first round of every arm, then the further rounds only while its test was short of its tokens
    assert result.verdict == "PASS" and f"the reference on {plan['reference_rounds']} of them" in "\n".join(
        detail_lines(result))
    first = len(PROMPTS) + 2 * (len(PROMPTS) // 4 + 1) + len(PROMPTS)  # round 0: single, equal, ragged, repeated
    per_round = {"single": len(PROMPTS), "repeated": len(PROMPTS)}.get(plan["extension_arm"], len(PROMPTS) // 4 + 1)
    assert first <= sample["jobs"] <= first + plan["reference_rounds"] * per_round
    assert any(line.startswith(f"reference: {sample['tokens']} tokens on {sample['jobs']} of") for line in
               detail_lines(result))
    # asked for the same TV as the engine's, it runs on every further round (and the first round of every arm)
    every = _audit(min_detectable_tv=0.05, reference=PAIR.reference(), reference_tv=0.05)
    assert every.power_plan["reference_rounds"] == every.power_plan["extension_rounds"] > 0


def test_reference_tv_is_for_an_audit_that_runs_until_its_power():
    with pytest.raises(InvalidArgument, match="^reference_tv: sizes the reference"):
        audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, vocab_size=VOCAB, reference=PAIR.reference(),
                         reference_tv=0.1, progress=False)
    with pytest.raises(InvalidArgument, match="^reference_tv: expected"):
        _audit(reference=PAIR.reference(), reference_tv=0.0)
    planned = audit_generation(correct_engine(PAIR), PAIR.scorer(), PROMPTS, vocab_size=VOCAB,
                               reference=PAIR.reference(), progress=False)
    assert planned.reference_sample is None and "reference_sample" not in planned.to_dict()


def test_a_resumed_audit_skips_the_reference_on_the_same_calls(tmp_path):
    store = str(tmp_path / "store.sqlite")
    first = _audit(min_detectable_tv=0.07, reference=PAIR.reference(), store=store)
    resumed = audit_generation(lambda *a: 1 / 0, PAIR.scorer(), PROMPTS, vocab_size=VOCAB, rounds="auto",
                               min_detectable_tv=0.07, progress=False, store=store, resume=True,
                               reference=lambda *a: 1 / 0, name=first.generator, per_row_max_new_tokens=True)
    one, two = first.to_dict(), resumed.to_dict()
    for summary in (one, two):
        summary.pop("seconds")
    assert one == two and one["reference_sample"]["jobs"] < one["num_jobs"]
