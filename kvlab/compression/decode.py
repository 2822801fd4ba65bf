"""Decode policies: what happens to the cache while tokens are generated.

The slot exists on every pipeline (``model.compression.decode``). ``none`` appends every
decoded token and never evicts (the default of SnapKV, LOOK-M's "look once" and the papers).
Policies that evict during decode (H2O-style fixed size, PrefixKV's drop) implement
:meth:`DecodePolicy.after_step`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.registry import Registry


class DecodePolicy:
    """Base class: override :meth:`after_step` to change the cache after each decode step."""

    registry_name: str = ""

    def after_step(self, cache, step: int) -> None:
        """Called after every decode step with the :class:`~kvlab.cache.CompressedCache`."""
        raise NotImplementedError


DECODE_POLICIES: Registry[DecodePolicy] = Registry("decode policy", "model.compression.decode")


@DECODE_POLICIES.register("none")
@dataclass
class AppendOnly(DecodePolicy):
    """Append every decoded token; never evict."""

    def after_step(self, cache, step: int) -> None:
        return None
