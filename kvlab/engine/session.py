"""CompressionSession: the one object a run's attention calls need, reached in one way.

transformers calls the ``kvlab`` attention function with a layer's query, key and value only;
``generate``-style keyword arguments do not reach it. Everything else a batch's prefill and
decode need lives in one :class:`CompressionSession`, which kvlab's generation makes per batch
and makes active with :func:`compression_session` (a context variable) around every forward; the
attention function reads it with :func:`active_session`. Nothing else is module state.

The session holds the batch's :class:`~kvlab.cache.state.RunState` (the cache, the prompt masks,
the components' own state: the part components see, as ``ctx.run``), the pipeline, the layer
reports, and the engine's own bookkeeping of a chunked prefill, of a progressive one and of
``schedule: global``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.cache.cache import CompressedCache
from kvlab.cache.state import RunState
from kvlab.compression.context import LayerContext
from kvlab.models.facts import LayerFacts, ModelFacts
from kvlab.pipeline import LayerReport, Pipeline

_SESSION: contextvars.ContextVar[CompressionSession | None] = contextvars.ContextVar(
    "kvlab_session", default=None
)


@dataclass
class ProgressiveState:
    """A progressive prefill's bookkeeping (``model.compression.prefill: progressive``), kept by the
    session and advanced by :mod:`kvlab.engine.progressive` one step (chunk) at a time.

    Shapes: B samples, c the step's chunk columns, Q the question's, S a layer's held entries,
    H query heads, Hkv KV heads, w the held window queries, D head dim.

    Attributes:
        pipeline: the run's pipeline with its budget asked per sample from the whole prompt
            (:class:`~kvlab.compression.budget.TargetBudget`), what every step compresses with.
        window: the window queries a layer holds from one step to the next (the budget's window
            when a scorer observes it, else 0).
        block_valid: ``[B, c + Q]`` bool, the step's block: its chunk (left padded), then its
            question (left padded; all False for a sample whose prompt has ended).
        chunk_width: ``c``.
        chunk_columns: ``[B, c]`` long, each chunk token's column in the padded prompt, -1 on padding.
        last: this step is the last: every layer is compressed into the cache after it.
        logical_length: prompt columns fed so far (what the cache's layers report as their length).
        kept_valid: by layer, ``[B, S]`` bool, the entries it holds (each sample's right aligned).
        kept_columns: by layer, ``[B, Hkv, S]`` long, each held entry's column in the padded prompt.
        held_queries: by layer, the queries of each sample's last ``window`` entries, right aligned,
            ``([B, H, w, D], valid [B, w])``.
        seconds: by layer, seconds spent compressing it so far (its report's, at the last step).
        peak_entries: the most entries any layer held during a step (kept, chunk and question), for
            the bound ``budget + chunk`` (+ the question's while it scores).
    """

    pipeline: Pipeline
    window: int = 0
    block_valid: torch.Tensor | None = None
    chunk_width: int = 0
    chunk_columns: torch.Tensor | None = None
    last: bool = False
    logical_length: int = 0
    kept_valid: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    kept_columns: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    held_queries: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    seconds: dict[int, float] = field(default_factory=dict)
    peak_entries: int = 0


@dataclass
class ReconstructionState:
    """A reconstruct prefill's bookkeeping (``model.compression.prefill: reconstruct``, KVzip), kept by
    the session and advanced by :mod:`kvlab.engine.reconstruction` one step (chunk) at a time.

    Shapes: B samples, q the step's block.

    Attributes:
        scorers: the pipeline's reconstruction scorers (every branch's), each handed every step.
        keep_queries: the last queries a waiting layer's context keeps (None: all of them).
        pending: by layer, the contexts waiting for the reconstruction (the prompt's dense K/V).
        active: a reconstruction forward is running (the attention function scores instead of
            compressing).
        block_valid: ``[B, q]`` bool, the step's block (left padded).
        chunk_start / chunk_count: ``[B]`` long, the step's chunk: its first prompt column and tokens.
        entries: ``scope: chunk``: the prompt columns the step's scoring softmax runs over, ``(columns
            [B, S], entry_valid [B, S], scored [B, S])`` (each sample's sinks, then its chunk's;
            :func:`~kvlab.engine.reconstruction.step_entries`), made once per step; None under
            ``scope: cache`` (every column).
    """

    scorers: list[Any] = field(default_factory=list)
    keep_queries: int | None = None
    pending: dict[int, LayerContext] = field(default_factory=dict, repr=False)
    active: bool = False
    block_valid: torch.Tensor | None = None
    chunk_start: torch.Tensor | None = None
    chunk_count: torch.Tensor | None = None
    entries: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass
class CompressionSession:
    """State of one batch's prefill + decode.

    Attributes:
        run: what the components share (:class:`~kvlab.cache.state.RunState`): the cache, the
            prompt padding mask ``valid [B, T]`` and modality ids, the components' own state.
        pipeline: the compression method.
        record_scores: keep each layer's mixed scores in its report (for TensorBoard).
        reports: one :class:`LayerReport` per compressed layer, in layer order.
        prefill_chunk: None: the prompt comes in one forward; N: in chunks of N tokens (each
            layer is compressed when the chunk that ends the prompt reaches it).
        held_queries: with chunks, the queries of the last ``held_queries`` positions a layer
            keeps from the chunks before the last (the largest window a scorer observes), so the
            compressing :class:`LayerContext` holds them.
        global_queries: ``schedule: global`` only: the queries of the prompt's last
            ``global_queries`` positions an observed layer's context keeps until it is compressed
            (None: all of them, for a component that reads every query after scoring).
        pending: ``schedule: global``: the observed layers waiting for the last one, by layer
            index, each ``(LayerContext, seconds spent observing it)``.
        block_elements: the most attention elements (``B x H x rows x keys``) prefill attention
            and the scorers' attention helpers hold at once; None: their defaults
            (:data:`~kvlab.engine.prefill_attention.PREFILL_BLOCK_ELEMENTS`,
            :data:`~kvlab.kernels.window_scores.REFERENCE_BLOCK_ELEMENTS`, 64 MiB of fp32 each).
        facts: the model facts the pipeline's components declared (:class:`~kvlab.models.facts.ModelFacts`),
            None when none declares one.
        progressive: a progressive prefill's bookkeeping (:class:`ProgressiveState`), None otherwise.
        reconstruction: a reconstruct prefill's bookkeeping (:class:`ReconstructionState`), None
            otherwise.
        scoring_seconds: wall time of the forwards the model ran only to score (a reconstruct
            prefill's): compression work, counted in :attr:`compression_seconds`.
    """

    run: RunState
    pipeline: Pipeline
    record_scores: bool = False
    reports: list[LayerReport] = field(default_factory=list)
    prefill_chunk: int | None = None
    held_queries: int = 0
    global_queries: int | None = None
    pending: dict[int, tuple[LayerContext, float]] = field(default_factory=dict, repr=False)
    block_elements: int | None = None
    facts: ModelFacts | None = None
    progressive: ProgressiveState | None = None
    reconstruction: ReconstructionState | None = None
    scoring_seconds: float = 0.0
    _queries: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def cache(self) -> CompressedCache:
        """The batch's cache (``run.cache``)."""
        return self.run.cache

    @property
    def valid(self) -> torch.Tensor:
        """``[B, T]`` bool prompt padding mask (``run.valid``)."""
        return self.run.valid

    @property
    def block_options(self) -> dict[str, int]:
        """``{"block_elements": ...}`` for a :class:`LayerContext` or a step when the run bounds its
        attention blocks, else ``{}`` (the context's default bound)."""
        return {"block_elements": self.block_elements} if self.block_elements is not None else {}

    def layer_facts(self, layer_idx: int) -> LayerFacts:
        """The declared model facts of layer ``layer_idx`` (an empty view when none is declared)."""
        return self.facts.layer(layer_idx) if self.facts is not None else LayerFacts()

    def hold_queries(self, layer_idx: int, query: torch.Tensor) -> None:
        """Keep the last :attr:`held_queries` queries of layer ``layer_idx`` seen so far (chunked
        prefill: the window the scorers observe may reach back into earlier chunks).

        ``query`` ``[B, H, q, D]``: the queries of a chunk before the last.
        """
        if self.held_queries <= 0:
            return
        held = self._queries.get(layer_idx)
        joined = query if held is None else torch.cat([held, query], dim=2)
        self._queries[layer_idx] = joined[:, :, -self.held_queries :].clone()  # not a view of the chunk

    def observed_queries(self, layer_idx: int, query: torch.Tensor) -> torch.Tensor:
        """The last chunk's ``query [B, H, q, D]`` preceded by the queries held from earlier chunks,
        ``[B, H, n, D]`` (the queries of the prompt's last ``n`` positions); drops the held ones."""
        held = self._queries.pop(layer_idx, None)
        return query if held is None else torch.cat([held, query], dim=2)

    def start_decoding(self) -> None:
        """Before the first decode step: the attention function records each step's attention when
        the decode policy declares ``Capabilities(decode_attention=True)``, then the policy's ``start``
        runs."""
        policy = self.pipeline.decode_policy
        self.run.want_decode_attention(policy, policy.capabilities.decode_attention)
        policy.start(self.run)

    @property
    def compression_seconds(self) -> float:
        """Seconds spent compressing: the layer reports' and the scoring forwards'
        (:attr:`scoring_seconds`)."""
        return sum(report.seconds for report in self.reports) + self.scoring_seconds


@contextlib.contextmanager
def compression_session(session: CompressionSession) -> Iterator[CompressionSession]:
    """Make ``session`` the active one for kvlab attention calls inside the block (the only way)."""
    token = _SESSION.set(session)
    try:
        yield session
    finally:
        _SESSION.reset(token)


def active_session() -> CompressionSession | None:
    """The session of the :func:`compression_session` block running now (None outside one)."""
    return _SESSION.get()
