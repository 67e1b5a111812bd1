"""Degenerate and hostile inputs across every built-in verifier and every entry point.

Each built-in verifier (found through the registry, so new ones are covered
automatically) is run on degenerate distributions; the exact audit must stay
exact for verifiers that claim exactness in one iteration, nothing may be NaN,
and meaningless inputs must raise a clear :class:`InvalidArgument`.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from spectr_audit.cli import main
from spectr_audit.contract.verifier import FunctionVerifier, Verifier, check_verify_output
from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.drafting.models import ContextFreeModel
from spectr_audit.contract.randomness import InjectedUniforms
from spectr_audit.registry import builtin_names, load_verifier
from spectr_audit.run.runner import run_suite
from spectr_audit.run.suite import Case, Suite

JUST_BELOW_ONE = 1 - 2**-53


def single_iteration_exact(verifier: Verifier) -> bool:
    """Verifiers that claim exactness within one iteration (no declared loss, no carried repair)."""
    from spectr_audit.contract.correction import has_carried_correction

    return verifier.expected != "inexact" and not has_carried_correction(verifier)


@dataclasses.dataclass(frozen=True)
class Degenerate:
    name: str
    draft: tuple
    target: tuple


DEGENERATE = [
    Degenerate("disjoint supports (beta = 0)", (1.0, 0.0, 0.0), (0.0, 0.5, 0.5)),
    Degenerate("draft = target", (0.2, 0.3, 0.5), (0.2, 0.3, 0.5)),
    Degenerate("one-hot target (temperature 0)", (0.2, 0.3, 0.5), (0.0, 1.0, 0.0)),
    Degenerate("one-hot draft", (0.0, 1.0, 0.0), (0.2, 0.3, 0.5)),
    Degenerate("residual mass 1e-30", (0.5, 0.5 - 1e-30, 1e-30), (0.5, 0.5, 0.0)),
    Degenerate("residual mass 1e-17", (0.5 - 1e-17, 0.5 + 1e-17), (0.5, 0.5)),
    Degenerate("V = 1", (1.0,), (1.0,)),
    Degenerate("K > V", (0.7, 0.3), (0.4, 0.6)),
    Degenerate("near uniform", (0.3333333, 0.3333334, 0.3333333), (0.3333334, 0.3333333, 0.3333333)),
]


def _shapes(verifier: Verifier, vocab_size: int, max_nodes: int = 27):
    for num_drafts in (1, 2, 3):
        for draft_len in (1, 2, 3):
            if verifier.supports(num_drafts, draft_len) and vocab_size**draft_len <= max_nodes:
                yield num_drafts, draft_len


@pytest.mark.parametrize("name", builtin_names())
@pytest.mark.parametrize("case", DEGENERATE, ids=lambda c: c.name)
def test_degenerate_distributions(name, case):
    verifier = load_verifier(name)
    draft_model, target_model = ContextFreeModel(case.draft), ContextFreeModel(case.target)
    support = sum(p > 0 for p in case.draft)
    for num_drafts, draft_len in _shapes(verifier, len(case.draft)):
        if verifier.draft_scheme == "without_replacement" and num_drafts > support:
            with pytest.raises(InvalidArgument, match="distinct drafts"):
                exact_iteration(verifier, draft_model, target_model, num_drafts, draft_len)
            continue
        audit = exact_iteration(verifier, draft_model, target_model, num_drafts, draft_len)
        for law in audit.emitted_law:
            assert bool(torch.isfinite(law).all())
        assert abs(float(sum(law.sum() for law in audit.emitted_law)) - 1) < 1e-12
        if single_iteration_exact(verifier):
            assert audit.max_abs_error <= 1e-12, (name, num_drafts, draft_len, audit.worst_strings())
            assert audit.prefix_cap_excess <= 1e-12


def _inputs(num_drafts, draft_len, vocab_size, dtype, seed=0, batch_size=16):
    gen = torch.Generator().manual_seed(seed)
    from spectr_audit.drafting.harness import draft
    from spectr_audit.drafting.models import random_markov

    batch = draft(random_markov(vocab_size, 1, seed=seed, temperature=0.5), random_markov(vocab_size, 1, seed=seed + 1),
                  torch.full((batch_size, 1), -1, dtype=torch.int64), num_drafts, draft_len, gen)
    # round to the half-precision dtype: rows then sum to 1 only within its rounding
    return batch.draft_tokens, batch.draft_probs.to(dtype), batch.target_probs.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", builtin_names())
def test_half_precision_inputs_within_rounding(name, dtype):
    verifier = load_verifier(name)
    num_drafts, draft_len = next(iter(_shapes(verifier, 6, max_nodes=10**6)))
    if verifier.draft_scheme == "without_replacement":
        return
    tokens, draft_probs, target_probs = _inputs(num_drafts, draft_len, 6, dtype)
    keep = draft_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).gt(0).all(-1).all(-1)
    tokens, draft_probs, target_probs = tokens[keep], draft_probs[keep], target_probs[keep]
    out = verifier.verify(tokens, draft_probs, target_probs, torch.Generator().manual_seed(0))
    check_verify_output(out, tokens.shape[0], num_drafts, draft_len, 6)
    if verifier.has_exact_law:
        law = verifier.output_probs(tokens, draft_probs, target_probs)
        assert bool(torch.isfinite(law).all())
        torch.testing.assert_close(law.sum((1, 2, 3)), torch.ones(tokens.shape[0], dtype=law.dtype), atol=1e-9, rtol=0)


@pytest.mark.parametrize("name", builtin_names())
@pytest.mark.parametrize("coin", [0.0, JUST_BELOW_ONE, 0.5, 0.25])
def test_boundary_uniforms_never_emit_an_impossible_verdict(name, coin):
    """With every uniform pinned at a boundary, the verdict must have positive exact probability.

    In particular a token of zero target mass is never emitted by an exact verifier, and
    an acceptance test ``u < a`` with ``u = 0`` never accepts a token with ``a = 0``.
    """
    verifier = load_verifier(name)
    if not verifier.has_exact_law:
        return
    for num_drafts, draft_len in list(_shapes(verifier, 4, max_nodes=64))[:4]:
        if verifier.draft_scheme == "without_replacement" and num_drafts > 3:
            continue
        tokens, draft_probs, target_probs = _inputs(num_drafts, draft_len, 4, torch.float64, seed=num_drafts + 10 * draft_len)
        if verifier.draft_scheme == "without_replacement":
            continue
        law = verifier.output_probs(tokens, draft_probs, target_probs)
        out = verifier.verify(tokens, draft_probs, target_probs, InjectedUniforms.constant(coin))
        rows = torch.arange(tokens.shape[0])
        cell = law[rows, out.draft_index, out.num_accepted, out.next_token]
        assert bool((cell > 0).all()), (name, num_drafts, draft_len, coin)


def test_zero_target_draft_is_rejected_at_u_zero():
    """docs/historic-bugs.md entry 9 / sglang #35771: u = 0 must not accept a draft whose target mass is 0."""
    tokens = torch.tensor([[[0]]])
    draft_probs = torch.tensor([[[[0.5, 0.5]]]], dtype=torch.float64)
    target_probs = torch.tensor([[[[0.0, 1.0], [0.5, 0.5]]]], dtype=torch.float64)
    for name in ("speculative", "kseq", "rrs", "block"):
        if name not in builtin_names():
            continue
        out = load_verifier(name).verify(tokens, draft_probs, target_probs, InjectedUniforms.constant(0.0))
        assert out.num_accepted.tolist() == [0] and out.next_token.tolist() == [1], name


def test_certain_acceptance_holds_just_below_one():
    tokens = torch.tensor([[[1]]])
    draft_probs = torch.tensor([[[[0.5, 0.5]]]], dtype=torch.float64)
    target_probs = torch.tensor([[[[0.2, 0.8], [0.0, 1.0]]]], dtype=torch.float64)
    for name in ("speculative", "kseq", "rrs"):
        out = load_verifier(name).verify(tokens, draft_probs, target_probs, InjectedUniforms.constant(JUST_BELOW_ONE))
        assert out.num_accepted.tolist() == [1] and out.next_token.tolist() == [1], name


# --- hostile third-party verifiers ---------------------------------------------------------------


def _hostile(kind):
    def fn(draft_tokens, draft_probs, target_probs, generator):
        b = draft_tokens.shape[0]
        zeros = torch.zeros(b, dtype=torch.int64)
        if kind == "raises":
            raise ZeroDivisionError("division by zero inside the engine")
        if kind == "wrong shape":
            return zeros[:-1], zeros[:-1], zeros[:-1]
        if kind == "wrong dtype":
            return zeros.float(), zeros, zeros
        if kind == "out of range":
            return zeros, zeros, torch.full((b,), 10**6, dtype=torch.int64)
        if kind == "None":
            return None
        raise AssertionError(kind)

    return fn


def _nan_law(draft_tokens, draft_probs, target_probs):
    b, k, l = draft_tokens.shape
    return torch.full((b, k, l + 1, draft_probs.shape[-1]), float("nan"), dtype=torch.float64)


HOSTILE = [
    (FunctionVerifier(_hostile("raises"), name="raises"), "ZeroDivisionError"),
    (FunctionVerifier(_hostile("wrong shape"), name="wrong-shape", output_probs=_nan_law), "output_probs contains NaN"),
    (FunctionVerifier(_hostile("wrong shape"), name="wrong-shape-2"), "must have shape"),
    (FunctionVerifier(_hostile("wrong dtype"), name="wrong-dtype"), "must have dtype torch.int64"),
    (FunctionVerifier(_hostile("out of range"), name="out-of-range"), "is outside"),
    (FunctionVerifier(_hostile("None"), name="returns-none"), "must return VerifyOutput"),
]


def test_hostile_verifiers_become_error_results_and_lose_nothing():
    suite = Suite(name="s", cases=(Case("seed", ContextFreeModel([0.6, 0.4]), ContextFreeModel([0.3, 0.7]), 2),))
    verifiers = [v for v, _ in HOSTILE] + [load_verifier("kseq"), load_verifier("rrs")]
    report = run_suite(suite, verifiers, num_drafts=2)  # plain functions declare no K: select the case's
    by_name = {r.verifier: r for r in report.results}
    assert set(by_name) == {v.name for v in verifiers}
    for verifier, message in HOSTILE:
        result = by_name[verifier.name]
        assert not result.passed and not result.as_expected
        # an error, or (statistical audits) a failed check naming the breach
        text = (result.error or "") + " ".join(c.detail for c in result.checks)
        assert message in text or result.error is not None, (verifier.name, text)
    assert by_name["kseq"].passed and by_name["rrs"].passed
    assert report.exit_code == 1
    json.dumps(report.to_dict(), allow_nan=False)  # the report stays valid JSON


def test_cli_with_a_hostile_verifier_records_the_others(tmp_path, capsys):
    path = tmp_path / "hostile.py"
    path.write_text("def verify(draft_tokens, draft_probs, target_probs, generator):\n    raise RuntimeError('engine exploded')\n")
    suite = tmp_path / "s.toml"
    suite.write_text('[[case]]\nname = "seed"\ndraft = [0.6, 0.4]\ntarget = [0.3, 0.7]\nnum_drafts = 2\n')
    code = main(["run", "--suite", str(suite), "--verifier", f"{path}:verify", "--verifier", "kseq", "--out",
                 str(tmp_path / "out"), "--num-drafts", "2"])
    assert code == 4  # an error and no finding: the error exit status
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    results = {r["verifier"]: r for r in report["results"]}
    assert results["kseq"]["passed"] is True
    assert "engine exploded" in (results["verify"].get("error") or json.dumps(results["verify"]))
    capsys.readouterr()
