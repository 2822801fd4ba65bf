"""RunState: what one run's components share, and the only place they keep per-run state.

One run is one batch's prefill and decode. The engine makes one :class:`RunState` per batch
(inside its :class:`~kvlab.engine.session.CompressionSession`, the one object a run's attention
calls reach) and hands it to the components: as :attr:`LayerContext.run
<kvlab.compression.context.LayerContext.run>` during the prefill, as the argument of a decode
policy's ``start`` / ``after_step`` during decoding. It holds

- the batch's :class:`~kvlab.cache.cache.CompressedCache` and prompt masks (``valid``,
  ``modality``, the image blocks of a bidirectional-image model, copied once per device);
- each component's own bookkeeping (:meth:`RunState.owned`: an object of the component's own
  type, made on first use; e.g. H2O's per-entry scores, a route latch, what ``schedule: global``
  observed of each layer): a pipeline and its components serve many batches, so nothing per
  batch lives on them;
- the layers the pipeline keeps whole without scoring (:meth:`RunState.keep_whole`);
- each decode step's attention probabilities, recorded by the attention function while a
  decode policy or the decode-time protocol asks for them (:meth:`RunState.want_decode_attention`).

Every change goes through a method of this class; components never replace its fields.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kvlab.cache.cache import CompressedCache
from kvlab.cache.checkpoint import CacheCheckpoint
from kvlab.cache.masks import image_block_ids

T = TypeVar("T")


@dataclass
class RunCheckpoint:
    """A :class:`RunState` 's cache and component state, to return to (:meth:`RunState.restore`)."""

    cache: CacheCheckpoint
    owned: dict[int, tuple[object, Any]]


@dataclass
class RunState:
    """One run's shared state; see the module docstring. Every field may be left out (a standalone
    :class:`~kvlab.compression.context.LayerContext` gets an empty one).

    Attributes:
        cache: the batch's cache.
        valid: ``[B, T]`` bool prompt padding mask (False on padding).
        modality: ``[B, T]`` modality ids of the prompt.
        bidirectional_image_blocks: the model lets the tokens of one image attend to each other in
            both directions (``ModelInfo.bidirectional_image_blocks``, Gemma 3): prefill attention
            and the scorers then apply :meth:`image_blocks_on`'s blocks.
    """

    cache: CompressedCache | None = None
    valid: torch.Tensor | None = None
    modality: torch.Tensor | None = None
    bidirectional_image_blocks: bool = False
    _owned: dict[int, tuple[object, Any]] = field(default_factory=dict, repr=False)
    _whole: set[int] = field(default_factory=set, repr=False)
    _attention_wanted: set[int] = field(default_factory=set, repr=False)
    _step_attention: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _placed: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    _blocks: dict[torch.device, torch.Tensor | None] = field(default_factory=dict, repr=False)

    # --- the prompt ------------------------------------------------------------------------------
    def masks_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(valid, modality)``, both ``[B, T]``, on ``device`` (a layer's device under a
        ``device_map``); copied once per device and batch, the tensors themselves on their own."""
        if device == self.valid.device:
            return self.valid, self.modality
        if device not in self._placed:
            self._placed[device] = (self.valid.to(device), self.modality.to(device))
        return self._placed[device]

    def image_blocks_on(self, device: torch.device) -> torch.Tensor | None:
        """The prompt's image blocks, ``[B, T]`` long (:func:`~kvlab.cache.masks.image_block_ids`),
        on ``device``; None when the model is causal over images or the batch has no image token
        (plain causal paths)."""
        if not self.bidirectional_image_blocks:
            return None
        if device not in self._blocks:
            blocks = image_block_ids(self.masks_on(device)[1])
            self._blocks[device] = blocks if bool((blocks >= 0).any()) else None
        return self._blocks[device]

    # --- components' own state --------------------------------------------------------------------
    def owned(self, owner: object, factory: Callable[[], T]) -> T:
        """``owner`` 's own state for this run: ``factory()`` on the first call, the same object after.

        Keyed by the owner's identity (a component, a pipeline node), so two components never see
        each other's state and a pipeline serving many batches keeps none of it.
        """
        held = self._owned.get(id(owner))
        if held is None or held[0] is not owner:
            held = (owner, factory())
            self._owned[id(owner)] = held
        return held[1]

    def keep_whole(self, layer_idx: int) -> None:
        """Record that layer ``layer_idx`` is kept whole without scoring (a sliding-window layer under
        ``sliding_layers: window``), so a component comparing layers knows none is missing."""
        self._whole.add(layer_idx)

    @property
    def whole_layers(self) -> frozenset[int]:
        """The layers kept whole without scoring so far (:meth:`keep_whole`)."""
        return frozenset(self._whole)

    # --- decode attention --------------------------------------------------------------------------
    def want_decode_attention(self, requester: object, wanted: bool) -> None:
        """Ask for (or stop asking for) each decode step's attention probabilities. They are recorded
        while any requester wants them (a decode policy that declares ``decode_attention``, the
        decode-time protocol's window); stopping to record drops what was not taken."""
        if wanted:
            self._attention_wanted.add(id(requester))
        else:
            self._attention_wanted.discard(id(requester))
        if not self._attention_wanted:
            self._step_attention.clear()

    @property
    def records_decode_attention(self) -> bool:
        """Whether the attention function records this step's attention (:meth:`record_decode_attention`)."""
        return bool(self._attention_wanted)

    def record_decode_attention(self, layer_idx: int, probs: torch.Tensor) -> None:
        """Layer ``layer_idx`` 's attention of this decode step, ``[B, Hkv, G, q, S]`` fp32 over its
        ``S`` slots (:meth:`~kvlab.cache.slots.SlotLayout.attention_probs`); set by the attention function."""
        self._step_attention[layer_idx] = probs

    def take_decode_attention(self) -> dict[int, torch.Tensor]:
        """The recorded attention of the last decode step by layer index, handed over once."""
        taken, self._step_attention = self._step_attention, {}
        return taken

    # --- checkpoints -------------------------------------------------------------------------------
    def checkpoint(self) -> RunCheckpoint:
        """The cache (:meth:`~kvlab.cache.cache.CompressedCache.checkpoint`: references, copied on
        write) and a copy of every component's state (a decode policy changes its own in place)."""
        return RunCheckpoint(self.cache.checkpoint(), self._copy_owned(self._owned))

    def restore(self, checkpoint: RunCheckpoint) -> None:
        """Return to ``checkpoint`` (which stays usable: restore it again later); recorded decode
        attention is dropped."""
        self.cache.restore(checkpoint.cache)
        self._owned = self._copy_owned(checkpoint.owned)
        self._step_attention.clear()

    @staticmethod
    def _copy_owned(owned: dict[int, tuple[object, Any]]) -> dict[int, tuple[object, Any]]:
        """A deep copy of each component's state (the components themselves are not copied)."""
        return {key: (owner, copy.deepcopy(state)) for key, (owner, state) in owned.items()}
