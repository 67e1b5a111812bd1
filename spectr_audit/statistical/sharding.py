"""Sampling in chunks with one random stream per chunk, sharded over processes by ``torch.distributed``.

Every chunk of an audit draws from its own ``torch.Generator``, seeded by
:func:`chunk_seed` ``(seed, stream, chunk index)``: the randomness is indexed by chunk, never
by process, so a chunk's counts are the same whichever process computes it.  With a
``torch.distributed`` process group of W processes (gloo on CPU, NCCL on GPU), the chunks run in
rounds: process w computes chunk ``round * W + w``, the per-chunk statistics are gathered
(:func:`run_chunks`), and every process replays them in chunk order through the same stopping
rule, so every process holds the same counts, and every count, interval and verdict is
bit-identical to a one-process run (counts are integers in float64: sums are exact).  Chunks
computed past a stopping point in the same round are dropped.  Only a wall-time budget
(``max_seconds``) depends on speed, hence on W; it is decided by the first process, so all
agree.

Use: ``torchrun --nproc-per-node 4 -m spectr_audit run ...`` (the CLI joins the group), or
from Python, in every process, ``torch.distributed.init_process_group("gloo")`` before the
audit (any audit then shards over the default group), or :func:`spawn_local` to run a function
on W local gloo processes.  Every process must make the same audits in the same order.

Examples
--------
>>> chunk_seed(0, 1, 0) != chunk_seed(0, 1, 1) != chunk_seed(1, 1, 0)
True
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Any, Callable, Iterable, Optional, Union

import torch

from spectr_audit.contract.randomness import splitmix64
from spectr_audit.errors import InvalidArgument, SpectrAuditError

__all__ = ["Shards", "chunk_generator", "chunk_seed", "current_shards", "run_chunks", "spawn_local"]

_MASK64 = (1 << 64) - 1

#: Stream labels: each design of an audit draws from its own family of chunk streams.
MAIN_STREAM, STRATIFIED_STREAM, PERMUTATION_STREAM, AGREEMENT_STREAM = 1, 2, 3, 4


def chunk_seed(seed: int, stream: int, index: int) -> int:
    """The 63-bit seed of chunk ``index`` of ``stream`` in an audit seeded ``seed`` (SplitMix64 steps)."""
    state = splitmix64(int(seed) & _MASK64)
    state = splitmix64(state ^ (int(stream) & _MASK64))
    state = splitmix64(state ^ (int(index) & _MASK64))
    return state >> 1


def chunk_generator(seed: int, stream: int, index: int, device: Union[str, torch.device] = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with :func:`chunk_seed`."""
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(chunk_seed(seed, stream, index))
    return generator


@dataclasses.dataclass(frozen=True)
class Shards:
    """The processes an audit's chunks are spread over."""

    rank: int
    world_size: int
    group: Any = None
    #: where collectives run (a CUDA device for NCCL)
    device: torch.device = torch.device("cpu")


def current_shards(distributed: Union[bool, str, Any] = "auto") -> Optional[Shards]:
    """The default ``torch.distributed`` group when it is initialised with more than one process (else None).

    ``distributed``: ``"auto"`` (that group when there is one), ``False`` (never shard), ``True``
    (the default group, which must be initialised) or a process group.
    """
    if distributed is False:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        if distributed is True:
            raise InvalidArgument("distributed: True needs torch.distributed.init_process_group() first")
        return None
    group = None if isinstance(distributed, (bool, str)) else distributed
    world_size = dist.get_world_size(group)
    if world_size < 2:
        return None
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return Shards(dist.get_rank(group), world_size, group, device)


class WorkerFailed(SpectrAuditError):
    """Another process of the group failed while computing its chunk."""


def run_chunks(
    sizes: Iterable[int],
    compute: Callable[[int, int, int], torch.Tensor],
    consume: Callable[[int, int, int, torch.Tensor], Optional[str]],
    *,
    deadline: Optional[float] = None,
    shards: Optional[Shards] = None,
    ordered: bool = True,
) -> tuple[int, str]:
    """Run the chunks of ``sizes``; returns (samples consumed, stop reason).

    Parameters
    ----------
    sizes : iterable of int
        The chunk schedule.
    compute : callable
        ``compute(index, offset, size)``: run chunk ``index`` (its first sample is number
        ``offset``) and return its statistics, a 1-D float64 tensor of the same length for every
        chunk.
    consume : callable
        ``consume(index, offset, size, stats)``, called in chunk order: add a chunk's
        statistics; return a stop reason to end the run after it, or None.
    deadline : float, optional
        ``time.perf_counter()`` value after which no new chunk (round) starts: ``"max_seconds"``.
    shards : Shards, optional
        Spread the chunks over these processes (None: this process alone).
    ordered : bool
        With shards: gather every chunk's statistics and consume them in order (a stopping
        rule sees each chunk); False: sum a round's statistics and consume the sum once, as
        chunk ``index`` of the round's first (for designs that stop only on the deadline).
    """
    sizes = list(sizes)
    total = sum(sizes)
    offsets = [0]
    for size in sizes[:-1]:
        offsets.append(offsets[-1] + size)
    done = 0
    if shards is None:
        for index, (offset, size) in enumerate(zip(offsets, sizes)):
            reason = consume(index, offset, size, compute(index, offset, size))
            done += size
            if reason is not None:
                return done, reason
            if deadline is not None and done < total and time.perf_counter() >= deadline:
                return done, "max_seconds"
        return done, "planned"
    return _run_sharded(sizes, offsets, total, compute, consume, deadline, shards, ordered)


def _run_sharded(sizes, offsets, total, compute, consume, deadline, shards: Shards, ordered: bool) -> tuple[int, str]:
    import torch.distributed as dist

    world, rank, device = shards.world_size, shards.rank, shards.device
    done = 0
    width = None
    for start in range(0, len(sizes), world):
        index = start + rank
        error: Optional[BaseException] = None
        stats = None
        if index < len(sizes):
            try:
                stats = compute(index, offsets[index], sizes[index]).detach().double().cpu().reshape(-1)
            except Exception as exc:  # every process must reach the collective, or the others hang
                error = exc
        # the statistics' length: agreed from any process that computed a chunk
        local_width = torch.tensor([-1 if stats is None else stats.numel()], dtype=torch.int64, device=device)
        dist.all_reduce(local_width, op=dist.ReduceOp.MAX, group=shards.group)
        width = int(local_width.item())
        packed = torch.zeros(width + 2, dtype=torch.float64)
        if stats is not None:
            packed[:width] = stats
            packed[width] = 1.0  # present
        if error is not None:
            packed[width + 1] = 1.0
        packed = packed.to(device)
        if ordered:
            gathered = [torch.empty_like(packed) for _ in range(world)]
            dist.all_gather(gathered, packed, group=shards.group)
            rows = [g.cpu() for g in gathered]
        else:
            flags = packed[width:].clone()
            dist.all_reduce(packed, group=shards.group)
            rows = [packed.cpu()]
            failed = torch.zeros(world, dtype=torch.float64, device=device)
            failed[rank] = flags[1]
            dist.all_reduce(failed, group=shards.group)
        failures = ([w for w, row in enumerate(rows) if row[width + 1] > 0] if ordered
                    else [w for w in range(world) if failed[w] > 0])
        if failures:
            if error is not None:
                raise error
            raise WorkerFailed(f"process {failures[0]} of {world} failed computing chunk {start + failures[0]}; "
                               "see its output")
        if ordered:
            for w, row in enumerate(rows):
                chunk = start + w
                if chunk >= len(sizes):
                    break
                reason = consume(chunk, offsets[chunk], sizes[chunk], row[:width])
                done += sizes[chunk]
                if reason is not None:
                    return done, reason
        else:
            last = min(start + world, len(sizes))
            size = sum(sizes[start:last])
            reason = consume(start, offsets[start], size, rows[0][:width])
            done += size
            if reason is not None:
                return done, reason
        if deadline is not None and done < total:
            late = torch.tensor([1.0 if (rank == 0 and time.perf_counter() >= deadline) else 0.0],
                                dtype=torch.float64, device=device)
            dist.all_reduce(late, op=dist.ReduceOp.MAX, group=shards.group)
            if float(late.item()) > 0:
                return done, "max_seconds"
    return done, "planned"


# ---------------------------------------------------------------------------------------------
# Local process groups (tests, benchmarks, notebooks)
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spawned(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any, threads: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        value = fn(*args)
        if rank == 0:
            results.put(value)
    finally:
        dist.destroy_process_group()


def spawn_local(fn: Callable, num_processes: int, *args: Any, threads: int = 1) -> Any:
    """Run ``fn(*args)`` in ``num_processes`` local processes joined in a gloo group; returns rank 0's value.

    ``fn`` must be importable (a module-level function) and its value picklable.  Each process
    uses ``threads`` torch threads.  Localhost only.
    """
    import torch.multiprocessing as mp

    if not isinstance(num_processes, int) or num_processes < 1:
        raise InvalidArgument(f"num_processes: expected a positive integer, got {num_processes!r}")
    results = mp.get_context("spawn").SimpleQueue()
    processes = mp.start_processes(_spawned, args=(num_processes, _free_port(), fn, args, results, threads),
                                   nprocs=num_processes, join=False, start_method="spawn")
    # read before joining: a large value fills the pipe, and rank 0 waits for the reader to exit
    while True:
        if not results.empty():
            value = results.get()
            break
        if processes.join(timeout=0.05):
            if results.empty():
                raise WorkerFailed("spawn_local: every process ended and rank 0 returned nothing")
            value = results.get()
            break
    while not processes.join():
        pass
    return value
