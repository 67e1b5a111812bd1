"""Moved public modules keep their old import path for one minor release, with a warning naming the new one.

An alias module (``spectr_audit/models.py`` for :mod:`spectr_audit.drafting.models`) is two lines: it calls
:func:`moved_module`, which warns (a :class:`DeprecationWarning` naming the new path and the release that
drops the alias) and binds every public name of the new module, and any renamed one under its old name.
``tests/test_public_api.py`` lists the aliases and checks each.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Optional

__all__ = ["REMOVED_IN", "moved_module"]

#: The release that drops the aliases of this one.
REMOVED_IN = "0.2"


def moved_module(old: str, new: str, namespace: dict, renamed: Optional[dict] = None) -> None:
    """Warn that ``old`` moved to ``new`` and bind ``new``'s public names (and ``renamed``: old name -> new
    name) in ``namespace``, the alias module's globals; any other name is read from ``new`` on access."""
    warnings.warn(f"{old} is deprecated: it moved to {new}; import from {new} (the old path goes in spectr-audit "
                  f"{REMOVED_IN})", DeprecationWarning, stacklevel=3)
    module = importlib.import_module(new)
    names = list(getattr(module, "__all__", ()))
    for name in names:
        namespace[name] = getattr(module, name)
    for old_name, new_name in (renamed or {}).items():
        namespace[old_name] = getattr(module, new_name)
        names.append(old_name)
    namespace["__all__"] = names
    # any other name (a private one a caller reached for) is read from the new module on access
    namespace["__getattr__"] = lambda name: getattr(module, name)
