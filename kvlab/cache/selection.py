"""What the cache stores after a layer's compression: a :class:`Selection` of kept entries.

The types live at the storage layer because the cache stores them: a selector (in
:mod:`kvlab.compression`) produces a :class:`Selection`, :meth:`kvlab.cache.layer.CompressedLayer.compress`
consumes it, and a store of K/V kept outside the cache (:class:`OffloadedStore`, e.g. the
``retrieve`` selector's chunk store) answers the layer's decode attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from kvlab.cache.packed import EntryQuantizer


@dataclass
class Selection:
    """What one layer keeps.

    Attributes:
        indices: ``[B, Hkv, K]`` long, kept positions in ascending order; entries past
            ``counts[b, h]`` are padding (0) and must be ignored. K = max count.
        counts: ``[B, Hkv]`` long, kept tokens per (sample, head).
        keys / values: optional ``[B, Hkv, K, D]`` replacements for the kept entries (merge
            selectors); None means gather them from the prefill K/V.
        offloaded: optional store of K/V kept outside the compressed cache (a retrieve
            selector: full K/V of some heads off the accelerator, fetched per decode step); the
            layer hands its decode attention to it (:class:`OffloadedStore`).
        quantizer: optional step storing the kept entries as codes (``model.compression.quantize``,
            :class:`~kvlab.cache.packed.EntryQuantizer`); the layer packs them after compaction.
        channels: optional ``[B, Hkv, Dk]`` long, the key channels each (sample, KV head) keeps,
            ascending (``model.compression.channels``); the layer stores the kept keys with these
            channels only (:mod:`kvlab.cache.pruned`).
    """

    indices: torch.Tensor
    counts: torch.Tensor
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    offloaded: OffloadedStore | None = None
    quantizer: EntryQuantizer | None = None
    channels: torch.Tensor | None = None

    def mask(self) -> torch.Tensor:
        """``[B, Hkv, K]`` bool, True on real entries."""
        K = self.indices.shape[-1]
        return torch.arange(K, device=self.counts.device) < self.counts[..., None]

    def kept_mask(self, length: int) -> torch.Tensor:
        """``[B, Hkv, length]`` bool (on the indices' device): which prompt positions each (sample,
        head) kept. Unused slots (index 0 past a row's count) go to a spare column, so they can
        never clear or set position 0."""
        B, Hkv, _ = self.indices.shape
        mask = torch.zeros(B, Hkv, length + 1, dtype=torch.bool, device=self.indices.device)
        mask.scatter_(2, torch.where(self.mask(), self.indices, length), True)
        return mask[..., :length]

    def kept_positions(self, b: int, h: int) -> list[int]:
        """Kept positions of one (sample, head) as a Python list."""
        return self.indices[b, h, : int(self.counts[b, h])].tolist()


class OffloadedStore(Protocol):
    """K/V a selector keeps outside the compressed cache, attended at decode (retrieval)."""

    def decode_attention(self, layer: Any, query: torch.Tensor, scaling: float, options: Any) -> torch.Tensor:
        """Attention of ``query [B, H, q, D]`` over ``layer``'s kept entries and what the store
        fetches -> ``[B, H, q, D]`` (replaces :meth:`CompressedLayer.decode_attention`)."""
        ...

    def device_bytes(self) -> int:
        """Bytes the store holds on the layer's device (e.g. a chunk index)."""
        ...

    def offloaded_bytes(self) -> int:
        """Bytes the store holds elsewhere (host memory)."""
        ...

    def for_samples(self, rows: torch.Tensor) -> Any:
        """What the store reports for a batch of samples whose sample ``b`` was compressed as row
        ``rows[b]`` of the store's batch (``[B]`` long: a context compressed alone, for one or
        several questions), for the report only: the context protocols' layer reports carry it so
        the store's figures reach every sample."""
        ...
