"""Prefill modes: when during the prefill a layer is compressed (``model.compression.prefill``).

A prefill mode is a component kind of its own (registry :data:`PREFILL_MODES`, ``kvlab list``):

- ``once`` (the default): every layer is compressed once, when the whole prompt has run through
  its attention (``model.prefill_chunk`` may still feed the prompt in several forwards, for the
  activations' memory only: every layer keeps its dense K/V until the last chunk).
- ``progressive`` (Finch's kind, Corallo and Papotti 2024, Sec. 3): the prompt (its context,
  under ``query_aware`` with ``question: true``) is fed ``chunk`` tokens at a time, and after
  each chunk every layer runs the pipeline (scorers, allocators, selector) over its kept entries
  and the chunk's, keeping at most its budget before the next chunk arrives. A layer never holds
  more than ``budget + chunk`` entries, so peak memory falls with the budget. With
  ``question: true`` the question part of the prompt is appended to every chunk: its queries
  score the entries (``LayerContext.question_attention``, read by the ``question_attention``
  scorer) and its own K/V are dropped after; once the context is compressed the question is
  prefilled on top, uncompressed. Any scorer that runs after a chunked prefill runs here
  (SnapKV per chunk is ``prefill: {name: progressive, chunk: 512}`` over the ``snapkv`` preset).
- ``reconstruct`` (KVzip's kind, Kim et al. 2025, Sec. 3.2): a prefill mode that runs the model to
  score. The prompt is prefilled whole (every layer holds its dense K/V, uncompressed); then the
  model is asked to repeat it, ``chunk`` prompt tokens per forward: each forward feeds the block
  [repeat request, the chat template's assistant opening, the chunk's tokens] at the positions
  after the prompt, every layer attends it over its held K/V and itself, and the scorers that
  read the reconstruction (:class:`~kvlab.compression.reconstruction.ReconstructionScorer`,
  ``Capabilities(reads_reconstruction=True)``) take what they need of the step
  (:class:`~kvlab.compression.reconstruction.ReconstructionStep`); the block's K/V are dropped.
  After the last chunk every layer is compressed with the scores of the whole prompt.

The engine runs the mode (:mod:`kvlab.engine.progressive`); a mode only declares what it is. The
pipeline refuses the combinations a progressive prefill cannot run
(:meth:`kvlab.pipeline.spec.Pipeline.from_config`, ``docs/architecture.md``, "Prefill modes").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from kvlab.config import papers
from kvlab.config.capabilities import Capabilities, Component
from kvlab.config.registry import Registry

WHERE = "model.compression.prefill"


class PrefillMode(Component):
    """Base class: what a prefill mode declares.

    ``chunk``: context tokens fed per step, each step followed by a compression of every layer
    (None: the layer is compressed once, after the whole prompt). ``question``: the question part
    of each prompt is appended to every step for scoring and removed after (needs a prompt kvlab
    can split into context and question). Capabilities: the kind's default (nothing asked of the
    engine beyond the mode itself).
    """

    capabilities: ClassVar[Capabilities] = Capabilities()

    chunk: int | None = None
    question: bool = False

    @property
    def progressive(self) -> bool:
        """True when layers are compressed after every chunk (the engine's progressive prefill)."""
        return self.chunk is not None

    @property
    def reconstructs(self) -> bool:
        """True when the model is run again after the prefill to score the prompt (``reconstruct``)."""
        return False


PREFILL_MODES: Registry[PrefillMode] = Registry("prefill mode", WHERE)


@PREFILL_MODES.register("once")
@dataclass
class OncePrefill(PrefillMode):
    """Every layer compressed once, after the whole prompt's attention (kvlab's default)."""


@PREFILL_MODES.register("progressive")
@dataclass
class ProgressivePrefill(PrefillMode):
    """The prompt fed ``chunk`` tokens at a time, every layer compressed to its budget after each chunk.

    ``question: true`` appends the prompt's question part to every chunk for scoring and drops
    its entries after (Finch, Sec. 3); the question is then prefilled on top of the compressed
    context. A layer holds at most ``budget + chunk`` entries (plus the question's while it scores).
    """

    paper: ClassVar[str | None] = papers.FINCH

    chunk: int = 512
    question: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.chunk, bool) or self.chunk < 1:
            raise ValueError(f"chunk must be an integer >= 1 (context tokens per step), got {self.chunk!r}")


@PREFILL_MODES.register("reconstruct")
@dataclass
class ReconstructPrefill(PrefillMode):
    """KVzip: the prompt prefilled whole, then reconstructed by the model ``chunk`` tokens at a time
    to score every entry (Kim et al. 2025, Sec. 3.2); every layer is compressed after the last chunk.

    Chunk ``i`` of each sample's prompt (counted from its first token) is fed as the block
    ``[request, opening, chunk]``: the request is "Repeat the previous context exactly." for the
    first chunk and "Repeat the part of the previous context exactly, starting with" followed by
    the previous chunk's last ``overlap`` tokens for the others (Sec. 3.2, the authors' code), the
    opening the chat template's end of the user turn and assistant opening. ``scope``: the entries
    the block's softmax runs over besides its own keys: ``chunk`` the prompt's first
    ``budget.sinks`` tokens and the chunk's (the authors' code and kvpress' ``KVzipPress``),
    ``cache`` every prompt entry (the whole held cache, as the model itself attends). Needs a
    scorer reading the reconstruction (``reconstruction_attention``) and a prompt format kvlab
    builds (a :class:`~kvlab.models.base.PromptProcessor`: the request is text).
    """

    paper: ClassVar[str | None] = papers.KVZIP

    chunk: int = 2048
    scope: Literal["chunk", "cache"] = "chunk"
    overlap: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.chunk, bool) or self.chunk < 1:
            raise ValueError(
                f"chunk must be an integer >= 1 (prompt tokens per reconstruction), got {self.chunk!r}"
            )
        if self.scope not in ("chunk", "cache"):
            raise ValueError(
                f"scope must be chunk (sinks + the chunk, as KVzip's code) or cache, got {self.scope!r}"
            )
        if isinstance(self.overlap, bool) or self.overlap < 0:
            raise ValueError(
                f"overlap must be an integer >= 0 (tokens of the previous chunk), got {self.overlap!r}"
            )

    @property
    def progressive(self) -> bool:
        """Never: every layer is compressed once, after the reconstruction."""
        return False

    @property
    def reconstructs(self) -> bool:
        return True
