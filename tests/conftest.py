"""Fixtures shared by the whole test suite.

Shared models live in :mod:`tests._models` (module-level objects: case tables need them at import
time), shared statistical helpers in :mod:`tests._stats`, and every slow oracle in :mod:`tests.oracles`.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, settings

# Hypothesis's explain phase re-runs a failing example under a line tracer to say which lines it
# reached; through torch that takes hours, so a failure would stall the run instead of being
# reported.  The shrunk example and its traceback are reported as usual.  Profiles: "default" (here
# and locally) and "ci" (hypothesis selects it when the CI variable is set) both drop the phase.
_PHASES = tuple(phase for phase in Phase if phase is not Phase.explain)
settings.register_profile("default", phases=_PHASES)
settings.register_profile("ci", settings.get_profile("ci"), phases=_PHASES)
_current = getattr(settings, "get_current_profile_name", lambda: "default")()
settings.load_profile("ci" if _current == "ci" else "default")


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op torch thread for the duration of a module.

    The tensors in the audit tests are small; one thread avoids oversubscribing a shared CI runner
    (with 2 threads on a busy 2-core machine those tests ran 10x slower).  A module opts in with
    ``pytestmark = pytest.mark.usefixtures("single_thread")``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
