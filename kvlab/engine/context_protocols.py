"""The protocols that compress the context alone (``query_agnostic``, ``multi_question``), and
``query_aware``, which does too when the pipeline scores with the question.

The context of each sample (or of each ``context_id``) is prefilled and compressed without its
question (:mod:`kvlab.engine.prompt_split`); the question part is then prefilled on top of the
compressed cache, uncompressed (:func:`~kvlab.engine.generation.extend`), and decoding follows.
``multi_question`` answers the questions of one context in turn from one compressed context,
restored between them (:meth:`~kvlab.cache.state.RunState.checkpoint`). ``query_aware`` prefills
the whole prompt with compression inside; under a progressive prefill with ``question: true``
(Finch, ``model.compression.prefill``) it runs the same context run, the question appended to
every chunk of the context for scoring (:mod:`kvlab.engine.progressive`), then prefilled on top.
docs/protocols.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.config.errors import ConfigError
from kvlab.engine.decode_positions import EvictionLog
from kvlab.engine.generation import (
    DEFAULT_OPTIONS,
    GenerationResult,
    PrefillState,
    RunOptions,
    decode,
    extend,
    generation_result,
    prefill,
    stop_tokens,
    trim_at_stop,
)
from kvlab.engine.prompt_split import PromptSplit, question_block, report_rows, split_prompts
from kvlab.engine.protocols import PROTOCOLS, WHERE, Protocol, ProtocolResult, cut_at_limits, sample_limits
from kvlab.models.base import Batch, LoadedModel, PromptProcessor
from kvlab.pipeline import Pipeline


def _context_run(
    loaded: LoadedModel,
    pipeline: Pipeline,
    batch: Batch,
    options: RunOptions,
    group: bool,
    question_scoring: bool = False,
) -> ProtocolResult:
    """``query_agnostic`` (``group`` False: one context per sample) and ``multi_question``: prefill and
    compress the contexts once, then answer round r's question of every context from the
    checkpointed cache (restored between rounds), each question prefilled uncompressed.
    ``question_scoring`` (``query_aware`` under a progressive prefill with ``question: true``, one
    context per sample): the prefill scores every chunk of the context with its sample's question."""
    split = split_prompts(loaded.processor, batch, group)
    B = len(split.questions)
    limits = sample_limits(batch, options.max_new_tokens)
    longest = max([len(q) for q in split.questions] + [0])
    pad_id = loaded.processor.pad_token_id if isinstance(loaded.processor, PromptProcessor) else 0
    questions = question_block(split.questions, pad_id) if question_scoring else None
    state = prefill(
        loaded, pipeline, split.context, longest + int(limits.max()), options, questions=questions
    )
    teacher_tokens = options.teacher_tokens
    session = state.session
    kept = state.cache.kept_tokens()  # [L, C, Hkv] before any question
    rounds = max(len(members) for members in split.groups)
    checkpoint = session.run.checkpoint() if rounds > 1 else None  # the cache and the components' state
    tokens: list[list[int]] = [[] for _ in range(B)]
    logits: list[torch.Tensor | None] = [None] * B
    seconds = {"extend": 0.0, "decode": 0.0}
    for r in range(rounds):
        members = [g[r] if r < len(g) else None for g in split.groups]  # one sample (or none) per context
        if r > 0:
            session.run.restore(checkpoint)
        ids, valid = question_block([split.questions[m] if m is not None else None for m in members], pad_id)
        asked = extend(state, ids, valid)
        seconds["extend"] += asked.seconds - state.seconds
        round_limits = torch.tensor([int(limits[m]) if m is not None else 1 for m in members], device="cpu")
        teacher = None
        if teacher_tokens is not None:
            index = torch.tensor([m if m is not None else 0 for m in members], device="cpu")
            teacher = teacher_tokens[index]
        decoded = decode(asked, int(round_limits.max()), options.return_logits, teacher, limits=round_limits)
        seconds["decode"] += decoded.seconds
        for c, m in enumerate(members):
            if m is not None:
                tokens[m] = decoded.tokens[c].tolist()
                if decoded.step_logits is not None:
                    logits[m] = decoded.step_logits[c].cpu()
    stops = set(stop_tokens(loaded, kept.device).tolist())
    result = _sample_result(loaded, state, split, kept, tokens, logits, stops, seconds)
    result.tokens = cut_at_limits(result.tokens, limits, teacher_tokens)
    sizes = [len(members) for members in split.groups]
    extras = [
        {"question_tokens": len(split.questions[b]), "context_questions": sizes[int(split.rows[b])]}
        for b in range(B)
    ]
    questions = torch.tensor([len(q) for q in split.questions], dtype=torch.long, device="cpu")
    context = split.lengths.cpu() - questions
    groups = split.groups if group else None
    return ProtocolResult(result, extras, context_tokens=context, context_groups=groups)


def _sample_result(
    loaded: LoadedModel,
    state: PrefillState,
    split: PromptSplit,
    kept: torch.Tensor,
    tokens: list[list[int]],
    logits: list[torch.Tensor | None],
    stops: set[int],
    seconds: dict[str, float],
) -> GenerationResult:
    """The samples' :class:`GenerationResult` of a context run: ``kept`` ``[L, C, Hkv]`` context
    tokens kept per context (before any question), a sample's kept bytes are its context's kept
    entries plus its question part's, prefilled uncompressed."""
    info, cache, session = loaded.info, state.cache, state.session
    rows = split.rows
    per_token = info.head_dim * 2 * cache.layers[0].dtype.itemsize  # one head, one layer
    whole = info.num_kv_heads * info.num_layers * per_token
    questions = torch.tensor([len(q) for q in split.questions], dtype=torch.long, device="cpu")
    sample_kept = kept[:, rows.to(kept.device)].cpu()  # [L, B, Hkv]
    step_logits = None
    if logits and logits[0] is not None:
        steps = max(t.shape[0] for t in logits if t is not None)
        step_logits = torch.zeros(len(logits), steps, logits[0].shape[-1], device="cpu")
        for b, t in enumerate(logits):
            step_logits[b, : t.shape[0]] = t
    reports = [report_rows(report, rows, split.shift, split.width) for report in session.reports]
    return GenerationResult(
        tokens=[trim_at_stop(row, stops) for row in tokens],
        kept=sample_kept,
        prompt_lengths=split.lengths.cpu(),
        kv_bytes_full=(split.lengths.cpu() * whole),
        kv_bytes_kept=cache.kept_bytes(kept, info.head_dim).cpu()[rows.cpu()] + questions * whole,
        kv_bytes_allocated=cache.kv_bytes(),
        prefill_seconds=state.seconds - session.compression_seconds + seconds["extend"],
        compression_seconds=session.compression_seconds,
        decode_seconds=seconds["decode"],
        step_logits=step_logits,
        reports=reports,
    )


@PROTOCOLS.register("query_aware")
@dataclass
class QueryAware(Protocol):
    """The whole prompt, question included, in one prefill with compression inside (kvlab's default)."""

    def run(self, loaded, pipeline, batch, options=DEFAULT_OPTIONS) -> ProtocolResult:
        if pipeline.prefill_mode.question:  # Finch: the context compressed with the question's scores
            return _context_run(loaded, pipeline, batch, options, group=False, question_scoring=True)
        limits = sample_limits(batch, options.max_new_tokens)
        steps = int(limits.max())
        state = prefill(loaded, pipeline, batch, steps, options)
        uniform = bool((limits == steps).all())
        policy = pipeline.decode_policy
        if options.record_positions:  # before decoding starts: the policy records what it evicts
            policy.record_evictions(state.session.run)
        teacher = options.teacher_tokens
        decoded = decode(state, steps, options.return_logits, teacher, limits=None if uniform else limits)
        result = generation_result(state, decoded)
        result.tokens = cut_at_limits(result.tokens, limits, teacher)
        record = policy.evicted_positions(state.session.run) if options.record_positions else None
        positions = None
        if record is not None:  # the sample's tokens, its stop token included (as decode_time counts)
            produced = [min(len(row) + 1, int(limits[b])) for b, row in enumerate(result.tokens)]
            log = EvictionLog(state.session.reports, state.session.valid, merged=True)
            positions = log.policy_samples(record, produced)
        return ProtocolResult(result, [{} for _ in result.tokens], decode_positions=positions)


@PROTOCOLS.register("query_agnostic")
@dataclass
class QueryAgnostic(Protocol):
    """The context compressed alone, then the question part prefilled uncompressed (kvpress' default)."""

    splits_prompts: ClassVar[bool] = True

    def check(self, pipeline: Pipeline) -> None:
        _refuse_decode_policy(pipeline, self.registry_name)
        refuse_question_scoring(pipeline, self.registry_name)

    def run(self, loaded, pipeline, batch, options=DEFAULT_OPTIONS) -> ProtocolResult:
        return _context_run(loaded, pipeline, batch, options, group=False)


@PROTOCOLS.register("multi_question")
@dataclass
class MultiQuestion(Protocol):
    """One compressed context per ``context_id`` answers each of its questions in turn (compressed once)."""

    groups_contexts: ClassVar[bool] = True
    splits_prompts: ClassVar[bool] = True

    def check(self, pipeline: Pipeline) -> None:
        _refuse_decode_policy(pipeline, self.registry_name)
        refuse_question_scoring(pipeline, self.registry_name)

    def run(self, loaded, pipeline, batch, options=DEFAULT_OPTIONS) -> ProtocolResult:
        return _context_run(loaded, pipeline, batch, options, group=True)


def _refuse_decode_policy(pipeline: Pipeline, protocol: str) -> None:
    """A decode policy that evicts (``h2o``) is seeded by the prefill's attention and tracks the
    decode region from the first decode step: the question block prefilled in between has no
    scores, so the combination is refused rather than run wrong."""
    policy = pipeline.decode_policy
    name = getattr(policy, "registry_name", "none")
    if name != "none":
        raise ConfigError(
            f"{WHERE} = {protocol} prefills the question after the context's compression, and the decode "
            f"policy model.compression.decode = {name} scores only the prompt's and the decoded tokens (the "
            "question's entries would enter it unscored). Use `model.compression.decode: {name: none}` "
            f"with {protocol}, or `model.protocol: query_aware` with {name}."
        )


def refuse_question_scoring(pipeline: Pipeline, protocol: str) -> None:
    """A pipeline scoring with the question (a progressive prefill with ``question: true``, Finch)
    compresses each context for its own question, which ``query_agnostic`` (no question at
    compression) and ``multi_question`` (one compression for several questions) do not have, nor
    ``decode_time`` (the question is part of the prompt it recompresses)."""
    if pipeline.prefill_mode.question:
        raise ConfigError(
            f"{WHERE} = {protocol}: model.compression.prefill.question = true scores the context with its "
            "question, which this protocol does not compress with (query_agnostic compresses the context "
            "before any question, multi_question once for several, decode_time the prompt and its output). "
            "Use `model.protocol: query_aware` (Finch's), or set model.compression.prefill.question to false."
        )
