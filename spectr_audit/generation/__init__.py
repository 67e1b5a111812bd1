"""The generation audit: what an engine's ``generate()`` emits, every token, against the target model's own law.

The whole audit lives here, from an engine spec to the verdict and its reports' data:

* the entry point: :func:`audit_generation` (:mod:`.audit`) and its result (:mod:`.results`);
* the contract (:mod:`.contract`): generators, scorers, their outputs;
* the options (:mod:`.options`), the batch designs and the jobs they plan (:mod:`.designs`), and the
  request that holds them with the wrapped components, built once (:mod:`.request`);
* the method: the randomized PIT and surprisal of every token (:mod:`.pit`), scoring a job
  (:mod:`.scoring`) into its typed record (:mod:`.records`), the stopping rules and the job schedule
  (:mod:`.schedule`), the sample store (:mod:`.store`), the statistical tests (:mod:`.statistical_tests`), the plan of their Holm family
  (:mod:`.family`) and the analysis that builds and decides it (:mod:`.analysis`);
* the faces: engines by spec (:mod:`.engine_specs`), the ``[[generation]]`` cases of suites
  (:mod:`.cases`) and their runner (:mod:`.suite`), the verdict in words and the written reports
  (:mod:`.verdict`), the assertions an engine author calls (:mod:`.checks`);
* :mod:`.library`: a correct generation loop over a small model pair and planted slips;
* :mod:`.tests`: a deprecated alias of :mod:`.statistical_tests`.

The adapters that put whole engines (transformers, vLLM, llama.cpp, an OpenAI-compatible server, the
project's own SmolLM2 loop) behind the contract are :mod:`spectr_audit.engine_adapters`: they load real
models, a layer above this package and the runner.

The names below load their modules when first read, so the torch-free faces (:mod:`.cases`,
:mod:`.engine_specs`, :mod:`.checks`, :mod:`.verdict`) import without torch.  docs/generation.md describes
the contract and the method.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "ARMS",
    "GenerationAuditResult",
    "GenerationContractError",
    "GenerationInterrupted",
    "GenerationOutput",
    "ScoredLogits",
    "as_generator",
    "as_scorer",
    "audit_generation",
]

#: Where each name lives.
_HOMES = {
    "ARMS": "designs",
    "GenerationAuditResult": "results",
    "GenerationContractError": "contract",
    "GenerationInterrupted": "audit",
    "GenerationOutput": "contract",
    "ScoredLogits": "contract",
    "as_generator": "contract",
    "as_scorer": "contract",
    "audit_generation": "audit",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
