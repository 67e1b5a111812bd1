"""Fixtures shared by the whole test suite.

Shared models live in :mod:`tests._models` (module-level objects: case tables need them at import
time), shared statistical helpers in :mod:`tests._stats`, and every slow oracle in :mod:`tests.oracles`.
"""

from __future__ import annotations

import pytest
import torch


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
