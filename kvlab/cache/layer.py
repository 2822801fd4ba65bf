"""CompressedLayer: one decoder layer's real ragged per-(sample, KV head) storage.

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

The cache only stores, and changes only through its own methods. For decode policies it offers
a *slot layout* of each (sample, head)'s entries (:mod:`kvlab.cache.slots`); checkpoints are in
:mod:`kvlab.cache.checkpoint`, byte accounting in :mod:`kvlab.cache.accounting`; the transformers
``Cache`` over the layers is :class:`kvlab.cache.cache.CompressedCache`.

Before compression (during prefill) a layer holds the dense ``[B, Hkv, T, D]`` K/V the model
just computed, so prefill attention sees everything. ``get_seq_length`` reports the *logical*
length (prompt + decoded tokens), which transformers uses for positions, so RoPE positions
continue from the original prompt length after compression.

Sliding-window layers (compressed with their ``sliding_window``, :meth:`CompressedLayer.compress`)
also keep each entry's original position, ``prompt_positions [N]`` and ``decode_positions [B, Hkv, C]``
(positions in the padded prompt row; each sample's new tokens continue after it, counting its
real tokens only), so decode attention masks entries outside the window whatever compression
kept or moved. Other layers store none.

Padded blocks of new tokens (a batch of questions of different lengths prefilled on top of the
compressed cache, :meth:`kvlab.cache.cache.CompressedCache.appending_valid`, which announces each
block with :meth:`CompressedLayer.expect_block`) mark their padding in ``decode_valid [B, C]``
(None while every decode entry is real): padding entries are hidden from every later query, are
never slots a policy may keep (:meth:`~kvlab.cache.slots.SlotLayout.slot_valid`), and
:meth:`~kvlab.cache.slots.SlotLayout.keep_slots` drops them.

Channel-pruned layers (``model.compression.channels``, :mod:`kvlab.cache.pruned`) hold their prompt
keys as ``[N, Dk]`` rows, each segment's own ``Dk`` channels (``key_channels [B, Hkv, Dk]``); values
and the decode region keep every channel.

Devices: every buffer and offset of a layer is allocated on the device of the K/V that layer
received (its attention's device), so a model spread over devices with a ``device_map`` keeps
each layer's cache beside its weights; nothing is moved between devices by the cache.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvlab.cache.accounting import ByteAccounting
from kvlab.cache.checkpoint import Checkpoints
from kvlab.cache.packed import EntryQuantizer, PackedPrompt, fold, merged_order, packed_decode_attention
from kvlab.cache.pruned import prune_key_channels, pruned_decode_attention
from kvlab.cache.selection import OffloadedStore, Selection
from kvlab.cache.slots import SlotLayout
from kvlab.kernels.compaction import compact_kv
from kvlab.kernels.decode_attention import RunViews, SegmentRuns, ragged_decode_attention, reads_in_place
from kvlab.kernels.types import segment_starts


class CompressedLayer(SlotLayout, Checkpoints, ByteAccounting, CacheLayerMixin):
    """One decoder layer's cache; see the module docstring for the layout."""

    is_sliding = False

    def __init__(self, decode_capacity: int = 64):
        super().__init__()
        # (starts, lengths, their SegmentRuns), see segment_runs
        self._runs: tuple[torch.Tensor, torch.Tensor, SegmentRuns] | None = None
        # (prompt_keys, prompt_values, runs, their RunViews), see run_views
        self._views: tuple[torch.Tensor, torch.Tensor, SegmentRuns, RunViews] | None = None
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
        self.next_positions: torch.Tensor | None = None  # [B] long (sliding layers): next real position
        self.new_positions: torch.Tensor | None = None  # [B, q] long: positions of the newest appended block
        self.decode_valid: torch.Tensor | None = None  # [B, C] bool, None while every decode entry is real
        self.pending_valid: torch.Tensor | None = None  # [B, q] bool for the next append (expect_block)
        self.shares_buffers = False  # a checkpoint references this layer's buffers (copy before writing)
        self.offloaded: OffloadedStore | None = None  # K/V kept outside this cache (retrieval)
        self.packed: PackedPrompt | None = None  # the prompt region as codes (a quantizer's), see packed.py
        self.quantizer: EntryQuantizer | None = None  # the quantizer of `packed` (folds decoded tokens)
        self.folded = 0  # decoded tokens folded into `packed` (every segment's newest), see _fold_decode
        self.key_channels: torch.Tensor | None = None  # [B, Hkv, Dk] long: prompt keys' channels, pruned.py

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

    def run_views(self) -> RunViews:
        """:meth:`segment_runs` bound to the prompt buffers
        (:class:`~kvlab.kernels.decode_attention.RunViews`): each run's keys and values as the
        view the CPU flash kernel reads.

        Made once per buffers and segments (kept while ``prompt_keys``, ``prompt_values`` and the
        runs stay the same objects; a copy before an in-place write or an eviction assigns new
        ones), so a decode step makes no view of the prompt entries.
        """
        runs, held = self.segment_runs(), self._views
        keys, values = self.prompt_keys, self.prompt_values
        if held is None or held[0] is not keys or held[1] is not values or held[2] is not runs:
            held = self._views = (keys, values, runs, RunViews.of(runs, keys, values))
        return held[3]

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
        self._fold_decode()
        self._append_decode(key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    # --- compression -----------------------------------------------------------------------
    def hold_dense(self, keys: torch.Tensor, values: torch.Tensor, logical_length: int) -> None:
        """Replace the dense prefill K/V, before compression, by ``keys / values [B, Hkv, S, D]``.

        A progressive prefill (:mod:`kvlab.engine.progressive`) keeps between two chunks only each
        sample's kept entries (one dense row per sample, left padded) and drops the question it
        scored with; the next chunk's K/V are concatenated to them (:meth:`update`).
        ``logical_length``: the prompt tokens seen so far (what :meth:`get_seq_length` reports).
        """
        if self.compressed:
            raise RuntimeError("hold_dense: the layer is already compressed")
        self.keys, self.values = keys, values
        self.cumulative_length = logical_length

    def compress(self, selection: Selection, sliding_window: int | None = None) -> None:
        """Replace the dense prefill K/V by the ragged kept entries of ``selection``.

        One :func:`kvlab.kernels.compaction.compact_kv` call gathers keys and values into the
        flat buffers (Triton on CUDA). ``sliding_window``: the layer's window (None for a
        full-attention layer); a sliding layer keeps each kept entry's position for the window
        mask at decode.
        """
        self.sliding_window = sliding_window
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
        self.key_channels = selection.channels
        if selection.channels is not None:  # the keys keep their head's channels only (kvlab.cache.pruned)
            self.prompt_keys = prune_key_channels(self.prompt_keys, self.lengths, selection.channels)
        self.packed, self.quantizer, self.folded = None, selection.quantizer, 0
        if selection.quantizer is not None:  # the codes replace the flat buffers (kvlab.cache.packed)
            self.packed = selection.quantizer.pack(
                self.prompt_keys, self.prompt_values, self.starts, self.lengths
            )
            self.prompt_keys = self.prompt_values = None
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

    def _fold_decode(self) -> None:
        """Fold the decode region into the codes once the quantizer's ``fold_every`` tokens are
        pending (KIVI's streaming residual, :func:`kvlab.cache.packed.fold`).

        Runs before an append, so every folded token was appended by an earlier step and is
        visible to every later query. The segments grow by the folded tokens (``starts / lengths``,
        the original positions of a sliding layer), ``folded`` counts them, and the decode region
        starts again empty (fresh buffers when a checkpoint holds the old ones). A decode region
        with padding entries (``decode_valid``) is not folded: padding must stay hidden.
        """
        every = self.quantizer.fold_every if self.packed is not None else None
        t = self.decode_length
        if every is None or t < every or self.decode_valid is not None:
            return
        B, Hkv, _, D = self.decode_keys.shape
        keys = self.decode_keys[:, :, :t].reshape(B * Hkv, t, D)
        values = self.decode_values[:, :, :t].reshape(B * Hkv, t, D)
        self.packed = fold(self.quantizer, self.packed, keys, values)
        if self.prompt_positions is not None:
            order = merged_order(self.lengths, torch.full_like(self.lengths, t))
            decoded = self.decode_positions[:, :, :t].flatten()
            self.prompt_positions = torch.cat([self.prompt_positions, decoded])[order]
        self.lengths = self.lengths + t
        self.starts = segment_starts(self.lengths)
        self.max_prompt_length += t
        self.folded += t
        self.decode_length = 0
        if self.shares_buffers:  # a checkpoint holds the decode entries: appends must not overwrite them
            self.decode_keys = torch.empty_like(self.decode_keys)
            self.decode_values = torch.empty_like(self.decode_values)
            if self.decode_positions is not None:
                self.decode_positions = torch.empty_like(self.decode_positions)

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

    def expect_block(self, valid: torch.Tensor | None) -> None:
        """Mark the next appended block's tokens by ``valid [B, q]`` (False on padding; None: every
        token is real, the ordinary append). Set around one forward by
        :meth:`kvlab.cache.cache.CompressedCache.appending_valid`."""
        self.pending_valid = valid

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
        :class:`kvlab.cache.options.AttentionOptions` or None) adds the layer's sliding
        window (over the stored original positions), logit soft-capping and sinks; padding
        entries of a padded block (``decode_valid``) are hidden. A layer whose selection
        offloaded K/V (a retrieve selector) hands the call to its store.
        """
        if self.offloaded is not None:
            return self.offloaded.decode_attention(self, query, scaling, options)
        return self.local_decode_attention(query, scaling, options)

    def local_decode_attention(
        self, query: torch.Tensor, scaling: float, options: Any = None
    ) -> torch.Tensor:
        """:meth:`decode_attention` over the entries this cache holds, an offloaded store set aside
        (what a store adds its fetched entries to)."""
        window = softcap = sinks = query_positions = None
        if options is not None and not options.plain:
            window, softcap, sinks = options.sliding_window, options.softcap, options.sinks
            if window is not None and self.prompt_positions is None:
                raise RuntimeError("a sliding-window layer was compressed without its positions")
            if window is not None:
                query_positions = self.new_positions[:, -query.shape[2] :]
        if self.packed is not None:
            return packed_decode_attention(
                query, self.packed, self.starts, self.lengths, self.decode_keys, self.decode_values,
                self.decode_length, scaling, self.max_prompt_length, sliding_window=window, softcap=softcap,
                sinks=sinks, prompt_positions=self.prompt_positions, decode_positions=self.decode_positions,
                query_positions=query_positions, decode_valid=self.decode_valid,
            )  # fmt: skip
        if self.key_channels is not None:
            return pruned_decode_attention(
                query, self.prompt_keys, self.prompt_values, self.key_channels, self.starts, self.lengths,
                self.decode_keys, self.decode_values, self.decode_length, scaling, self.max_prompt_length,
                runs=self.run_views() if reads_in_place(query) else None, sliding_window=window,
                softcap=softcap, sinks=sinks, prompt_positions=self.prompt_positions,
                decode_positions=self.decode_positions, query_positions=query_positions,
                decode_valid=self.decode_valid,
            )  # fmt: skip
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
            runs=self.run_views() if reads_in_place(query) else None,
            sliding_window=window,
            softcap=softcap,
            sinks=sinks,
            prompt_positions=self.prompt_positions,
            decode_positions=self.decode_positions,
            query_positions=query_positions,
            decode_valid=self.decode_valid,
        )
