"""What every engine adapter shares: deterministic seeding of the engine's RNG, thread control."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from spectr_audit.contract.verifier import Verifier
from spectr_audit.contract.randomness import RandomSource
from spectr_audit.engines.rng import engine_random_state, seed_from

__all__ = ["EngineVerifier", "seed_from", "engine_rng"]


@contextlib.contextmanager
def engine_rng(generator: RandomSource, num_threads: Optional[int] = None) -> Iterator[int]:
    """Run an engine on the global torch RNG seeded from ``generator``; restore the RNG and threads after.

    ``num_threads``: ``torch.set_num_threads`` inside the block (loops of small batch-1 calls
    run far faster on one thread); ``None`` leaves it alone.
    """
    # the torch-only case of the general helper (spectr_audit.engines.rng): one seed, torch.manual_seed(seed)
    with engine_random_state(generator, python=False, numpy=False, num_threads=num_threads) as seeds:
        yield seeds.seed


class EngineVerifier(Verifier):
    """Base of the engine adapters: black boxes (no exact law), audited statistically.

    Subclasses set ``engine`` (the package) and ``engine_version`` (read when built).
    """

    engine: str = ""
    engine_version: str = ""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.engine} {self.engine_version}>"
