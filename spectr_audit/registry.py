"""Find verifiers by short name or import string; built-ins are imported lazily."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from spectr_audit.contract.verifier import Verifier, as_verifier
from spectr_audit.errors import InvalidArgument

__all__ = ["BUILTIN_VERIFIERS", "builtin_names", "load_verifier", "load_object", "builtin_verifiers"]

#: Short name -> "module:attribute".  Imported only when asked for.
BUILTIN_VERIFIERS: dict[str, str] = {
    "speculative": "spectr_audit.verifiers.speculative:SpeculativeSampling",
    "kseq": "spectr_audit.verifiers.kseq:KSeq",
    "spectr-tree": "spectr_audit.verifiers.kseq:SpecTrTree",
    "rrs": "spectr_audit.verifiers.recursive_rejection:RecursiveRejection",
    "rrs-wor": "spectr_audit.verifiers.recursive_rejection:RecursiveRejectionWithoutReplacement",
    "block": "spectr_audit.verifiers.block:BlockVerification",
    "greedy-block": "spectr_audit.verifiers.greedy_block:GreedyBlockVerification",
    "greedy-block-repaired": "spectr_audit.verifiers.greedy_block:RepairedGreedyBlockVerification",
    "spectr-gbv-published": "spectr_audit.verifiers.spectr_gbv:PublishedSpecTrGBV",
    "spectr-gbv-published-alg2": "spectr_audit.verifiers.spectr_gbv:PublishedSpecTrGBVWithCorrection",
}


def builtin_names() -> list[str]:
    """Short names of the built-in verifiers, in registry order."""
    return list(BUILTIN_VERIFIERS)


def builtin_verifiers() -> list[Verifier]:
    """A fresh instance of every built-in verifier."""
    return [load_verifier(name) for name in BUILTIN_VERIFIERS]


def load_object(spec: str, argument: str = "verifier") -> Any:
    """Import ``package.module:attr`` or ``path/to/file.py:attr`` (``attr`` may be dotted)."""
    if ":" not in spec:
        raise InvalidArgument(
            f"{argument}: {spec!r} is neither a built-in name ({', '.join(BUILTIN_VERIFIERS)}) "
            f"nor an import string 'package.module:attr' or 'path/to/file.py:attr'"
        )
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise InvalidArgument(f"{argument}: malformed import string {spec!r}")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target)
        if not path.is_file():
            raise InvalidArgument(f"{argument}: file {target!r} does not exist")
        mod_name = f"_spectr_audit_user_{abs(hash(str(path.resolve())))}"
        spec_obj = importlib.util.spec_from_file_location(mod_name, path)
        if spec_obj is None or spec_obj.loader is None:
            raise InvalidArgument(f"{argument}: cannot load {target!r} as a Python file")
        module = importlib.util.module_from_spec(spec_obj)
        sys.modules[mod_name] = module
        try:
            spec_obj.loader.exec_module(module)
        except Exception as exc:
            raise InvalidArgument(f"{argument}: importing {target!r} failed: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise InvalidArgument(f"{argument}: cannot import module {target!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise InvalidArgument(f"{argument}: {target!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def load_verifier(spec: Any) -> Verifier:
    """Return a :class:`Verifier` for a short name, an import string, or an object.

    Examples
    --------
    >>> load_verifier("kseq").name
    'kseq'
    """
    if isinstance(spec, str):
        if spec in BUILTIN_VERIFIERS:
            module, _, attr = BUILTIN_VERIFIERS[spec].partition(":")
            return getattr(importlib.import_module(module), attr)()
        name = spec.rpartition(":")[2]
        return _named(load_object(spec), name)
    return as_verifier(spec)


def _named(obj: Any, default_name: str) -> Verifier:
    verifier = as_verifier(obj)
    if not verifier.name:
        verifier.name = default_name
    return verifier
