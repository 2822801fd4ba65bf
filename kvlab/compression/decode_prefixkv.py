"""PrefixKV's decode rule: hold each layer's kept fraction by dropping one entry at a fixed cache index.

PrefixKV (Wang et al. 2024, arXiv 2412.03409, Sec. 3.1 and 4.1) follows Elastic Cache (Liu et
al. 2024) at decode: "prune the vectors at a fixed distance to the latest generated token and
maintain the global prefix configuration". In the release this is, per layer and sample, with
``n0`` the entries kept at prefill, ``T`` the prompt length and ``keep = n0 / T``:

- the eviction index is ``e = n0 - distance`` (``distance = 25``), or ``n0 // 2`` when that is
  below 1; entries are ordered as they arrived (kept prompt tokens by position, then generated
  tokens), so the first ``e`` entries are frozen and the rest is a FIFO;
- after each step (the new token stored, ``n_tok`` tokens processed so far) the entry at index
  ``e`` is dropped when ``trunc(len - n_tok keep) > 0``: at most one per step, so the layer's
  size follows ``(T + t) keep`` within one token.

Importance is not updated during decoding. Positions are not renumbered: kvlab's decode keeps
each token's true position (the release gives new tokens layer 0's compressed length).

The cache stores ``[B, Hkv]`` ragged prompt segments and one decode region shared by the batch,
and :meth:`~kvlab.cache.slots.SlotLayout.evict_one` evicts in every row at once, while
here each (sample, head) follows its own schedule.
:meth:`~kvlab.cache.slots.SlotLayout.evict_rows` therefore drops one entry from chosen rows
only, using the slack the cache already has (see its docstring); attention is
order-invariant over stored entries (RoPE is applied before caching), so where an entry sits
does not matter, only which entries are stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from kvlab.cache.state import RunState
from kvlab.compression.context import LayerContext
from kvlab.compression.decode import DECODE_POLICIES, DecodePolicy, EvictionRecord, evict_rows_of_layers
from kvlab.config import papers


@dataclass
class FixedIndexRows:
    """The policy's bookkeeping for one layer (``[B, Hkv]`` unless noted).

    Attributes:
        kept: entries kept at prefill ``n0``; also each prompt segment's physical capacity.
        prompt: ``[B, 1]`` prompt length ``T`` of each sample (valid tokens).
        index: the fixed eviction index ``e`` (in arrival order).
        order: ``[B, Hkv, S]`` arrival rank of the entry in each slot (slot layout): prompt
            entries ``0 .. n0 - 1`` by position, the i-th generated token ``K + i``.
        positions: ``[B, Hkv, S]`` position of the entry in each slot (padded batch coordinates),
            followed only while evictions are recorded (``model.record_positions``), else None.
    """

    kept: torch.Tensor
    prompt: torch.Tensor
    index: torch.Tensor
    order: torch.Tensor
    positions: torch.Tensor | None = None

    def grow(self, slots: int) -> None:
        """Make room for ``slots`` slots (the cache's decode region grew)."""
        if self.order.shape[-1] < slots:
            self.order = F.pad(self.order, (0, slots - self.order.shape[-1]))
        if self.positions is not None and self.positions.shape[-1] < slots:
            self.positions = F.pad(self.positions, (0, slots - self.positions.shape[-1]))

    def tracked(self) -> list[torch.Tensor]:
        """The slot-layout bookkeeping that follows every move of the cache."""
        return [self.order] if self.positions is None else [self.order, self.positions]


@dataclass
class FixedIndexState:
    """The policy's state in one run: :class:`FixedIndexRows` by layer index; each layer's kept
    prompt positions ``[B, Hkv, K']`` (selection layout) from the prefill; the eviction record when
    asked for one."""

    layers: dict[int, FixedIndexRows] = field(default_factory=dict)
    prefill: dict[int, torch.Tensor] = field(default_factory=dict)
    record: EvictionRecord | None = None


@DECODE_POLICIES.register("fixed_index_evict")
@dataclass
class FixedIndexEvict(DecodePolicy):
    """PrefixKV / Elastic Cache at decode: drop the entry at a fixed index to hold the kept fraction.

    Per layer and (sample, KV head), with ``n0`` entries after prefill out of ``T`` prompt tokens:
    after each step, when ``len * T - n_tok * n0 >= T`` (``len - n_tok n0 / T >= 1``, the
    release's ``trunc(len - n_tok (1 - forget)) > 0``), the entry at index ``e = n0 - distance``
    (``n0 // 2`` if that is below 1) in arrival order is dropped. Rows that were not compressed
    (``n0 = T``) never drop, nor do sliding-window layers: the model bounds what they see, and
    the fixed index would drop entries still inside the window. Bookkeeping lives in the run
    state; see the module docstring. Under ``model.record_positions`` each slot's position is
    followed too (from the prefill's selection) and every step's victims are recorded
    (:class:`~kvlab.compression.decode.EvictionRecord`).
    """

    paper: ClassVar[str | None] = papers.PREFIXKV

    distance: int = 25

    def __post_init__(self) -> None:
        if self.distance < 0:
            raise ValueError(f"distance must be >= 0, got {self.distance}")

    def on_compress(self, ctx: LayerContext, selection: Any, budget: torch.Tensor) -> None:
        """Keep the layer's kept prompt positions (what a recorded eviction names)."""
        run_state = run_state_of(self, ctx.run)
        run_state.prefill[ctx.layer_idx] = selection.indices

    def start(self, run: RunState) -> None:
        prompt = run.valid.sum(-1, keepdim=True)  # [B, 1]
        state = run_state_of(self, run)
        layers = {}
        for layer_idx, layer in enumerate(run.cache.layers):
            kept = layer.lengths.clone()
            index = kept - self.distance
            index = torch.where(index >= 1, index, kept // 2)
            K, decode = layer.prompt_slots, layer.decode_keys.shape[2]
            order = torch.arange(K + decode, device=kept.device).expand(*kept.shape, -1).clone()
            positions = None
            if state.record is not None:
                positions = F.pad(state.prefill[layer_idx][..., :K].long().to(kept.device), (0, decode))
            layers[layer_idx] = FixedIndexRows(kept, prompt.to(kept.device), index, order, positions)
        state.layers, state.prefill = layers, {}

    def record_evictions(self, run: RunState) -> None:
        run_state_of(self, run).record = EvictionRecord()

    def evicted_positions(self, run: RunState) -> EvictionRecord | None:
        return run_state_of(self, run).record

    def rows(self, run: RunState) -> dict[int, FixedIndexRows]:
        """The batch's :class:`FixedIndexRows` per layer index (after :meth:`start`)."""
        return run_state_of(self, run).layers

    def after_step(self, run: RunState, step: int) -> None:
        """Decide every layer's evictions on the device, read the decisions of all layers at once
        (one host sync per step, which the decode region's new length needs), then evict."""
        pending, evicted = [], {}
        record = run_state_of(self, run).record
        for layer_idx, layer in enumerate(run.cache.layers):
            if layer.sliding_window is not None:  # entries leave its window by position, not here
                continue
            rows = self.rows(run)[layer_idx]
            K, D = layer.prompt_slots, layer.decode_length
            rows.grow(K + D)
            rows.order[:, :, K + D - 1] = K + step  # the step's token: the newest arrival
            if rows.positions is not None:
                rows.positions[:, :, K + D - 1] = layer.cumulative_length - 1
            processed = rows.prompt + step + 1  # prompt tokens and the tokens fed so far
            size = layer.lengths + D
            evict = size * rows.prompt - processed * rows.kept >= rows.prompt
            # The victim is the index-th entry in arrival order. The first `index` arrivals are never
            # evicted (the victim is always the index-th), so it is the stored entry of lowest
            # arrival rank at or above `index`: a masked argmin, no sort.
            arrival = rows.order[..., : K + D]
            candidate = layer.slot_valid() & (arrival >= rows.index[..., None])
            victim = arrival.masked_fill(~candidate, torch.iinfo(torch.long).max).argmin(-1)
            if rows.positions is not None:  # the victim's position, read before it is overwritten
                position = rows.positions.gather(-1, victim[..., None])[..., 0]
                evicted[layer_idx] = torch.where(evict, position, -1)
            pending.append((layer, victim, evict, rows.kept, rows.tracked()))
        evict_rows_of_layers(pending)
        if record is not None:
            record.steps.append(evicted)


def run_state_of(policy: FixedIndexEvict, run: RunState) -> FixedIndexState:
    """``policy``'s :class:`FixedIndexState` in ``run``."""
    return run.owned(policy, FixedIndexState)
