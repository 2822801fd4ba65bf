"""The reconstruct prefill (``model.compression.prefill: {name: reconstruct, chunk: N}``): the model
repeats the prompt to score it (KVzip, Kim et al. 2025, Sec. 3.2).

Three phases, all inside :func:`~kvlab.engine.generation.prefill`:

1. The prompt's forward: every layer attends exactly and keeps its dense K/V; its
   :class:`~kvlab.compression.context.LayerContext` waits (:func:`hold_layer`, with only the recent
   window's queries a scorer of the pipeline may still read) instead of being compressed.
2. :func:`reconstruct`: one forward per chunk of ``N`` prompt tokens (each sample's chunks counted
   from its own first token, so a padded batch gives what each sample gives alone) of the block
   ``[request, opening, chunk]`` (:func:`reconstruction_blocks`) at the positions right after each
   sample's prompt. In every layer, :func:`reconstruction_attention` attends the block over the
   held prompt and itself, causally and exactly (the model's own computation), hands a
   :class:`~kvlab.compression.reconstruction.ReconstructionStep` to every scorer reading the
   reconstruction, and drops the block's K/V (the layer holds the prompt's again).
3. :func:`finish_reconstruction`: every waiting layer is compressed in order (``layerwise``), or
   observed and then compressed (``schedule: global``), with the scores of the whole prompt.

The reconstruction forwards are compression work: their wall time counts in the session's
``compression_seconds`` (:attr:`~kvlab.engine.session.CompressionSession.scoring_seconds`), never in
the prefill's.
"""

from __future__ import annotations

import math
import time

import torch

from kvlab.cache.options import AttentionOptions
from kvlab.compression.context import LayerContext
from kvlab.compression.reconstruction import ReconstructionScorer, ReconstructionStep
from kvlab.config.errors import ConfigError
from kvlab.engine.prefill_attention import prefill_attention
from kvlab.engine.schedule import compress_context, observe_layer
from kvlab.engine.session import CompressionSession, ReconstructionState
from kvlab.models.base import PromptProcessor
from kvlab.pipeline import Pipeline

WHERE = "model.compression.prefill"

#: the request of the first chunk (KVzip, Sec. 3.2; the authors' code and kvpress)
FIRST_REQUEST = "\n\nRepeat the previous context exactly."
#: the request of every later chunk, followed by the previous chunk's last tokens
NEXT_REQUEST = "\n\nRepeat the part of the previous context exactly, starting with"


def reconstruction_state(pipeline: Pipeline, keep_queries: int | None) -> ReconstructionState:
    """The bookkeeping of a reconstruct prefill: the pipeline's reconstruction scorers (every branch's)."""
    scorers = [p.component for p in pipeline.walk() if isinstance(p.component, ReconstructionScorer)]
    return ReconstructionState(scorers=scorers, keep_queries=keep_queries)


def hold_layer(session: CompressionSession, ctx: LayerContext) -> None:
    """Phase 1: layer ``ctx.layer_idx`` waits for the reconstruction with its dense K/V (in the cache
    and in ``ctx``) and the queries the pipeline may still read."""
    state = session.reconstruction
    ctx.release(state.keep_queries)
    state.pending[ctx.layer_idx] = ctx


def reconstruction_blocks(
    processor: object, input_ids: torch.Tensor, valid: torch.Tensor, chunk: int, overlap: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The reconstruction's blocks of the left-padded prompts ``input_ids [B, T]`` (``valid``), one per step.

    Step ``i`` gives sample ``b`` (``n_b`` prompt tokens, ``p_b = T - n_b`` padding) the block
    ``request_i + opening + x_b[i chunk : (i + 1) chunk]``: ``request_0`` is :data:`FIRST_REQUEST`,
    ``request_i`` :data:`NEXT_REQUEST` followed by the previous chunk's last ``overlap`` tokens;
    ``opening`` the prompt format's end of the user turn and assistant opening. A sample whose
    prompt has ended gets no block. Returns per step ``(ids [B, q], block_valid [B, q], start [B],
    count [B])``, blocks left padded; ``start`` the chunk's first prompt column, ``count`` its tokens.

    Raises:
        ConfigError: the processor builds no prompts from text (a wrapped model without kvlab's processor).
    """
    if not isinstance(processor, PromptProcessor):
        raise ConfigError(
            f"{WHERE} = reconstruct asks the model to repeat the prompt in words (a request and the chat "
            "template's assistant opening), which needs kvlab's processor (a tokenizer and a prompt format); "
            f"this model's processor is a {type(processor).__name__}. Load the model through kvlab "
            "(kvlab.load_model, or kvlab.wrap_model with its tokenizer)."
        )
    first, later = processor.text_ids(FIRST_REQUEST), processor.text_ids(NEXT_REQUEST)
    opening = processor.assistant_opening_ids()
    B, T = input_ids.shape
    lengths = valid.sum(1).tolist()
    rows = [input_ids[b, T - int(n) :].tolist() for b, n in enumerate(lengths)]
    steps = max(1, math.ceil(max(lengths + [1]) / chunk))
    pad_id = processor.pad_token_id
    out = []
    for i in range(steps):
        begin = i * chunk
        blocks = []
        for row in rows:
            part = row[begin : begin + chunk]
            if not part:
                blocks.append([])
                continue
            request = first if i == 0 else later + row[max(begin - chunk, begin - overlap) : begin]
            blocks.append(request + opening + part)
        width = max(len(block) for block in blocks)
        ids = torch.full((B, width), pad_id, dtype=torch.long, device="cpu")
        block_valid = torch.zeros(B, width, dtype=torch.bool, device="cpu")
        for b, block in enumerate(blocks):
            if block:
                ids[b, width - len(block) :] = torch.tensor(block, dtype=torch.long, device="cpu")
                block_valid[b, width - len(block) :] = True
        n = torch.tensor(lengths, dtype=torch.long, device="cpu")
        count = (n - begin).clamp(0, chunk)
        start = (T - n) + begin
        out.append((ids, block_valid, start, count))
    return out


def reconstruct(
    model: torch.nn.Module, session: CompressionSession, processor: object, input_ids: torch.Tensor
) -> None:
    """Phases 2 and 3: the reconstruction forwards over the held prompt, then every layer compressed.

    The forwards' wall time is added to ``session.scoring_seconds`` (compression work); the
    compression's own lands in the layer reports as for every prefill.
    """
    state, mode = session.reconstruction, session.pipeline.prefill_mode
    valid = session.valid
    device = input_ids.device
    start_time = time.perf_counter()
    lengths = valid.sum(1)
    prompt_start = valid.shape[1] - lengths.cpu()  # each sample's first prompt column
    for ids, block_valid, start, count in reconstruction_blocks(
        processor, input_ids, valid, mode.chunk, mode.overlap
    ):
        block_valid = block_valid.to(device)
        before = block_valid.long().cumsum(1) - 1
        positions = (lengths[:, None] + before).clamp(min=0).masked_fill(~block_valid, 0)
        state.block_valid = block_valid
        sinks = (start - prompt_start).clamp(max=int(session.pipeline.budget.sinks))
        entries = step_entries(prompt_start, start, count, sinks, mode.scope, valid.shape[1])
        state.entries = tuple(x.to(device) for x in entries) if entries is not None else None
        state.chunk_start, state.chunk_count = start.to(device), count.to(device)
        state.active = True
        try:
            model(
                input_ids=ids.to(device),
                position_ids=positions,
                cache=session.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        finally:
            state.active = False
    session.scoring_seconds += time.perf_counter() - start_time
    finish_reconstruction(session)


def finish_reconstruction(session: CompressionSession) -> None:
    """Phase 3: every waiting layer compressed in order (observed first under ``schedule: global``)."""
    state = session.reconstruction
    for layer_idx in sorted(state.pending):
        ctx = state.pending.pop(layer_idx)
        if session.pipeline.schedule == "global":
            observe_layer(session, ctx)
        else:
            compress_context(session, ctx)


def step_entries(
    prompt_start: torch.Tensor,
    start: torch.Tensor,
    count: torch.Tensor,
    sinks: torch.Tensor,
    scope: str,
    T: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The prompt columns a step's scoring softmax runs over, ``(columns [B, S], entry_valid [B, S],
    scored [B, S])`` (``scored`` marks the chunk's), from each sample's first prompt column, its
    chunk's first column and tokens and its sinks (``[B]`` long each, on the CPU): each sample's
    first ``sinks`` and its chunk's (``scope: chunk``); None under ``scope: cache`` (every column,
    the chunk's scored: :func:`reconstruction_attention` takes the layer's keys as they are)."""
    if scope == "cache":
        return None
    s_max = int(sinks.max()) if sinks.numel() else 0
    c_max = int(count.max()) if count.numel() else 0
    js = torch.arange(s_max, device="cpu")[None, :]
    jc = torch.arange(c_max, device="cpu")[None, :]
    columns = torch.cat([prompt_start[:, None] + js, start[:, None] + jc], dim=1).clamp(max=T - 1)
    real = torch.cat([js < sinks[:, None], jc < count[:, None]], dim=1)
    scored = torch.cat([torch.zeros_like(real[:, :s_max]), jc < count[:, None]], dim=1)
    return columns, real, scored


def reconstruction_attention(
    session: CompressionSession,
    layer_idx: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    options: AttentionOptions,
) -> torch.Tensor:
    """One layer at one reconstruction step: the block's exact attention over the held prompt and
    itself, the step handed to the reconstruction scorers, the block's K/V dropped.

    Shapes: query ``[B, H, q, D]`` (the block), key / value ``[B, Hkv, T + q, D]`` (the prompt's,
    then the block's). Returns the block's attention ``[B, H, q, D]``.

    Raises:
        ConfigError: the layer has a sliding window, soft-capping or sinks (the scorers' softmax
            would not be the model's).
    """
    state = session.reconstruction
    if not options.plain:
        raise ConfigError(
            f"{WHERE} = reconstruct: layer {layer_idx} has {options.describe()}, which the reconstruction "
            "scorers' attention does not apply (they score with plain causal softmax attention). Use another "
            "method with this model."
        )
    T = session.valid.shape[1]
    prompt_valid = session.run.masks_on(key.device)[0]
    block_valid = state.block_valid.to(key.device)
    out = prefill_attention(
        query, key, value, torch.cat([prompt_valid, block_valid], dim=1), scaling, options,
        block_elements=session.block_elements,
    )  # fmt: skip
    held = state.pending[layer_idx]
    B, Hkv, _, D = key.shape
    if state.entries is None:  # scope: cache, every prompt entry in the softmax, the chunk's scored
        columns = torch.arange(T, device=key.device)[None, :].expand(B, -1)
        start, count = state.chunk_start.to(key.device), state.chunk_count.to(key.device)
        scored = (columns >= start[:, None]) & (columns < (start + count)[:, None])
        keys, values, entry_valid = key[:, :, :T], value[:, :, :T], prompt_valid
    else:
        columns, entry_valid, scored = (x.to(key.device) for x in state.entries)
        entry_valid = entry_valid & prompt_valid.gather(1, columns)
        index = columns[:, None, :, None].expand(B, Hkv, -1, D)
        keys, values = key[:, :, :T].gather(2, index), value[:, :, :T].gather(2, index)
    facts = session.layer_facts(layer_idx)
    step = ReconstructionStep(
        layer_idx=layer_idx,
        queries=query,
        block_keys=key[:, :, T:],
        block_valid=block_valid,
        keys=keys,
        values=values,
        entry_valid=entry_valid,
        columns=columns,
        scored=scored,
        seq_len=T,
        scaling=scaling,
        hidden_states=facts.inputs,
        facts=facts,
        **session.block_options,
    )
    for scorer in state.scorers:
        scorer.observe(step, session.run)
    session.cache.layers[layer_idx].hold_dense(held.keys, held.values, T)  # the block's K/V dropped
    return out
