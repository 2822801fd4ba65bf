"""Reading JSON-lines files: one JSON object per line, each error naming the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvlab.config.errors import ConfigError


def read_json_lines(path: Path, fix: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line of ``path`` (numbered from 1).

    Raises:
        ConfigError: a line that is not UTF-8, not valid JSON, or not a JSON object, naming ``path:line``
            and ending with ``fix`` (what the file must hold, in the caller's terms).
    """
    with path.open("rb") as handle:
        for lineno, data in enumerate(handle, start=1):
            try:
                raw = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    f"{path}:{lineno}: not UTF-8 text (byte {exc.start} of the line, "
                    f"0x{data[exc.start]:02x}, cannot be decoded). Save the file as UTF-8. {fix}"
                ) from None
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{path}:{lineno}: malformed JSON ({exc.msg} at column {exc.colno}). {fix}"
                ) from None
            if not isinstance(obj, dict):
                raise ConfigError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}. {fix}")
            yield lineno, obj
