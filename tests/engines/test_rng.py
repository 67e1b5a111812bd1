"""Seeding and restoring engines' random sources (spectr_audit/engines/rng.py, engines/_base.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from spectr_audit.contract.randomness import InjectedUniforms
from spectr_audit.engines._base import engine_rng, seed_from as base_seed_from
from spectr_audit.engines.rng import EngineSeeds, derive_seed, engine_random_state, request_generators, seed_from
from spectr_audit.errors import InvalidArgument


def _draw_all(gens):
    return (random.random(), float(np.random.random()), torch.rand(1).item(), [g.initial_seed() and torch.rand(1, generator=g).item() for g in gens])


def _snapshot(gens):
    return random.getstate(), np.random.get_state()[1].copy(), torch.random.get_rng_state().clone(), [g.get_state().clone() for g in gens]


def test_every_source_restored():
    gens = [torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)]
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    before = _snapshot(gens)
    with engine_random_state(torch.Generator().manual_seed(0), request_generators=gens):
        _draw_all(gens)
    after = _snapshot(gens)
    assert before[0] == after[0]
    assert (before[1] == after[1]).all()
    assert torch.equal(before[2], after[2])
    assert all(torch.equal(a, b) for a, b in zip(before[3], after[3]))


def test_restored_when_the_block_raises():
    random.seed(5)
    expected = random.random()
    random.seed(5)
    with pytest.raises(RuntimeError):
        with engine_random_state(None):
            random.random()
            raise RuntimeError("engine failed")
    assert random.random() == expected


def test_seeding_is_reproducible_and_depends_on_the_generator():
    def run(seed):
        gens = {3: torch.Generator(), 7: torch.Generator()}
        with engine_random_state(torch.Generator().manual_seed(seed), request_generators=gens) as seeds:
            return seeds, _draw_all(list(gens.values()))

    seeds_a, draws_a = run(0)
    seeds_b, draws_b = run(0)
    seeds_c, draws_c = run(1)
    assert seeds_a == seeds_b and draws_a == draws_b
    assert draws_a[0] != draws_c[0] and draws_a[1] != draws_c[1] and draws_a[2] != draws_c[2]
    assert draws_a[3][0] != draws_a[3][1]  # two requests, two streams
    assert seeds_a.requests == {3: seeds_a.request(3), 7: seeds_a.request(7)}


def test_one_uniform_drawn_whatever_is_seeded():
    for kwargs in (dict(), dict(python=False, numpy=False), dict(request_generators=[torch.Generator()] * 3)):
        audit = torch.Generator().manual_seed(4)
        with engine_random_state(audit, **kwargs):
            pass
        reference = torch.Generator().manual_seed(4)
        torch.rand(1, generator=reference, dtype=torch.float64)
        assert torch.equal(audit.get_state(), reference.get_state())


def test_request_generator_depends_on_its_row_only():
    alone = request_generators(99, [5])[5]
    among = request_generators(99, 8)[5]
    assert torch.rand(3, generator=alone).tolist() == torch.rand(3, generator=among).tolist()
    seeds = EngineSeeds(seed=99, python=0, numpy=0, requests={})
    assert request_generators(99, [2])[2].initial_seed() == seeds.request(2)


def test_old_engine_rng_unchanged():
    """engine_rng is the torch-only case: torch.manual_seed(seed_from(generator)), as before."""
    with engine_rng(torch.Generator().manual_seed(8)) as seed:
        inside = torch.rand(4)
    expected_seed = int(float(torch.rand(1, generator=torch.Generator().manual_seed(8), dtype=torch.float64)[0]) * 2**53)
    assert seed == expected_seed
    torch.manual_seed(expected_seed)
    assert torch.equal(inside, torch.rand(4))
    assert base_seed_from is seed_from
    random.seed(3)
    with engine_rng(None):
        pass
    assert random.random() == random.Random(3).random()  # Python's random left alone


def test_threads_restored():
    before = torch.get_num_threads()
    with engine_random_state(None, num_threads=1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_injected_uniforms_give_the_seed():
    with engine_random_state(InjectedUniforms([0.5])) as seeds:
        pass
    assert seeds.seed == 2**52 and seed_from(InjectedUniforms([0.0])) == 0


def test_derive_seed_table():
    assert derive_seed(0) != derive_seed(1)
    assert derive_seed(5, 1) != derive_seed(5, 2)
    assert derive_seed(5, 3, 0) != derive_seed(5, 3, 1)
    assert all(0 <= derive_seed(s, *p) < 2**63 for s in (0, 2**53 - 1) for p in ((), (1,), (3, 10**9)))
    # SplitMix64's first output from state 0 (its published test vector)
    assert derive_seed(0) == 0xE220A8397B1DCDAF >> 1


def test_bad_request_generators():
    with pytest.raises(InvalidArgument, match="request_generators: row 1 holds int, not a torch.Generator"):
        with engine_random_state(None, request_generators=[torch.Generator(), 3]):
            pass
