"""Crash-safe file writes: a file is either its old content or its new content, never half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write_text"]


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically and durably; return the path.

    The text goes to a temporary file in the same directory (so the rename stays on one file
    system), which is flushed, fsynced and then renamed over ``path`` with :func:`os.replace`.
    A process killed at any point leaves either the previous file or the new one (and at worst
    a stray ``.<name>.*.tmp`` file, which readers ignore). The parent directory must exist.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
