"""Crash-safe files: a write leaves either the old content or the new, never half of one; a read of a
JSON-lines file skips the one line a crash may have cut short."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["atomic_write_text", "read_jsonl"]


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically and durably; return the path.

    The text goes to a temporary file in the same directory (so the rename stays on one file
    system), which is flushed, fsynced and then renamed over ``path`` with :func:`os.replace`.
    A process killed at any point leaves either the previous file or the new one (and at worst
    a stray ``.<name>.*.tmp`` file, which readers ignore). The parent directory must exist. The
    file gets the mode any new file gets (``0666`` less the user's umask), as ``open`` would give.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp's 0600 would hide the file from the group
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


def current_umask() -> int:
    """The process's file-creation mask (read from ``/proc`` where it can be, else set and restored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of one JSONL file (a line cut short by a crash is ignored)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
