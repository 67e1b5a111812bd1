"""Seeding and restoring an engine's own random sources from the audit's generator.

Engines draw from their own sources: Python's ``random``, NumPy's global generator, torch's
global generator, and per-request ``torch.Generator`` objects (vLLM's
``SamplingMetadata.generators``).  An audit must make them reproducible from its own
``generator`` without disturbing the caller's state.  :func:`engine_random_state` draws **one**
53-bit seed from the audit's generator (whatever sources are seeded, so the audit's own stream
does not depend on the engine), derives one seed per source from it, seeds the sources, and
restores every one of them afterwards, also when the block raises.

Derived seeds are SplitMix64 steps over ``(seed, source, row)``: distinct sources and rows get
unrelated streams, and a per-request generator's seed depends on its row index only, not on
which other rows exist (what :mod:`spectr_audit.engines.workers` relies on to give the same
results for any number of workers).

Examples
--------
>>> import random, torch
>>> with engine_random_state(torch.Generator().manual_seed(0)) as seeds:
...     first = (random.random(), torch.rand(1).item())
>>> with engine_random_state(torch.Generator().manual_seed(0)) as again:
...     second = (random.random(), torch.rand(1).item())
>>> first == second and seeds == again
True
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from typing import Iterator, Mapping, Optional, Sequence, Union

import torch

from spectr_audit.contract.randomness import RandomSource, splitmix64, uniform
from spectr_audit.errors import InvalidArgument

__all__ = [
    "EngineSeeds",
    "derive_seed",
    "engine_random_state",
    "request_generators",
    "seed_from",
]

_MASK64 = (1 << 64) - 1

#: Stream labels of the derived seeds.
_PYTHON, _NUMPY, _REQUEST = 1, 2, 3


def seed_from(generator: RandomSource) -> int:
    """One 53-bit seed drawn from ``generator`` (a ``torch.Generator``, injected uniforms, or None)."""
    u = uniform(generator, (1,), torch.device("cpu"))
    return int(float(u[0]) * 2**53)


def derive_seed(seed: int, *path: int) -> int:
    """A 63-bit seed derived from ``seed`` along ``path`` (e.g. ``(stream, row)``) by SplitMix64 steps.

    Examples
    --------
    >>> derive_seed(7, 3, 0) != derive_seed(7, 3, 1) != derive_seed(8, 3, 0)
    True
    """
    state = splitmix64(int(seed) & _MASK64)
    for label in path:
        state = splitmix64(state ^ (int(label) & _MASK64))
    return state >> 1  # non-negative and below 2**63: every library's seed setter takes it


def request_generators(seed: int, rows: Union[int, Sequence[int]], device: Union[str, torch.device] = "cpu") -> dict[int, torch.Generator]:
    """Per-request generators, row -> ``torch.Generator``, each seeded from ``seed`` and its row index.

    ``rows`` is a count (rows ``0 .. rows - 1``) or the row indices.  Row ``b``'s generator is the
    same whichever other rows are asked for.
    """
    indices = range(rows) if isinstance(rows, int) else [int(r) for r in rows]
    out = {}
    for row in indices:
        gen = torch.Generator(device=device)
        gen.manual_seed(derive_seed(seed, _REQUEST, row))
        out[row] = gen
    return out


@dataclasses.dataclass(frozen=True)
class EngineSeeds:
    """The seeds :func:`engine_random_state` used.

    Attributes
    ----------
    seed : int
        The one 53-bit seed drawn from the audit's generator; torch's global generator gets it
        as it is.
    python, numpy : int
        Derived seeds of Python's ``random`` and NumPy's global generator (NumPy takes it mod 2**32).
    requests : dict
        Row -> seed of each per-request generator seeded.
    """

    seed: int
    python: int
    numpy: int
    requests: dict

    def request(self, row: int) -> int:
        """The seed of row ``row``'s per-request generator (seeded or not)."""
        return derive_seed(self.seed, _REQUEST, row)


def _as_request_map(request_gens) -> dict:
    if request_gens is None:
        return {}
    items = request_gens.items() if isinstance(request_gens, Mapping) else enumerate(request_gens)
    out = {}
    for row, gen in items:
        if not isinstance(gen, torch.Generator):
            raise InvalidArgument(f"request_generators: row {row!r} holds {type(gen).__name__}, not a torch.Generator")
        out[int(row)] = gen
    return out


@contextlib.contextmanager
def engine_random_state(
    generator: RandomSource,
    *,
    python: bool = True,
    numpy: bool = True,
    torch_global: bool = True,
    cuda: bool = False,
    request_generators: Union[Mapping[int, torch.Generator], Sequence[torch.Generator], None] = None,
    num_threads: Optional[int] = None,
) -> Iterator[EngineSeeds]:
    """Seed an engine's random sources from ``generator`` for the block; restore them all after.

    Parameters
    ----------
    generator : torch.Generator, InjectedUniforms or None
        The audit's source; exactly one uniform is drawn from it.
    python, numpy, torch_global : bool
        Which global sources to seed (and restore).
    cuda : bool
        Also fork (save and restore) the CUDA generators of every visible device; torch's
        ``manual_seed`` seeds them.
    request_generators : mapping row -> torch.Generator, or a sequence, optional
        The engine's per-request generators; row ``b``'s is seeded with
        :meth:`EngineSeeds.request` ``(b)`` and restored afterwards.
    num_threads : int, optional
        ``torch.set_num_threads`` inside the block (loops of small batch-1 calls run far faster
        on one thread), restored after.

    Yields
    ------
    EngineSeeds
    """
    seeds_map = _as_request_map(request_generators)
    seed = seed_from(generator)
    seeds = EngineSeeds(
        seed=seed,
        python=derive_seed(seed, _PYTHON),
        numpy=derive_seed(seed, _NUMPY),
        requests={row: derive_seed(seed, _REQUEST, row) for row in seeds_map},
    )
    saved_requests = {row: gen.get_state() for row, gen in seeds_map.items()}
    python_state = random.getstate() if python else None
    np = None
    numpy_state = None
    if numpy:
        import numpy as np

        numpy_state = np.random.get_state()
    previous_threads = torch.get_num_threads()
    devices = list(range(torch.cuda.device_count())) if cuda and torch.cuda.is_available() else []
    fork = torch.random.fork_rng(devices=devices) if torch_global or devices else contextlib.nullcontext()
    try:
        with fork:
            if torch_global:
                torch.manual_seed(seed)
            if python:
                random.seed(seeds.python)
            if numpy:
                np.random.seed(seeds.numpy % 2**32)
            for row, gen in seeds_map.items():
                gen.manual_seed(seeds.requests[row])
            if num_threads is not None:
                torch.set_num_threads(num_threads)
            yield seeds
    finally:
        if num_threads is not None:
            torch.set_num_threads(previous_threads)
        if python:
            random.setstate(python_state)
        if numpy:
            np.random.set_state(numpy_state)
        for row, gen in seeds_map.items():
            gen.set_state(saved_requests[row])
