"""What a prefill must hold for its pipeline: the checks of ``model.prefill_chunk`` and the queries a
layer keeps until it is compressed (a chunked prefill's window, ``schedule: global``).

Both read the pipeline's declared capabilities (:attr:`kvlab.pipeline.spec.Pipeline.capabilities`).
"""

from __future__ import annotations

import torch

from kvlab.compression.diversity import DiversityScorer
from kvlab.compression.importance import ImportanceScorer
from kvlab.config.capabilities import Component
from kvlab.config.errors import ConfigError
from kvlab.pipeline import Pipeline

CHUNK_FIELD = "model.prefill_chunk"


def check_prefill_chunk(pipeline: Pipeline, prefill_chunk: int | None) -> None:
    """Refuse ``model.prefill_chunk`` when a component cannot score a prompt prefilled in chunks.

    A chunked prefill keeps every key and value of the prompt until the layer is compressed,
    but only the queries of the recent window
    (:attr:`~kvlab.engine.session.CompressionSession.held_queries`). A component says whether that suffices
    in its declared capabilities (``chunked_prefill``): importance and diversity scorers must declare it
    (their bases say False), any other component is refused only when it declares ``chunked_prefill=False``.
    The table of the built-in components is in ``docs/scaling.md``.

    Raises:
        ConfigError: a bad value, or a component that needs every prompt query's attention
            (H2O's accumulated attention, LOOK-M's), naming its field and ``model.prefill_chunk``.
    """
    if prefill_chunk is None:
        return
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ConfigError(
            f"{CHUNK_FIELD} must be null (the prompt in one forward) or a number of tokens >= 1 per "
            f"prefill chunk, got {prefill_chunk!r}."
        )
    if pipeline.schedule == "global":
        raise ConfigError(
            f"model.compression.schedule = global cannot run with {CHUNK_FIELD} = {prefill_chunk}: a chunked "
            "prefill exists to bound the prefill's memory, while the global schedule keeps every layer's "
            "full K/V until the last layer's prefill ends. Set "
            f"{CHUNK_FIELD} to null (the prompt in one forward), or model.compression.schedule: layerwise "
            "(with a layer allocator that needs only its own layer, e.g. PrefixKV's prefix_calibrated)."
        )
    unchunked = pipeline.capabilities.unchunked
    if not unchunked:
        return
    part = unchunked[0]
    # a scorer whose class (below the scorer base) never declares its capabilities may read any query
    bases = (ImportanceScorer, DiversityScorer, Component, object)
    declared = any("capabilities" in vars(cls) for cls in type(part.component).__mro__ if cls not in bases)
    reason = (
        "needs the attention of every prompt query, which a chunked prefill does not keep"
        if declared
        else "does not declare `chunked_prefill` (set `capabilities = Capabilities(chunked_prefill=True)` "
        "on its class if it reads only keys, values and the queries of the recent budget.window)"
    )
    raise ConfigError(
        f"{part.field} ({part.name}) {reason}, so it cannot run with {CHUNK_FIELD} = {prefill_chunk}. Set "
        f"{CHUNK_FIELD} to null (the prompt in one forward), or use a method whose scorers observe only "
        "the recent window (snapkv, pyramidkv, adakv, mixkv_*, knorm, keydiff, streamingllm); "
        "docs/scaling.md lists which components support chunked prefill."
    )


def chunked_vlm_message(model: str, prefill_chunk: int) -> str:
    """The refusal of ``model.prefill_chunk`` for a vision-language model (one paragraph)."""
    return (
        f"{CHUNK_FIELD} = {prefill_chunk}: model {model!r} is a vision-language model, whose forward merges "
        "the image features into the prompt and computes its positions (M-RoPE) over the whole prompt, "
        "which chunks of input ids cannot carry; it prefills in one forward. Set "
        f"{CHUNK_FIELD} to null for this model."
    )


def observed_window(pipeline: Pipeline, lengths: torch.Tensor) -> int:
    """The most recent queries any component of ``pipeline`` observes for prompts of ``lengths [B]``:
    the largest ``budget.window`` (per sample, branches included), at least 1."""
    budgets = [pipeline.budget, *(branch.budget for branch in pipeline.branches.values())]
    windows = [int(b.window_counts(lengths).max()) for b in budgets if b is not None and lengths.numel()]
    return max([1, *windows])


def global_query_window(pipeline: Pipeline, lengths: torch.Tensor) -> int | None:
    """``schedule: global``: how many of a layer's last queries to keep between its observation and
    its compression (:attr:`~kvlab.engine.session.CompressionSession.global_queries`).

    The scorers and the route rule have run by then; what compression still reads is the recent
    window the pipeline observes (:func:`observed_window`), unless another component declares
    ``chunked_prefill=False`` (it reads every prompt query, e.g. the ``h2o`` decode policy's
    seed, ``PipelineCapabilities.reads_all_queries``): then all of them (None).
    """
    if pipeline.capabilities.reads_all_queries:
        return None
    return observed_window(pipeline, lengths)
