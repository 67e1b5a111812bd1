"""Deprecated alias of :mod:`spectr_audit.generation.cases`, where the module moved.

Importing it warns with ``DeprecationWarning``; it offers the same names, read from the new module on access
(through :mod:`importlib`, so the alias adds no import edge to the layering).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_NEW = "spectr_audit.generation.cases"
__all__ = list(getattr(importlib.import_module(_NEW), "__all__", ()))

warnings.warn(f"{__name__} is deprecated: import {_NEW}", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    return getattr(importlib.import_module(_NEW), name)
