"""Byte accounting of a compressed layer: what it allocates, on the device and elsewhere.

:class:`ByteAccounting` is a mixin of :class:`~kvlab.cache.layer.CompressedLayer`; the cache sums
it over layers (:meth:`kvlab.cache.cache.CompressedCache.kv_bytes`). ``kv_bytes`` is exactly the
buffers the layer holds (prompt and decode regions, offsets; a quantized prompt region's codes,
scales and full-precision residual; a channel-pruned layer's narrower keys and channel index)
plus the device part of an offloaded store; nothing is padded, so memory falls with the kept entries.
"""

from __future__ import annotations

import torch


class ByteAccounting:
    """Mixin of :class:`~kvlab.cache.layer.CompressedLayer`: bytes held, and one (sample, head)'s entries."""

    def kv_bytes(self) -> int:
        """Bytes allocated by this layer: K/V buffers (decode capacity included) + offsets."""
        tensors = (
            [self.keys, self.values]
            if not self.compressed
            else [
                self.prompt_keys,
                self.prompt_values,
                self.decode_keys,
                self.decode_values,
                self.starts,
                self.lengths,
                self.key_channels,
            ]
        )
        on_device = self.offloaded.device_bytes() if self.offloaded is not None else 0
        if self.compressed and self.packed is not None:  # codes, scales, residual (kvlab.cache.packed)
            on_device += self.packed.nbytes()
        return on_device + sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def offloaded_bytes(self) -> int:
        """Bytes of this layer's K/V held outside the cache's device (a retrieve selector's store)."""
        return self.offloaded.offloaded_bytes() if self.offloaded is not None else 0

    def prompt_kv_bytes(self) -> int:
        """Bytes of the kept prompt K/V alone (no decode region, no offsets; a quantized layer's
        codes, their parameters and its full-precision residual, :meth:`PackedPrompt.nbytes`; a
        channel-pruned layer's ``[N, Dk]`` keys and its channel index ``[B, Hkv, Dk]``)."""
        if not self.compressed:
            return 0
        if self.packed is not None:
            return self.packed.nbytes()
        tensors = (self.prompt_keys, self.prompt_values, self.key_channels)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def segment(self, b: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept prompt keys and values ``[n, D]`` of one (sample, head) (dequantized when the layer
        holds codes, followed by the decoded tokens folded into them, ``folded``; a channel-pruned
        layer's keys are ``[n, Dk]``, the channels ``key_channels[b, h]``)."""
        start, n = int(self.starts[b, h]), int(self.lengths[b, h])
        keys, values = (self.prompt_keys, self.prompt_values) if self.packed is None else self.packed.dense()
        return keys[start : start + n], values[start : start + n]
