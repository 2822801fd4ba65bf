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
and :meth:`~kvlab.engine.cache.CompressedLayer.evict_one` evicts in every row at once, while
here each (sample, head) follows its own schedule. :func:`evict_rows` therefore drops one entry
from chosen rows only, using the slack the cache already has (see its docstring); attention is
order-invariant over stored entries (RoPE is applied before caching), so where an entry sits
does not matter, only which entries are stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from kvlab.compression.decode import DECODE_POLICIES, DecodePolicy
from kvlab.engine.cache import CompressedLayer, write_rows

if TYPE_CHECKING:
    from kvlab.engine.attention import CompressionSession


def _read(prompt: torch.Tensor, decode: torch.Tensor, layer: CompressedLayer, b, h, slots) -> torch.Tensor:
    """The entry at slot ``slots [B, Hkv]`` (slot layout, see ``CompressedLayer.slot_valid``) of every
    row ``(b, h)`` (``[B, Hkv]`` grids), ``[B, Hkv, *entry]``; a slot outside the row reads a clamped
    neighbour, which callers discard."""
    K = layer.prompt_slots
    from_decode = decode[b, h, (slots - K).clamp(min=0, max=decode.shape[2] - 1)]
    if prompt.shape[0] == 0:
        return from_decode
    rows = (layer.starts + slots).clamp(min=0, max=prompt.shape[0] - 1)
    inside = (slots < K).view(*slots.shape, *([1] * (prompt.dim() - 1)))
    return torch.where(inside, prompt[rows], from_decode)


def move_entries(
    layer: CompressedLayer,
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
    layer._own_buffers()  # a checkpoint may share these buffers: copy before writing in place
    K = layer.prompt_slots
    B, Hkv = rows.shape
    b = torch.arange(B, device=rows.device)[:, None].expand(B, Hkv)
    h = torch.arange(Hkv, device=rows.device)[None, :].expand(B, Hkv)
    to_prompt = rows & (target < K)
    to_decode = rows & (target >= K)
    decode_slot = torch.where(to_decode, target - K, 0)
    pairs = [(layer.prompt_keys, layer.decode_keys), (layer.prompt_values, layer.decode_values)]
    if layer.prompt_positions is not None:
        pairs.append((layer.prompt_positions, layer.decode_positions))
    moved = [_read(prompt, decode, layer, b, h, source) for prompt, decode in pairs]
    kept = [decode[b, h, decode_slot] for _, decode in pairs]  # what a row not moving rewrites
    read = [source.clamp(min=0, max=t.shape[2] - 1) for t in tracked]
    extra = [t.gather(2, slot[..., None]) for t, slot in zip(tracked, read, strict=True)]
    for (prompt, decode), values, old in zip(pairs, moved, kept, strict=True):
        write_rows(prompt, layer.starts + target.clamp(min=0, max=max(K - 1, 0)), values, to_prompt)
        where = to_decode.view(B, Hkv, *([1] * (values.dim() - 2)))
        decode[b, h, decode_slot] = torch.where(where, values, old)
    for t, slot, values in zip(tracked, read, extra, strict=True):
        t.scatter_(2, torch.where(rows, target, slot)[..., None], values)


def evict_flags(layer: CompressedLayer, rows: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
    """``[3]`` bool on the layer's device: (some row evicts, the decode region can shrink, a row
    that must evict has no prompt row left); what :func:`evict_rows` decides on, computed without
    a host sync so that one read serves every layer of a step."""
    D = layer.decode_length
    shrink = ((layer.lengths < capacity) | rows).all() & (D >= 1)
    return torch.stack([rows.any(), shrink, (rows & (layer.lengths < 1)).any()])


def evict_rows(
    layer: CompressedLayer,
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
      always the case, as in ``evict_one``);
    - otherwise the evicting rows' last prompt row moves into the victim's slot and their
      ``lengths`` drop by one.

    ``lengths`` therefore drifts below the prefill count only while samples of a batch evict on
    different steps. ``tracked`` tensors (``[B, Hkv, S]``, slot layout) follow every move.
    ``flags``: the host values of :func:`evict_flags` (read here when not given).

    Raises:
        RuntimeError: a row must evict but holds every entry in the shared decode region (the
            other rows cannot give one up); the cache would need per-row decode lengths.
    """
    K, D = layer.prompt_slots, layer.decode_length
    evicts, shrink, empty = flags if flags is not None else evict_flags(layer, rows, capacity).tolist()
    if not evicts:
        return
    stay = ~rows
    if shrink:
        source = torch.full_like(victim, K + D - 1)
        target = torch.where(rows, victim, layer.lengths)
        move_entries(layer, source, target, source != target, tracked)
        layer.lengths = layer.lengths + stay.long()  # not in place: lengths may be the selection's counts
        layer.decode_length = D - 1
        return
    if empty:
        raise RuntimeError(
            "fixed_index_evict: a sample must drop an entry, but all of its entries sit in the decode region "
            "shared with the rest of the batch, which does not drop one on this step. Run this decode policy "
            "with data.batch_size 1 (or fewer new tokens)."
        )
    source = layer.lengths - 1
    move_entries(layer, source, victim, rows & (source != victim), tracked)
    layer.lengths = layer.lengths - rows.long()


@dataclass
class FixedIndexRows:
    """The policy's bookkeeping for one layer (``[B, Hkv]`` unless noted).

    Attributes:
        kept: entries kept at prefill ``n0``; also each prompt segment's physical capacity.
        prompt: ``[B, 1]`` prompt length ``T`` of each sample (valid tokens).
        index: the fixed eviction index ``e`` (in arrival order).
        order: ``[B, Hkv, S]`` arrival rank of the entry in each slot (slot layout): prompt
            entries ``0 .. n0 - 1`` by position, the i-th generated token ``K + i``.
    """

    kept: torch.Tensor
    prompt: torch.Tensor
    index: torch.Tensor
    order: torch.Tensor

    def grow(self, slots: int) -> None:
        """Make room for ``slots`` slots (the cache's decode region grew)."""
        if self.order.shape[-1] < slots:
            self.order = F.pad(self.order, (0, slots - self.order.shape[-1]))


@DECODE_POLICIES.register("fixed_index_evict")
@dataclass
class FixedIndexEvict(DecodePolicy):
    """PrefixKV / Elastic Cache at decode: drop the entry at a fixed index to hold the kept fraction.

    Per layer and (sample, KV head), with ``n0`` entries after prefill out of ``T`` prompt tokens:
    after each step, when ``len * T - n_tok * n0 >= T`` (``len - n_tok n0 / T >= 1``, the
    release's ``trunc(len - n_tok (1 - forget)) > 0``), the entry at index ``e = n0 - distance``
    (``n0 // 2`` if that is below 1) in arrival order is dropped. Rows that were not compressed
    (``n0 = T``) never drop, nor do sliding-window layers: the model bounds what they see, and
    the fixed index would drop entries still inside the window. Bookkeeping lives in
    ``session.state``; see the module docstring.
    """

    distance: int = 25

    STATE: ClassVar[str] = "fixed_index_evict"

    def __post_init__(self) -> None:
        if self.distance < 0:
            raise ValueError(f"distance must be >= 0, got {self.distance}")

    def start(self, session: CompressionSession) -> None:
        prompt = session.valid.sum(-1, keepdim=True)  # [B, 1]
        layers = {}
        for layer_idx, layer in enumerate(session.cache.layers):
            kept = layer.lengths.clone()
            index = kept - self.distance
            index = torch.where(index >= 1, index, kept // 2)
            slots = layer.prompt_slots + layer.decode_keys.shape[2]
            order = torch.arange(slots, device=kept.device).expand(*kept.shape, -1).clone()
            layers[layer_idx] = FixedIndexRows(kept, prompt.to(kept.device), index, order)
        session.state[self.STATE] = layers

    def rows(self, session: CompressionSession) -> dict[int, FixedIndexRows]:
        """The batch's :class:`FixedIndexRows` per layer index (after :meth:`start`)."""
        return session.state[self.STATE]

    def after_step(self, session: CompressionSession, step: int) -> None:
        """Decide every layer's evictions on the device, read the decisions of all layers at once
        (one host sync per step, which the decode region's new length needs), then evict."""
        pending = []
        for layer_idx, layer in enumerate(session.cache.layers):
            if layer.sliding_window is not None:  # entries leave its window by position, not here
                continue
            rows = self.rows(session)[layer_idx]
            K, D = layer.prompt_slots, layer.decode_length
            rows.grow(K + D)
            rows.order[:, :, K + D - 1] = K + step  # the step's token: the newest arrival
            processed = rows.prompt + step + 1  # prompt tokens and the tokens fed so far
            size = layer.lengths + D
            evict = size * rows.prompt - processed * rows.kept >= rows.prompt
            # The victim is the index-th entry in arrival order. The first `index` arrivals are never
            # evicted (the victim is always the index-th), so it is the stored entry of lowest
            # arrival rank at or above `index`: a masked argmin, no sort.
            arrival = rows.order[..., : K + D]
            candidate = layer.slot_valid() & (arrival >= rows.index[..., None])
            victim = arrival.masked_fill(~candidate, torch.iinfo(torch.long).max).argmin(-1)
            pending.append((layer, rows, victim, evict, evict_flags(layer, evict, rows.kept)))
        if not pending:
            return
        device = pending[0][4].device
        flags = torch.stack([f.to(device) for *_, f in pending]).tolist()  # the step's one host read
        for (layer, rows, victim, evict, _), layer_flags in zip(pending, flags, strict=True):
            evict_rows(layer, victim, evict, rows.kept, [rows.order], flags=layer_flags)
