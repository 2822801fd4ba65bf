"""The progressive prefill (``model.compression.prefill: {name: progressive, chunk: N}``): compress as
the prompt comes in.

Finch (Corallo and Papotti 2024, Sec. 3) as a prefill mode any pipeline can run. :func:`progressive_forward`
feeds the prompt ``chunk`` tokens per sample at a time (each sample's chunks counted from its own
first token, so a padded batch gives what each sample gives alone); with ``question: true`` the
question part follows every chunk, at the positions right after it. In every layer,
:func:`progressive_attention`:

1. attends the step's block (chunk, question) over the entries the layer holds and the block
   itself, causally, exactly (:func:`~kvlab.engine.prefill_attention.prefill_attention`);
2. builds a :class:`~kvlab.compression.context.LayerContext` over the held entries and the chunk's
   (each sample's right aligned, as a left-padded prompt), holding the chunk's queries and the
   window's queries held from the step before (so a window observer sees the same queries it
   would over that prompt), and the question's queries and keys
   (:class:`~kvlab.compression.context.QuestionView`) when it is appended;
3. runs the pipeline with each sample's budget asked of its whole prompt
   (:class:`~kvlab.compression.budget.TargetBudget`): the layer keeps at most its budget;
4. holds the kept entries, right aligned, as the layer's dense K/V for the next step
   (:meth:`~kvlab.cache.layer.CompressedLayer.hold_dense`); the question's K/V are dropped. After
   the last step the layer is compressed into the ragged cache instead, and its report names the
   kept entries by their columns in the padded prompt, as a one-forward prefill's.

Kept entries keep the positions (RoPE) they were computed at; nothing is re-rotated. A layer
never holds more than ``budget + chunk`` entries besides the question's, so the prefill's memory
falls with the budget (``docs/benchmarks.md``, "Long prompts: prefill peak memory").
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from kvlab.cache.options import AttentionOptions
from kvlab.cache.selection import Selection
from kvlab.compression.budget import TargetBudget
from kvlab.compression.context import LayerContext, QuestionView
from kvlab.config.errors import ConfigError
from kvlab.engine.prefill_attention import prefill_attention
from kvlab.engine.session import CompressionSession, ProgressiveState
from kvlab.models.base import PAD, TEXT
from kvlab.pipeline import LayerReport, Pipeline

WHERE = "model.compression.prefill"


def progressive_state(pipeline: Pipeline, lengths: torch.Tensor) -> ProgressiveState:
    """The bookkeeping of a progressive prefill of prompts of ``lengths [B]`` (their budgets asked once)."""
    budget = pipeline.budget
    target = TargetBudget(
        tokens=None,
        ratio=None,
        window=budget.window,
        sinks=budget.sinks,
        max_window_share=budget.max_window_share,
        targets=budget.asked(lengths),
    )
    observes = any(
        p.kind == "scorer" and "window" in p.component.budget_settings.values() for p in pipeline.walk()
    )
    return ProgressiveState(
        pipeline=dataclasses.replace(pipeline, budget=target),
        window=int(budget.window) if observes else 0,
    )


def right_aligned(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's valid columns, in order, moved to the row's end: ``(index [B, S'], valid' [B, S'])``.

    ``valid [B, S]`` bool; ``S'`` the most valid columns of a row; ``index`` the source column of
    every output column (a padding output column points at some column, to be masked).
    """
    B, S = valid.shape
    counts = valid.sum(1)
    width = int(counts.max()) if B else 0
    order = torch.sort(valid.to(torch.uint8), dim=1, stable=True).indices  # padding first, then valid
    index = order[:, S - width :]
    aligned = torch.arange(width, device=valid.device)[None, :] >= (width - counts)[:, None]
    return index, aligned


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [B, N, S, D]`` at columns ``index [B, S']`` of every head -> ``[B, N, S', D]``."""
    B, N, _, D = x.shape
    return x.gather(2, index[:, None, :, None].expand(B, N, -1, D))


def progressive_attention(
    session: CompressionSession,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    options: AttentionOptions,
) -> torch.Tensor:
    """One layer's attention and compression at a step of a progressive prefill (steps in the module
    docstring).

    Shapes: query ``[B, H, c + Q, D]`` (the block), key / value ``[B, Hkv, S + c + Q, D]`` (the held
    entries, then the block). Returns the block's attention ``[B, H, c + Q, D]``.

    Raises:
        ConfigError: the layer has a sliding window, soft-capping or sinks (its kept entries would
            need their positions, not their columns, to be masked).
    """
    state = session.progressive
    if not options.plain:
        raise ConfigError(
            f"{WHERE} = progressive: layer {layer_idx} has {options.describe()}, which a progressive prefill "
            "does not apply to its kept entries (it masks by column, not by the entries' positions). Use "
            f"`{WHERE}: {{name: once}}` with this model."
        )
    B, q = query.shape[0], query.shape[2]
    device = key.device
    held = key.shape[2] - q
    held_valid = state.kept_valid.get(layer_idx, torch.zeros(B, 0, dtype=torch.bool, device=device))
    block_valid = state.block_valid.to(device)
    valid = torch.cat([held_valid, block_valid], dim=1)  # [B, S + c + Q]
    state.peak_entries = max(state.peak_entries, key.shape[2])
    out = prefill_attention(query, key, value, valid, scaling, options, block_elements=session.block_elements)
    start = time.perf_counter()
    c = state.chunk_width
    entries = held + c
    index, entry_valid = right_aligned(valid[:, :entries])
    keys, values = _gather(key[:, :, :entries], index), _gather(value[:, :, :entries], index)
    Hkv = key.shape[1]
    held_columns = state.kept_columns.get(layer_idx, torch.zeros(B, Hkv, 0, dtype=torch.long, device=device))
    chunk_columns = state.chunk_columns.to(device)[:, None, :].expand(-1, Hkv, -1)
    columns = torch.cat([held_columns, chunk_columns], dim=2).gather(2, index[:, None, :].expand(-1, Hkv, -1))
    queries, query_valid = _observed_queries(state, layer_idx, query[:, :, :c], block_valid[:, :c])
    question = None
    if q > c:
        question = QuestionView(query[:, :, c:], key[:, :, entries:], block_valid[:, c:])
    ctx = LayerContext(
        layer_idx=layer_idx,
        num_layers=len(session.cache.layers),
        queries=queries,
        keys=keys,
        values=values,
        valid=entry_valid,
        modality=torch.full_like(index, TEXT).masked_fill(~entry_valid, PAD),
        scaling=scaling,
        run=session.run,
        query_start=keys.shape[2] - queries.shape[2],
        question=question,
        **session.block_options,
    )
    record = session.record_scores and state.last
    selection, report = state.pipeline.compress(ctx, record_scores=record)
    layer = session.cache.layers[layer_idx]
    if state.last:
        layer.hold_dense(keys, values, state.logical_length)
        layer.compress(selection)
        report.seconds = state.seconds.pop(layer_idx, 0.0) + time.perf_counter() - start
        session.reports.append(_prompt_report(report, columns, session.valid.shape[1]))
        return out
    _hold(state, layer, layer_idx, selection, keys, values, columns)
    if state.window:
        rows = queries[:, :, -state.window :]
        state.held_queries[layer_idx] = (rows.clone(), query_valid[:, -state.window :])
    state.seconds[layer_idx] = state.seconds.get(layer_idx, 0.0) + time.perf_counter() - start
    return out


def _observed_queries(
    state: ProgressiveState, layer_idx: int, chunk: torch.Tensor, chunk_valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries of each sample's last entries, right aligned: the window's held from the step before,
    then the chunk's; ``([B, H, R, D], valid [B, R])``, padding rows zero."""
    held = state.held_queries.get(layer_idx)
    if held is not None:
        chunk = torch.cat([held[0].to(chunk.device), chunk], dim=2)
        chunk_valid = torch.cat([held[1].to(chunk.device), chunk_valid], dim=1)
    index, aligned = right_aligned(chunk_valid)
    rows = _gather(chunk, index) * aligned[:, None, :, None]
    return rows, aligned


def _hold(
    state: ProgressiveState,
    layer: object,
    layer_idx: int,
    selection: Selection,
    keys: torch.Tensor,
    values: torch.Tensor,
    columns: torch.Tensor,
) -> None:
    """Keep ``selection``'s entries of ``keys / values [B, Hkv, E, D]`` as the layer's dense K/V, each
    sample's right aligned (every head of a sample holds the same count: a uniform head allocation)."""
    counts = selection.counts  # [B, Hkv]
    n = counts[:, 0]
    if bool((counts != n[:, None]).any()):
        raise RuntimeError(
            "a progressive prefill holds one row per sample: every head must keep the same count"
        )
    K = int(n.max()) if n.numel() else 0
    indices = selection.indices[..., :K]  # ascending, padding past the count
    B, Hkv = counts.shape
    j = torch.arange(K, device=counts.device)
    real = j[None, :] >= (K - n)[:, None]  # [B, K]: right aligned
    source = (j[None, :] - (K - n)[:, None]).clamp(min=0)  # the selection slot of each output column
    slots = indices.gather(2, source[:, None, :].expand(-1, Hkv, -1))  # [B, Hkv, K] entry column
    D = keys.shape[-1]
    if selection.keys is not None:  # a merge selector's entries
        src_keys, src_values = selection.keys, selection.values
        gather = source[:, None, :, None].expand(-1, Hkv, -1, D)
    else:
        src_keys, src_values = keys, values
        gather = slots[..., None].expand(-1, -1, -1, D)
    mask = real[:, None, :, None]
    layer.hold_dense(
        src_keys.gather(2, gather) * mask, src_values.gather(2, gather) * mask, state.logical_length
    )
    state.kept_valid[layer_idx] = real
    state.kept_columns[layer_idx] = columns.gather(2, slots).masked_fill(~real[:, None, :], -1)


def _prompt_report(report: LayerReport, columns: torch.Tensor, width: int) -> LayerReport:
    """``report`` of the last step with its entries named by their columns in the padded prompt of
    ``width`` tokens (``columns [B, Hkv, E]``): the kept positions, and the scores (-inf on the
    columns evicted before)."""
    selection = report.selection
    real = selection.mask()
    moved = columns.gather(2, selection.indices).masked_fill(~real, 0)
    selection = dataclasses.replace(selection, indices=moved, keys=None, values=None)

    def placed(scores: torch.Tensor | None) -> torch.Tensor | None:
        if scores is None:
            return None
        B, Hkv, E = scores.shape
        target = torch.where(columns >= 0, columns, width)
        out = scores.new_full((B, Hkv, width + 1), float("-inf"))
        out.scatter_(2, target, scores)
        return out[..., :width]

    scorer_scores = report.scorer_scores
    if scorer_scores is not None:
        scorer_scores = {role: placed(score) for role, score in scorer_scores.items()}
    return dataclasses.replace(
        report, selection=selection, scores=placed(report.scores), scorer_scores=scorer_scores
    )


def progressive_forward(
    model: torch.nn.Module,
    session: CompressionSession,
    input_ids: torch.Tensor,
    questions: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """Feed the left-padded prompt ``input_ids [B, T]`` (``session.valid``) chunk by chunk, the
    questions ``(ids [B, Q], valid [B, Q])`` after each chunk when given; every layer is compressed
    after every step (:func:`progressive_attention`).

    Returns:
        ``[B, V]`` fp32 logits at each sample's last prompt token.
    """
    state = session.progressive
    chunk = session.pipeline.prefill_mode.chunk
    valid = session.valid
    B, T = input_ids.shape
    device = input_ids.device
    lengths = valid.sum(1)
    pad = T - lengths
    steps = max(1, math.ceil(int(lengths.max()) / chunk)) if B else 0
    logits: torch.Tensor | None = None
    for step in range(steps):
        first = step * chunk
        counts = (lengths - first).clamp(0, chunk)  # [B] this step's chunk tokens per sample
        c = int(counts.max())
        j = torch.arange(c, device=device)[None, :]
        real = j >= (c - counts)[:, None]  # [B, c] left padded
        offset = j - (c - counts)[:, None]  # the token's index within the sample's chunk
        columns = torch.where(real, pad[:, None] + first + offset, -1)
        ids = input_ids.gather(1, columns.clamp(min=0)).masked_fill(~real, 0)
        positions = (first + offset).clamp(min=0).masked_fill(~real, 0)
        block, block_valid, block_positions = [ids], [real], [positions]
        if questions is not None:
            q_ids, q_valid = questions
            q_valid = q_valid.to(device) & (counts > 0)[:, None]
            q_pos = (first + counts)[:, None] + q_valid.long().cumsum(1) - 1  # right after the chunk
            block += [q_ids.to(device)]
            block_valid += [q_valid]
            block_positions += [q_pos.clamp(min=0).masked_fill(~q_valid, 0)]
        state.block_valid = torch.cat(block_valid, dim=1)
        state.chunk_width = c
        state.chunk_columns = columns
        state.last = step == steps - 1
        state.logical_length = T if state.last else int((pad + first + counts).max())
        width = sum(x.shape[1] for x in block)
        out = model(
            input_ids=torch.cat(block, dim=1),
            position_ids=torch.cat(block_positions, dim=1),
            cache=session.cache,
            use_cache=True,
            logits_to_keep=width - (c - 1),  # from the chunk's last column on
        )
        step_logits = out.logits[:, 0].float()
        logits = step_logits if logits is None else logits
        ends = (counts > 0) & (first + counts == lengths)  # the samples whose prompt ends here
        logits = torch.where(ends[:, None], step_logits, logits)
    return logits
