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


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of one JSONL file (a line cut short by a crash is ignored)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
