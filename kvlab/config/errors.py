"""Errors kvlab raises for bad input.

Every user-facing mistake (a config field, a data file, a calibration artefact) becomes a
:class:`ConfigError` whose message is one paragraph that names the field and says how to fix it.
The CLI prints the message without a traceback and exits with status 2.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A configuration or input problem found before (or instead of) running the model."""


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name most similar to ``name`` (for "did you mean" hints), or None: the one known
    name that ``name`` abbreviates, else the closest by :mod:`difflib`."""
    known = list(known)
    extensions = [k for k in known if name and k.startswith(name)]
    if len(extensions) == 1:
        return extensions[0]
    matches = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    return matches[0] if matches else None


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """A sentence fragment ``" Did you mean 'x'?"`` or an empty string."""
    match = closest(name, known)
    return f" Did you mean '{match}'?" if match else ""
