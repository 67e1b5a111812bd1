"""Running batch-1 engines over a batch in parallel worker processes, deterministically.

Many real verifiers handle one request at a time: a Python loop calls the engine's function
once per row (about 0.5 ms a row for a pure-torch verifier), and an audit needs hundreds of
thousands of rows.  :class:`RowParallelVerifier` splits each batch into chunks of rows and
runs them in worker processes (``multiprocessing`` with the ``spawn`` start method: engines
and their threads do not survive ``fork``), each worker building its own copy of the verifier
once.

Determinism: one 53-bit seed is drawn from the audit's generator per call, and row ``b`` is
verified with a fresh ``torch.Generator`` seeded by
:func:`~spectr_audit.engines.rng.derive_seed` ``(seed, stream, b)``.  The randomness is indexed
by row, never by worker or chunk, so the result is identical for any number of workers and any
chunk size, including ``num_workers=0`` (the same loop in this process).  A worker that dies (a
segfault in an extension, ``os._exit``) raises :class:`~spectr_audit.errors.VerifierError`
naming the rows it was verifying; the pool is rebuilt on the next call.

Examples
--------
>>> import torch
>>> from spectr_audit.verifiers.speculative import SpeculativeSampling
>>> rows = RowParallelVerifier(SpeculativeSampling, num_workers=0)   # 0: in this process
>>> draft = torch.tensor([[[[0.6, 0.4]]]]).expand(4, 1, 1, 2)
>>> target = torch.tensor([[[[0.3, 0.7], [0.5, 0.5]]]]).expand(4, 1, 2, 2)
>>> out = rows.verify(torch.zeros(4, 1, 1, dtype=torch.int64), draft, target, torch.Generator().manual_seed(0))
>>> out.num_accepted.shape
torch.Size([4])
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import weakref
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Optional, Union

import torch

from spectr_audit.contract.convert import as_verifier
from spectr_audit.contract.randomness import RandomSource
from spectr_audit.contract.verifier import SHAPE_ATTRS, Verifier, VerifyOutput, check_verify_output
from spectr_audit.engines.rng import derive_seed, seed_from
from spectr_audit.errors import InvalidArgument, VerifierError
from spectr_audit.registry import load_verifier

__all__ = ["RowParallelVerifier", "row_generator", "verify_rows"]

#: Stream label of the per-row generators (distinct from :mod:`spectr_audit.engines.rng`'s).
_ROW_STREAM = 17

_PASSTHROUGH = ("draft_scheme", *SHAPE_ATTRS, "expected", "guarantees", "description")

Factory = Union[str, Callable[[], Any], Verifier]


def row_generator(seed: int, row: int) -> torch.Generator:
    """The generator row ``row`` of a call seeded ``seed`` is verified with."""
    gen = torch.Generator()
    gen.manual_seed(derive_seed(seed, _ROW_STREAM, row))
    return gen


def _build(factory: Factory) -> Verifier:
    """A verifier from a registered name or import string, a zero-argument callable, or an instance."""
    if isinstance(factory, str):
        return load_verifier(factory)
    if isinstance(factory, Verifier):
        return factory
    if callable(factory):
        built = factory()
        return as_verifier(built) if not isinstance(built, Verifier) else built
    raise InvalidArgument(
        f"factory: expected a verifier name, a zero-argument callable or class, or a Verifier; got {type(factory).__name__}"
    )


def _verify_chunk(verifier: Verifier, start: int, seed: int, draft_tokens, draft_probs, target_probs) -> VerifyOutput:
    """Verify rows ``start ..`` of a chunk one at a time, row ``b`` with :func:`row_generator` ``(seed, b)``."""
    fields = ([], [], [])
    for offset in range(draft_tokens.shape[0]):
        row = slice(offset, offset + 1)
        out = verifier.verify(
            draft_tokens[row], draft_probs[row], target_probs[row], row_generator(seed, start + offset), validate=False
        )
        if out.correction is not None:
            raise VerifierError(f"{verifier.name}: a row-parallel verifier cannot carry a correction to the next iteration")
        for field, value in zip(fields, (out.num_accepted, out.draft_index, out.next_token)):
            field.append(value.reshape(1).to("cpu", torch.int64))
    return VerifyOutput(*(torch.cat(field) for field in fields))


# -- the worker side ------------------------------------------------------------------------------
_WORKER_VERIFIER: Optional[Verifier] = None


def _init_worker(factory: Factory, num_threads: Optional[int]) -> None:
    global _WORKER_VERIFIER
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    _WORKER_VERIFIER = _build(factory)


def _worker_chunk(start: int, seed: int, draft_tokens, draft_probs, target_probs):
    out = _verify_chunk(_WORKER_VERIFIER, start, seed, draft_tokens, draft_probs, target_probs)
    return out.num_accepted, out.draft_index, out.next_token


def _shutdown(pool) -> None:
    pool.shutdown(wait=False, cancel_futures=True)


class RowParallelVerifier(Verifier):
    """A batch-1 verifier run row by row, in ``num_workers`` worker processes.

    Parameters
    ----------
    factory : str, callable or Verifier
        How each process gets its verifier: a registered name or import string (resolved by
        :func:`spectr_audit.registry.load_verifier` in the worker), a picklable zero-argument
        callable such as a verifier class or a module-level function, or a picklable instance.
        It is also built once here, for its attributes and for ``num_workers=0``.
    num_workers : int
        Worker processes; 0 runs the same row loop in this process.
    chunk_size : int
        Rows per task sent to a worker.
    threads_per_worker : int or None
        ``torch.set_num_threads`` in each worker (default 1: many processes, one thread each).
    name : str, optional
        Defaults to the wrapped verifier's name.

    Notes
    -----
    The verifier's exact law is not forwarded (audit the wrapped verifier itself for that); the
    wrapper is for black-box engines audited statistically.  Call :meth:`close` (or use it as a
    context manager) to stop the workers; they are also stopped when the object is collected.
    """

    def __init__(
        self,
        factory: Factory,
        *,
        num_workers: int = 2,
        chunk_size: int = 64,
        threads_per_worker: Optional[int] = 1,
        name: Optional[str] = None,
    ):
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise InvalidArgument(f"num_workers: expected an integer >= 0, got {num_workers!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise InvalidArgument(f"chunk_size: expected an integer >= 1, got {chunk_size!r}")
        self.factory = factory
        self.inner = _build(factory)
        self.num_workers = num_workers
        self.chunk_size = chunk_size
        self.threads_per_worker = threads_per_worker
        self.name = name or self.inner.name
        for attr in _PASSTHROUGH:
            setattr(self, attr, getattr(self.inner, attr))
        self._pool = None
        self._finalizer = None

    # -- the pool ------------------------------------------------------------------------------
    def _executor(self):
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=self.num_workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(self.factory, self.threads_per_worker),
            )
            self._finalizer = weakref.finalize(self, _shutdown, self._pool)
        return self._pool

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        if self._pool is not None:
            self._finalizer.detach()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "RowParallelVerifier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_pool"] = state["_finalizer"] = None
        return state

    # -- verification --------------------------------------------------------------------------
    def _verify(self, draft_tokens, draft_probs, target_probs, generator: RandomSource) -> VerifyOutput:
        batch_size, num_drafts, draft_len = draft_tokens.shape
        seed = seed_from(generator)
        device = draft_tokens.device
        tokens, drafts, targets = draft_tokens.cpu(), draft_probs.cpu(), target_probs.cpu()
        starts = list(range(0, batch_size, self.chunk_size))
        if self.num_workers == 0 or batch_size == 0:
            parts = [
                _verify_chunk(self.inner, s, seed, tokens[s : s + self.chunk_size], drafts[s : s + self.chunk_size], targets[s : s + self.chunk_size])
                for s in starts
            ]
            fields = [(p.num_accepted, p.draft_index, p.next_token) for p in parts]
        else:
            fields = self._run_in_workers(starts, seed, tokens, drafts, targets)
        if not fields:
            empty = torch.zeros(0, dtype=torch.int64)
            return VerifyOutput(empty, empty.clone(), empty.clone())
        out = VerifyOutput(*(torch.cat([f[i] for f in fields]).to(device) for i in range(3)))
        return check_verify_output(out, batch_size, num_drafts, draft_len, draft_probs.shape[-1], who=self.name)

    def _run_in_workers(self, starts, seed, tokens, drafts, targets):
        pool = self._executor()
        chunk = self.chunk_size
        futures = [
            pool.submit(_worker_chunk, s, seed, tokens[s : s + chunk].clone(), drafts[s : s + chunk].clone(), targets[s : s + chunk].clone())
            for s in starts
        ]
        results = []
        for start, future in zip(starts, futures):
            rows = f"rows {start}..{min(start + chunk, tokens.shape[0]) - 1}"
            try:
                results.append(future.result())
            except BrokenProcessPool as exc:
                self._discard_pool()
                raise VerifierError(
                    f"{self.name}: a worker process died while verifying {rows} ({exc}); the pool will be rebuilt on the next call"
                ) from exc
            except (VerifierError, InvalidArgument):
                raise
            except Exception as exc:
                raise VerifierError(f"{self.name}: verifying {rows} in a worker raised {type(exc).__name__}: {exc}") from exc
        return results

    def _discard_pool(self) -> None:
        if self._pool is not None:
            self._finalizer.detach()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def verify_rows(
    factory: Factory,
    draft_tokens: torch.Tensor,  # [batch_size, num_drafts, draft_len]
    draft_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len, vocab_size]
    target_probs: torch.Tensor,  # [batch_size, num_drafts, draft_len + 1, vocab_size]
    generator: RandomSource = None,
    *,
    num_workers: int = 2,
    chunk_size: int = 64,
) -> VerifyOutput:
    """One batch through :class:`RowParallelVerifier`, its workers stopped afterwards."""
    with RowParallelVerifier(factory, num_workers=num_workers, chunk_size=chunk_size) as verifier:
        return verifier.verify(draft_tokens, draft_probs, target_probs, generator)
