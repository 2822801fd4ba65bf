"""CompressedCache: real ragged per-(sample, KV head) storage, a transformers ``Cache``.

Layout of one layer after compression (``D`` head dim)::

    prompt_keys / prompt_values   [N, D]        N = sum of kept prompt tokens over (b, h)
    starts, lengths               [B, Hkv]      segment of (b, h) is rows starts..starts+lengths
    decode_keys / decode_values   [B, Hkv, C, D] tokens appended during decode (C reserved once)

Every (sample, head) keeps its own number of prompt tokens and nothing else is allocated: no
masked-out tokens, no padding to the largest head. Decode tokens go into the reserved
``decode_*`` region (one token per step for every head); when it fills up it grows by
doubling, without touching the prompt buffers. Decode attention reads the flat buffers through
strided views (:meth:`CompressedLayer.segment_runs`: equal-length heads are one
``[B * Hkv, L, D]`` view), never a per-step gather or copy.

The cache only stores. For decode policies it offers a *slot layout* of each (sample, head)'s
entries (``[B, Hkv, K + decode_length]``: its prompt rows padded to ``K``, then its decode
tokens), the attention probabilities of new queries in that layout and
:meth:`CompressedLayer.evict_one`; a policy that scores entries (H2O) keeps the scores itself
(:class:`kvlab.compression.decode.H2ODecodePolicy`).

Before compression (during prefill) a layer holds the dense ``[B, Hkv, T, D]`` K/V the model
just computed, so prefill attention sees everything. ``get_seq_length`` reports the *logical*
length (prompt + decoded tokens), which transformers uses for positions, so RoPE positions
continue from the original prompt length after compression.

Sliding-window layers (the attention function sets ``sliding_window`` before compressing) also
keep each entry's original position, ``prompt_positions [N]`` and ``decode_positions [B, Hkv, C]``
(positions in the padded prompt row; each sample's new tokens continue after it, counting its
real tokens only), so decode attention masks entries outside the window whatever compression
kept or moved. Other layers store none.

Padded blocks of new tokens (a batch of questions of different lengths prefilled on top of the
compressed cache, :meth:`CompressedCache.appending_valid`) mark their padding in
``decode_valid [B, C]`` (None while every decode entry is real): padding entries are hidden from
every later query, are never slots a policy may keep (:meth:`CompressedLayer.slot_valid`), and
:meth:`CompressedLayer.keep_slots` drops them.

Protocols that reuse one compressed context (several questions in turn) take a
:meth:`CompressedCache.checkpoint` and :meth:`CompressedCache.restore` it: the checkpoint holds
references, and a layer copies its buffers before the first in-place write that would change a
checkpointed entry (:meth:`CompressedLayer.evict_one`), so a checkpoint is free when nothing is
evicted.

Devices: every buffer and offset of a layer is allocated on the device of the K/V that layer
received (its attention's device), so a model spread over devices with a ``device_map`` keeps
each layer's cache beside its weights; nothing is moved between devices by the cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlab.compression.selectors import OffloadedStore, Selection
from kvlab.kernels.compaction import compact_kv
from kvlab.kernels.decode_attention import (
    FULL_PRECISION,
    SegmentRuns,
    grouped_logits,
    ragged_decode_attention,
    reads_in_place,
)


def write_rows(buffer: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, write: torch.Tensor) -> None:
    """``buffer[rows[write]] = values[write]`` without reading ``write`` on the host.

    ``rows`` ``[...]`` row indices into ``buffer [N, *entry]``, ``values [..., *entry]``, ``write``
    ``[...]`` bool; the written rows must be distinct. Every entry not written repeats the first
    written ``(row, value)`` (row 0 and its own value when none is written), so the one scatter
    holds duplicate indices with equal values only: the result does not depend on the order in
    which the device applies them.
    """
    if buffer.shape[0] == 0:
        return
    rows, write = rows.reshape(-1), write.reshape(-1)
    values = values.reshape(-1, *buffer.shape[1:])
    first = write.to(torch.uint8).argmax().view(1)  # the first written entry (0 when none is)
    hit = write[first]  # [1]; indexed by a tensor, never read on the host
    fill_row = torch.where(hit, rows[first], 0)
    entry = (-1, *([1] * (buffer.dim() - 1)))
    fill_value = torch.where(hit.view(entry), values[first], buffer[:1])
    buffer[torch.where(write, rows, fill_row)] = torch.where(write.view(entry), values, fill_value)


class CompressedLayer(CacheLayerMixin):
    """One decoder layer's cache; see the module docstring for the layout."""

    is_sliding = False

    def __init__(self, decode_capacity: int = 64):
        super().__init__()
        # (starts, lengths, their SegmentRuns), see segment_runs
        self._runs: tuple[torch.Tensor, torch.Tensor, SegmentRuns] | None = None
        self.decode_capacity = max(1, decode_capacity)
        self.cumulative_length = 0
        self.compressed = False
        self.prompt_keys: torch.Tensor | None = None
        self.prompt_values: torch.Tensor | None = None
        self.starts: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        self.max_prompt_length = 0
        self.decode_keys: torch.Tensor | None = None
        self.decode_values: torch.Tensor | None = None
        self.decode_length = 0
        self.sliding_window: int | None = None
        self.prompt_positions: torch.Tensor | None = None
        self.decode_positions: torch.Tensor | None = None
        self.next_positions: torch.Tensor | None = (
            None  # [B] long (sliding layers): next real token's position
        )
        self.new_positions: torch.Tensor | None = None  # [B, q] long: positions of the newest appended block
        self.decode_valid: torch.Tensor | None = None  # [B, C] bool, None while every decode entry is real
        self.pending_valid: torch.Tensor | None = None  # [B, q] bool for the next append (set by the cache)
        self.shares_buffers = False  # a checkpoint references this layer's buffers (copy before writing)
        self.offloaded: OffloadedStore | None = None  # K/V kept outside this cache (retrieval)

    def segment_runs(self) -> SegmentRuns:
        """The strided views of the flat prompt buffers decode attention reads
        (:class:`kvlab.kernels.decode_attention.SegmentRuns`).

        Computed once per ``starts`` / ``lengths`` (one host sync), so a decode step needs neither
        a sync nor a gather. Whoever changes the segments assigns new ``starts`` / ``lengths``
        tensors, never writes them in place: the runs are kept for the tensors they were computed
        from (held here, compared by identity).
        """
        if self._runs is None or self._runs[0] is not self.starts or self._runs[1] is not self.lengths:
            self._runs = (self.starts, self.lengths, SegmentRuns.of(self.starts, self.lengths))
        return self._runs[2]

    # --- transformers CacheLayerMixin API -------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store new K/V ``[B, Hkv, q, D]``.

        Before compression: concatenate to the dense prefill K/V and return all of it. After:
        append to the decode region and return only the new tokens (kvlab's attention
        function reads the ragged layout from the layer itself).
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        if not self.compressed:
            if self.keys is None:
                self.keys, self.values = key_states, value_states
            else:
                self.keys = torch.cat([self.keys, key_states], dim=-2)
                self.values = torch.cat([self.values, value_states], dim=-2)
            return self.keys, self.values
        self._append_decode(key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    # --- compression -----------------------------------------------------------------------
    def compress(self, selection: Selection) -> None:
        """Replace the dense prefill K/V by the ragged kept entries of ``selection``.

        One :func:`kvlab.kernels.compaction.compact_kv` call gathers keys and values into the
        flat buffers (Triton on CUDA).
        """
        keys, values = self.keys, self.values  # [B, Hkv, T, D]
        B, Hkv, T, D = keys.shape
        if selection.keys is None:
            source_keys, source_values, indices = keys, values, selection.indices
        else:
            source_keys, source_values, indices = selection.keys, selection.values, None
        # [N, D] ordered by (b, h, position)
        self.prompt_keys, self.prompt_values, self.starts, self.lengths = compact_kv(
            source_keys, source_values, indices, selection.counts
        )
        self.max_prompt_length = int(self.lengths.max()) if self.lengths.numel() else 0
        self.decode_keys = keys.new_empty(B, Hkv, self.decode_capacity, D)
        self.decode_values = values.new_empty(B, Hkv, self.decode_capacity, D)
        self.decode_length = 0
        self.decode_valid = None
        if self.sliding_window is not None:  # positions of the kept entries, for the window mask
            self.prompt_positions = selection.indices[selection.mask()].to(torch.int64)
            self.decode_positions = selection.counts.new_zeros(
                B, Hkv, self.decode_capacity, dtype=torch.int64
            )
            self.next_positions = torch.full((B,), T, dtype=torch.int64, device=keys.device)
        self.offloaded = selection.offloaded
        self.keys = self.values = None  # free the dense prefill K/V
        self.compressed = True

    def _append_decode(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        q = key_states.shape[-2]
        needed = self.decode_length + q
        if needed > self.decode_keys.shape[2]:
            capacity = max(needed, 2 * self.decode_keys.shape[2])
            grow = capacity - self.decode_keys.shape[2]
            pad = self.decode_keys.new_empty(*self.decode_keys.shape[:2], grow, self.decode_keys.shape[-1])
            self.decode_keys = torch.cat([self.decode_keys, pad], dim=2)
            self.decode_values = torch.cat([self.decode_values, torch.empty_like(pad)], dim=2)
            if self.decode_positions is not None:
                grown = self.decode_positions.new_zeros(*self.decode_positions.shape[:2], grow)
                self.decode_positions = torch.cat([self.decode_positions, grown], dim=2)
            if self.decode_valid is not None:
                grown = self.decode_valid.new_ones(self.decode_valid.shape[0], grow)
                self.decode_valid = torch.cat([self.decode_valid, grown], dim=1)
        self._mark_valid(q, needed)
        self.decode_keys[:, :, self.decode_length : needed] = key_states
        self.decode_values[:, :, self.decode_length : needed] = value_states
        if self.decode_positions is not None:
            self.new_positions = self._positions_of_new(q)
            self.decode_positions[:, :, self.decode_length : needed] = self.new_positions[:, None]
        self.decode_length = needed

    def _mark_valid(self, q: int, needed: int) -> None:
        """Record which of the ``q`` tokens being appended are real (``pending_valid``)."""
        valid = self.pending_valid
        if valid is None and self.decode_valid is None:
            return
        if self.decode_valid is None:  # first padded block: every earlier decode entry is real
            self.decode_valid = torch.ones(
                self.decode_keys.shape[0],
                self.decode_keys.shape[2],
                dtype=torch.bool,
                device=self.decode_keys.device,
            )
        block = valid.to(self.decode_valid.device) if valid is not None else True
        self.decode_valid[:, self.decode_length : needed] = block

    def _positions_of_new(self, q: int) -> torch.Tensor:
        """``[B, q]`` long: original positions of the ``q`` tokens being appended.

        Each sample's real tokens continue from its ``next_positions`` (padding tokens of a padded
        block take no position: they get the position of the sample's next real token and are
        hidden anyway).
        """
        valid = self.pending_valid
        if valid is None:
            steps = torch.arange(q, device=self.next_positions.device)[None]
            advance = q
        else:
            valid = valid.to(self.next_positions.device).long()
            steps = valid.cumsum(1) - valid
            advance = valid.sum(1)
        positions = self.next_positions[:, None] + steps
        self.next_positions = self.next_positions + advance
        return positions

    def decode_attention(self, query: torch.Tensor, scaling: float, options: Any = None) -> torch.Tensor:
        """Attention of new queries ``[B, H, q, D]`` over this compressed layer -> ``[B, H, q, D]``.

        The queries' own K/V must already be appended (``update``). Dispatches to
        :func:`kvlab.kernels.decode_attention.ragged_decode_attention`. ``options`` (a
        :class:`kvlab.engine.attention.AttentionOptions` or None) adds the layer's sliding
        window (over the stored original positions), logit soft-capping and sinks; padding
        entries of a padded block (``decode_valid``) are hidden. A layer whose selection
        offloaded K/V (a retrieve selector) hands the call to its store.
        """
        if self.offloaded is not None:
            return self.offloaded.decode_attention(self, query, scaling, options)
        window = softcap = sinks = query_positions = None
        if options is not None and not options.plain:
            window, softcap, sinks = options.sliding_window, options.softcap, options.sinks
            if window is not None and self.prompt_positions is None:
                raise RuntimeError("a sliding-window layer was compressed without its positions")
            if window is not None:
                query_positions = self.new_positions[:, -query.shape[2] :]
        return ragged_decode_attention(
            query,
            self.prompt_keys,
            self.prompt_values,
            self.starts,
            self.lengths,
            self.decode_keys,
            self.decode_values,
            self.decode_length,
            scaling,
            self.max_prompt_length,
            # the runs serve the in-place torch path (CPU) only; elsewhere computing them would
            # cost a host sync whenever the segments change (a decode policy's eviction)
            runs=self.segment_runs() if reads_in_place(query) else None,
            sliding_window=window,
            softcap=softcap,
            sinks=sinks,
            prompt_positions=self.prompt_positions,
            decode_positions=self.decode_positions,
            query_positions=query_positions,
            decode_valid=self.decode_valid,
        )

    # --- slot layout and decode-time eviction (decode policies) ----------------------------
    @property
    def prompt_slots(self) -> int:
        """``K``: prompt slots per (sample, head) in the slot layout (the longest head's kept count)."""
        return self.max_prompt_length

    def slot_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt rows of each (sample, head), padded to ``K`` slots: ``rows, valid``, ``[B, Hkv, K]`` each.

        ``rows`` index ``prompt_keys`` / ``prompt_values`` (clamped to a real row where
        ``valid`` is False, so gathering through them never fails).
        """
        K = self.prompt_slots
        slot = torch.arange(K, device=self.lengths.device)
        valid = slot < self.lengths[..., None]
        rows = (self.starts[..., None] + slot).clamp(max=max(self.prompt_keys.shape[0] - 1, 0))
        return rows, valid

    def slot_valid(self) -> torch.Tensor:
        """``[B, Hkv, K + decode_length]`` bool: which slots of the slot layout hold an entry.

        The slot layout lists every stored entry of a (sample, head): slots ``< K`` are its
        prompt rows (valid below its length), then its decode region; the last slot is the
        newest token. :meth:`attention_probs` and :meth:`evict_one` use the same indexing.
        """
        _, valid = self.slot_rows()
        return torch.cat([valid, self._decode_slot_valid()], -1)

    def _decode_slot_valid(self) -> torch.Tensor:
        """``[B, Hkv, decode_length]`` bool: the real entries of the decode region."""
        B, Hkv = self.lengths.shape
        if self.decode_valid is None:
            return torch.ones(B, Hkv, self.decode_length, dtype=torch.bool, device=self.lengths.device)
        return self.decode_valid[:, None, : self.decode_length].expand(B, Hkv, -1)

    def attention_probs(self, query: torch.Tensor, scaling: float, options: Any = None) -> torch.Tensor:
        """Softmax of queries ``[B, H, q, D]`` over every stored entry, ``[B, Hkv, G, q, K + decode_length]``.

        fp32, in the slot layout (:meth:`slot_valid`; empty slots get 0), query heads grouped per
        KV head (``G = H / Hkv``). Every query sees every stored entry (one decode token per
        step: the newest entry is the query's own). A read of the stored K, nothing is kept. ``options`` (see
        :meth:`decode_attention`) soft-caps the logits, hides entries outside the newest token's
        sliding window (probability 0) and adds the sinks to the denominator, as decode attention does.
        """
        B, H, q, _ = query.shape
        Hkv, dl = self.lengths.shape[1], self.decode_length
        valid = self.slot_valid()
        logits = self._slot_logits(query) * scaling
        if options is None or options.plain:
            probs = torch.softmax(logits.masked_fill(~valid[:, :, None], float("-inf")), -1)
            return probs.view(B, Hkv, H // Hkv, q, -1)
        if options.softcap is not None:
            logits = torch.tanh(logits / options.softcap) * options.softcap
        if options.sliding_window is not None:
            rows, _ = self.slot_rows()
            positions = torch.cat([self.prompt_positions[rows], self.decode_positions[:, :, :dl]], -1)
            newest = self.next_positions - 1  # [B]: the newest token's window
            valid = valid & (positions > (newest - options.sliding_window)[:, None, None])
        logits = logits.masked_fill(~valid[:, :, None], float("-inf"))
        if options.sinks is not None:
            sinks = options.sinks.float().view(1, Hkv, H // Hkv, 1, 1).expand(B, -1, -1, q, 1)
            logits = torch.cat([logits, sinks.reshape(B, Hkv, -1, 1)], -1)
            return torch.softmax(logits, -1)[..., :-1].reshape(B, Hkv, H // Hkv, q, -1)
        return torch.softmax(logits, -1).view(B, Hkv, H // Hkv, q, -1)

    def _slot_logits(self, query: torch.Tensor) -> torch.Tensor:
        """Unscaled fp32 logits of ``query [B, H, q, D]`` over the slot layout, ``[B, Hkv, G * q, S]``.

        ``S = K + decode_length`` (:meth:`slot_valid`). Empty slots hold any value (the caller masks
        them). fp32 / fp64 caches are read in place (:func:`kvlab.kernels.decode_attention.grouped_logits`);
        16-bit ones are gathered in fp32.
        """
        B, H, q, D = query.shape
        Hkv, dl, rows_per_head = self.lengths.shape[1], self.decode_length, (H // self.lengths.shape[1]) * q
        if query.dtype in FULL_PRECISION:
            grouped = query.reshape(B * Hkv, rows_per_head, D)
            decode = self.decode_keys[:, :, :dl].flatten(0, 1)
            logits = grouped_logits(grouped, self.prompt_keys, self.segment_runs(), decode, self.prompt_slots)
            return logits.view(B, Hkv, rows_per_head, -1).float()
        rows, _ = self.slot_rows()
        keys = torch.cat([self.prompt_keys[rows], self.decode_keys[:, :, :dl]], 2).float()
        return torch.matmul(query.float().reshape(B, Hkv, rows_per_head, D), keys.transpose(-1, -2))

    def evict_one(self, victim: torch.Tensor) -> None:
        """Evict slot ``victim [B, Hkv]`` (slot layout, see :meth:`slot_valid`) of every (sample, head).

        The newest decode token moves into the victim's slot (nothing moves when it is the
        victim) and the decode region shrinks by one, so each head keeps its size and no
        buffer is reallocated.
        """
        K = self.prompt_slots
        self._own_buffers()
        new = self.decode_length - 1
        B, Hkv = victim.shape
        b = torch.arange(B, device=victim.device)[:, None].expand(B, Hkv)
        h = torch.arange(Hkv, device=victim.device)[None, :].expand(B, Hkv)
        in_prompt = victim < K  # dense over every (sample, head): no host sync (write_rows)
        row = self.starts + victim.clamp(max=max(K - 1, 0))
        write_rows(self.prompt_keys, row, self.decode_keys[:, :, new], in_prompt)
        write_rows(self.prompt_values, row, self.decode_values[:, :, new], in_prompt)
        if self.prompt_positions is not None:
            write_rows(self.prompt_positions, row, self.decode_positions[:, :, new], in_prompt)
        slot = torch.where(in_prompt, new, victim - K)  # a prompt victim's row rewrites its newest slot
        buffers = [self.decode_keys, self.decode_values]
        if self.decode_positions is not None:
            buffers.append(self.decode_positions)
        for buffer in buffers:
            buffer[b, h, slot] = buffer[:, :, new]
        self.decode_length = new

    def keep_slots(self, keep: torch.Tensor) -> None:
        """Keep the entries ``keep [B, Hkv, K + decode_length]`` marks (slot layout) and drop the rest.

        The kept entries of each (sample, head), prompt and decode alike, become its new prompt
        region in slot order (counts may differ per head); the decode region is emptied and its
        padding marks cleared. Logical length and positions are unchanged (RoPE positions are in
        the keys already; sliding layers keep each entry's original position). Invalidates any
        slot-indexed state a decode policy holds for this layer.

        Raises:
            ValueError: ``keep`` has the wrong shape or marks a slot that holds no entry.
        """
        valid = self.slot_valid()
        if keep.shape != valid.shape:
            raise ValueError(
                f"keep_slots: keep must be {tuple(valid.shape)} (slot layout), got {tuple(keep.shape)}"
            )
        keep = keep.to(valid.device)
        if bool((keep & ~valid).any()):
            raise ValueError("keep_slots: keep marks slots that hold no entry (see slot_valid)")
        rows, _ = self.slot_rows()
        dl = self.decode_length
        keys = torch.cat([self.prompt_keys[rows], self.decode_keys[:, :, :dl]], 2)  # [B, Hkv, S, D]
        values = torch.cat([self.prompt_values[rows], self.decode_values[:, :, :dl]], 2)
        counts = keep.sum(-1)
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices  # kept slots first
        compacted = compact_kv(keys, values, order, counts)
        self.prompt_keys, self.prompt_values, self.starts, self.lengths = compacted
        if self.prompt_positions is not None:
            positions = torch.cat([self.prompt_positions[rows], self.decode_positions[:, :, :dl]], 2)
            kept = torch.arange(order.shape[-1], device=order.device) < counts[..., None]
            self.prompt_positions = positions.gather(2, order)[kept]
        self.max_prompt_length = int(self.lengths.max()) if self.lengths.numel() else 0
        if self.shares_buffers:  # a checkpoint holds the decode buffers: later appends go to new ones
            self.decode_keys = torch.empty_like(self.decode_keys)
            self.decode_values = torch.empty_like(self.decode_values)
            if self.decode_positions is not None:
                self.decode_positions = torch.zeros_like(self.decode_positions)
            self.shares_buffers = False
        self.decode_length = 0
        self.decode_valid = None

    # --- checkpoints (one compressed context reused by several questions) ------------------
    CHECKPOINTED = (
        "prompt_keys", "prompt_values", "starts", "lengths", "max_prompt_length", "prompt_positions",
        "decode_keys", "decode_values", "decode_positions", "decode_length", "decode_valid",
        "next_positions", "cumulative_length",
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

    def _own_buffers(self) -> None:
        """Copy the buffers a checkpoint shares before writing into them in place."""
        if not self.shares_buffers:
            return
        buffers = ("prompt_keys", "prompt_values", "prompt_positions")
        for name in buffers + ("decode_keys", "decode_values", "decode_positions"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.clone())
        self.shares_buffers = False

    # --- inspection --------------------------------------------------------------------------
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
            ]
        )
        on_device = self.offloaded.device_bytes() if self.offloaded is not None else 0
        return on_device + sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def offloaded_bytes(self) -> int:
        """Bytes of this layer's K/V held outside the cache's device (a retrieve selector's store)."""
        return self.offloaded.offloaded_bytes() if self.offloaded is not None else 0

    def prompt_kv_bytes(self) -> int:
        """Bytes of the kept prompt K/V alone (no decode region, no offsets)."""
        if not self.compressed:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.prompt_keys, self.prompt_values))

    def segment(self, b: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept prompt keys and values ``[n, D]`` of one (sample, head)."""
        start, n = int(self.starts[b, h]), int(self.lengths[b, h])
        return self.prompt_keys[start : start + n], self.prompt_values[start : start + n]


@dataclass
class CacheCheckpoint:
    """A :class:`CompressedCache` 's state, one dict per layer (see :meth:`CompressedCache.checkpoint`)."""

    layers: list[dict[str, Any]]


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
            layer.pending_valid = valid
        try:
            yield
        finally:
            for layer in self.layers:
                layer.pending_valid = None

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

    def kept_tokens(self) -> torch.Tensor:
        """``[L, B, Hkv]`` kept prompt tokens per layer and head (compressed layers only), on the
        first compressed layer's device (layers may sit on different devices, see the module docstring)."""
        lengths = [layer.lengths for layer in self.layers if layer.compressed]
        return torch.stack([n.to(lengths[0].device) for n in lengths])

    def devices(self) -> list[torch.device | None]:
        """Each layer's device (where its buffers and offsets live; None before its first update)."""
        return [layer.device if layer.is_initialized else None for layer in self.layers]
