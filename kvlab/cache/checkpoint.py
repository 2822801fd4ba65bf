"""Checkpoints of the compressed cache: one compressed context reused by several questions.

A checkpoint holds references, not copies: a layer copies its buffers before the first in-place
write that would change a checkpointed entry (:meth:`Checkpoints.own_buffers`, called by the slot
layout's evictions), and appends write past the checkpointed decode length only, so a checkpoint
is free when nothing is evicted. :class:`Checkpoints` is a mixin of
:class:`~kvlab.cache.layer.CompressedLayer`; :class:`CacheCheckpoint` holds one per layer
(:meth:`kvlab.cache.cache.CompressedCache.checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class CacheCheckpoint:
    """A :class:`~kvlab.cache.cache.CompressedCache` 's state, one dict per layer."""

    layers: list[dict[str, Any]]


class Checkpoints:
    """Mixin of :class:`~kvlab.cache.layer.CompressedLayer`: checkpoint, restore, copy-on-write."""

    CHECKPOINTED = (
        "prompt_keys", "prompt_values", "starts", "lengths", "max_prompt_length", "prompt_positions",
        "decode_keys", "decode_values", "decode_positions", "decode_length", "decode_valid",
        "next_positions", "cumulative_length", "packed", "folded", "key_channels",
    )  # fmt: skip

    def checkpoint(self) -> dict[str, Any]:
        """This compressed layer's state, by reference (see :meth:`CompressedCache.checkpoint`)."""
        if not self.compressed:
            raise RuntimeError("checkpoint: only a compressed layer can be checkpointed")
        self.shares_buffers = True
        state = {name: getattr(self, name) for name in self.CHECKPOINTED}
        if self.decode_valid is not None:  # later appends write it in place
            state["decode_valid"] = self.decode_valid.clone()
        return state

    def restore(self, state: dict[str, Any]) -> None:
        """Return to a :meth:`checkpoint` (which stays usable: restore it again later)."""
        for name, value in state.items():
            setattr(self, name, value.clone() if name == "decode_valid" and value is not None else value)
        self.shares_buffers = True
        self.new_positions = None

    def own_buffers(self) -> None:
        """Copy the buffers a checkpoint shares before writing into them in place."""
        if not self.shares_buffers:
            return
        buffers = ("prompt_keys", "prompt_values", "prompt_positions")
        for name in buffers + ("decode_keys", "decode_values", "decode_positions"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.clone())
        self.shares_buffers = False
