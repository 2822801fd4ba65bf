"""Numbers a config may hold: finite, and small enough for the engine to index with.

Range checks written as ``if not 0 <= ratio <= 1`` pass a NaN (every comparison with NaN is
false), and a budget of ``10**30`` tokens passes a ``>= window`` check and overflows the int64
tensors that index the cache. :func:`check_numbers` walks a whole config once, before any
component sees it, and refuses both, naming the field:

- a float must be finite (no ``.nan``, ``.inf``);
- an integer must lie within +-:data:`MAX_INDEX` (2**31 - 1: more tokens, layers or samples than
  any model or dataset has), except ``seed_everything``, which Lightning takes in [0, 2**32 - 1].
"""

from __future__ import annotations

import math
from typing import Any

from kvlab.config.errors import ConfigError

#: the largest integer a config may hold (tokens, samples, steps, seeds of datasets)
MAX_INDEX = 2**31 - 1
#: Lightning's range of ``seed_everything``
MAX_SEED = 2**32 - 1


def check_numbers(node: Any, field: str = "") -> None:
    """Raise :class:`ConfigError` for the first non-finite float or out-of-range integer in ``node``
    (a config dict, list or value), naming its dotted field."""
    if isinstance(node, dict):
        for key, value in node.items():
            check_numbers(value, f"{field}.{key}" if field else str(key))
    elif isinstance(node, list | tuple):
        for index, value in enumerate(node):
            check_numbers(value, f"{field}[{index}]")
    elif isinstance(node, bool):
        return
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(
            f"{field or 'a value'} = {node} is not a finite number. Write a finite value (a NaN passes range "
            "checks unnoticed and an infinity has no meaning as a budget, ratio or weight)."
        )
    elif isinstance(node, int):
        low, high = (0, MAX_SEED) if field == "seed_everything" else (-MAX_INDEX, MAX_INDEX)
        if not low <= node <= high:
            raise ConfigError(
                f"{field or 'a value'} = {node} is outside [{low}, {high}], beyond what kvlab can index "
                "(token positions and counts are 32-bit ranges). Write a smaller value; a budget at least "
                "the prompt's length already keeps every token."
            )
