"""Broken logits verifiers (verifiers/library/sampling_bugs.py): flagged by the exact audit, with their exact TV.

Every case is deterministic: the exact single-iteration audit enumerates the drafts of a
context-free case (V = 6, fixed draft and target logits, vLLM's processing order) and computes
the TV distance of the emitted law; an independent plain-Python oracle
(:mod:`tests.oracles.sampling`) recomputes each TV from the bug's definition.  A slip is
flagged when its TV is positive; a slip that the setting cannot reach (top-p bugs without
top-p, say) must have TV 0, so each table row also checks where a bug is invisible.
"""

from __future__ import annotations

import pytest
import torch

from spectr_audit.contract.logits import output_probs_with_params, verify_with_params
from spectr_audit.contract.sampling import SamplingParams, process_logits
from spectr_audit.contract.verifier import Verifier
from spectr_audit.drafting.models import ContextFreeModel
from spectr_audit.errors import InvalidArgument
from spectr_audit.exact.iteration import exact_iteration
from spectr_audit.verifiers.library.sampling_bugs import (
    SAMPLING_BUG_VERIFIERS,
    LogitsSpeculativeSampling,
    load_sampling_bug,
    sampling_bug_names,
)
from spectr_audit.verifiers.speculative import SpeculativeSampling

from tests.oracles import sampling as oracle

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB_SIZE = 6
DRAFT_LOGITS = [1.2, 0.3, -0.5, 0.9, -1.4, 0.1]
TARGET_LOGITS = [0.2, 1.1, 0.4, -0.8, 0.6, -0.3]

SETTINGS = {
    "T=0.6": dict(temperature=0.6),
    "top-k=3": dict(top_k=3),
    "top-p=0.8": dict(top_p=0.8),
    "T=0.6,top-p=0.8": dict(temperature=0.6, top_p=0.8),
    "T=0.7,k=5,p=0.75,min-p=0.05": dict(temperature=0.7, top_k=5, top_p=0.75, min_p=0.05),
    "greedy": dict(temperature=0.0),
}

#: (bug, setting) pairs where the slip changes the law (TV > 0); every other pair must have TV 0.
#: top-p-before-temperature needs both a temperature and a binding top-p; the unrenormalised
#: top-p needs a binding top-p.  Under greedy decoding the draft's argmax (token 0) is never the
#: target's (token 1): every draft is rejected, so a slip of the bonus is invisible there while a
#: slip of the residual is not, and raw draft probabilities change nothing (the ratio is 0 anyway).
EXPECTED_FLAGGED = {
    ("params-draft-only", s) for s in SETTINGS
} | {
    ("params-target-only", s) for s in SETTINGS if s != "greedy"
} | {
    ("top-p-before-temperature", "T=0.6,top-p=0.8"),
    ("top-p-before-temperature", "T=0.7,k=5,p=0.75,min-p=0.05"),
} | {
    ("bonus-unprocessed", s) for s in SETTINGS if s != "greedy"
} | {
    ("residual-unprocessed", s) for s in SETTINGS
} | {
    ("top-p-unrenormalised-target", s) for s in ("top-p=0.8", "T=0.6,top-p=0.8", "T=0.7,k=5,p=0.75,min-p=0.05")
}


class FixedLogitsCase(Verifier):
    """The context-free case as the exact audit sees it: every node has the same raw logits rows.

    The audit enumerates drafts from the processed draft law and holds the step to the processed
    target law; the verifier under test is handed the raw logits and the parameters.
    """

    max_drafts = 1

    def __init__(self, inner: Verifier, params: SamplingParams, order="vllm"):
        self.inner, self.params, self.order = inner, params, order
        self.name = inner.name

    def _output_probs(self, draft_tokens, draft_probs, target_probs):
        num, num_drafts, draft_len = draft_tokens.shape
        draft = torch.tensor(DRAFT_LOGITS, dtype=torch.float64).expand(num, num_drafts, draft_len, VOCAB_SIZE)
        target = torch.tensor(TARGET_LOGITS, dtype=torch.float64).expand(num, num_drafts, draft_len + 1, VOCAB_SIZE)
        return output_probs_with_params(self.inner, draft_tokens, draft, target, self.params, order=self.order)


def _exact_tv(verifier: Verifier, setting: dict, draft_len: int, order="vllm") -> float:
    params = SamplingParams(**setting)
    draft = process_logits(torch.tensor([DRAFT_LOGITS], dtype=torch.float64), params, order)[0]
    target = process_logits(torch.tensor([TARGET_LOGITS], dtype=torch.float64), params, order)[0]
    audit = exact_iteration(
        FixedLogitsCase(verifier, params, order), ContextFreeModel(draft.tolist()), ContextFreeModel(target.tolist()),
        num_drafts=1, draft_len=draft_len,
    )
    return audit.tv_distance


@pytest.mark.parametrize("draft_len", [1, 2])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("bug", sampling_bug_names())
def test_tv_table(bug, setting, draft_len):
    tv = _exact_tv(load_sampling_bug(bug), SETTINGS[setting], draft_len)
    expected = oracle.bug_tv(bug, DRAFT_LOGITS, TARGET_LOGITS, SETTINGS[setting], draft_len)
    assert tv == pytest.approx(expected, abs=1e-12)
    if (bug, setting) in EXPECTED_FLAGGED:
        assert tv > 1e-3, f"{bug} at {setting} is not flagged (TV {tv:.3g})"
    else:
        assert tv < 1e-12, f"{bug} at {setting} should be invisible, TV {tv:.3g}"


@pytest.mark.parametrize("draft_len", [1, 2])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_correct_controls_are_exact(setting, draft_len):
    """The correct logits verifier, and a probabilities verifier handed processed laws, have TV 0."""
    assert _exact_tv(LogitsSpeculativeSampling(), SETTINGS[setting], draft_len) < 1e-12
    assert _exact_tv(SpeculativeSampling(), SETTINGS[setting], draft_len) < 1e-12
    assert oracle.bug_tv("logits-speculative", DRAFT_LOGITS, TARGET_LOGITS, SETTINGS[setting], draft_len) < 1e-12


@pytest.mark.parametrize("order", ["sglang", "transformers"])
def test_other_engines_orders(order):
    """With another engine's conventions the control stays exact and the one-sided slip is flagged."""
    setting = dict(temperature=0.7, top_k=4, top_p=0.8)
    assert _exact_tv(LogitsSpeculativeSampling(order), setting, 1, order) < 1e-12
    tv = _exact_tv(load_sampling_bug("params-draft-only", order=order), setting, 1, order)
    assert tv == pytest.approx(oracle.bug_tv("params-draft-only", DRAFT_LOGITS, TARGET_LOGITS, setting, 1, order), abs=1e-12)
    assert tv > 1e-3


def test_processed_order_mismatch_is_flagged():
    """A correct verifier that processes with vLLM's conventions, audited against SGLang's, is flagged
    where the conventions differ (SGLang's top-p measures the unfiltered mass)."""
    setting = dict(top_k=2, top_p=0.5)
    assert _exact_tv(LogitsSpeculativeSampling("vllm"), setting, 1, "sglang") > 1e-3


@pytest.mark.parametrize("bug", ["logits-speculative"] + sampling_bug_names())
def test_sampler_matches_own_law(bug):
    """Each verifier's sampler draws from its own exact law (fixed seed; each cell within 5 sigma,
    a false-alarm rate below 1e-5 per cell)."""
    verifier = LogitsSpeculativeSampling() if bug == "logits-speculative" else load_sampling_bug(bug)
    params = SamplingParams(temperature=0.6, top_p=0.8)
    rows = 20_000
    draft_tokens = torch.tensor([[[0, 3]]]).expand(rows, 1, 2).contiguous()
    draft = torch.tensor(DRAFT_LOGITS, dtype=torch.float64).expand(rows, 1, 2, VOCAB_SIZE)
    target = torch.tensor(TARGET_LOGITS, dtype=torch.float64).expand(rows, 1, 3, VOCAB_SIZE)
    law = output_probs_with_params(verifier, draft_tokens[:1], draft[:1], target[:1], params)[0, 0]  # [L + 1, V]
    out = verify_with_params(verifier, draft_tokens, draft, target, params, torch.Generator().manual_seed(5))
    counts = torch.zeros_like(law)
    counts.index_put_((out.num_accepted, out.next_token), torch.ones(rows, dtype=law.dtype), accumulate=True)
    freq = counts / rows
    sigma = (law * (1 - law) / rows).sqrt()
    assert bool(((freq - law).abs() <= 5 * sigma + 1e-12).all()), (freq, law)


def test_library_lookup():
    assert sampling_bug_names() == list(SAMPLING_BUG_VERIFIERS)
    for name in sampling_bug_names():
        verifier = load_sampling_bug(name)
        assert verifier.name == name and verifier.expected == "inexact" and verifier.takes_logits
        assert verifier.has_exact_law
    with pytest.raises(InvalidArgument, match="unknown sampling bug"):
        load_sampling_bug("no-such-bug")


def test_neutral_parameters_hide_every_slip():
    """Through the probability entry point (log-probabilities, neutral parameters) each slip is
    invisible, which is why the audits must hand these verifiers logits and parameters."""
    draft = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    target = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    for name in sampling_bug_names():
        audit = exact_iteration(load_sampling_bug(name), ContextFreeModel(draft.tolist()), ContextFreeModel(target.tolist()), 1, 1)
        assert audit.tv_distance < 1e-12, name
