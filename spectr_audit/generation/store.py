"""The generation audit's sample store: every finished job's records in SQLite (WAL), one transaction each.

An engine audit on a CPU can take an hour.  Each job's records (the per-token statistics and the
per-continuation facts) are written in one transaction as soon as the job is scored, so Ctrl-C or a
crash of the engine or of the process loses at most the job in flight; ``resume=True`` reads the
finished jobs back and runs only the others.  The store also holds the audit's configuration:
resuming with another one (other prompts, seed, arms, ...) is refused, since the jobs would not
be the same.

Each job is a :class:`~spectr_audit.generation.records.JobRecord`, saved in its stored form (named numpy
arrays) as ``.npz`` bytes (no pickling).
"""

from __future__ import annotations

import io
import json
import sqlite3
from pathlib import Path
from typing import Iterator, Optional, Union

import numpy as np

from spectr_audit.errors import InvalidArgument
from spectr_audit.generation.records import JobRecord

__all__ = ["SampleStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (job INTEGER PRIMARY KEY, arm TEXT NOT NULL, payload BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS failures (job INTEGER PRIMARY KEY, arm TEXT NOT NULL, message TEXT NOT NULL);
"""


def _pack(arrays: dict) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **{k: np.asarray(v) for k, v in arrays.items()})
    return buffer.getvalue()


def _unpack(blob: bytes) -> dict:
    with np.load(io.BytesIO(blob), allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


class SampleStore:
    """An SQLite file of finished jobs (or an in-memory one when ``path`` is None).

    Parameters
    ----------
    path : str or Path, optional
    config : dict
        The audit's configuration (JSON values); stored on creation, compared on resumption.
    resume : bool
        Keep the jobs already in the file (their configuration must match); otherwise an existing
        file is replaced.
    """

    def __init__(self, path: Optional[Union[str, Path]], config: dict, resume: bool = False):
        self.path = None if path is None else Path(path)
        if self.path is not None and self.path.exists() and not resume:
            for suffix in ("", "-wal", "-shm"):
                candidate = Path(str(self.path) + suffix)
                if candidate.exists():
                    candidate.unlink()
        if resume and (self.path is None or not self.path.exists()):
            where = "no store path" if self.path is None else f"{self.path} does not exist"
            raise InvalidArgument(f"resume: nothing to resume ({where})")
        self._db = sqlite3.connect(":memory:" if self.path is None else str(self.path))
        if self.path is not None:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        text = json.dumps(config, sort_keys=True)
        stored = self._db.execute("SELECT value FROM meta WHERE key = 'config'").fetchone()
        if stored is None:
            with self._db:
                self._db.execute("INSERT INTO meta VALUES ('config', ?)", (text,))
        elif stored[0] != text:
            old, new = json.loads(stored[0]), config
            differ = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            raise InvalidArgument(f"resume: the store {self.path} holds an audit with other settings "
                                  f"({', '.join(differ)} differ); start it afresh without resume")

    def put(self, job: int, arm: str, record: JobRecord) -> None:
        """Store one job's record in one transaction."""
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO jobs VALUES (?, ?, ?)",
                             (int(job), arm, _pack(record.to_stored())))
            self._db.execute("DELETE FROM failures WHERE job = ?", (int(job),))

    def fail(self, job: int, arm: str, message: str) -> None:
        """Record that a job's engine call failed (the audit goes on with the other arms)."""
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO failures VALUES (?, ?, ?)", (int(job), arm, message))

    def records(self) -> Iterator[tuple[int, str, JobRecord]]:
        """Every stored job's ``(job, arm, record)``, in job order."""
        for job, arm, blob in self._db.execute("SELECT job, arm, payload FROM jobs ORDER BY job"):
            yield job, arm, JobRecord.from_stored(_unpack(blob))

    def close(self) -> None:
        self._db.close()
