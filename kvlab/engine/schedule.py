"""When layers are compressed (``model.compression.schedule``): the engine side of the schedule.

``layerwise`` (the default): each layer right after its own prefill attention
(:func:`compress_context`). ``global``: each layer is only observed after its prefill attention
(:func:`observe_layer`: scores, route decision, the allocator's view of the layer, through
:meth:`~kvlab.pipeline.execution.LayerExecution.observe`; its dense K/V stay in the cache and its
context waits in the session), and every layer is compressed, in order, right after the last
layer's attention (:func:`finish_global`): peak memory is the full cache plus each layer's scores.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from kvlab.compression.context import LayerContext
from kvlab.engine.session import CompressionSession


def layer_context(
    session: CompressionSession,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    sliding_window: int | None,
) -> LayerContext:
    """The :class:`LayerContext` of layer ``layer_idx`` after its prefill attention (shapes there)."""
    valid, modality = session.run.masks_on(key.device)  # the layer's device (device_map)
    return LayerContext(
        layer_idx=layer_idx,
        num_layers=len(session.cache.layers),
        queries=query,
        query_start=key.shape[2] - query.shape[2],
        keys=key,
        values=value,
        valid=valid,
        modality=modality,
        scaling=scaling,
        run=session.run,
        sliding_window=sliding_window,
        image_blocks=session.run.image_blocks_on(key.device),
        facts=session.layer_facts(layer_idx),
        **session.block_options,
    )


def compress_context(session: CompressionSession, ctx: LayerContext, seconds: float = 0.0) -> None:
    """Compress layer ``ctx.layer_idx`` (its dense K/V -> the kept entries) and append its report;
    ``seconds`` already spent on it (observing it, under ``schedule: global``) count in the report."""
    start = time.perf_counter()
    with torch.no_grad():
        selection, report = session.pipeline.compress(ctx, record_scores=session.record_scores)
        # a sliding layer keeps its kept entries' positions
        session.cache.layers[ctx.layer_idx].compress(selection, ctx.sliding_window)
    report.seconds = seconds + time.perf_counter() - start
    if ctx.keys.device != session.valid.device:  # reports live on the batch's device, whatever the layer's
        report = _report_to(report, session.valid.device)
    session.reports.append(report)


def observe_layer(session: CompressionSession, ctx: LayerContext) -> None:
    """``schedule: global``: observe layer ``ctx.layer_idx`` (scores, route decision, allocator hook)
    and keep its context, dense K/V included, until the last layer has been observed; then compress all."""
    start = time.perf_counter()
    with torch.no_grad():
        session.pipeline.observe(ctx)
    ctx.release(session.global_queries)  # free what the context no longer needs while it waits
    session.pending[ctx.layer_idx] = (ctx, time.perf_counter() - start)
    if len(session.pending) == len(session.cache.layers):
        finish_global(session)


def finish_global(session: CompressionSession) -> None:
    """``schedule: global``, after the last layer's attention: compress every observed layer in order."""
    for layer_idx in sorted(session.pending):
        ctx, seconds = session.pending.pop(layer_idx)
        compress_context(session, ctx, seconds)


def check_prefill_done(session: CompressionSession) -> None:
    """After the prefill forward: every layer is compressed (none left waiting by ``schedule: global``).

    Raises:
        RuntimeError: some layers were observed but the model never ran attention on the others.
    """
    if session.pending:
        raise RuntimeError(
            f"model.compression.schedule: global observed layers {sorted(session.pending)} but the prefill "
            f"ended before all {len(session.cache.layers)} layers ran their attention; the model's decoder "
            "layers must all run kvlab attention."
        )


def _report_to(value: Any, device: torch.device) -> Any:
    """``value`` (report, selection, route decision, tensor, dict or list), its tensors on ``device``."""
    if torch.is_tensor(value):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _report_to(getattr(value, f.name), device) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **changes)
    if isinstance(value, dict):
        return {k: _report_to(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_report_to(v, device) for v in value)
    return value
