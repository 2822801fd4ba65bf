"""kvlab's own generation: :func:`prefill` (compression inside), then :func:`decode` over the cache.

Short on purpose (no forked ``generate``): :func:`prefill` runs one forward over the padded
prompt and returns a :class:`PrefillState` (cache, first logits, next positions, session);
:func:`decode` takes one token per step through the Cache API (greedy or teacher-forced) and
runs the decode policy after each; :func:`generate` is the two in a row.

Positions: text models get explicit ``position_ids`` from the attention mask (each sample
counts from its own first token, padding or not), and decode positions continue from the
*original* prompt length. Multimodal-RoPE models (Qwen2-VL) compute their own positions at
prefill from the attention mask (``get_rope_index``), which also stores per-sample
``rope_deltas`` (kept in the :class:`PrefillState`). At decode kvlab passes the new token's
position itself, exactly as the model derives it from a full attention mask (valid tokens so
far + ``rope_deltas``, the same on all three M-RoPE axes): Qwen2-VL (transformers 5.24) would otherwise build
positions for the whole sequence (given a mask) or ignore left padding (without one).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvlab.cache.cache import CompressedCache
from kvlab.cache.state import RunState
from kvlab.compression.context import sample_positions
from kvlab.config.errors import ConfigError
from kvlab.engine.prefill_plan import (
    check_prefill_chunk,
    chunked_vlm_message,
    global_query_window,
    observed_window,
)
from kvlab.engine.progressive import progressive_forward, progressive_state
from kvlab.engine.reconstruction import reconstruct, reconstruction_state
from kvlab.engine.schedule import check_prefill_done
from kvlab.engine.session import CompressionSession, compression_session
from kvlab.models.base import Batch, LoadedModel
from kvlab.models.facts import ModelFacts
from kvlab.models.placement import input_device
from kvlab.pipeline import LayerReport, Pipeline


@dataclass(frozen=True)
class RunOptions:
    """How a batch is generated: one object from the module or the API down to :func:`prefill`
    (what a protocol's :meth:`~kvlab.engine.protocols.Protocol.run` takes).

    Attributes:
        max_new_tokens: greedy decode limit (of samples without their own ``max_new_tokens``).
        return_logits: keep every step's logits (``GenerationResult.step_logits``; fidelity).
        record_scores: keep each layer's scores in its report (TensorBoard histograms).
        teacher_tokens: ``[B, S]``: feed these tokens instead of the greedy choices (teacher
            forcing, for fidelity metrics); decoding then runs exactly S steps.
        prefill_chunk: None: the prompt in one forward. N: forwards of N prompt tokens each
            (``model.prefill_chunk``): a chunk attends to the dense K/V of the chunks before it,
            and each layer is compressed by the last chunk, with the queries of the recent window
            held from the earlier ones (``docs/scaling.md``). Refused with
            ``model.compression.schedule: global``, under which every layer is scored during the
            forward and all are compressed after the last layer's attention.
        record_positions: also follow what happens to the kept positions after the prefill
            (``ProtocolResult.decode_positions``: ``decode_time``'s compressions, a decode
            policy's evictions; the prefill's own selections are always in the layer reports).
    """

    max_new_tokens: int = 32
    return_logits: bool = False
    record_scores: bool = False
    teacher_tokens: torch.Tensor | None = None
    prefill_chunk: int | None = None
    record_positions: bool = False


#: the defaults (frozen, so one object serves every call)
DEFAULT_OPTIONS = RunOptions()


@dataclass
class GenerationResult:
    """Outputs of :func:`generate` for a batch of B samples.

    Attributes:
        tokens: generated token ids per sample (eos excluded, stops at eos or the limit).
        kept: ``[L, B, Hkv]`` kept prompt tokens per layer and head.
        prompt_lengths: ``[B]`` valid prompt tokens.
        kv_bytes_full: bytes an uncompressed cache of each prompt would hold, ``[B]``.
        kv_bytes_kept: bytes of each sample's kept prompt K/V, ``[B]``.
        kv_bytes_allocated: everything the cache allocated for the batch (decode region and
            offsets included).
        prefill_seconds / compression_seconds / decode_seconds: batch timings (prefill excludes
            the compression time spent inside it).
        step_logits: ``[B, steps, V]`` logits of every generated position (when requested).
        reports: per-layer :class:`LayerReport` s.
    """

    tokens: list[list[int]]
    kept: torch.Tensor
    prompt_lengths: torch.Tensor
    kv_bytes_full: torch.Tensor
    kv_bytes_kept: torch.Tensor
    kv_bytes_allocated: int
    prefill_seconds: float
    compression_seconds: float
    decode_seconds: float
    step_logits: torch.Tensor | None = None
    reports: list[LayerReport] = field(default_factory=list)


def _uses_mrope(model: torch.nn.Module) -> bool:
    return hasattr(getattr(model, "model", model), "get_rope_index")


def _prefill_positions(
    model: torch.nn.Module, positions: torch.Tensor, extra: dict[str, Any]
) -> dict[str, Any]:
    """Prefill ``position_ids`` kwargs: explicit for text models and for text-only M-RoPE batches.

    M-RoPE models keep ``rope_deltas`` on the model between calls; it is reset here so a batch
    never sees the previous batch's deltas. With images they compute their own 3-D positions.
    """
    if not _uses_mrope(model):
        return {"position_ids": positions}
    model.model.rope_deltas = None
    if extra.get("image_grid_thw") is None and extra.get("video_grid_thw") is None:
        return {"position_ids": positions[None].expand(3, -1, -1)}
    return {}


def _decode_positions(
    model: torch.nn.Module, next_pos: torch.Tensor, deltas: torch.Tensor | None
) -> torch.Tensor:
    """Position ids of the next token: ``[B, 1]``, or ``[3, B, 1]`` for multimodal RoPE.

    ``deltas`` ``[B, 1]``: the M-RoPE ``rope_deltas`` of the prefill (None: text only).
    """
    if not _uses_mrope(model):
        return next_pos
    if deltas is not None:
        next_pos = next_pos + deltas.to(next_pos.device)
    return next_pos[None].expand(3, -1, -1)


@dataclass
class PrefillState:
    """A batch right after :func:`prefill`: its compressed cache and what :func:`decode` needs.

    Shapes: B samples, T padded prompt length, V vocabulary.

    Attributes:
        loaded: the model.
        pipeline: the compression method (its decode policy runs in :func:`decode`).
        session: the batch's :class:`~kvlab.engine.session.CompressionSession`: the run state
            (the cache, the padding mask ``valid [B, T]``, the components' state) and the layer
            reports. Decode steps run inside it again.
        logits: ``[B, V]`` fp32 logits at each sample's last prompt token (the first generated
            token's distribution).
        next_positions: ``[B, 1]`` long, position of the next token within its own sample (its
            valid prompt length: positions continue from the original, uncompressed prompt).
        rope_deltas: ``[B, 1]`` M-RoPE offsets the prefill computed (``get_rope_index``; kept
            here because the model overwrites them at its next prefill), None for other models
            and for text-only batches.
        seconds: wall time of the prefill forward, compression included (see
            ``session.compression_seconds`` for the compression part, a reconstruct prefill's
            scoring forwards included).
    """

    loaded: LoadedModel
    pipeline: Pipeline
    session: CompressionSession
    logits: torch.Tensor
    next_positions: torch.Tensor
    seconds: float
    rope_deltas: torch.Tensor | None = None

    @property
    def cache(self) -> CompressedCache:
        """The batch's :class:`CompressedCache` (every layer compressed)."""
        return self.session.cache


@dataclass
class DecodeResult:
    """Outputs of :func:`decode` (S steps, S <= the step limit).

    Attributes:
        tokens: ``[B, S]`` long, the chosen (or teacher) tokens, a sample's eos and what follows
            it included (the batch runs until every sample finished).
        step_logits: ``[B, S, V]`` fp32 logits each token was chosen from (when requested).
        seconds: wall time of the decode loop.
    """

    tokens: torch.Tensor
    step_logits: torch.Tensor | None
    seconds: float


def stop_tokens(loaded: LoadedModel, device: torch.device) -> torch.Tensor:
    """``[E]`` long: the processor's end-of-sequence ids, sorted and unique."""
    return torch.tensor(sorted(set(loaded.processor.eos_token_ids)), device=device)


@torch.no_grad()
def prefill(
    loaded: LoadedModel,
    pipeline: Pipeline,
    batch: Batch,
    decode_capacity: int = 32,
    options: RunOptions = DEFAULT_OPTIONS,
    block_elements: int | None = None,
    questions: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PrefillState:
    """One forward over the padded prompt of ``batch`` (or chunks); every layer is compressed inside it.

    A progressive prefill (``model.compression.prefill: progressive``) feeds the prompt chunk by
    chunk instead, every layer compressed after each (:mod:`kvlab.engine.progressive`), with the
    ``questions`` (``ids [B, Q]``, ``valid [B, Q]``, left padded) appended to every chunk for
    scoring when the mode asks for them (``question: true``).

    Args:
        loaded: the model, its attention routed through kvlab (``enable_kvlab_attention``).
        pipeline: the compression method.
        batch: a processor's collate output: ``input_ids`` / ``attention_mask`` ``[B, T]`` (left
            padded), ``modality [B, T]``, optional ``model_inputs`` (pixel values, grids).
        decode_capacity: decode tokens reserved per (sample, KV head) in every layer (the step
            limit is the right value; the region grows if exceeded).
        options: what it reads of the run's options: ``record_scores`` (keep each layer's mixed
            scores in its report) and ``prefill_chunk`` (:class:`RunOptions`).
        block_elements: the most attention elements (``B x H x rows x keys``) prefill attention and
            the scorers' attention helpers hold at once (None: 2**24, 64 MiB of fp32): the working
            set of a long prompt's prefill, whatever its length.
        questions: the question parts a progressive prefill with ``question: true`` scores with
            (the context protocols' split, :mod:`kvlab.engine.context_protocols`); None otherwise.

    Returns:
        the :class:`PrefillState` to hand to :func:`decode`.

    Raises:
        ConfigError: a ``prefill_chunk`` the pipeline refuses
            (:func:`~kvlab.engine.prefill_plan.check_prefill_chunk`), or any with a vision-language
            model; a model fact a component declares that the model cannot provide
            (:meth:`~kvlab.models.facts.ModelFacts.of`), before the forward.
    """
    model, info = loaded.model, loaded.info
    pipeline.bind_model(info.name)
    readers = pipeline.capabilities.model_facts  # only what a component declared is collected
    facts = ModelFacts.of(model, info.name, readers, info.head_dim) if readers else None
    prefill_chunk = options.prefill_chunk
    if prefill_chunk is not None:
        check_prefill_chunk(pipeline, prefill_chunk)
        if info.vision_language:
            raise ConfigError(chunked_vlm_message(info.name, prefill_chunk))
    mode = pipeline.prefill_mode
    if mode.progressive:
        _check_progressive(info.name, info.vision_language, prefill_chunk, mode.question, questions)
    if mode.reconstructs and info.vision_language:
        raise ConfigError(
            f"model.compression.prefill = reconstruct: model {info.name!r} is a vision-language model, "
            "whose prompt (its images) the text-only reconstruction cannot repeat. Use another method "
            "with this model."
        )
    device = input_device(model)  # embeddings' device: with a device_map, not the first parameter's
    input_ids = batch.input_ids.to(device)
    attention_mask = batch.attention_mask.to(device)
    valid = attention_mask.bool()
    extra = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.model_inputs.items()}
    cache = CompressedCache(info.num_layers, decode_capacity=decode_capacity)
    T = input_ids.shape[1]
    chunk = prefill_chunk if prefill_chunk is not None and prefill_chunk < T else None
    run = RunState(
        cache=cache,
        valid=valid,
        modality=batch.modality.to(device),
        bidirectional_image_blocks=info.bidirectional_image_blocks,
    )
    session = CompressionSession(
        run=run,
        pipeline=pipeline,
        record_scores=options.record_scores,
        prefill_chunk=chunk,
        held_queries=observed_window(pipeline, valid.sum(-1)) if chunk is not None else 0,
        global_queries=global_query_window(pipeline, valid.sum(-1))
        if pipeline.schedule == "global"
        else None,
        block_elements=block_elements,
        facts=facts,
        progressive=progressive_state(pipeline, valid.sum(-1)) if mode.progressive else None,
        reconstruction=reconstruction_state(pipeline, global_query_window(pipeline, valid.sum(-1)))
        if mode.reconstructs
        else None,
    )
    positions = sample_positions(valid).clamp(min=0)  # [B, T]; padding gets 0, as in transformers
    capturing = facts.capturing() if facts is not None else contextlib.nullcontext()
    with compression_session(session), capturing:
        start = time.perf_counter()
        if mode.progressive:
            first_logits = progressive_forward(
                model, session, input_ids, questions if mode.question else None
            )
        elif chunk is None:
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
                **_prefill_positions(model, positions, extra),
                **extra,
            )
        else:  # text only: explicit positions ([B, T], or [3, B, T] for M-RoPE), sliced per chunk
            position_ids = _prefill_positions(model, positions, extra)["position_ids"]
            for first in range(0, T, chunk):
                last = min(T, first + chunk)
                out = model(
                    input_ids=input_ids[:, first:last],
                    attention_mask=attention_mask[:, :last],
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                    position_ids=position_ids[..., first:last],
                )
        if not mode.progressive:
            first_logits = out.logits[:, -1].float()
        if mode.reconstructs:  # the model repeats the prompt to score it, then every layer is compressed
            reconstruct(model, session, loaded.processor, input_ids)
        seconds = time.perf_counter() - start
    check_prefill_done(session)
    return PrefillState(
        loaded=loaded,
        pipeline=pipeline,
        session=session,
        logits=first_logits,
        next_positions=positions[:, -1:] + 1,
        seconds=seconds,
        rope_deltas=model.model.rope_deltas if _uses_mrope(model) else None,
    )


def _check_progressive(
    model: str,
    vision_language: bool,
    prefill_chunk: int | None,
    question: bool,
    questions: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """Refuse a progressive prefill (``model.compression.prefill``) the run cannot give: with
    ``model.prefill_chunk`` (two chunkings), on a vision-language model, or asking for the question
    where the protocol has none to give."""
    where = "model.compression.prefill"
    if prefill_chunk is not None:
        raise ConfigError(
            f"{where} = progressive feeds the prompt in chunks of its own (its `chunk`), so "
            "model.prefill_chunk "
            f"= {prefill_chunk} has nothing left to do: set model.prefill_chunk to null."
        )
    if vision_language:
        raise ConfigError(
            f"{where} = progressive: model {model!r} is a vision-language model, whose forward places the "
            "image features and positions over the whole prompt, which chunks of input ids cannot carry. Use "
            f"`{where}: {{name: once}}` with this model."
        )
    if question and questions is None:
        raise ConfigError(
            f"{where}.question = true scores every chunk with the prompt's question, which this run does not "
            "separate from its context: use model.protocol: query_aware with prompts kvlab can split "
            "(samples with a context and a question, or string prompts), or set question to false."
        )


@torch.no_grad()
def decode(
    state: PrefillState,
    max_new_tokens: int = 32,
    return_logits: bool = False,
    teacher_tokens: torch.Tensor | None = None,
    limits: torch.Tensor | None = None,
    on_step: Callable[[int], None] | None = None,
) -> DecodeResult:
    """Greedy decoding over ``state``'s cache, one token per step, the decode policy after each.

    The first token comes from ``state.logits``; each step feeds the chosen token ``[B, 1]`` at
    its position and takes the next one from the new logits. Stops after ``max_new_tokens``
    tokens or once every sample chose an end-of-sequence token; the last chosen token is not
    fed to the model. ``teacher_tokens [B, S]`` are fed instead of the greedy choices (teacher
    forcing, for fidelity metrics); decoding then runs exactly S steps.

    ``limits [B]`` (long, each <= ``max_new_tokens``): a sample is finished once it holds that
    many tokens (per-sample ``max_new_tokens``; its row still gets the batch's steps, to be cut
    by the caller). ``on_step(step)`` runs after the decode policy at every fed step (the
    step's token is in the cache): the decode-time protocol compresses from there.

    Decoding advances ``state.cache`` (and the decode policy's state): run it once per prefill.
    """
    loaded, session = state.loaded, state.session
    model, device = loaded.model, state.logits.device
    policy = state.pipeline.decode_policy
    eos = stop_tokens(loaded, device)
    B = state.logits.shape[0]
    with compression_session(session):
        session.start_decoding()
        logits = state.logits
        step_logits = [logits] if return_logits else []
        tokens = torch.empty(B, 0, dtype=torch.long, device=device)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        next_pos = state.next_positions
        start = time.perf_counter()
        steps = max_new_tokens if teacher_tokens is None else teacher_tokens.shape[1]
        for step in range(steps):
            next_token = logits.argmax(-1) if teacher_tokens is None else teacher_tokens[:, step].to(device)
            tokens = torch.cat([tokens, next_token[:, None]], dim=1)
            finished |= torch.isin(next_token, eos)
            if limits is not None:
                finished |= limits.to(device) <= step + 1
            if (teacher_tokens is None and bool(finished.all())) or step == steps - 1:
                break
            out = model(
                input_ids=next_token[:, None],
                position_ids=_decode_positions(model, next_pos, state.rope_deltas),
                cache=session.cache,
                use_cache=True,
            )
            next_pos = next_pos + 1
            logits = out.logits[:, -1].float()
            if return_logits:
                step_logits.append(logits)
            policy.after_step(session.run, step)
            if on_step is not None:
                on_step(step)
        seconds = time.perf_counter() - start
    return DecodeResult(
        tokens=tokens,
        step_logits=torch.stack(step_logits, dim=1) if return_logits else None,
        seconds=seconds,
    )


@torch.no_grad()
def extend(state: PrefillState, input_ids: torch.Tensor, valid: torch.Tensor) -> PrefillState:
    """Prefill a left-padded block of new tokens on top of ``state``'s compressed cache, uncompressed.

    One forward of ``input_ids [B, q]`` (``valid [B, q]`` bool, False on each row's left padding)
    through the compressed layers: every token attends to the kept entries and, causally, to the
    block's real tokens before it (kvlab's attention sends ``q > 1`` new tokens on a compressed
    layer to decode attention); the padding entries are hidden from every later query and take
    no position (:meth:`~kvlab.cache.cache.CompressedCache.appending_valid`). Positions continue
    from each sample's own next position (RoPE positions never shift after compression). This is
    how the ``query_agnostic`` and ``multi_question`` protocols put a question on a compressed
    context (docs/protocols.md).

    Returns:
        a new :class:`PrefillState` on the same session: ``logits`` at each row's last real token
        (unchanged for a row with no real token), ``next_positions`` advanced by each row's real
        tokens, ``seconds`` increased by this forward's wall time.
    """
    if input_ids.shape[1] == 0:
        return state
    loaded, session = state.loaded, state.session
    model, device = loaded.model, state.logits.device
    input_ids, valid = input_ids.to(device), valid.to(device).bool()
    before = valid.long().cumsum(1) - valid.long()  # [B, q] real tokens before each one
    positions = _decode_positions(model, state.next_positions + before, state.rope_deltas)
    with compression_session(session), session.cache.appending_valid(valid):
        start = time.perf_counter()
        out = model(
            input_ids=input_ids,
            position_ids=positions,
            cache=session.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        seconds = time.perf_counter() - start
    real = valid.any(1, keepdim=True)  # [B, 1]
    return replace(
        state,
        logits=torch.where(real, out.logits[:, -1].float(), state.logits),
        next_positions=state.next_positions + valid.sum(1, keepdim=True),
        seconds=state.seconds + seconds,
    )


@torch.no_grad()
def generate(
    loaded: LoadedModel,
    pipeline: Pipeline,
    batch: Batch,
    options: RunOptions = DEFAULT_OPTIONS,
) -> GenerationResult:
    """Prefill ``batch`` (a processor's collate output), compress every layer, decode greedily:
    :func:`prefill` then :func:`decode` of ``options.max_new_tokens`` steps (teacher-forced with
    ``options.teacher_tokens``)."""
    state = prefill(loaded, pipeline, batch, options.max_new_tokens, options)
    decoded = decode(state, options.max_new_tokens, options.return_logits, options.teacher_tokens)
    return generation_result(state, decoded)


def generation_result(state: PrefillState, decoded: DecodeResult) -> GenerationResult:
    """The :class:`GenerationResult` of a prefill and its decode (counts and bytes on the CPU)."""
    info, cache, session = state.loaded.info, state.cache, state.session
    kept = cache.kept_tokens()  # [L, B, Hkv]
    lengths = session.valid.sum(-1)
    bytes_per_token = info.head_dim * 2 * cache.layers[0].dtype.itemsize
    full = lengths * info.num_kv_heads * info.num_layers * bytes_per_token
    stops = set(stop_tokens(state.loaded, lengths.device).tolist())
    return GenerationResult(
        tokens=[trim_at_stop(row, stops) for row in decoded.tokens.tolist()],
        kept=kept.cpu(),
        prompt_lengths=lengths.cpu(),
        kv_bytes_full=full.cpu(),
        kv_bytes_kept=cache.kept_bytes(kept, info.head_dim).cpu(),
        kv_bytes_allocated=cache.kv_bytes(),
        prefill_seconds=state.seconds - session.compression_seconds,
        compression_seconds=session.compression_seconds,
        decode_seconds=decoded.seconds,
        step_logits=decoded.step_logits.cpu() if decoded.step_logits is not None else None,
        reports=session.reports,
    )


def trim_at_stop(row: list[int], stops: set[int]) -> list[int]:
    """``row`` up to (excluding) its first stop token."""
    for i, token in enumerate(row):
        if token in stops:
            return row[:i]
    return row
