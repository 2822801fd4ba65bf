"""The positions removed and kept during generation (``model.record_positions``): ``decode_time``'s
compressions and a decode policy's per-step evictions.

:class:`EvictionLog` follows every layer's entries through the compressions of one batch's
:class:`~kvlab.engine.decode_time.DecodeTimeCompressor`: it holds, for each slot of each layer's
slot layout (:mod:`kvlab.cache.slots`), the position of the entry stored there, in the sample's
own coordinates (0-based, padding removed: the prompt is ``0 .. T_b - 1``, the generated token
fed at decode step ``i`` is ``T_b + i``). It starts from the prefill's selections (the cache
stores a layer's kept entries in ascending position order), appends each fed token, and after a
compression keeps the slots the compression kept, in slot order, as
:meth:`~kvlab.cache.slots.SlotLayout.keep_slots` does. The cache itself is not read: it stores
positions only for sliding-window layers, which the tests use as an independent check.

Per sample (:meth:`EvictionLog.samples`) it gives what each compression that preceded the
sample's last token removed, and what the sample's cache held when its last token was chosen.
A decode policy that evicts during generation (``h2o``, ``tova``, ``fixed_index_evict``) records
the position it evicts from each (sample, KV head) at every step
(:class:`~kvlab.compression.decode.EvictionRecord`); :meth:`EvictionLog.policy_samples` turns that
into the same per-sample record: the positions held when the last token was chosen (the evictions
themselves, one per step, are not listed).
Shapes: B samples, L layers, Hkv KV heads, K prompt slots, n positions of one sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.compression.decode import EvictionRecord
from kvlab.pipeline import LayerReport


@dataclass
class DecodeEviction:
    """What one decode-time compression removed from one sample's cache.

    Attributes:
        step: generated tokens in the cache when the compression ran (it ran after decode step
            ``step``; the tokens chosen after it saw the compressed cache).
        removed: ``[L, Hkv, T_b + step]`` bool, True where the layer's head held the position just
            before the compression and not after it.
    """

    step: int
    removed: torch.Tensor


@dataclass
class DecodePositions:
    """One sample's decode-time record.

    Attributes:
        evictions: the compressions before the sample's last token, in order.
        final_step: generated tokens in the cache when the sample's last token was chosen (its
            output tokens, the stop token included, minus one: the last is never fed).
        final: ``[L, Hkv, T_b + final_step]`` bool, the positions each layer's head held then.
    """

    evictions: list[DecodeEviction]
    final_step: int
    final: torch.Tensor


class EvictionLog:
    """The positions of every layer's slots through one batch's decode-time compressions.

    Args:
        reports: the prefill's layer reports, each with its ``selection`` in the batch's padded
            prompt coordinates (the layer's prompt slots, in ascending position order).
        valid: ``[B, T]`` bool, the prompt padding mask of the prefill.
        merged: accept selections that merged evicted entries into kept ones (a decode policy's
            evictions name the kept token's position; ``decode_time`` refuses merging).
    """

    def __init__(self, reports: Sequence[LayerReport], valid: torch.Tensor, merged: bool = False):
        valid = valid.bool().cpu()
        B, T = valid.shape
        #: ``[B]`` long, each sample's prompt length
        self.prompt_lengths = valid.sum(-1)
        self._padded = T
        pad = (T - self.prompt_lengths)[:, None, None]
        self._slots: dict[int, torch.Tensor] = {}  # layer -> [B, Hkv, K] long, -1 on an empty slot
        for report in reports:
            selection = report.selection
            if selection is None or (selection.keys is not None and not merged):
                raise RuntimeError(
                    f"model.record_positions: layer {report.layer_idx} has no plain selection to follow "
                    "through decode-time compression"
                )
            real = selection.mask().cpu()
            positions = torch.where(real, selection.indices.cpu() - pad, -1)
            self._slots[report.layer_idx] = positions[..., : int(selection.counts.max())]
        self._prefill = dict(self._slots)
        #: ``(generated tokens, {layer: [B, Hkv, K] slot positions after the compression})`` per compression
        self.events: list[tuple[int, dict[int, torch.Tensor]]] = []

    def compressed(self, layer_idx: int, keep: torch.Tensor, generated: int, decode_length: int) -> None:
        """Layer ``layer_idx`` keeps the slots ``keep [B, Hkv, K + decode_length]`` marks (its slot
        layout: ``K`` prompt slots, then the ``decode_length`` tokens fed since the last compression,
        the last of them the ``generated``-th generated token)."""
        slots = self._slots[layer_idx]
        B, Hkv, K = slots.shape
        keep = keep.cpu()
        if keep.shape != (B, Hkv, K + decode_length):
            raise RuntimeError(
                f"record_positions: layer {layer_idx} has {K} + {decode_length} slots in the log but the "
                f"compression marked {tuple(keep.shape)}"
            )
        fed = self.prompt_lengths[:, None] + (generated - decode_length) + torch.arange(decode_length)
        held = torch.cat([slots, fed[:, None, :].expand(B, Hkv, decode_length)], dim=2)  # [B, Hkv, S]
        keep = keep & (held >= 0)
        counts = keep.sum(-1)
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices  # kept slots first, in order
        width = int(counts.max()) if counts.numel() else 0
        kept = held.gather(2, order)[..., :width]
        self._slots[layer_idx] = torch.where(torch.arange(width) < counts[..., None], kept, -1)

    def event(self, generated: int) -> None:
        """Every layer has been compressed after ``generated`` generated tokens: keep their slots."""
        self.events.append((generated, dict(self._slots)))

    def samples(self, produced: Sequence[int]) -> list[DecodePositions]:
        """Per sample, its :class:`DecodePositions`; ``produced[b]``: the tokens sample ``b`` chose,
        its stop token included (the compressions at or after ``produced[b] - 1`` generated tokens came
        after its last token and are left out)."""
        layers = sorted(self._slots)
        out = []
        for b, count in enumerate(produced):
            length, last = int(self.prompt_lengths[b]), max(int(count) - 1, 0)
            held, held_step = self._prefill, 0
            evictions = []
            for step, slots in self.events:
                if step >= last:
                    break
                before = self._mask(held, layers, b, length, held_step, step)
                after = self._mask(slots, layers, b, length, step, step)
                evictions.append(DecodeEviction(step, before & ~after))
                held, held_step = slots, step
            final = self._mask(held, layers, b, length, held_step, last)
            out.append(DecodePositions(evictions, last, final))
        return out

    def policy_samples(self, record: EvictionRecord, produced: Sequence[int]) -> list[DecodePositions]:
        """Per sample, its :class:`DecodePositions` after a decode policy's per-step evictions.

        ``record``: what the policy evicted at each step (positions in the padded batch's
        coordinates, -1 for none); ``produced[b]``: the tokens sample ``b`` chose, its stop token
        included. Its ``final`` is what it held when its last token was chosen: the prefill's kept
        positions and its ``produced[b] - 1`` fed tokens, less what the policy evicted after each
        fed token but the last (the eviction after the last fed token came after the last token
        was computed, as :meth:`samples` leaves out a compression at that point). ``evictions``
        is empty.
        """
        layers = sorted(self._slots)
        T = self._padded
        evicted = {layer: self._evicted(record, layer) for layer in layers}  # [steps, B, Hkv]
        out = []
        for b, count in enumerate(produced):
            length, last = int(self.prompt_lengths[b]), max(int(count) - 1, 0)
            final = self._mask(self._prefill, layers, b, length, 0, last)  # [L, Hkv, length + last]
            for i, layer in enumerate(layers):
                victims = evicted[layer][: max(last - 1, 0), b]  # [steps before the last fed token, Hkv, n]
                heads = torch.arange(victims.shape[1])[:, None].expand_as(victims)
                # in the sample's own coordinates: prompt t -> t - padding, generated T + i -> length + i
                own = torch.where(victims < T, victims - (T - length), victims - T + length)
                hit = victims >= 0
                final[i, heads[hit], own[hit]] = False
            out.append(DecodePositions([], last, final))
        return out

    def _evicted(self, record: EvictionRecord, layer: int) -> torch.Tensor:
        """``[steps, B, Hkv, n]`` long on the host: the positions layer ``layer`` evicted at each step of
        ``record`` (padded batch coordinates, -1 for none; ``n`` the most any row evicted in a step,
        1 for a policy evicting one entry per step), read in one copy."""
        B, Hkv = self._slots[layer].shape[:2]
        steps = [step.get(layer) for step in record.steps]
        device = next((v.device for v in steps if v is not None), torch.device("cpu"))
        views = [None if v is None else v.long().to(device).view(B, Hkv, -1) for v in steps]
        n = max([1] + [v.shape[-1] for v in views if v is not None])
        none = torch.full((B, Hkv, n), -1, dtype=torch.long, device=device)
        if not steps:
            return none.cpu()[None][:0]
        padded = [none if v is None else F.pad(v, (0, n - v.shape[-1]), value=-1) for v in views]
        return torch.stack(padded).cpu()

    @staticmethod
    def _mask(
        slots: dict[int, torch.Tensor], layers: list[int], b: int, length: int, since: int, upto: int
    ) -> torch.Tensor:
        """``[L, Hkv, length + upto]`` bool: the positions sample ``b``'s slots hold, plus the tokens
        generated from ``since`` to ``upto`` (fed after those slots were set)."""
        n = length + upto
        rows = []
        for layer in layers:
            positions = slots[layer][b]  # [Hkv, K]
            mask = torch.zeros(positions.shape[0], n + 1, dtype=torch.bool)
            mask.scatter_(1, torch.where(positions >= 0, positions, n), True)
            mask[:, length + since : n] = True
            rows.append(mask[:, :n])
        return torch.stack(rows)
