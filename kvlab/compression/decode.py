"""Decode policies: what happens to the cache while tokens are generated.

The slot exists on every pipeline (``model.compression.decode``). ``none`` appends every
decoded token and never evicts (the default of SnapKV, LOOK-M's "look once", DAVID and the
papers). ``h2o`` and ``tova`` hold each (sample, KV head) at a fixed size by evicting one entry
per step. A policy has three hooks, all optional:

- :meth:`DecodePolicy.on_compress` sees each layer's prefill selection, its context and its
  layer budget, e.g. to seed per-entry scores; it keeps what it needs in the run's state
  (``ctx.run.owned(self, factory)``, :class:`~kvlab.cache.state.RunState`);
- :meth:`DecodePolicy.start` runs once before the first decode step with the batch's
  :class:`~kvlab.cache.state.RunState`. A policy that needs each step's decode attention declares
  it (``Capabilities(decode_attention=True)``); the engine then has the attention function
  record every layer's attention probabilities of each step in the run state
  (:meth:`RunState.take_decode_attention <kvlab.cache.state.RunState.take_decode_attention>`
  hands them over);
- :meth:`DecodePolicy.after_step` runs after every decode step (the step's token is already in
  each layer's decode region). Evicting goes through
  :meth:`~kvlab.cache.slots.SlotLayout.evict_one`, which moves the newest token into the
  victim's slot, so memory stays what was allocated and nothing is masked, or
  :meth:`~kvlab.cache.slots.SlotLayout.evict_rows` when only some rows evict
  (:func:`evict_rows_of_layers`).

**The shared eviction step.** :class:`ScoredEviction` is decode-time eviction by score: every
stored entry carries a score (:class:`ScoredEntries`, in the cache's slot layout), and after each
step the entry with the lowest score outside the ``recent`` newest positions is evicted from
every (sample, KV head) that holds more than its capacity. A method on it supplies only its
per-entry scores: their prefill seed (:meth:`ScoredEviction.prefill_scores`) and how each step's
attention updates them (:meth:`ScoredEviction.update`), and, when it differs from the
post-prefill size, each row's capacity (:meth:`ScoredEviction.capacity`). ``h2o`` accumulates
(here); ``tova`` replaces the scores by the step's attention (:mod:`kvlab.compression.tova`).

**What was evicted.** Under ``model.record_positions`` the engine asks the policy to record what
it evicts (:meth:`DecodePolicy.record_evictions`, before the first step) and reads it back
after decoding (:meth:`DecodePolicy.evicted_positions`: per step and layer, the position each
(sample, KV head) evicted), so ``positions.jsonl`` holds the cache as it was at each sample's
last token (:mod:`kvlab.engine.decode_positions`). ``none`` never evicts and records nothing.

The cache only stores K/V: a policy keeps its per-entry bookkeeping itself, per batch, in the
run state (a pipeline and its policy serve many batches). Other eviction rules, e.g. a victim
picked by index or by age rather than by score, fit the same hooks (PrefixKV's fixed index,
:mod:`kvlab.compression.decode_prefixkv`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F

from kvlab.cache.layer import CompressedLayer
from kvlab.cache.state import RunState
from kvlab.compression.context import LayerContext
from kvlab.compression.ops import reduce_groups
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities, Component
from kvlab.config.registry import Registry


@dataclass
class EvictionRecord:
    """What a decode policy evicted, step by step (``model.record_positions``).

    Attributes:
        steps: one mapping per :meth:`DecodePolicy.after_step` call, in order: layer index ->
            ``[B, Hkv]`` long, the position each (sample, KV head) evicted in that step, in the
            padded batch's coordinates (a prompt token its index ``t < T``, the i-th decoded token
            ``T + i``), -1 where the row evicted nothing; or ``[B, Hkv, n]`` when a step evicts
            several entries per row (a periodic eviction), -1 past a row's evictions. A layer that
            evicted nothing in a step may be left out.
    """

    steps: list[dict[int, torch.Tensor]] = field(default_factory=list)


class DecodePolicy(Component):
    """Base class: override :meth:`after_step` (and :meth:`on_compress` / :meth:`start` when needed).

    ``capabilities.decode_attention``: the policy reads each decode step's attention
    (``run.take_decode_attention()``); ``capabilities.chunked_prefill`` False: it reads every
    prompt query's attention at ``on_compress``.
    """

    def on_compress(self, ctx: LayerContext, selection: Any, budget: torch.Tensor) -> None:
        """Called right after layer ``ctx.layer_idx`` chose its ``Selection``; ``budget [B]`` is the
        layer's budget per sample (tokens per head; at least the prompt when nothing was compressed)."""
        return None

    def start(self, run: RunState) -> None:
        """Called once before the first decode step, with the batch's run state (cache, own state)."""
        return None

    def after_step(self, run: RunState, step: int) -> None:
        """Called after every decode step; ``run.cache`` holds the step's token."""
        raise NotImplementedError

    def record_evictions(self, run: RunState) -> None:
        """Record from now on what :meth:`after_step` evicts (``model.record_positions``; called after
        the prefill, before :meth:`start`). A policy that never evicts has nothing to record."""
        return None

    def evicted_positions(self, run: RunState) -> EvictionRecord | None:
        """What the policy evicted since :meth:`record_evictions` (None: it never evicts)."""
        return None


DECODE_POLICIES: Registry[DecodePolicy] = Registry("decode policy", "model.compression.decode")


@DECODE_POLICIES.register("none")
@dataclass
class AppendOnly(DecodePolicy):
    """Append every decoded token; never evict."""

    def after_step(self, run: RunState, step: int) -> None:
        return None


#: one layer's eviction for :func:`evict_rows_of_layers`: ``(layer, victim, rows, capacity, tracked)``
RowEviction = tuple[CompressedLayer, torch.Tensor, torch.Tensor, torch.Tensor, Sequence[torch.Tensor]]


def evict_rows_of_layers(pending: Sequence[RowEviction]) -> None:
    """Evict from chosen rows of several layers with one host read for all of them.

    Each entry is ``(layer, victim [B, Hkv], rows [B, Hkv] bool, capacity [B, Hkv], tracked)`` as
    :meth:`~kvlab.cache.slots.SlotLayout.evict_rows` takes them (``capacity``: each prompt segment's
    physical length, its prefill count; ``tracked``: ``[B, Hkv, S]`` bookkeeping in the slot layout
    that follows every move). The layers' :meth:`~kvlab.cache.slots.SlotLayout.evict_flags` are
    read at once (the decode region's new length is a host value), then each layer evicts.
    """
    if not pending:
        return
    flags = [layer.evict_flags(rows, capacity) for layer, _, rows, capacity, _ in pending]
    device = flags[0].device
    read = torch.stack([f.to(device) for f in flags]).tolist()  # the step's one host read
    for (layer, victim, rows, capacity, tracked), layer_flags in zip(pending, read, strict=True):
        layer.evict_rows(victim, rows, capacity, list(tracked), flags=layer_flags)


def grow_to_budget(kept: torch.Tensor, budget: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv]`` decode capacity: the layer ``budget [B]`` where the prefill kept the whole prompt
    (``budget >= lengths [B]``), so the cache grows to the budget while generating, else the kept
    count ``kept [B, Hkv]`` (TOVA's multi-state size, R-KV's budget)."""
    uncompressed = (budget >= lengths)[:, None]  # [B, 1]
    return torch.where(uncompressed, budget[:, None].expand_as(kept), kept)


@dataclass
class ScoredEntries:
    """A scored policy's bookkeeping for one layer: the score and position of every stored entry.

    Both tensors are in the cache's slot layout (see
    :meth:`~kvlab.cache.slots.SlotLayout.slot_valid`): slot ``s < K`` is a prompt row of the
    (sample, head), then its decode tokens; they hold at least ``K + decode_length`` slots. Empty
    slots hold leftovers that are never read unmasked.

    Attributes:
        scores: ``[B, Hkv, S]`` fp32 score of each entry (higher: kept longer).
        positions: ``[B, Hkv, S]`` long, the entry's position in the padded batch (a prompt token
            its index ``t < T``, the i-th decoded token ``T + i``).
        countdown: with a periodic eviction (``ScoredEviction.every > 1``), ``[B, Hkv]`` long, the
            decode steps left before each row's next eviction as :meth:`ScoredEviction.update` sees
            them (0: this step's); a method observing only the queries right before an eviction
            reads it (R-KV). None with ``every == 1``.
    """

    scores: torch.Tensor
    positions: torch.Tensor
    countdown: torch.Tensor | None = None

    @classmethod
    def seed(cls, layer: CompressedLayer, scores: torch.Tensor, positions: torch.Tensor) -> ScoredEntries:
        """Entries of a just-compressed ``layer`` from prefill ``scores`` and ``positions``, both
        ``[B, Hkv, K']`` in the layer's selection layout (slot ``s`` of a (sample, head) is its
        ``s``-th kept entry, ``K' >= K``); the decode slots start at 0."""
        K, decode = layer.prompt_slots, layer.decode_keys.shape[2]
        return cls(F.pad(scores.float()[..., :K], (0, decode)), F.pad(positions.long()[..., :K], (0, decode)))

    def arrive(self, layer: CompressedLayer) -> int:
        """The step's token is in ``layer``'s newest slot: give it its position and a score of 0;
        returns the slots in use, ``K + decode_length`` (the newest is the last)."""
        slots = layer.prompt_slots + layer.decode_length
        if self.scores.shape[-1] < slots:  # the cache's decode region grew
            grow = slots - self.scores.shape[-1]
            self.scores = F.pad(self.scores, (0, grow))
            self.positions = F.pad(self.positions, (0, grow))
        self.positions[:, :, slots - 1] = layer.cumulative_length - 1
        self.scores[:, :, slots - 1] = 0
        return slots

    def lowest(self, layer: CompressedLayer, recent: int) -> torch.Tensor:
        """``[B, Hkv]`` slot of the stored entry with the lowest score outside the ``recent`` newest
        positions (the first such slot on a tie), or of the oldest entry when every entry is recent."""
        slots = layer.prompt_slots + layer.decode_length
        scores, positions = self.scores[:, :, :slots], self.positions[:, :, :slots]
        valid = layer.slot_valid()  # [B, Hkv, slots]
        newest = layer.cumulative_length - 1
        candidate = valid & ~(positions > newest - recent)
        lowest = scores.masked_fill(~candidate, float("inf")).argmin(-1)
        oldest = positions.masked_fill(~valid, torch.iinfo(positions.dtype).max).argmin(-1)
        return torch.where(candidate.any(-1), lowest, oldest)

    def evict(self, victim: torch.Tensor, newest: int) -> None:
        """Mirror :meth:`~kvlab.cache.slots.SlotLayout.evict_one`: slot ``newest`` moves into
        ``victim [B, Hkv]`` and is freed."""
        b, h = torch.meshgrid(
            torch.arange(victim.shape[0], device=victim.device),
            torch.arange(victim.shape[1], device=victim.device),
            indexing="ij",
        )
        self.scores[b, h, victim] = self.scores[b, h, newest]
        self.positions[b, h, victim] = self.positions[b, h, newest]
        self.scores[:, :, newest] = 0


@dataclass
class ScoredLayer:
    """:class:`ScoredEviction`'s state for one layer of one run.

    Attributes:
        entries: the per-entry scores and positions.
        capacity: ``[B, Hkv]`` long, the entries each (sample, head) may hold (the policy's
            :meth:`ScoredEviction.capacity`).
        physical: ``[B, Hkv]`` long, each prompt segment's physical length (its prefill count),
            what :meth:`~kvlab.cache.slots.SlotLayout.evict_rows` needs.
        growth: decode steps before every row is at its capacity (from then on every step evicts
            from every row: :meth:`~kvlab.cache.slots.SlotLayout.evict_one`).
        room: with a periodic eviction (``ScoredEviction.every > 1``), ``[B, Hkv]`` long, the step
            of each row's first eviction (the first step it would hold more than its capacity);
            None otherwise.
        period: ``[B, Hkv]`` long, the steps between a row's evictions (``every``, or its capacity
            when that is smaller); None without a periodic eviction.
        schedule: the distinct ``(room, period)`` pairs of the rows, on the host: a layer evicts
            at a step where one of them is due, with no host read.
    """

    entries: ScoredEntries
    capacity: torch.Tensor
    physical: torch.Tensor
    growth: int
    room: torch.Tensor | None = None
    period: torch.Tensor | None = None
    schedule: frozenset[tuple[int, int]] = frozenset()


#: one layer's prefill seed: ``(scores [B, Hkv, K'], positions [B, Hkv, K'], budget [B], lengths [B])``
Seed = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class ScoredEvictionState:
    """A scored policy's state in one run: each layer's prefill seeds ``(scores [B, Hkv, K'],
    positions [B, Hkv, K'], budget [B], lengths [B])`` until :meth:`ScoredEviction.start` turns them
    into :class:`ScoredLayer` s; the eviction record when asked for one."""

    seeds: dict[int, Seed] = field(default_factory=dict)
    layers: dict[int, ScoredLayer] = field(default_factory=dict)
    record: EvictionRecord | None = None


@dataclass
class ScoredEviction(DecodePolicy):
    """The shared decode-time eviction step: score the stored entries, evict the lowest per row.

    After every decode step (the step's token stored), for every layer:

    1. the new entry gets its position and a score of 0 (:meth:`ScoredEntries.arrive`);
    2. the subclass updates every entry's score from the step's attention
       ``probs [B, Hkv, G, q, S]`` (:meth:`update`);
    3. every (sample, KV head) holding more than its :meth:`capacity` evicts its entry of lowest
       score outside the ``recent`` newest positions (the oldest entry when everything is recent;
       :meth:`ScoredEntries.lowest`).

    Rows at capacity after the prefill (the default capacity is the post-prefill size) evict one
    entry every step through :meth:`~kvlab.cache.slots.SlotLayout.evict_one`, with no host read; a
    capacity above the post-prefill size (a prompt shorter than the budget) lets the row grow
    first, the rows over capacity evicting through :func:`evict_rows_of_layers` (one host read per
    step) until every row is at capacity. Inside a pipeline, ``recent`` comes from
    ``budget.window`` when that is a token count.

    **Periodic eviction** (``every > 1``; R-KV's buffer, :mod:`kvlab.compression.rkv`): the entries
    are still scored after every step (:meth:`update`), but each (sample, KV head) evicts only once
    every ``every`` steps, many entries at once: at the step it would exceed its capacity ``C`` (its
    first eviction, :attr:`ScoredLayer.room`) and every ``every`` steps after (``C`` steps when
    ``C < every``), it keeps its ``C - every + 1`` entries of highest :meth:`eviction_scores`, the
    ``recent`` newest positions always among them (:meth:`periodic_keep`), through
    :meth:`~kvlab.cache.slots.SlotLayout.keep_slots`. After every step each row holds at most its
    capacity, as with ``every == 1`` (1 is the one-entry-per-step path above, unchanged), and a row's
    schedule depends on its own sizes only (a padded batch equals its samples alone). An eviction
    step reads the evicting layers' new prompt sizes on the host once; the steps between read
    nothing. :attr:`ScoredEntries.countdown` tells :meth:`update` how far each row's next eviction is.

    A subclass supplies :meth:`prefill_scores` (the seed, default 0) and :meth:`update`, and may
    override :meth:`capacity` and, for a periodic eviction, :meth:`eviction_scores`. The state
    lives in the batch's run state (:class:`ScoredEvictionState`), never on the policy.
    """

    recent: int = 32
    every: int = 1

    capabilities: ClassVar[Capabilities] = Capabilities(decode_attention=True)

    def __post_init__(self) -> None:
        if self.recent < 0:
            raise ValueError(f"recent must be >= 0, got {self.recent}")
        if self.every < 1:
            raise ValueError(f"every must be >= 1 (decode steps between evictions), got {self.every}")

    # --- what a method supplies -------------------------------------------------------------------
    def prefill_scores(self, ctx: LayerContext) -> torch.Tensor | None:
        """``[B, Hkv, T]`` seed of every prompt token's score (None: every entry starts at 0)."""
        return None

    def update(self, entries: ScoredEntries, probs: torch.Tensor, layer: CompressedLayer) -> None:
        """Update ``entries.scores`` from one step's attention ``probs [B, Hkv, G, q, S]`` (fp32 over the
        ``S = K + decode_length`` slots of ``layer``, empty slots 0; the newest slot is the step's own
        token, already given a score of 0)."""
        raise NotImplementedError

    def capacity(self, kept: torch.Tensor, budget: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``[B, Hkv]`` entries each (sample, head) may hold during decoding, from its prefill ``kept
        [B, Hkv]`` count, the layer ``budget [B]`` and the prompt ``lengths [B]``. Default: the
        post-prefill size (``kept``), so every step evicts one entry."""
        return kept

    def eviction_scores(self, entries: ScoredEntries, layer: CompressedLayer) -> torch.Tensor:
        """``[B, Hkv, S]`` fp32 rank of every slot at a periodic eviction (``every > 1``; higher: kept),
        over the ``S = K + decode_length`` slots of ``layer``. Default: ``entries.scores``."""
        return entries.scores[:, :, : layer.prompt_slots + layer.decode_length]

    # --- the step -----------------------------------------------------------------------------------
    def state(self, run: RunState) -> ScoredEvictionState:
        """The batch's :class:`ScoredEvictionState`."""
        return run.owned(self, ScoredEvictionState)

    def on_compress(self, ctx: LayerContext, selection: Any, budget: torch.Tensor) -> None:
        scores = self.prefill_scores(ctx)
        indices = selection.indices
        if scores is None:
            kept = torch.zeros(indices.shape, device=indices.device)
        else:
            kept = scores.gather(-1, indices)  # [B, Hkv, K'] in the selection's layout
        self.seed(ctx.run, ctx.layer_idx, kept, indices, budget, ctx.lengths)

    def seed(
        self,
        run: RunState,
        layer_idx: int,
        scores: torch.Tensor,
        positions: torch.Tensor,
        budget: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> None:
        """Record layer ``layer_idx``'s prefill ``scores`` of its kept entries at ``positions``, both
        ``[B, Hkv, K']`` in the selection's layout, with the layer ``budget [B]`` and prompt
        ``lengths [B]`` (None: the post-prefill size is the capacity). :meth:`start` turns the seeds
        into entries."""
        if budget is None or lengths is None:
            budget = lengths = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
        self.state(run).seeds[layer_idx] = (scores, positions, budget.long(), lengths.long())

    def start(self, run: RunState) -> None:
        state = self.state(run)
        seeds, state.seeds = state.seeds, {}
        built = []
        for layer_idx, layer in enumerate(run.cache.layers):
            scores, positions, budget, lengths = seeds[layer_idx]
            kept = layer.lengths.clone()
            capacity = self.capacity(kept, budget.to(kept.device), lengths.to(kept.device))
            built.append((ScoredEntries.seed(layer, scores, positions), torch.maximum(capacity, kept), kept))
        device = built[0][1].device if built else None
        growth = torch.stack([(c - k).amax().to(device) for _, c, k in built]).tolist() if built else []
        state.layers = {  # the growth of every layer read at once, before the first step
            layer_idx: ScoredLayer(entries, capacity, kept, int(grows))
            for layer_idx, ((entries, capacity, kept), grows) in enumerate(zip(built, growth, strict=True))
        }
        if self.every > 1:
            self.schedule(state)

    def schedule(self, state: ScoredEvictionState) -> None:
        """Each row's periodic eviction schedule (``every > 1``): its first eviction at the step it
        would exceed its capacity ``C`` (``room = C - kept``), then one every ``period = min(every, C)``
        steps, each down to ``C - period + 1`` entries; the layers' pairs read at once."""
        layers = list(state.layers.values())
        for scored in layers:
            scored.room = scored.capacity - scored.physical
            scored.period = scored.capacity.clamp(min=1, max=self.every)
        if not layers:
            return
        device = layers[0].capacity.device
        pairs = torch.stack([torch.stack([s.room, s.period], -1).flatten(0, 1).to(device) for s in layers])
        for scored, rows in zip(layers, pairs.tolist(), strict=True):  # one host read
            scored.schedule = frozenset((int(room), int(period)) for room, period in rows)

    def entries(self, run: RunState) -> dict[int, ScoredEntries]:
        """The batch's :class:`ScoredEntries` per layer index (after :meth:`start`)."""
        return {layer_idx: scored.entries for layer_idx, scored in self.state(run).layers.items()}

    def record_evictions(self, run: RunState) -> None:
        self.state(run).record = EvictionRecord()

    def evicted_positions(self, run: RunState) -> EvictionRecord | None:
        return self.state(run).record

    def after_step(self, run: RunState, step: int) -> None:
        if self.every > 1:
            self.periodic_step(run, step)
            return
        state = self.state(run)
        attention = run.take_decode_attention()  # by layer: [B, Hkv, G, 1, slots]
        evicted: dict[int, torch.Tensor] = {}
        pending = []
        for layer_idx, layer in enumerate(run.cache.layers):
            scored = state.layers[layer_idx]
            tracked = scored.entries
            slots = tracked.arrive(layer)
            self.update(tracked, attention[layer_idx], layer)
            victim = tracked.lowest(layer, self.recent)
            if state.record is not None:  # the victim's position, read before it is overwritten
                evicted[layer_idx] = tracked.positions.gather(-1, victim[..., None])[..., 0]
            if step >= scored.growth:  # every row is at capacity: one entry out of every row
                layer.evict_one(victim)
                tracked.evict(victim, slots - 1)
                continue
            rows = layer.slot_valid().sum(-1) > scored.capacity  # [B, Hkv]
            if state.record is not None:
                evicted[layer_idx] = torch.where(rows, evicted[layer_idx], -1)
            pending.append((layer, victim, rows, scored.physical, (tracked.scores, tracked.positions)))
        evict_rows_of_layers(pending)
        if state.record is not None:
            state.record.steps.append(evicted)

    @staticmethod
    def due(step: int, schedule: frozenset[tuple[int, int]]) -> bool:
        """Whether a row of a layer with this ``schedule`` evicts at ``step`` (host values only)."""
        return any(step >= room and (step - room) % period == 0 for room, period in schedule)

    def periodic_keep(
        self, layer: CompressedLayer, entries: ScoredEntries, target: torch.Tensor
    ) -> torch.Tensor:
        """``[B, Hkv, S]`` bool, the slots each row keeps at a periodic eviction: its ``target [B, Hkv]``
        entries of highest :meth:`eviction_scores`, the ``recent`` newest positions first (every
        entry where the row holds no more than ``target``, e.g. a row that is not due; ties go to the
        lower slot)."""
        valid = layer.slot_valid()  # [B, Hkv, S]
        S = valid.shape[-1]
        recent = entries.positions[:, :, :S] > layer.cumulative_length - 1 - self.recent
        rank_by = self.eviction_scores(entries, layer).float().masked_fill(recent, float("inf"))
        order = rank_by.masked_fill(~valid, float("-inf")).argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(
            -1, order, torch.arange(S, device=order.device).expand_as(order)
        )
        return valid & (rank < target[..., None])

    def periodic_step(self, run: RunState, step: int) -> None:
        """One decode step of the periodic eviction (``every > 1``, see the class docstring)."""
        state = self.state(run)
        attention = run.take_decode_attention()  # by layer: [B, Hkv, G, 1, slots]
        evicted: dict[int, torch.Tensor] = {}
        due = []
        for layer_idx, layer in enumerate(run.cache.layers):
            scored = state.layers[layer_idx]
            tracked = scored.entries
            tracked.arrive(layer)
            since = step - scored.room  # [B, Hkv]
            tracked.countdown = torch.where(since < 0, -since, (-since).remainder(scored.period))
            self.update(tracked, attention[layer_idx], layer)
            if self.due(step, scored.schedule):
                target = scored.capacity - scored.period + 1  # [B, Hkv]
                target = torch.where(tracked.countdown == 0, target, torch.iinfo(target.dtype).max)
                due.append((layer_idx, layer, scored, self.periodic_keep(layer, tracked, target)))
        if not due:
            if state.record is not None:
                state.record.steps.append(evicted)
            return
        device = due[0][3].device
        sizes = torch.stack([keep.sum(-1).amax().to(device) for *_, keep in due]).tolist()  # one host read
        for (layer_idx, layer, scored, keep), size in zip(due, sizes, strict=True):
            tracked = scored.entries
            S = keep.shape[-1]
            positions = tracked.positions[:, :, :S]
            if state.record is not None:  # every evicted position of a row, -1 past them
                gone = layer.slot_valid() & ~keep
                evicted[layer_idx] = torch.where(gone, positions, -1).sort(-1, descending=True).values
            order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices  # kept slots first
            layer.keep_slots(keep, prompt_slots=int(size))
            scored.entries = ScoredEntries.seed(
                layer, tracked.scores[:, :, :S].gather(-1, order), positions.gather(-1, order)
            )
            scored.entries.countdown = tracked.countdown
            scored.physical = layer.lengths.clone()
        if state.record is not None:
            state.record.steps.append(evicted)


@DECODE_POLICIES.register("h2o")
@dataclass
class H2ODecodePolicy(ScoredEviction):
    """H2O at decode (Zhang et al. 2023): evict one entry per step so every head keeps a fixed size.

    Each cached entry carries its accumulated attention ``s``: at prefill the column sum of the
    prompt attention over every prompt query (``cumulative_attention``, GQA-reduced with
    ``gqa``, gathered at the kept positions; a merged entry inherits its kept token's score),
    then ``s += p`` for every decode query, ``p`` its softmax over the head's cached entries
    (``[B, Hkv, n]``, query heads of a group reduced the same way). After each step the
    newest token is stored and the entry with the lowest ``s`` outside the ``recent`` newest
    positions is evicted (the oldest entry when everything is recent), so each (sample, head)
    stays at its post-prefill size. Inside a pipeline, ``recent`` comes from ``budget.window``
    when that is a token count.

    The step itself is the shared :class:`ScoredEviction`; H2O supplies the seed
    (:meth:`prefill_scores`) and the accumulation (:meth:`update`).
    """

    paper: ClassVar[str | None] = papers.H2O

    recent: int = 32
    gqa: Literal["mean", "sum"] = "mean"

    # seeded with every prompt query's attention; each step's attention accumulates into the scores
    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=False, decode_attention=True)

    def prefill_scores(self, ctx: LayerContext) -> torch.Tensor:
        return reduce_groups(ctx.cumulative_attention(), ctx.num_kv_heads, self.gqa)  # [B, Hkv, T]

    def update(self, entries: ScoredEntries, probs: torch.Tensor, layer: CompressedLayer) -> None:
        """``s += p``: the step's ``q`` queries summed, the ``G`` query heads of a KV head reduced by
        ``gqa`` (mean | sum)."""
        slots = probs.shape[-1]
        per_query = probs.sum(3)  # [B, Hkv, G, slots]
        entries.scores[:, :, :slots] += per_query.mean(2) if self.gqa == "mean" else per_query.sum(2)
