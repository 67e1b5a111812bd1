"""A library of broken verifiers: each one a small, realistic slip that breaks exactness.

The statistical audit must flag every one of them (``tests/verifiers/test_broken_verifiers.py``); each
has an exact law (``output_probs``), so its true TV distance to the target can be computed
with :func:`spectr_audit.exact.iteration.exact_iteration` and compared with what the audit needed to see
it.  Every class declares ``expected = "inexact"``.  They reuse the reference verifiers' node
rules with one thing changed, so the bug is the only difference.  The short names are the
``broken`` namespace of :mod:`spectr_audit.registry` (``load_broken(name)``); a new slip is
registered there.

========================  ====  ====  ==========================================================
name                      K     L     the slip
========================  ====  ====  ==========================================================
independent-accept        >= 2  1     each draft copy accepted with min(1, q/p), residual (q-p)+
                                      (SpecTr's naive rule; p=(1,0), q=(.5,.5), K=2 gives 3/4)
kseq-low-rho              any   1     K-SEQ with rho = 0.97 rho* (residual clipped at 0)
kseq-dedup                >= 2  1     K-SEQ over the *distinct* drafts only (k = #distinct)
rrs-skip-duplicates       >= 2  1     recursive rejection that skips repeated i.i.d. drafts
resample-target           1     >= 1  on rejection, resample from q instead of (q - p)+
                                      (Spec-RL #14; docs/historic-bugs.md entry 37)
inflated-ratio            1     >= 1  acceptance min(1, 1.03 q/p)
bonus-from-draft          1     >= 1  the bonus token drawn from the draft's last conditional
block-first-failure       1     >= 2  block verification stopping at the first failing level
                                      (a forward scan instead of the last passing level)
residual-drop-rejected    1     >= 1  residual = q with the rejected token removed (EAGLE #20)
always-accept             any   any   every draft token accepted (u = 0; vllm-ascend #13730)
========================  ====  ====  ==========================================================

``kseq-sampler-drift`` (:data:`spectr_audit.registry.INCONSISTENT_VERIFIERS`) has a sampler that
is exact but disagrees with its own ``output_probs`` (a fast sampler that drifted from its formula); only
:func:`spectr_audit.statistical.audit.sampler_law_agreement` can see those.

Recorded audits (``python benchmarks/bench_montecarlo.py library``): the standard case is V = 8,
context-free Dirichlet(1) draft (seed 1) and target (seed 2), K = 4 for multi-draft verifiers,
K = 1 otherwise, L = 2 for block-first-failure, else 1.  "Needed" is the fewest verifications
(main plus stratified design, seed 0, doubling then bisection to 1/8) at which the default
audit (alpha 1e-3) rejected; "default" is the audit at the default budget (planned for TV 0.005
at power 0.99: 959,971 samples per design), which the e-process usually stops early.  Each
chunk draws from its own random stream (docs/audit/statistical.md), so these numbers are those
of any number of processes.

========================  =========  ========  ==========================  =====================
name                      exact TV   needed    p at "needed" (test)        default p (samples)
========================  =========  ========  ==========================  =====================
independent-accept        0.2804     72        3.2e-06 (g-test)            < 1e-300 (12,288)
kseq-low-rho              0.0118     57,344    8.3e-05 (pearson)           5.0e-89 (1,920,603)
kseq-dedup                0.1193     576       7.5e-05 (g-test)            9.6e-140 (12,288)
rrs-skip-duplicates       0.0951     704       1.7e-06 (g-test)            1.6e-104 (12,288)
resample-target           0.1577     224       2.0e-04 (g-test)            < 1e-285 (12,288)
inflated-ratio            0.0054     90,112    3.4e-05 (stratified)        5.2e-28 (1,919,942)
bonus-from-draft          0.2498     144       2.5e-07 (pearson)           < 1e-300 (12,288)
block-first-failure       0.1157     208       1.5e-04 (g-test)            < 1e-300 (12,288)
residual-drop-rejected    0.1338     641       1.1e-04 (stratified)        5.3e-197 (12,288)
always-accept             0.5139     72        2.4e-38 (pearson)           < 1e-300 (12,288)
========================  =========  ========  ==========================  =====================
"""

from __future__ import annotations

import torch

from spectr_audit.contract.randomness import sample_categorical, uniform
from spectr_audit.contract.verifier import VerifyOutput
from spectr_audit.verifiers._walk import NodeRule, ChainWalkVerifier, gather_tokens, normalise
from spectr_audit.verifiers.block import BlockVerification
from spectr_audit.verifiers.kseq import KSeqRule
from spectr_audit.verifiers.library._chain import chain_law
from spectr_audit.verifiers.library._rules import AlwaysAcceptRule, CouplingRule, ResampleTargetRule, first_occurrence
from spectr_audit.verifiers.recursive_rejection import RecursiveRejectionRule
from spectr_audit.verifiers.speculative import SpeculativeSampling

__all__ = [
    "AlwaysAccept",
    "BlockFirstFailure",
    "BonusFromDraft",
    "IndependentAccept",
    "InflatedRatio",
    "KSeqDedup",
    "KSeqLowRho",
    "KSeqSamplerDrift",
    "ResampleTarget",
    "ResidualDropRejected",
    "RRSSkipDuplicates",
]

# ---------------------------------------------------------------------------------------------
# Node rules with one slip each (speculative sampling's parts: verifiers/library/_rules.py)
# ---------------------------------------------------------------------------------------------


class _DedupRule(NodeRule):
    """The slip: run ``inner`` over the distinct surviving tokens only (duplicates get acceptance 0).

    Repeated i.i.d. drafts are neither tried nor allowed to update the residual.
    """

    def __init__(self, inner: NodeRule):
        self.inner = inner

    def __call__(self, tokens, survivors, draft_dist, target_dist):
        distinct = first_occurrence(tokens, survivors)
        accept_probs, residual = self.inner(tokens, distinct, draft_dist, target_dist)
        return torch.where(distinct, accept_probs, torch.zeros_like(accept_probs)), residual


class _InflatedRatioRule(CouplingRule):
    """The slip: accept with ``min(1, factor * q/p)``; the residual stays ``(q - p)_+``."""

    def __init__(self, factor: float):
        self.factor = factor

    def accept_probs(self, tokens, draft_dist, target_dist):
        drafted = gather_tokens(draft_dist, tokens)
        safe = torch.where(drafted > 0, drafted, torch.ones_like(drafted))
        ratio = self.factor * gather_tokens(target_dist, tokens) / safe
        return torch.where(drafted > 0, ratio.clamp(max=1.0), torch.zeros_like(ratio))


class _DropRejectedRule(CouplingRule):
    """The slip: on rejection draw from q with the rejected token zeroed, not from ``(q - p)_+`` (EAGLE #20)."""

    def residual(self, tokens, draft_dist, target_dist):
        dropped = target_dist.scatter(1, tokens[:, :1], 0.0)
        return normalise(dropped, target_dist)


# ---------------------------------------------------------------------------------------------
# The broken verifiers
# ---------------------------------------------------------------------------------------------


class IndependentAccept(ChainWalkVerifier):
    """Each of K i.i.d. drafts accepted independently with min(1, q/p); residual (q - p)_+.

    SpecTr's naive multi-draft rule (docs/rules/kseq.md): with p = (1, 0), q = (1/2, 1/2), K = 2
    it emits token 0 with probability 3/4.
    """

    name = "independent-accept"
    description = "BROKEN: each draft copy accepted independently with min(1, q/p)"
    expected = "inexact"
    min_drafts = 2
    max_draft_len = 1
    rule = CouplingRule()  # the K = 1 rule, correct there: the slip is applying it to each of K >= 2 copies


class KSeqLowRho(ChainWalkVerifier):
    """K-SEQ with rho = 0.97 rho*: the residual q - A goes negative and is clipped."""

    name = "kseq-low-rho"
    description = "BROKEN: K-SEQ with rho 3% below rho*"
    expected = "inexact"
    max_draft_len = 1
    rule = KSeqRule(rho_scale=0.97)


class KSeqDedup(ChainWalkVerifier):
    """K-SEQ run over the distinct draft tokens only (k = number of distinct tokens)."""

    name = "kseq-dedup"
    description = "BROKEN: K-SEQ that deduplicates the i.i.d. drafts"
    expected = "inexact"
    min_drafts = 2
    max_draft_len = 1
    rule = _DedupRule(KSeqRule())


class RRSSkipDuplicates(ChainWalkVerifier):
    """Recursive rejection sampling over i.i.d. drafts that skips a token it has already tried.

    A repeated draft is neither tried nor lets the residual shrink again: recursive rejection
    run over the distinct drafts only (``kseq-dedup``'s slip, applied to ``rrs``'s rule).
    """

    name = "rrs-skip-duplicates"
    description = "BROKEN: recursive rejection skipping duplicate i.i.d. drafts"
    expected = "inexact"
    min_drafts = 2
    max_draft_len = 1
    rule = _DedupRule(RecursiveRejectionRule())


class ResampleTarget(ChainWalkVerifier):
    """Speculative sampling that resamples from the target q, not the residual (q - p)_+, on rejection."""

    name = "resample-target"
    description = "BROKEN: on rejection, resample from the target instead of the residual"
    expected = "inexact"
    max_drafts = 1
    rule = ResampleTargetRule()


class InflatedRatio(ChainWalkVerifier):
    """Speculative sampling with the acceptance ratio inflated by 3%: min(1, 1.03 q/p)."""

    name = "inflated-ratio"
    description = "BROKEN: acceptance ratio q/p inflated by 3%"
    expected = "inexact"
    max_drafts = 1
    rule = _InflatedRatioRule(1.03)


class ResidualDropRejected(ChainWalkVerifier):
    """Speculative sampling whose residual is q with the rejected token removed (EAGLE #20)."""

    name = "residual-drop-rejected"
    description = "BROKEN: residual = target minus the rejected token, not (target - draft)_+"
    expected = "inexact"
    max_drafts = 1
    rule = _DropRejectedRule()


class AlwaysAccept(ChainWalkVerifier):
    """Every draft token is accepted (the output follows the draft); acceptance 1 > alpha*."""

    name = "always-accept"
    description = "BROKEN: acceptance uniform stuck at 0, every draft accepted"
    expected = "inexact"
    rule = AlwaysAcceptRule()


class BonusFromDraft(SpeculativeSampling):
    """Speculative sampling whose bonus token is drawn from the draft's last conditional, not from q."""

    name = "bonus-from-draft"
    description = "BROKEN: bonus token drawn from the draft instead of the target"
    expected = "inexact"

    @staticmethod
    def _swap_bonus(draft_probs, target_probs):
        swapped = target_probs.clone()
        swapped[:, :, -1] = draft_probs[:, :, -1]
        return swapped

    def _verify(self, draft_tokens, draft_probs, target_probs, generator):
        return super()._verify(draft_tokens, draft_probs, self._swap_bonus(draft_probs, target_probs), generator)

    def _output_probs(self, draft_tokens, draft_probs, target_probs):
        return super()._output_probs(draft_tokens, draft_probs, self._swap_bonus(draft_probs, target_probs))


class BlockFirstFailure(BlockVerification):
    """Block verification that stops at the first failing level (forward scan) instead of the last passing one.

    ``tau`` = the number of leading levels that pass, so ``P(tau = i) = h_1 .. h_i (1 - h_{i+1})``;
    corrections and bonus as in block verification.
    """

    name = "block-first-failure"
    description = "BROKEN: block verification stopping at the first failure"
    expected = "inexact"
    min_draft_len = 2

    def _verify(self, draft_tokens, draft_probs, target_probs, generator):
        batch_size, _, draft_len = draft_tokens.shape
        pass_probs, residual = self._levels(draft_tokens, draft_probs, target_probs)
        u = uniform(generator, (batch_size, draft_len + 1), draft_tokens.device)
        passed = u[:, :draft_len] < pass_probs
        tau = passed.to(torch.int64).cumprod(-1).sum(-1)  # leading passes
        law = self._next_token_law(residual, target_probs[:, 0].double(), tau)
        next_token = sample_categorical(law, u[:, draft_len])
        return VerifyOutput(tau, torch.zeros_like(tau), next_token)

    def _output_probs(self, draft_tokens, draft_probs, target_probs):
        draft_len = draft_tokens.shape[-1]
        pass_probs, residual = self._levels(draft_tokens, draft_probs, target_probs)
        target = target_probs[:, 0].double()
        vocab_size = residual.shape[-1]
        corrections = normalise(residual.reshape(-1, vocab_size), target[:, :draft_len].reshape(-1, vocab_size))
        # the forward scan is a first-rejection chain over the level pass probabilities
        return chain_law(pass_probs, corrections.reshape(residual.shape), target[:, draft_len])


class KSeqSamplerDrift(ChainWalkVerifier):
    """K-SEQ whose fast sampler uses rho = 1.05 rho* while ``output_probs`` reports the rho* law.

    Any rho >= rho* is valid, so the *sampler* is exact (the black-box audit passes it); it
    simply is not the law the verifier claims.  Only a sampler-vs-own-law check catches it.
    """

    name = "kseq-sampler-drift"
    description = "INCONSISTENT: sampler uses 1.05 rho*, output_probs uses rho*"
    max_draft_len = 1
    rule = KSeqRule()

    def _verify(self, draft_tokens, draft_probs, target_probs, generator):
        sampler = ChainWalkVerifier()
        sampler.rule = KSeqRule(rho_scale=1.05)
        return sampler._verify(draft_tokens, draft_probs, target_probs, generator)
