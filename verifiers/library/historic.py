"""Historic speculative-decoding fidelity bugs, reproduced as small verifiers, with two declared-lossy rules.

Each class reproduces one *class* of public bug from the catalogue in docs/historic-bugs.md
(its entry numbers are cited below as "entry N") with code written here, never copied from the engine, and its
docstring cites the public issue or pull request it reproduces.  The buggy verifiers declare
``expected = "inexact"`` (or ``"exact"`` where the bug costs acceptance, not fidelity), so a
suite run passes exactly when the audit flags every bug and passes every fix.  Two are not bugs
but rules lossy by design, declared so by their authors: Medusa, declared lossy (typical
acceptance, by design; ``medusa-typical-acceptance``), and Spec-RL's RL-rollout residual
(``residual-is-target``); they declare ``"inexact"`` too, so the audit measures their declared loss.
:data:`FIXED_COUNTERPART` names the correct verifier each bug is audited next to.  The short
names are the ``historic`` namespace of :mod:`spectr_audit.registry` (``load_historic(name)``);
a new bug is registered there.

Letters: engines' reports often write p = target, q = draft (vLLM's convention); this module
names tensors by role only (``draft_probs``, ``target_probs``).

===============================  ====  ====  ============================================  ==================================
name                             K     L     reproduces                                    audit that sees it
===============================  ====  ====  ============================================  ==================================
always-accept-npu                any   any   vllm-ascend #13730 / #13766                   exact, acceptance > alpha*
greedy-draft-soft-q              1     1     transformers #32867                           exact
eagle-residual-zeroing           any   any   EAGLE #20 (2f982e2)                           exact
residual-is-target               1     any   Spec-RL #14 (declared lossy)                  exact
stale-residual-bonus             >= 2  1     EAGLE PR #47                                  exact (bonus law)
bonus-without-temperature        1     any   EAGLE bf10ac5 / c892473 (EAGLE-2/3 fix; the   exact (bonus law)
                                             EAGLE-1 wheel eagle-llm 1.2.1 keeps the bug)
correction-from-bonus-row        1     any   vllm PR #8320                                 exact
medusa-typical-acceptance        1     any   Medusa: declared lossy (typical acceptance,   exact (measures the declared loss)
                                             by design), not a bug
strict-no-draft-probs            1     any   vllm #40149, sglang #9877                     optimality only
target-only-siblings             any   1     sglang PR #35798 (the fix)                    optimality only
target-only-inclusive-coin       any   1     sglang #35771                                 coin injection only
inclusive-coin                   1     any   vllm v1 / pytorch #16706                      coin injection only
draft-probs-mutated              1     any   vllm #16952                                   statistical (no exact law)
block-tokenwise-residual         1     >= 2  vllm-ascend #3794 / #7807                     exact (needs block.py)
===============================  ====  ====  ============================================  ==================================

Bugs that only a coin injection can see (a uniform of exactly 0, a CDF tie) change the law on
a set of measure zero: their exact laws equal the correct ones, and
``tests/verifiers/test_historic_bugs.py`` pins them with :class:`spectr_audit.contract.randomness.InjectedUniforms`.
"""

from __future__ import annotations

import math

import torch

from spectr_audit.contract.verifier import Verifier, VerifyOutput
from spectr_audit.errors import InvalidArgument
from spectr_audit.contract.randomness import sample_categorical, uniform
from spectr_audit.verifiers._walk import ChainWalkVerifier, gather_tokens, normalise
from spectr_audit.verifiers.library._chain import chain_law, chain_sample
from spectr_audit.verifiers.library._rules import AlwaysAcceptRule, ResampleTargetRule, first_occurrence
from spectr_audit.verifiers.recursive_rejection import RecursiveRejectionRule

__all__ = [
    "FIXED_COUNTERPART",
    "AlwaysAcceptBug",
    "BonusWithoutTemperatureBug",
    "ChainVerifier",
    "CorrectionFromBonusRowBug",
    "DraftProbsMutatedBug",
    "EagleResidualBug",
    "GreedyDraftSoftQBug",
    "InclusiveCoinBug",
    "MedusaTypicalAcceptance",
    "ResidualIsTargetBug",
    "StaleResidualBonusBug",
    "StrictNoDraftProbs",
    "TargetOnlyInclusiveCoinBug",
    "TargetOnlySiblings",
]

_MODULE = "spectr_audit.verifiers.library.historic"

#: Historic-bug short name -> the correct verifier it is audited next to (a built-in short
#: name or an import string).  ``None``: the rule is lossy by design and has no fixed form.
FIXED_COUNTERPART: dict[str, object] = {
    "always-accept-npu": "speculative",
    "greedy-draft-soft-q": "speculative",
    "eagle-residual-zeroing": "rrs",
    "residual-is-target": "speculative",
    "stale-residual-bonus": "rrs",
    "bonus-without-temperature": "speculative",
    "correction-from-bonus-row": "speculative",
    "medusa-typical-acceptance": None,
    "strict-no-draft-probs": "speculative",
    "target-only-siblings": "rrs",
    "target-only-inclusive-coin": f"{_MODULE}:TargetOnlySiblings",
    "inclusive-coin": "speculative",
    "draft-probs-mutated": "speculative",
    "block-tokenwise-residual": "spectr_audit.verifiers.block:BlockVerification",
}


# ---------------------------------------------------------------------------------------------
# A single-draft chain whose per-level numbers are fixed once the draft is known
# ---------------------------------------------------------------------------------------------


class ChainVerifier(Verifier):
    """Single-draft chains: accept level by level, stop at the first rejection.

    Subclasses implement :meth:`_levels`, returning per-level acceptance probabilities, the
    law of the token emitted after a rejection at each level, and the law of the bonus token.
    Sampler and exact law are derived from those same numbers (``verifiers/library/_chain.py``).
    Randomness: one call to :func:`spectr_audit.contract.randomness.uniform` of shape
    ``[batch_size, draft_len + 1]``: the ``draft_len`` acceptance uniforms, then the uniform of
    the emitted (correction or bonus) token, drawn by inverse CDF.

    ``inclusive_accept = True`` tests ``u <= accept_prob`` instead of ``u < accept_prob``:
    identical laws, different behaviour at ``u = 0`` (a coin-boundary bug).
    """

    min_drafts = 1
    max_drafts = 1
    inclusive_accept = False

    def _levels(
        self,
        draft_tokens: torch.Tensor,  # [batch_size, 1, draft_len]
        draft_probs: torch.Tensor,  # [batch_size, 1, draft_len, vocab_size]
        target_probs: torch.Tensor,  # [batch_size, 1, draft_len + 1, vocab_size]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [B, L], [B, L, V], [B, V]
        raise NotImplementedError

    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        levels = self._levels(draft_tokens, draft_probs, target_probs)
        return chain_sample(*levels, generator, inclusive=self.inclusive_accept)

    def _output_probs(self, draft_tokens, draft_probs, target_probs) -> torch.Tensor:
        return chain_law(*self._levels(draft_tokens, draft_probs, target_probs))


def _path_probs(draft_tokens, draft_probs, target_probs):
    """Draft and target mass of the drafted tokens along draft 0: ``[B, L]`` each, float64."""
    draft_len = draft_tokens.shape[-1]
    path = draft_tokens[:, 0].unsqueeze(-1)  # [B, L, 1]
    drafted = draft_probs[:, 0].double().gather(-1, path).squeeze(-1)
    wanted = target_probs[:, 0, :draft_len].double().gather(-1, path).squeeze(-1)
    return drafted, wanted


def _maximal_coupling_levels(draft_tokens, draft_probs, target_probs):
    """Speculative sampling's numbers: ``min(1, q/p)`` per level and ``(q - p)_+`` normalised."""
    draft_len = draft_tokens.shape[-1]
    drafted, wanted = _path_probs(draft_tokens, draft_probs, target_probs)
    # The contract guarantees drafted > 0.
    accept_probs = (wanted / drafted).clamp(max=1.0)
    draft = draft_probs[:, 0].double()
    target = target_probs[:, 0, :draft_len].double()
    vocab_size = draft.shape[-1]
    residual = normalise((target - draft).clamp(min=0).reshape(-1, vocab_size), target.reshape(-1, vocab_size))
    return accept_probs, residual.reshape(target.shape)


class _SpeculativeChain(ChainVerifier):
    """Speculative sampling as a chain, correct: the bugs below override :meth:`_levels` to change one part."""

    def _levels(self, draft_tokens, draft_probs, target_probs):
        accept_probs, residual = _maximal_coupling_levels(draft_tokens, draft_probs, target_probs)
        return accept_probs, residual, target_probs[:, 0, -1].double()


# ---------------------------------------------------------------------------------------------
# EX bugs
# ---------------------------------------------------------------------------------------------


class AlwaysAcceptBug(ChainWalkVerifier):
    """vllm-ascend #13730 / PR #13766: the v2 rejection sampler always accepted draft tokens on NPU.

    The NPU lacked ``tl_rand64``, so the acceptance uniform was hard-coded to 0.0 and the test
    ``target/draft >= u`` passed for every draft: the output follows the *draft* law.  Case
    (entry 14): target (.7, .3), draft (.3, .7): output (.3, .7), TV .4, acceptance 1.0
    above the optimum .6, which no exact verifier can reach.  Fixed: ``speculative``.
    """

    name = "always-accept-npu"
    description = "vllm-ascend #13730: acceptance uniform hard-coded to 0, every draft accepted"
    expected = "inexact"
    rule = AlwaysAcceptRule()


class GreedyDraftSoftQBug(Verifier):
    """transformers #32867: a greedy assistant verified with its soft probabilities (a q-contract bug).

    transformers PR #30778 forced the assistant to decode greedily while
    ``_speculative_sampling`` kept using q = softmax(assistant logits) (bug window 4.41.0 -
    4.44.2, fixed in 4.45.0 by PR #33534).  The same class: z-lab/dflash #74 and
    jaymody/speculative-sampling #3.  The verifier receives draft tokens drawn from
    ``draft_probs`` like any other, but reproduces the engine by replacing the drafted token
    with the argmax of ``draft_probs`` (what the greedy assistant proposed) and then running
    speculative sampling with the soft ``draft_probs``: the declared draft law (softmax) is not
    the law of the proposed token (a point mass).  The proposed token is no drafted token, so
    the step emits one token: ``num_accepted = 0``, ``next_token`` = the argmax if "accepted",
    else a residual draw.  Case (entry 22): target (.5, .3, .2), draft (.6, .3, .1):
    output (5/6, 0, 1/6), TV 1/3.  Fixed: ``speculative`` (the assistant samples).
    """

    name = "greedy-draft-soft-q"
    description = "transformers #32867: greedy assistant, acceptance computed with softmax(q)"
    expected = "inexact"
    max_drafts = 1
    max_draft_len = 1

    def _law(self, draft_probs, target_probs) -> torch.Tensor:  # [B, V]
        draft = draft_probs[:, 0, 0].double()
        target = target_probs[:, 0, 0].double()
        proposed = draft.argmax(-1, keepdim=True)  # [B, 1]: the greedy assistant's token
        accept = (gather_tokens(target, proposed) / gather_tokens(draft, proposed)).clamp(max=1.0)
        residual = normalise((target - draft).clamp(min=0), target)
        return (1 - accept) * residual + accept * torch.zeros_like(draft).scatter(1, proposed, 1.0)

    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        law = self._law(draft_probs, target_probs)
        u = uniform(generator, (draft_tokens.shape[0],), draft_tokens.device)
        next_token = sample_categorical(law, u)
        zero = torch.zeros_like(next_token)
        return VerifyOutput(zero, zero, next_token)

    def _output_probs(self, draft_tokens, draft_probs, target_probs) -> torch.Tensor:
        batch_size, _, _ = draft_tokens.shape
        out = torch.zeros(batch_size, 1, 2, draft_probs.shape[-1], dtype=torch.float64, device=draft_probs.device)
        out[:, 0, 0] = self._law(draft_probs, target_probs)
        return out


class _ZeroRejectedRule(RecursiveRejectionRule):
    """EAGLE #20: recursive rejection whose residual zeroes the rejected token instead of subtracting p."""

    def _residual_after_rejection(self, residual, drafting, token):
        return normalise(residual.scatter(1, token, 0.0), residual)  # the slip: not (residual - drafting)_+


class EagleResidualBug(ChainWalkVerifier):
    """EAGLE #20 (fixed in commit 2f982e2, "fix non-greedy bugs"): the residual zeroed the rejected token.

    On rejecting draft token x, EAGLE's sampler set the target's mass at x to 0 and
    renormalised, instead of using ``(target - draft)_+``.  Applied recursively over the K
    drafts at a node, as EAGLE's tree does.  Case (entry 31): target (.3, .3, .4), draft
    (.45, .45, .1), K = 1: output (.3643, .3643, .2714), TV .129.  Fixed: ``rrs`` (recursive
    rejection sampling subtracts the draft law).
    """

    name = "eagle-residual-zeroing"
    description = "EAGLE #20: residual = target with the rejected token zeroed"
    expected = "inexact"
    rule = _ZeroRejectedRule()


class ResidualIsTargetBug(ChainWalkVerifier):
    """ShopeeLLM/Spec-RL #14: on rejection, resample from the target instead of the residual.

    A design choice for RL rollouts ("not for distribution preservation"), so declared lossy.
    Output ``min(draft, target) + (1 - sum min) target``.  Case (entry 37, "residual =
    p" in vLLM's letters): target (.5, .3, .2), draft (.6, .3, .1): output (.55, .33, .12), TV .08.
    Fixed: ``speculative``.
    """

    name = "residual-is-target"
    description = "Spec-RL #14: residual replaced by the target (declared lossy)"
    expected = "inexact"
    max_drafts = 1
    rule = ResampleTargetRule()


class StaleResidualBonusBug(Verifier):
    """EAGLE PR #47 ("fix: update verify process"): the bonus token drawn from a stale residual.

    Before the fix (``if adjustflag:`` became ``if adjustflag and accept_length !=
    candidates.shape[1]:``), when a sibling was rejected and a later sibling accepted at the
    last depth, the bonus token was drawn from that depth's residual instead of from the target
    at the next position.  Reproduced with recursive rejection sampling over K i.i.d. siblings
    (L = 1): if the first accepted sibling is not the first one tried, the bonus is drawn from
    the residual left by the rejections.  Case (entry 32): two siblings; the bonus
    marginal must equal the target's bonus row.  Fixed: ``rrs``.
    """

    name = "stale-residual-bonus"
    description = "EAGLE PR #47: bonus drawn from the stale residual after a sibling was rejected"
    expected = "inexact"
    max_draft_len = 1

    def _numbers(self, draft_tokens, draft_probs, target_probs):
        """First-accepted probabilities ``[B, K]``, residuals after i rejections ``[B, K + 1, V]``."""
        num_drafts = draft_tokens.shape[1]
        tokens = draft_tokens[:, :, 0]
        draft = draft_probs[:, 0, 0].double()
        residual = target_probs[:, 0, 0].double()
        residuals, first, none_yet = [residual], [], torch.ones_like(draft[:, :1])
        for i in range(num_drafts):
            token = tokens[:, i : i + 1]
            accept = (gather_tokens(residual, token) / gather_tokens(draft, token)).clamp(max=1.0)
            first.append(none_yet * accept)
            none_yet = none_yet * (1 - accept)
            residual = normalise((residual - draft).clamp(min=0), residual)
            residuals.append(residual)
        return torch.cat(first, dim=1), torch.stack(residuals, dim=1)

    def _canonical(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[B, K]``: the smallest draft index carrying each draft's token."""
        same = tokens.unsqueeze(2) == tokens.unsqueeze(1)  # [B, i, j]
        return same.to(torch.int8).argmax(-1)

    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        batch_size, num_drafts, _ = draft_tokens.shape
        device = draft_tokens.device
        rows = torch.arange(batch_size, device=device)
        tokens = draft_tokens[:, :, 0]
        draft = draft_probs[:, 0, 0].double()
        residual = target_probs[:, 0, 0].double()
        u = uniform(generator, (batch_size, num_drafts + 1), device)
        accepted_at = torch.full((batch_size,), num_drafts, dtype=torch.int64, device=device)
        stale = residual
        for i in range(num_drafts):
            token = tokens[:, i : i + 1]
            accept = (gather_tokens(residual, token) / gather_tokens(draft, token)).clamp(max=1.0).squeeze(1)
            newly = (accepted_at == num_drafts) & (u[:, i] < accept)
            accepted_at = torch.where(newly, i, accepted_at)
            stale = torch.where(newly.unsqueeze(1), residual, stale)
            residual = normalise((residual - draft).clamp(min=0), residual)
        accepted = accepted_at < num_drafts
        index = self._canonical(tokens)[rows, accepted_at.clamp(max=num_drafts - 1)]
        bonus_law = torch.where((accepted_at == 0).unsqueeze(1), target_probs[rows, index, 1].double(), stale)
        law = torch.where(accepted.unsqueeze(1), bonus_law, residual)
        next_token = sample_categorical(law, u[:, num_drafts])
        num_accepted = accepted.to(torch.int64)
        draft_index = torch.where(accepted, index, torch.zeros_like(index))
        return VerifyOutput(num_accepted, draft_index, next_token)

    def _output_probs(self, draft_tokens, draft_probs, target_probs) -> torch.Tensor:
        batch_size, num_drafts, _ = draft_tokens.shape
        vocab_size = draft_probs.shape[-1]
        first, residuals = self._numbers(draft_tokens, draft_probs, target_probs)
        out = torch.zeros(batch_size, num_drafts, 2, vocab_size, dtype=torch.float64, device=draft_probs.device)
        none = 1 - first.sum(-1, keepdim=True)
        out[:, 0, 0] = none.clamp(min=0) * residuals[:, num_drafts]
        canon = self._canonical(draft_tokens[:, :, 0])
        rows = torch.arange(batch_size, device=draft_probs.device)
        for i in range(num_drafts):
            index = canon[:, i]
            bonus_law = target_probs[rows, index, 1].double() if i == 0 else residuals[:, i]
            out[rows, index, 1] += first[:, i : i + 1] * bonus_law
        return out


class BonusWithoutTemperatureBug(_SpeculativeChain):
    """EAGLE's unprocessed bonus draw (fixed upstream for EAGLE-2/3 in bf10ac5; kept by the EAGLE-1 wheel).

    ``evaluate_posterior`` samples the fallback/bonus token from ``softmax(logits)`` without the
    logits processor whenever the walk ends without a rejection at its last depth or reaches the
    tree's full depth, so whatever processor is active (temperature, top-p, top-k) does not apply
    to that token.  Upstream added ``logits_processor(None, gt_logits)`` there in commit bf10ac5
    (then 50fc246, c892473 "fix bug in top_p sample", c7ef8e5) on its EAGLE-2/3 branch; the
    EAGLE-1 wheel ``eagle-llm`` 1.2.1 keeps the line (``eagle/model/utils.py:407``, ``:410-411``),
    which the ``eagle`` engine adapter audits.  This reproduction takes the temperature case: the
    target rows passed in are the tempered ``softmax(l / T)``; the bonus is drawn from the
    untempered ``softmax(l)``, proportional to ``target ** temperature``.  Case (entry 33):
    T = 0.5, full acceptance: the bonus marginal must be ``softmax(l / 0.5)``.  Fixed:
    ``speculative``.

    Parameters
    ----------
    temperature : float
        The sampling temperature the engine applied everywhere except to the bonus (default 0.5).
    """

    name = "bonus-without-temperature"
    description = ("EAGLE bf10ac5 (fixed for EAGLE-2/3; kept in the EAGLE-1 wheel): bonus token sampled without "
                   "the logits processor; here temperature (softmax(l), not softmax(l/T))")
    expected = "inexact"

    def __init__(self, temperature: float = 0.5):
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise InvalidArgument(f"temperature: must be a finite number > 0, got {temperature!r}")
        self.temperature = float(temperature)

    def _levels(self, draft_tokens, draft_probs, target_probs):
        accept_probs, residual, tempered = super()._levels(draft_tokens, draft_probs, target_probs)
        untempered = normalise(tempered.pow(self.temperature), tempered)  # 0 ** T stays 0
        return accept_probs, residual, untempered


class CorrectionFromBonusRowBug(_SpeculativeChain):
    """vllm PR #8320 ("Fix verify tokens with the correct bonus token"): bonus and first-unmatched confused.

    In the typical-acceptance sampler the token emitted after the first rejected position was
    taken from the bonus position (the target row after the whole draft) instead of the
    rejected position.  Reproduced in speculative sampling: on a rejection at level i the
    correction is drawn from the target's bonus row instead of the residual at level i.  Case
    (entry 13, greedy, i.e. one-hot rows): drafts (1, 2, 3, 5, 7), target argmax (1, 2,
    3, 4, 6, 8): the step must emit (1, 2, 3, 4); this bug emits (1, 2, 3, 8).  Fixed:
    ``speculative``.
    """

    name = "correction-from-bonus-row"
    description = "vllm PR #8320: correction token drawn from the bonus position's target row"
    expected = "inexact"

    def _levels(self, draft_tokens, draft_probs, target_probs):
        accept_probs, residual, bonus = super()._levels(draft_tokens, draft_probs, target_probs)
        return accept_probs, bonus.unsqueeze(1).expand_as(residual), bonus  # every correction from the bonus row


class MedusaTypicalAcceptance(ChainVerifier):
    """Medusa: declared lossy (typical acceptance, by design); FasterDecoding/Medusa, also vLLM PR #5131 / #5015.

    Not a bug: Medusa's README says it relaxes "the requirement of matching the distribution of
    the original model" (the medusa-llm 0.1 package description).

    A drafted token x is accepted iff ``target(x) > min(hard_threshold, entropy_factor *
    exp(-H(target)))``; at the first rejection the target's argmax is emitted (greedy
    fallback), and the bonus is drawn from the target.  Declared lossy: the audit reports how far
    it is from the target.  Case (entry 35): target (.5, .5): every proposal passes the
    threshold, so the output follows the draft law.

    Parameters
    ----------
    hard_threshold : float
        Medusa's ``posterior_threshold`` (default 0.09).
    entropy_factor : float
        Medusa's ``posterior_alpha`` (default 0.3).
    """

    name = "medusa-typical-acceptance"
    description = "Medusa: declared lossy (typical acceptance, by design): threshold on target(x), greedy fallback"
    expected = "inexact"

    def __init__(self, hard_threshold: float = 0.09, entropy_factor: float = 0.3):
        for arg, value in (("hard_threshold", hard_threshold), ("entropy_factor", entropy_factor)):
            if not (isinstance(value, (int, float)) and 0 <= value <= 1):
                raise InvalidArgument(f"{arg}: must be a number in [0, 1], got {value!r}")
        self.hard_threshold = float(hard_threshold)
        self.entropy_factor = float(entropy_factor)

    def _levels(self, draft_tokens, draft_probs, target_probs):
        draft_len = draft_tokens.shape[-1]
        target = target_probs[:, 0, :draft_len].double()  # [B, L, V]
        _, wanted = _path_probs(draft_tokens, draft_probs, target_probs)
        entropy = -(target * target.clamp(min=1e-300).log()).sum(-1)  # 0 log 0 = 0
        threshold = torch.minimum(torch.full_like(entropy, self.hard_threshold), self.entropy_factor * torch.exp(-entropy))
        accept_probs = (wanted > threshold).to(torch.float64)
        greedy = torch.zeros_like(target).scatter(-1, target.argmax(-1, keepdim=True), 1.0)
        return accept_probs, greedy, target_probs[:, 0, -1].double()


# ---------------------------------------------------------------------------------------------
# OPT: exact, but below the optimal acceptance
# ---------------------------------------------------------------------------------------------


class StrictNoDraftProbs(ChainVerifier):
    """vllm #40149 ("draft_model does not use draft_probs"); sglang #9877 (``FIXME: leverage draft probs``).

    vLLM's v1 path passed ``draft_probs=None``: a drafted token x is accepted with probability
    ``target(x)`` (the draft probability taken as 1), and on rejection the correction is drawn
    from the target with x removed.  That is *exact* (it is the coupling "accept iff an
    independent target sample equals the draft") but its acceptance is ``sum target * draft``
    instead of ``sum min(target, draft)``.  Declared exact: only the optimality audit sees it
    (acceptance ratio to alpha* below 1).  Case (entry 7): target (.4, .3, .15, .1, .05),
    draft (.1, .1, .2, .3, .3): acceptance .145 where the optimum is .5.  The sampler-match rule
    of lablup/mlxcel #902 / PR #992 has the same law.  Fixed: ``speculative``.
    """

    name = "strict-no-draft-probs"
    description = "vllm #40149: draft_probs=None (accept w.p. target(x)); exact but suboptimal"
    expected = "exact"

    def _levels(self, draft_tokens, draft_probs, target_probs):
        draft_len = draft_tokens.shape[-1]
        target = target_probs[:, 0, :draft_len].double()  # [B, L, V]
        _, wanted = _path_probs(draft_tokens, draft_probs, target_probs)
        removed = target.scatter(-1, draft_tokens[:, 0].unsqueeze(-1), 0.0)
        vocab_size = target.shape[-1]
        # Where target(x) = 1 the removed row is empty, but then x is always accepted.
        correction = normalise(removed.reshape(-1, vocab_size), target.reshape(-1, vocab_size)).reshape(target.shape)
        return wanted, correction, target_probs[:, 0, -1].double()


class TargetOnlySiblings(Verifier):
    """SGLang's target-only sibling sampler, as fixed by sglang PR #35798 (strict coin test).

    One coin u per row walks the target's CDF with the distinct sibling candidates first (in
    draft order), then the other tokens in vocabulary order; the token whose CDF interval
    ``[c_{i-1}, c_i)`` contains u is emitted.  A candidate so drawn is accepted (then a bonus is
    drawn from the target after it); any other token is the correction.  Exact whatever the
    drafts (the output is a target sample), with acceptance ``target(distinct candidates)``,
    below alpha* (sglang #9877: the draft probabilities are ignored).  L = 1, any K.
    Randomness: one uniform call of shape ``[batch_size, 2]`` (coin, bonus).
    """

    name = "target-only-siblings"
    description = "SGLang target-only sibling sampler (strict coin, PR #35798); exact, ignores draft probs"
    expected = "exact"
    max_draft_len = 1
    inclusive_coin = False

    def _ordered(self, draft_tokens, target_probs):
        """Vocabulary order with the distinct candidates first: ``order [B, V]``, ``is_candidate [B, V]``."""
        batch_size, num_drafts, _ = draft_tokens.shape
        vocab_size = target_probs.shape[-1]
        device = draft_tokens.device
        tokens = draft_tokens[:, :, 0]
        rank = torch.arange(vocab_size, device=device).expand(batch_size, vocab_size) + num_drafts
        # Each candidate takes its first position among the drafts (scatter_reduce keeps the min).
        position = torch.arange(num_drafts, device=device).expand(batch_size, num_drafts)
        rank = rank.scatter_reduce(1, tokens, position, reduce="amin")
        order = rank.argsort(dim=-1)  # ranks are distinct
        is_candidate = torch.zeros(batch_size, vocab_size, dtype=torch.bool, device=device).scatter(1, tokens, True)
        return order, is_candidate

    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        batch_size, num_drafts, _ = draft_tokens.shape
        device = draft_tokens.device
        rows = torch.arange(batch_size, device=device)
        target = target_probs[:, 0, 0].double()
        order, is_candidate = self._ordered(draft_tokens, target_probs)
        cdf = target.gather(1, order).cumsum(-1)
        u = uniform(generator, (batch_size, 2), device)
        coin = u[:, :1]
        # strict: the first interval whose right end exceeds the coin; the bug includes the end.
        hit = cdf >= coin if self.inclusive_coin else cdf > coin
        # A coin above a total that rounded below 1 takes the last slot of positive mass.
        last = (target.gather(1, order) > 0).to(torch.int8).flip(-1).argmax(-1)
        slot = torch.where(hit.any(-1), hit.to(torch.int8).argmax(-1), order.shape[1] - 1 - last)
        token = order[rows, slot]
        accepted = is_candidate[rows, token]
        index = (draft_tokens[:, :, 0] == token.unsqueeze(1)).to(torch.int8).argmax(-1)
        bonus = sample_categorical(target_probs[rows, index, 1].double(), u[:, 1])
        num_accepted = accepted.to(torch.int64)
        draft_index = torch.where(accepted, index, torch.zeros_like(index))
        return VerifyOutput(num_accepted, draft_index, torch.where(accepted, bonus, token))

    def _output_probs(self, draft_tokens, draft_probs, target_probs) -> torch.Tensor:
        batch_size, num_drafts, _ = draft_tokens.shape
        vocab_size = target_probs.shape[-1]
        target = target_probs[:, 0, 0].double()
        _, is_candidate = self._ordered(draft_tokens, target_probs)
        out = torch.zeros(batch_size, num_drafts, 2, vocab_size, dtype=torch.float64, device=target.device)
        out[:, 0, 0] = torch.where(is_candidate, torch.zeros_like(target), target)
        tokens = draft_tokens[:, :, 0]
        first = first_occurrence(tokens, torch.ones_like(tokens, dtype=torch.bool))  # [B, K]
        mass = target.gather(1, tokens) * first  # [B, K]: each distinct candidate once, at its first index
        out[:, :, 1] = mass.unsqueeze(-1) * target_probs[:, :, 1].double()
        return out


# ---------------------------------------------------------------------------------------------
# EDGE: coin boundaries (identical laws; only coin injection sees them)
# ---------------------------------------------------------------------------------------------


class TargetOnlyInclusiveCoinBug(TargetOnlySiblings):
    """sglang #35771 / PR #35798: "Target-only speculative sampler can accept a zero-probability draft".

    The coin test was inclusive (``coin <= cumulative``), so a coin of exactly 0 accepted a
    candidate of target probability 0, and a coin on an interior CDF boundary landed in the
    earlier bucket.  The law is the fixed one's (boundaries have measure zero); the regression
    table of entry 18 pins it with injected coins.  Fixed: ``target-only-siblings``.
    """

    name = "target-only-inclusive-coin"
    description = "sglang #35771: inclusive coin test accepts a zero-probability candidate at coin 0"
    expected = None
    inclusive_coin = True


class InclusiveCoinBug(_SpeculativeChain):
    """vLLM v1 rejection sampler comment / pytorch #16706: a coin of exactly 0 accepts a zero-target draft.

    The acceptance test ``target(x) / draft(x) >= u`` is inclusive, and float32 ``torch.rand``
    can return exactly 0 (pytorch #16706), so a drafted token with target probability 0 can be
    accepted (vLLM draws float64 uniforms to make this rare; SGLang #35771 is the same class).
    Speculative sampling with ``u <= min(1, q/p)``; the law equals the correct one, so only an
    injected ``u = 0`` (entry 9) shows it.  Fixed: ``speculative`` (strict ``u <``).
    """

    name = "inclusive-coin"
    description = "vllm v1 / pytorch #16706: inclusive acceptance test, u = 0 accepts target(x) = 0"
    expected = None
    inclusive_accept = True  # the slip; the levels are speculative sampling's


# ---------------------------------------------------------------------------------------------
# Sampler-only (no exact law): audited statistically
# ---------------------------------------------------------------------------------------------


class DraftProbsMutatedBug(Verifier):
    """vllm #16952 (``[BugFix][Spec Decode] No in-place update to draft probs``).

    The drafter sampled its token by an exponential race, ``probs.div_(E).argmax()`` with
    ``E ~ Exp(1)`` per vocabulary entry, and the in-place ``div_`` left ``probs / E`` in the
    draft probabilities that verification then read.  Reproduced here inside the verifier: given
    the drafted token x, the race noise is drawn from its law conditional on x winning (by
    memorylessness, ``E_x = draft(x) m`` and ``E_y = draft(y) m + G_y`` with ``m, G_y ~ Exp(1)``), the
    draft row is replaced by ``draft / E``, and speculative sampling runs on that.  The
    acceptance of x becomes ``target(x) (1 - exp(-1 / target(x)))`` whatever the draft, and the
    residual is random.  No exact law (the residual's law is a (V-1)-dimensional integral): the
    statistical audit judges it.  Case (entry 1): target (.7, .3), draft (.3, .7):
    acceptance .362 instead of .6.  Fixed: ``speculative``.  Randomness: per level, one uniform
    call of shape ``[batch_size, vocab_size + 1]`` (the race noise, by inversion), then the
    chain's ``[batch_size, draft_len + 1]``.
    """

    name = "draft-probs-mutated"
    description = "vllm #16952: draft probs divided in place by the drafter's exponential race noise"
    expected = "inexact"
    max_drafts = 1

    def _verify(self, draft_tokens, draft_probs, target_probs, generator) -> VerifyOutput:
        batch_size, _, draft_len = draft_tokens.shape
        device = draft_tokens.device
        draft = draft_probs[:, 0].double()  # [B, L, V]
        mutated = []
        for level in range(draft_len):
            noise = -torch.log1p(-uniform(generator, (batch_size, draft.shape[-1] + 1), device))  # Exp(1)
            race_min, extra = noise[:, :1], noise[:, 1:]
            token = draft_tokens[:, 0, level : level + 1]
            row = draft[:, level]
            exp_noise = (row * race_min + extra).scatter(1, token, gather_tokens(row, token) * race_min)
            mutated.append(torch.where(row > 0, row / exp_noise, torch.zeros_like(row)))
        mutated_probs = torch.stack(mutated, 1).unsqueeze(1)  # [B, 1, L, V]: no longer sums to 1
        accept_probs, residual = _maximal_coupling_levels(draft_tokens, mutated_probs, target_probs)
        return chain_sample(accept_probs, residual, target_probs[:, 0, -1].double(), generator)


# ---------------------------------------------------------------------------------------------
# Block verification with the token-wise residual (built lazily: needs verifiers/block.py)
# ---------------------------------------------------------------------------------------------


def _block_tokenwise_residual_class():
    # deferred: the library imports without verifiers/block.py (the class is built on first access)
    from spectr_audit.verifiers.block import BlockVerification

    class BlockTokenwiseResidualBug(BlockVerification):
        """vllm-ascend PR #3794 ("MagicMTP"), issue #7807 / PR #7808: block verify with the token-wise residual.

        Block verification's acceptance (clamped cumulative ratios, last passing level), but the
        correction after ``x^tau`` drawn from the token-wise residual ``(q - p)_+`` instead of
        ``(p_tau q - p)_+``: "uses the same acceptance criteria as the token-wise algorithm and
        does not adjust the distribution" (fixed to Sun et al. Eq. 4/5).  Case (entry
        16): draft (2/3, 1/3), target (1/3, 2/3), L = 2, 3.  Fixed: ``block``.
        """

        name = "block-tokenwise-residual"
        description = "vllm-ascend #3794 / #7807: block verification with the token-wise residual"
        expected = "inexact"
        min_draft_len = 2

        def _levels(self, draft_tokens, draft_probs, target_probs):
            pass_probs, _ = super()._levels(draft_tokens, draft_probs, target_probs)
            draft_len = draft_tokens.shape[-1]
            tokenwise = (target_probs[:, 0, :draft_len].double() - draft_probs[:, 0].double()).clamp(min=0)
            return pass_probs, tokenwise

    BlockTokenwiseResidualBug.__module__ = __name__
    BlockTokenwiseResidualBug.__qualname__ = "BlockTokenwiseResidualBug"
    return BlockTokenwiseResidualBug


def __getattr__(name: str):
    # PEP 562: built on first access, so this module imports without verifiers/block.py.
    if name == "BlockTokenwiseResidualBug":
        cls = _block_tokenwise_residual_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
