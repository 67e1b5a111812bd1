"""Atomic file writes: a reader sees the old file or the new one, never half of one.

:func:`write_text_atomic` writes to a temporary file in the destination's folder (so that the
rename stays on one file system), flushes it to disk, then ``os.replace`` s it over the
destination: a Ctrl-C, a crash or a full disk mid-write leaves the previous file intact and no
temporary behind.  A standard-library leaf: the reports and the pytest plugin may import it.

Examples
--------
>>> import pathlib, tempfile
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> write_text_atomic(folder / "report.md", "# hello\\n").read_text()
'# hello\\n'
>>> sorted(p.name for p in folder.iterdir())
['report.md']
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Union

__all__ = ["write_text_atomic"]


def write_text_atomic(path: Union[str, Path], text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (temporary file in the same folder, then ``os.replace``).

    The folder is created when missing.  The file gets the permissions a plain ``open`` would
    give it (``0o666`` less the umask), not ``mkstemp``'s ``0o600``.  Returns the path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding=encoding, newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
