"""The slot layout of a compressed layer: how decode policies address, score and evict its entries.

A (sample, KV head)'s entries in slot order (``[B, Hkv, K + decode_length]``): slots ``< K`` are
its kept prompt rows (padded to ``K``, the longest head's count), then its decode region (one
slot per appended token; the last slot is the newest token). :class:`SlotLayout` is a mixin of
:class:`~kvlab.cache.layer.CompressedLayer`: it reads the layer's buffers (``prompt_*``,
``decode_*``, ``starts`` / ``lengths``, positions) and offers

- the layout itself (:meth:`SlotLayout.slot_rows`, :meth:`SlotLayout.slot_valid`) and the
  attention probabilities of new queries in it (:meth:`SlotLayout.attention_probs`, H2O);
- the in-place changes a decode policy may ask for, each keeping the flat layout valid:
  :meth:`SlotLayout.evict_one` (one slot of every row, H2O), :meth:`SlotLayout.evict_rows`
  (one slot of chosen rows, PrefixKV's fixed index) and :meth:`SlotLayout.keep_slots`
  (decode-time compression). They copy checkpointed buffers before writing
  (:meth:`~kvlab.cache.checkpoint.Checkpoints.own_buffers`).

A policy keeps its own per-slot bookkeeping (H2O's scores, PrefixKV's arrival order); the cache
only stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvlab.cache.masks import sliding_window
from kvlab.kernels.compaction import compact_kv
from kvlab.kernels.decode_attention import FULL_PRECISION, grouped_logits


class SlotLayout:
    """Mixin of :class:`~kvlab.cache.layer.CompressedLayer`: the slot layout (module docstring)."""

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
            newest = (self.next_positions - 1)[:, None, None]  # [B, 1, 1]: the newest token's window
            valid = valid & sliding_window(options.sliding_window)(None, newest, positions)
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
        self.own_buffers()
        new = self.decode_length - 1
        b, h = torch.meshgrid(
            torch.arange(victim.shape[0], device=victim.device),
            torch.arange(victim.shape[1], device=victim.device),
            indexing="ij",
        )
        in_prompt = victim < K
        pb, ph = b[in_prompt], h[in_prompt]
        row = self.starts[pb, ph] + victim[in_prompt]
        self.prompt_keys[row] = self.decode_keys[pb, ph, new]
        self.prompt_values[row] = self.decode_values[pb, ph, new]
        if self.prompt_positions is not None:
            self.prompt_positions[row] = self.decode_positions[pb, ph, new]
        db, dh, slot = b[~in_prompt], h[~in_prompt], victim[~in_prompt] - K
        buffers = [self.decode_keys, self.decode_values]
        if self.decode_positions is not None:
            buffers.append(self.decode_positions)
        for buffer in buffers:
            buffer[db, dh, slot] = buffer[db, dh, new]
        self.decode_length = new

    def move_entries(
        self,
        source: torch.Tensor,
        target: torch.Tensor,
        rows: torch.Tensor,
        tracked: Sequence[torch.Tensor] = (),
    ) -> None:
        """In every row ``(b, h)`` where ``rows`` is True, copy the entry at slot ``source[b, h]`` to
        slot ``target[b, h]`` (keys, values, stored positions, and the ``[B, Hkv, S]`` ``tracked``
        bookkeeping of the caller). All sources are read before anything is written."""
        b, h = rows.nonzero(as_tuple=True)
        if b.numel() == 0:
            return
        self.own_buffers()  # a checkpoint may share these buffers: copy before writing in place
        src, dst = source[b, h], target[b, h]
        pairs = [(self.prompt_keys, self.decode_keys), (self.prompt_values, self.decode_values)]
        if self.prompt_positions is not None:
            pairs.append((self.prompt_positions, self.decode_positions))
        moved = [self._read_slots(prompt, decode, b, h, src) for prompt, decode in pairs]
        extra = [t[b, h, src] for t in tracked]
        for (prompt, decode), values in zip(pairs, moved, strict=True):
            self._write_slots(prompt, decode, b, h, dst, values)
        for t, values in zip(tracked, extra, strict=True):
            t[b, h, dst] = values

    def _read_slots(self, prompt: torch.Tensor, decode: torch.Tensor, b, h, slots) -> torch.Tensor:
        """Entries at ``slots`` (slot layout) of rows ``(b, h)`` from a prompt / decode buffer pair."""
        K = self.prompt_slots
        rows = (self.starts[b, h] + slots).clamp(max=max(prompt.shape[0] - 1, 0))
        inside = (slots < K).view(-1, *([1] * (prompt.dim() - 1)))
        return torch.where(inside, prompt[rows], decode[b, h, (slots - K).clamp(min=0)])

    def _write_slots(self, prompt: torch.Tensor, decode: torch.Tensor, b, h, slots, values) -> None:
        inside = slots < self.prompt_slots
        prompt[self.starts[b[inside], h[inside]] + slots[inside]] = values[inside]
        decode[b[~inside], h[~inside], slots[~inside] - self.prompt_slots] = values[~inside]

    def evict_rows(
        self,
        victim: torch.Tensor,
        rows: torch.Tensor,
        capacity: torch.Tensor,
        tracked: Sequence[torch.Tensor] = (),
    ) -> None:
        """Drop the entry at slot ``victim [B, Hkv]`` from the rows where ``rows [B, Hkv]`` is True only.

        A row's entries are its prompt segment (``lengths[b, h]`` rows of the flat buffer, physically
        ``capacity[b, h]`` long: its prefill count) and the decode region (``decode_length`` slots,
        the same for every row). One row's total can only change through its ``lengths``:

        - when every row that keeps its entries has a free prompt row (``lengths < capacity``), the
          decode region shrinks by one: the newest slot's entry moves into the victim's slot in the
          evicting rows and into the first free prompt row elsewhere (with a single sample this is
          always the case, as in :meth:`evict_one`);
        - otherwise the evicting rows' last prompt row moves into the victim's slot and their
          ``lengths`` drop by one.

        ``lengths`` therefore drifts below the prefill count only while samples of a batch evict on
        different steps (PrefixKV's fixed-index rule, :mod:`kvlab.compression.decode_prefixkv`).
        ``tracked`` tensors (``[B, Hkv, S]``, slot layout) follow every move.

        Raises:
            RuntimeError: a row must evict but holds every entry in the shared decode region (the
                other rows cannot give one up); the cache would need per-row decode lengths.
        """
        K, D = self.prompt_slots, self.decode_length
        stay = ~rows
        if D >= 1 and bool((self.lengths[stay] < capacity[stay]).all()):
            source = torch.full_like(victim, K + D - 1)
            target = torch.where(rows, victim, self.lengths)
            self.move_entries(source, target, source != target, tracked)
            self.lengths = self.lengths + stay.long()  # not in place: lengths may be the selection's counts
            self.decode_length = D - 1
            return
        if bool((self.lengths[rows] < 1).any()):
            raise RuntimeError(
                "fixed_index_evict: a sample must drop an entry, but all of its entries sit in the decode "
                "region shared with the rest of the batch, which does not drop one on this step. Run this "
                "decode policy with data.batch_size 1 (or fewer new tokens)."
            )
        source = self.lengths - 1
        self.move_entries(source, victim, rows & (source != victim), tracked)
        self.lengths = self.lengths - rows.long()

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
