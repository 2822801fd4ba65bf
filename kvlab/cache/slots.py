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
        if self.packed is not None:
            raise RuntimeError(
                "this layer stores its prompt entries as codes (model.compression.quantize), which have no "
                "slot layout: decode policies that rescore or move entries and decode-time compression are "
                "refused with a quantizer when the config is validated"
            )
        if self.key_channels is not None:
            raise RuntimeError(
                "this layer stores its prompt keys with fewer channels than its decoded tokens' "
                "(model.compression.channels), so no decoded token can move into a prompt slot: decode "
                "policies that rescore or move entries and decode-time compression are refused with a "
                "channel pruner when the config is validated"
            )
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

    def slot_keys(self) -> torch.Tensor:
        """``[B, Hkv, K + decode_length, D]``: the stored keys in the slot layout (:meth:`slot_valid`),
        in the cache's dtype; an empty slot holds another entry's key (mask it with :meth:`slot_valid`)."""
        rows, _ = self.slot_rows()
        return torch.cat([self.prompt_keys[rows], self.decode_keys[:, :, : self.decode_length]], 2)

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
        buffer is reallocated. Dense over every (sample, head), so no host sync: decode victims
        move the newest entry in place, prompt victims go through :func:`write_rows`.
        """
        K = self.prompt_slots
        self.own_buffers()
        new = self.decode_length - 1
        B, Hkv = victim.shape
        b = torch.arange(B, device=victim.device)[:, None].expand(B, Hkv)
        h = torch.arange(Hkv, device=victim.device)[None, :].expand(B, Hkv)
        in_prompt = victim < K
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

    def move_entries(
        self,
        source: torch.Tensor,
        target: torch.Tensor,
        rows: torch.Tensor,
        tracked: Sequence[torch.Tensor] = (),
    ) -> None:
        """In every row ``(b, h)`` where ``rows`` is True, copy the entry at slot ``source[b, h]`` to
        slot ``target[b, h]`` (keys, values, stored positions, and the ``[B, Hkv, S]`` ``tracked``
        bookkeeping of the caller). All sources are read before anything is written.

        Dense over the ``[B, Hkv]`` rows, with no host sync: a row that does not move rewrites one of
        its own decode slots (or, in the flat prompt buffer, repeats another row's write, see
        :func:`write_rows`) with the value it holds.
        """
        self.own_buffers()  # a checkpoint may share these buffers: copy before writing in place
        K = self.prompt_slots
        B, Hkv = rows.shape
        b = torch.arange(B, device=rows.device)[:, None].expand(B, Hkv)
        h = torch.arange(Hkv, device=rows.device)[None, :].expand(B, Hkv)
        to_prompt = rows & (target < K)
        to_decode = rows & (target >= K)
        decode_slot = torch.where(to_decode, target - K, 0)
        pairs = [(self.prompt_keys, self.decode_keys), (self.prompt_values, self.decode_values)]
        if self.prompt_positions is not None:
            pairs.append((self.prompt_positions, self.decode_positions))
        moved = [self._read_slots(prompt, decode, b, h, source) for prompt, decode in pairs]
        kept = [decode[b, h, decode_slot] for _, decode in pairs]  # what a row not moving rewrites
        read = [source.clamp(min=0, max=t.shape[2] - 1) for t in tracked]
        extra = [t.gather(2, slot[..., None]) for t, slot in zip(tracked, read, strict=True)]
        for (prompt, decode), values, old in zip(pairs, moved, kept, strict=True):
            write_rows(prompt, self.starts + target.clamp(min=0, max=max(K - 1, 0)), values, to_prompt)
            where = to_decode.view(B, Hkv, *([1] * (values.dim() - 2)))
            decode[b, h, decode_slot] = torch.where(where, values, old)
        for t, slot, values in zip(tracked, read, extra, strict=True):
            t.scatter_(2, torch.where(rows, target, slot)[..., None], values)

    def _read_slots(self, prompt: torch.Tensor, decode: torch.Tensor, b, h, slots) -> torch.Tensor:
        """The entry at slot ``slots [B, Hkv]`` (slot layout) of every row ``(b, h)`` (``[B, Hkv]``
        grids) from a prompt / decode buffer pair, ``[B, Hkv, *entry]``; a slot outside the row
        reads a clamped neighbour, which callers discard."""
        K = self.prompt_slots
        from_decode = decode[b, h, (slots - K).clamp(min=0, max=decode.shape[2] - 1)]
        if prompt.shape[0] == 0:
            return from_decode
        rows = (self.starts + slots).clamp(min=0, max=prompt.shape[0] - 1)
        inside = (slots < K).view(*slots.shape, *([1] * (prompt.dim() - 1)))
        return torch.where(inside, prompt[rows], from_decode)

    def evict_flags(self, rows: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
        """``[3]`` bool on the layer's device: (some row evicts, the decode region can shrink, a row
        that must evict has no prompt row left); what :meth:`evict_rows` decides on, computed
        without a host sync so that one read serves every layer of a step."""
        D = self.decode_length
        shrink = ((self.lengths < capacity) | rows).all() & (D >= 1)
        return torch.stack([rows.any(), shrink, (rows & (self.lengths < 1)).any()])

    def evict_rows(
        self,
        victim: torch.Tensor,
        rows: torch.Tensor,
        capacity: torch.Tensor,
        tracked: Sequence[torch.Tensor] = (),
        flags: Sequence[bool] | None = None,
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
        ``tracked`` tensors (``[B, Hkv, S]``, slot layout) follow every move. ``flags``: the host
        values of :meth:`evict_flags` (read here when not given).

        Raises:
            RuntimeError: a row must evict but holds every entry in the shared decode region (the
                other rows cannot give one up); the cache would need per-row decode lengths.
        """
        K, D = self.prompt_slots, self.decode_length
        evicts, shrink, empty = flags if flags is not None else self.evict_flags(rows, capacity).tolist()
        if not evicts:
            return
        stay = ~rows
        if shrink:
            source = torch.full_like(victim, K + D - 1)
            target = torch.where(rows, victim, self.lengths)
            self.move_entries(source, target, source != target, tracked)
            self.lengths = self.lengths + stay.long()  # not in place: lengths may be the selection's counts
            self.decode_length = D - 1
            return
        if empty:
            raise RuntimeError(
                "fixed_index_evict: a sample must drop an entry, but all of its entries sit in the decode "
                "region shared with the rest of the batch, which does not drop one on this step. Run this "
                "decode policy with data.batch_size 1 (or fewer new tokens)."
            )
        source = self.lengths - 1
        self.move_entries(source, victim, rows & (source != victim), tracked)
        self.lengths = self.lengths - rows.long()

    def keep_slots(self, keep: torch.Tensor, prompt_slots: int | None = None) -> None:
        """Keep the entries ``keep [B, Hkv, K + decode_length]`` marks (slot layout) and drop the rest.

        The kept entries of each (sample, head), prompt and decode alike, become its new prompt
        region in slot order (counts may differ per head); the decode region is emptied and its
        padding marks cleared. Logical length and positions are unchanged (RoPE positions are in
        the keys already; sliding layers keep each entry's original position). Invalidates any
        slot-indexed state a decode policy holds for this layer.

        ``prompt_slots``: the most entries a row keeps (``keep.sum(-1).max()``), when the caller has
        read it already (a periodic decode policy reads every layer's at once); the check that
        ``keep`` marks only stored entries is then the caller's too. None: both are done here.

        Raises:
            ValueError: ``keep`` has the wrong shape or marks a slot that holds no entry.
        """
        valid = self.slot_valid()
        if keep.shape != valid.shape:
            raise ValueError(
                f"keep_slots: keep must be {tuple(valid.shape)} (slot layout), got {tuple(keep.shape)}"
            )
        keep = keep.to(valid.device)
        if prompt_slots is None and bool((keep & ~valid).any()):
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
        if prompt_slots is not None:
            self.max_prompt_length = prompt_slots
        else:
            self.max_prompt_length = int(self.lengths.max()) if self.lengths.numel() else 0
        if self.shares_buffers:  # a checkpoint holds the decode buffers: later appends go to new ones
            self.decode_keys = torch.empty_like(self.decode_keys)
            self.decode_values = torch.empty_like(self.decode_values)
            if self.decode_positions is not None:
                self.decode_positions = torch.zeros_like(self.decode_positions)
            self.shares_buffers = False
        self.decode_length = 0
        self.decode_valid = None
