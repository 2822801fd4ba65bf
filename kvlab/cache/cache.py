"""CompressedCache: a transformers ``Cache`` over :class:`~kvlab.cache.layer.CompressedLayer` s, delegating.

As transformers' ``cache_utils`` (a ``Cache`` over per-layer objects): every operation is the
layers' own, applied to each; the container adds nothing but the sums over layers. Storage,
decode attention and compression are in :mod:`kvlab.cache.layer`, the slot layout decode
policies use in :mod:`kvlab.cache.slots`, checkpoints in :mod:`kvlab.cache.checkpoint`, byte
accounting in :mod:`kvlab.cache.accounting`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers.cache_utils import Cache

from kvlab.cache.checkpoint import CacheCheckpoint
from kvlab.cache.layer import CompressedLayer


class CompressedCache(Cache):
    """A transformers ``Cache`` of :class:`CompressedLayer` s (one per language-model layer).

    Args:
        num_layers: decoder layers of the language model.
        decode_capacity: decode tokens reserved per (sample, head) when a layer is compressed
            (``max_new_tokens`` is the right value; the region grows if exceeded).
    """

    def __init__(self, num_layers: int, decode_capacity: int = 64):
        super().__init__(layers=[CompressedLayer(decode_capacity) for _ in range(num_layers)])

    @contextlib.contextmanager
    def appending_valid(self, valid: torch.Tensor) -> Iterator[None]:
        """Within the block, tokens appended to compressed layers are marked by ``valid [B, q]``.

        For one forward of a left-padded block of new tokens over the compressed cache (a batch
        of questions of different lengths): padding entries are hidden from every later query
        and take no position. A block without padding (every entry of ``valid`` True) is an
        ordinary append: no layer gets a ``decode_valid`` mask, so decode keeps its plain
        (in-place, kernel) path (one host sync here, not one per layer).
        """
        if bool(valid.all()):
            valid = None
        for layer in self.layers:
            layer.expect_block(valid)
        try:
            yield
        finally:
            for layer in self.layers:
                layer.expect_block(None)

    def checkpoint(self) -> CacheCheckpoint:
        """The state of every layer (all must be compressed), to :meth:`restore` later.

        Nothing is copied now: a layer copies its buffers before the first in-place write that
        would alter a checkpointed entry (a decode policy's eviction), and appends write past
        the checkpointed decode length only.
        """
        return CacheCheckpoint([layer.checkpoint() for layer in self.layers])

    def restore(self, checkpoint: CacheCheckpoint) -> None:
        """Return every layer to ``checkpoint`` (taken from this cache); reusable any number of times."""
        if len(checkpoint.layers) != len(self.layers):
            raise ValueError("restore: the checkpoint comes from a cache with a different number of layers")
        for layer, state in zip(self.layers, checkpoint.layers, strict=True):
            layer.restore(state)

    def kv_bytes(self) -> int:
        """Bytes allocated by all layers (see :meth:`CompressedLayer.kv_bytes`)."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def offloaded_bytes(self) -> int:
        """Bytes held outside the device by all layers (see :meth:`CompressedLayer.offloaded_bytes`)."""
        return sum(layer.offloaded_bytes() for layer in self.layers)

    def prompt_kv_bytes(self) -> int:
        """Bytes of the kept prompt K/V over all layers."""
        return sum(layer.prompt_kv_bytes() for layer in self.layers)

    def kept_bytes(self, kept: torch.Tensor, head_dim: int) -> torch.Tensor:
        """``[B]`` bytes of the kept prompt entries of each batch row, given ``kept [L, B, Hkv]`` (the
        compressed layers' counts, :meth:`kept_tokens`): a layer's entries at ``2 * head_dim`` numbers
        of its dtype, a quantized layer's codes, parameters and residual
        (:meth:`~kvlab.cache.packed.PackedPrompt.sample_bytes`), or a channel-pruned layer's entries
        at ``Dk + head_dim`` numbers and its ``[Hkv, Dk]`` channel index (:mod:`kvlab.cache.pruned`)."""
        layers = [layer for layer in self.layers if layer.compressed]
        total = torch.zeros(kept.shape[1], dtype=torch.long, device=kept.device)
        for layer, counts in zip(layers, kept, strict=True):
            if layer.packed is not None:
                total += layer.packed.sample_bytes(layer.folded).to(kept.device)
            elif layer.key_channels is not None:  # [n, Dk] keys, [n, D] values, each head's channel index
                channels = layer.key_channels
                entry = (channels.shape[-1] + head_dim) * layer.dtype.itemsize
                index = channels[0].numel() * channels.element_size()
                total += counts.sum(-1) * entry + index
            else:
                total += counts.sum(-1) * (2 * head_dim * layer.dtype.itemsize)
        return total

    def kept_tokens(self) -> torch.Tensor:
        """``[L, B, Hkv]`` kept prompt tokens per layer and head (compressed layers only; decoded
        tokens folded into a quantized layer's codes are not prompt tokens), on the first compressed
        layer's device (layers may sit on different devices, see the module docstring)."""
        lengths = [layer.lengths - layer.folded for layer in self.layers if layer.compressed]
        return torch.stack([n.to(lengths[0].device) for n in lengths])

    def devices(self) -> list[torch.device | None]:
        """Each layer's device (where its buffers and offsets live; None before its first update)."""
        return [layer.device if layer.is_initialized else None for layer in self.layers]
