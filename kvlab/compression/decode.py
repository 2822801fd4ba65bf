"""Decode policies: what happens to the cache while tokens are generated.

The slot exists on every pipeline (``model.compression.decode``). ``none`` appends every
decoded token and never evicts (the default of SnapKV, LOOK-M's "look once", DAVID and the
papers). ``h2o`` holds each (sample, KV head) at its post-prefill size by evicting one entry per
step. A policy has three hooks, all optional:

- :meth:`DecodePolicy.on_compress` sees each layer's prefill selection (and its context), e.g.
  to seed per-entry scores; it keeps what it needs in the run's state
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
  victim's slot, so memory stays what was allocated and nothing is masked.

The cache only stores K/V: a policy keeps its per-entry bookkeeping itself, per batch, in the
run state (a pipeline and its policy serve many batches). Other eviction rules, e.g. a victim
picked by index or by age rather than by score, fit the same hooks (PrefixKV's fixed index,
:mod:`kvlab.compression.decode_prefixkv`).
"""

from __future__ import annotations

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


class DecodePolicy(Component):
    """Base class: override :meth:`after_step` (and :meth:`on_compress` / :meth:`start` when needed).

    ``capabilities.decode_attention``: the policy reads each decode step's attention
    (``run.take_decode_attention()``); ``capabilities.chunked_prefill`` False: it reads every
    prompt query's attention at ``on_compress``.
    """

    def on_compress(self, ctx: LayerContext, selection: Any) -> None:
        """Called right after layer ``ctx.layer_idx`` chose its ``Selection``."""
        return None

    def start(self, run: RunState) -> None:
        """Called once before the first decode step, with the batch's run state (cache, own state)."""
        return None

    def after_step(self, run: RunState, step: int) -> None:
        """Called after every decode step; ``run.cache`` holds the step's token."""
        raise NotImplementedError


DECODE_POLICIES: Registry[DecodePolicy] = Registry("decode policy", "model.compression.decode")


@DECODE_POLICIES.register("none")
@dataclass
class AppendOnly(DecodePolicy):
    """Append every decoded token; never evict."""

    def after_step(self, run: RunState, step: int) -> None:
        return None


@dataclass
class H2OEntries:
    """H2O's bookkeeping for one layer: accumulated attention and position of every stored entry.

    Both tensors are in the cache's slot layout (see
    :meth:`~kvlab.cache.slots.SlotLayout.slot_valid`): slot ``s < K`` is a prompt row of the
    (sample, head), then its decode tokens; they hold at least ``K + decode_length`` slots. Empty
    slots hold leftovers that are never read unmasked.

    Attributes:
        scores: ``[B, Hkv, S]`` fp32 accumulated attention ``s`` of each entry.
        positions: ``[B, Hkv, S]`` long, the entry's position in the padded batch (a prompt token
            its index ``t < T``, the i-th decoded token ``T + i``).
    """

    scores: torch.Tensor
    positions: torch.Tensor

    @classmethod
    def seed(cls, layer: CompressedLayer, scores: torch.Tensor, positions: torch.Tensor) -> H2OEntries:
        """Entries of a just-compressed ``layer`` from prefill ``scores [N]`` at ``positions [N]``.

        ``N`` follows the layer's flat ``prompt_keys`` order; the decode slots start at 0.
        """
        rows, _ = layer.slot_rows()  # [B, Hkv, K]
        decode = layer.decode_keys.shape[2]
        return cls(F.pad(scores.float()[rows], (0, decode)), F.pad(positions.long()[rows], (0, decode)))

    def accumulate(self, layer: CompressedLayer, probs: torch.Tensor, gqa: str) -> None:
        """Add one step's attention ``probs [B, Hkv, G, q, K + decode_length]`` to every entry's score.

        The step's ``q`` queries are summed and the ``G`` query heads of a KV head reduced by
        ``gqa`` (mean | sum); the newest ``q`` slots get their positions.
        """
        slots = probs.shape[-1]
        if self.scores.shape[-1] < slots:  # the cache's decode region grew
            grow = slots - self.scores.shape[-1]
            self.scores = F.pad(self.scores, (0, grow))
            self.positions = F.pad(self.positions, (0, grow))
        q, length = probs.shape[3], layer.cumulative_length
        self.positions[:, :, slots - q : slots] = torch.arange(length - q, length, device=probs.device)
        per_query = probs.sum(3)  # [B, Hkv, G, slots]
        self.scores[:, :, :slots] += per_query.mean(2) if gqa == "mean" else per_query.sum(2)

    def evict(self, victim: torch.Tensor, newest: int) -> None:
        """Mirror :meth:`~kvlab.cache.slots.SlotLayout.evict_one`: slot ``newest`` moves into
        ``victim [B, Hkv]`` and is freed (its score reset for the next token)."""
        b, h = torch.meshgrid(
            torch.arange(victim.shape[0], device=victim.device),
            torch.arange(victim.shape[1], device=victim.device),
            indexing="ij",
        )
        self.scores[b, h, victim] = self.scores[b, h, newest]
        self.positions[b, h, victim] = self.positions[b, h, newest]
        self.scores[:, :, newest] = 0


@dataclass
class H2OState:
    """H2O's state in one run: each layer's prefill seeds ``(scores [N], positions [N])`` until
    :meth:`H2ODecodePolicy.start` turns them into :class:`H2OEntries`."""

    seeds: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    entries: dict[int, H2OEntries] = field(default_factory=dict)


@DECODE_POLICIES.register("h2o")
@dataclass
class H2ODecodePolicy(DecodePolicy):
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

    The scores live in the batch's run state (one :class:`H2OEntries` per layer, see
    :meth:`entries`), not in the cache; the attention function hands each step's probabilities
    over through the run state (``decode_attention``, declared).
    """

    paper: ClassVar[str | None] = papers.H2O

    recent: int = 32
    gqa: Literal["mean", "sum"] = "mean"

    # seeded with every prompt query's attention; each step's attention accumulates into the scores
    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=False, decode_attention=True)

    def __post_init__(self) -> None:
        if self.recent < 0:
            raise ValueError(f"recent must be >= 0, got {self.recent}")

    def on_compress(self, ctx: LayerContext, selection: Any) -> None:
        scores = reduce_groups(ctx.cumulative_attention(), ctx.num_kv_heads, self.gqa)  # [B, Hkv, T]
        mask = selection.mask()
        kept = scores.gather(-1, selection.indices)[mask]  # [N] in the cache's flat order
        self.seed(ctx.run, ctx.layer_idx, kept, selection.indices[mask])

    def seed(self, run: RunState, layer_idx: int, scores: torch.Tensor, positions: torch.Tensor) -> None:
        """Record layer ``layer_idx``'s prefill scores ``[N]`` of its kept entries, at ``positions [N]``.

        ``N`` follows the layer's flat cache order; :meth:`start` turns the seeds into entries.
        """
        run.owned(self, H2OState).seeds[layer_idx] = (scores, positions)

    def start(self, run: RunState) -> None:
        state = run.owned(self, H2OState)
        seeds, state.seeds = state.seeds, {}
        state.entries = {
            layer_idx: H2OEntries.seed(layer, *seeds[layer_idx])
            for layer_idx, layer in enumerate(run.cache.layers)
        }

    def entries(self, run: RunState) -> dict[int, H2OEntries]:
        """The batch's :class:`H2OEntries` per layer index (after :meth:`start`)."""
        return run.owned(self, H2OState).entries

    def after_step(self, run: RunState, step: int) -> None:
        entries = self.entries(run)
        attention = run.take_decode_attention()  # by layer: [B, Hkv, G, 1, slots]
        for layer_idx, layer in enumerate(run.cache.layers):
            tracked = entries[layer_idx]
            tracked.accumulate(layer, attention[layer_idx], self.gqa)
            slots = layer.prompt_slots + layer.decode_length  # slot slots - 1 is the newest token
            scores, positions = tracked.scores[:, :, :slots], tracked.positions[:, :, :slots]
            valid = layer.slot_valid()  # [B, Hkv, slots]
            newest = layer.cumulative_length - 1
            recent = positions > newest - self.recent
            candidate = valid & ~recent
            lowest = scores.masked_fill(~candidate, float("inf")).argmin(-1)
            oldest = positions.masked_fill(~valid, torch.iinfo(positions.dtype).max).argmin(-1)
            victim = torch.where(candidate.any(-1), lowest, oldest)
            layer.evict_one(victim)
            tracked.evict(victim, slots - 1)
