"""What every engine adapter shares: deterministic seeding of the engine's RNG, thread control."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from spectr_audit.contract.verifier import Verifier
from spectr_audit.contract.randomness import RandomSource, uniform

__all__ = ["EngineVerifier", "seed_from", "engine_rng"]


def seed_from(generator: RandomSource) -> int:
    """One 53-bit seed drawn from ``generator`` (a ``torch.Generator``, injected uniforms, or None)."""
    u = uniform(generator, (1,), torch.device("cpu"))
    return int(float(u[0]) * 2**53)


@contextlib.contextmanager
def engine_rng(generator: RandomSource, num_threads: Optional[int] = None) -> Iterator[int]:
    """Run an engine on the global torch RNG seeded from ``generator``; restore the RNG and threads after.

    ``num_threads``: ``torch.set_num_threads`` inside the block (loops of small batch-1 calls
    run far faster on one thread); ``None`` leaves it alone.
    """
    seed = seed_from(generator)
    previous_threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        try:
            yield seed
        finally:
            if num_threads is not None:
                torch.set_num_threads(previous_threads)


class EngineVerifier(Verifier):
    """Base of the engine adapters: black boxes (no exact law), audited statistically.

    Subclasses set ``engine`` (the package) and ``engine_version`` (read when built).
    """

    engine: str = ""
    engine_version: str = ""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.engine} {self.engine_version}>"
