"""Compression protocols: what part of a prompt is compressed, and when (``model.protocol``).

Every protocol runs the configured pipeline (``model.compression``) on the same tokens: the
prompt is tokenized once, as a whole (chat template, images, answer prefix), and split into its
context and its question part by :meth:`~kvlab.models.processors.ChatProcessor.context_token_count`.
They differ in what the compression sees and when it runs (docs/protocols.md):

- ``query_aware`` (default): the whole prompt, question included, in one prefill; compression
  inside it. What kvlab always did; favours window-attention methods (SnapKV), whose window
  then holds the question (the kvpress FAQ's warning).
- ``query_agnostic``: the context alone is prefilled and compressed; the question part
  (question, the template's assistant opening, the answer prefix) is then prefilled on top of
  the compressed cache, uncompressed (:func:`~kvlab.engine.generation.extend`), and decoding
  follows. kvpress' default.
- ``multi_question``: as ``query_agnostic``, but the samples of one ``context_id`` share one
  compressed context: it is compressed once, checkpointed, and each question is answered in
  turn from it (the cache restored between questions, never re-compressed).
- ``decode_time``: a ``query_aware`` prefill, then the pipeline also runs during generation:
  every ``interval`` fed tokens each layer is compressed again, prompt and generated entries
  alike, down to ``target_size`` tokens per head or ``ratio`` of the sample's prompt + generated
  tokens (kvpress' ``DecodingPress``; in :mod:`kvlab.engine.decode_time`). The ``h2o`` decode
  policy is the per-step alternative.

With a budget that keeps everything, every protocol gives the full cache's tokens (tested).

Shapes: B samples of the batch, C contexts (B, or fewer under ``multi_question``), T the padded
prompt, Tc the padded context, Q the padded question part, L layers, Hkv KV heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvlab.cache.selection import Selection
from kvlab.compression.decision import RouteDecision
from kvlab.config.errors import ConfigError
from kvlab.config.registry import Registry, to_plain
from kvlab.engine.generation import (
    GenerationResult,
    PrefillState,
    decode,
    extend,
    generation_result,
    prefill,
    stop_tokens,
    trim_at_stop,
)
from kvlab.models.base import PAD, LoadedModel
from kvlab.pipeline import LayerReport, Pipeline

WHERE = "model.protocol"
#: per-token model inputs a context batch slices like ``input_ids`` (Qwen2-VL's token types)
PER_TOKEN_INPUTS = ("mm_token_type_ids",)


@dataclass
class ProtocolResult:
    """What a protocol gives for one batch of B samples.

    Attributes:
        result: the :class:`GenerationResult` in the batch's own coordinates (rows = samples,
            kept positions in the padded prompt of ``batch``, ``prompt_lengths`` = whole prompts).
        extras: one dict per sample of protocol-specific fields for the predictions (e.g.
            ``question_tokens``, ``decode_compressions``).
    """

    result: GenerationResult
    extras: list[dict[str, Any]]


class Protocol:
    """Base class of the protocols (registered in :data:`PROTOCOLS`).

    ``groups_contexts``: the data module must put every sample of a ``context_id`` in one
    batch (``multi_question``).
    """

    registry_name: str = ""
    groups_contexts: ClassVar[bool] = False

    def check(self, pipeline: Pipeline) -> None:
        """Refuse a pipeline this protocol cannot run (:class:`ConfigError` naming both fields)."""
        return None

    def run(
        self,
        loaded: LoadedModel,
        pipeline: Pipeline,
        batch: dict[str, Any],
        max_new_tokens: int = 32,
        *,
        return_logits: bool = False,
        record_scores: bool = False,
        teacher_tokens: torch.Tensor | None = None,
        prefill_chunk: int | None = None,
    ) -> ProtocolResult:
        """Generate for ``batch`` (a processor's ``collate`` output).

        ``max_new_tokens`` is the limit of samples without their own ``max_new_tokens``;
        ``teacher_tokens [B, S]`` feed these tokens instead of greedy choices (exactly S steps).
        """
        raise NotImplementedError

    def node(self) -> dict[str, Any]:
        """The canonical YAML node, ``{name: ..., <every parameter>}`` (recorded in run.json)."""
        return {"name": self.registry_name, **dataclasses.asdict(self)}  # type: ignore[call-overload]


PROTOCOLS: Registry[Protocol] = Registry("protocol", WHERE)


def build_protocol(node: Any) -> Protocol:
    """A protocol from ``model.protocol``: a name (``query_agnostic``) or a node
    (``{name: decode_time, interval: 32, ratio: 0.5}``); None is ``query_aware``.

    Raises:
        ConfigError: an unknown protocol or parameter, or a bad value, naming ``model.protocol.<field>``.
    """
    node = to_plain(node)
    if isinstance(node, Protocol):
        return node
    return PROTOCOLS.build("query_aware" if node is None else node, WHERE)


def protocol_node(node: Any) -> dict[str, Any]:
    """The canonical node of ``model.protocol`` (defaults filled in), as the run's fingerprint records it."""
    return build_protocol(node).node()


def sample_limits(batch: dict[str, Any], default: int) -> torch.Tensor:
    """``[B]`` long: each sample's ``max_new_tokens`` (``default`` where it has none)."""
    samples = batch.get("samples") or []
    if not samples:
        return torch.full((batch["input_ids"].shape[0],), default, dtype=torch.long)
    return torch.tensor([s.max_new_tokens or default for s in samples], dtype=torch.long)


def cut_at_limits(
    tokens: list[list[int]], limits: torch.Tensor, teacher: torch.Tensor | None
) -> list[list[int]]:
    """Each sample's tokens cut at its own limit (greedy runs; a teacher-forced run keeps its rows)."""
    return tokens if teacher is not None else [row[: int(n)] for row, n in zip(tokens, limits, strict=True)]


# ---- query_aware -----------------------------------------------------------------------------
@PROTOCOLS.register("query_aware")
@dataclass
class QueryAware(Protocol):
    """The whole prompt, question included, in one prefill with compression inside (kvlab's default)."""

    def run(self, loaded, pipeline, batch, max_new_tokens=32, *, return_logits=False, record_scores=False,
            teacher_tokens=None, prefill_chunk=None) -> ProtocolResult:  # fmt: skip
        limits = sample_limits(batch, max_new_tokens)
        steps = int(limits.max())
        state = prefill(
            loaded, pipeline, batch, steps, record_scores=record_scores, prefill_chunk=prefill_chunk
        )
        uniform = bool((limits == steps).all())
        decoded = decode(state, steps, return_logits, teacher_tokens, limits=None if uniform else limits)
        result = generation_result(state, decoded)
        result.tokens = cut_at_limits(result.tokens, limits, teacher_tokens)
        return ProtocolResult(result, [{} for _ in result.tokens])


# ---- query_agnostic and multi_question: the context compressed alone ---------------------------
@dataclass
class PromptSplit:
    """A batch split into its contexts and its question parts (see :func:`split_prompts`).

    Attributes:
        context: a ``collate``-layout batch of the C distinct contexts, left padded ``[C, Tc]``.
        rows: ``[B]`` long, the context row of each sample.
        questions: per sample, the token ids of its question part (possibly empty).
        shift: ``[B]`` long, a context position's offset to the same token in ``batch``'s padded
            prompt (``batch`` position = context position + shift).
        groups: the samples of each context, in batch order (``groups[c]`` lists sample indices).
        lengths: ``[B]`` long, each sample's whole prompt length.
        width: ``T``, the batch's padded prompt length.
    """

    context: dict[str, Any]
    rows: torch.Tensor
    questions: list[list[int]]
    shift: torch.Tensor
    groups: list[list[int]]
    lengths: torch.Tensor
    width: int


def split_prompts(processor: Any, batch: dict[str, Any], group: bool) -> PromptSplit:
    """Split each sample of ``batch`` into context and question part; ``group``: one context per
    ``context_id`` (samples without one keep their own).

    Raises:
        ConfigError: a batch without samples (token-id prompts), a processor that cannot split,
            or samples of one ``context_id`` whose contexts differ.
    """
    samples = batch.get("samples") or []
    if not samples or not hasattr(processor, "context_token_count"):
        raise ConfigError(
            f"{WHERE}: query_agnostic and multi_question need prompts kvlab can split into context and "
            "question (samples, string prompts or one-turn chats, through kvlab's processor); token-id "
            "prompts and multi-turn chats run only with `model.protocol: query_aware`."
        )
    ids, valid = batch["input_ids"], batch["attention_mask"].bool()
    T = ids.shape[1]
    lengths = valid.sum(1)
    rows_ids = [ids[b, T - int(n) :].tolist() for b, n in enumerate(lengths)]
    # at least one context token per sample: a prefill needs a token to attend to
    counts = [max(1, processor.context_token_count(s, row)) for s, row in zip(samples, rows_ids, strict=True)]
    keyed: dict[Any, list[int]] = {}
    for b, sample in enumerate(samples):
        key = sample.context_id if group and sample.context_id is not None else ("sample", b)
        keyed.setdefault(key, []).append(b)
    groups = list(keyed.values())
    for members in groups:
        first = members[0]
        for b in members[1:]:
            if rows_ids[b][: counts[b]] != rows_ids[first][: counts[first]]:
                raise ConfigError(
                    f"samples '{samples[first].id}' and '{samples[b].id}' share context_id "
                    f"'{samples[b].context_id}' but not the same context (text before the question, system "
                    "message, images), so multi_question cannot answer both from one compressed context. "
                    "Give them different context ids, or make their prompts start with the same context."
                )
    rows = torch.empty(len(samples), dtype=torch.long)
    for c, members in enumerate(groups):
        rows[members] = c
    reps = [members[0] for members in groups]
    source = batch if len(reps) == len(samples) else processor.collate([samples[r] for r in reps])
    context_counts = torch.tensor([counts[r] for r in reps], dtype=torch.long)
    context = _context_batch(source, context_counts)
    Tc = context["input_ids"].shape[1]
    shift = (T - lengths) - (Tc - context_counts[rows])
    questions = [row[count:] for row, count in zip(rows_ids, counts, strict=True)]
    return PromptSplit(context, rows, questions, shift, groups, lengths, T)


def _context_batch(source: dict[str, Any], counts: torch.Tensor) -> dict[str, Any]:
    """The first ``counts[r]`` valid tokens of each row of ``source`` as a left-padded batch ``[C, Tc]``."""
    ids, valid = source["input_ids"], source["attention_mask"].bool()
    C, Ts = ids.shape
    Tc = int(counts.max()) if counts.numel() else 0
    lengths = valid.sum(1)
    j = torch.arange(Tc)[None, :]
    pad = Tc - counts[:, None]  # [C, 1]
    keep = j >= pad
    index = ((Ts - lengths)[:, None] + j - pad).clamp(0, max(Ts - 1, 0))

    def take(values: torch.Tensor, fill: int) -> torch.Tensor:
        return values.gather(1, index.to(values.device)).masked_fill(~keep.to(values.device), fill)

    inputs = dict(source.get("model_inputs", {}))
    for name in PER_TOKEN_INPUTS:
        if torch.is_tensor(inputs.get(name)) and inputs[name].shape == ids.shape:
            inputs[name] = take(inputs[name], 0)
    return {
        **source,
        "input_ids": take(ids, 0),  # any id on padding: masked
        "attention_mask": keep.long(),
        "modality": take(source["modality"], PAD),
        "model_inputs": inputs,
    }


def _question_block(questions: list[list[int] | None], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(ids [R, Q], valid [R, Q])`` of question parts (None: a row with no question)."""
    rows = [q or [] for q in questions]
    width = max([len(q) for q in rows] + [0])
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, q in enumerate(rows):
        if q:
            ids[r, width - len(q) :] = torch.tensor(q, dtype=torch.long)
            valid[r, width - len(q) :] = True
    return ids, valid


def _take_columns(scores: torch.Tensor | None, shift: torch.Tensor, width: int) -> torch.Tensor | None:
    """``scores [B, Hkv, Tc]`` placed at the batch's positions, ``[B, Hkv, width]`` (-inf elsewhere)."""
    if scores is None:
        return None
    B, Hkv, Tc = scores.shape
    target = torch.arange(Tc, device=scores.device)[None, :] + shift.to(scores.device)[:, None]
    target = torch.where((target >= 0) & (target < width), target, width)  # outside: a spare column
    out = scores.new_full((B, Hkv, width + 1), float("-inf"))
    out.scatter_(2, target[:, None, :].expand(-1, Hkv, -1), scores)
    return out[..., :width]


def _report_rows(report: LayerReport, rows: torch.Tensor, shift: torch.Tensor, width: int) -> LayerReport:
    """A context batch's layer report as the samples' report: row ``b`` from context ``rows[b]``,
    positions moved by ``shift[b]`` into the batch's padded prompt of ``width`` tokens."""

    def take(value: torch.Tensor | None) -> torch.Tensor | None:
        return None if value is None else value[rows.to(value.device)]

    selection = report.selection
    if selection is not None:
        counts = take(selection.counts)
        indices = take(selection.indices)
        real = torch.arange(indices.shape[-1], device=indices.device) < counts[..., None]
        moved = indices + shift.to(indices.device)[:, None, None]
        selection = Selection(
            torch.where(real, moved, 0), counts, take(selection.keys), take(selection.values)
        )
    route = report.route
    if route is not None:
        branches = [route.branches[int(c)] for c in rows]
        route = RouteDecision(branches, take(route.switched), take(route.metric))
    scorer_scores = report.scorer_scores
    if scorer_scores is not None:
        scorer_scores = {k: _take_columns(take(v), shift, width) for k, v in scorer_scores.items()}
    return dataclasses.replace(
        report,
        kept=take(report.kept),
        budget=take(report.budget),
        selection=selection,
        scores=_take_columns(take(report.scores), shift, width),
        route=route,
        scorer_scores=scorer_scores,
        overshoot=take(report.overshoot),
    )


def _context_run(
    loaded: LoadedModel,
    pipeline: Pipeline,
    batch: dict[str, Any],
    max_new_tokens: int,
    group: bool,
    return_logits: bool,
    record_scores: bool,
    teacher_tokens: torch.Tensor | None,
    prefill_chunk: int | None,
) -> ProtocolResult:
    """``query_agnostic`` (``group`` False: one context per sample) and ``multi_question``: prefill and
    compress the contexts once, then answer round r's question of every context from the
    checkpointed cache (restored between rounds), each question prefilled uncompressed."""
    split = split_prompts(loaded.processor, batch, group)
    B = len(split.questions)
    limits = sample_limits(batch, max_new_tokens)
    longest = max([len(q) for q in split.questions] + [0])
    state = prefill(
        loaded,
        pipeline,
        split.context,
        decode_capacity=longest + int(limits.max()),
        record_scores=record_scores,
        prefill_chunk=prefill_chunk,
    )
    session = state.session
    kept = state.cache.kept_tokens()  # [L, C, Hkv] before any question
    rounds = max(len(members) for members in split.groups)
    checkpoint = session.run.checkpoint() if rounds > 1 else None  # the cache and the components' state
    tokens: list[list[int]] = [[] for _ in range(B)]
    logits: list[torch.Tensor | None] = [None] * B
    seconds = {"extend": 0.0, "decode": 0.0}
    pad_id = getattr(loaded.processor, "pad_token_id", 0) or 0
    for r in range(rounds):
        members = [g[r] if r < len(g) else None for g in split.groups]  # one sample (or none) per context
        if r > 0:
            session.run.restore(checkpoint)
        ids, valid = _question_block([split.questions[m] if m is not None else None for m in members], pad_id)
        asked = extend(state, ids, valid)
        seconds["extend"] += asked.seconds - state.seconds
        round_limits = torch.tensor([int(limits[m]) if m is not None else 1 for m in members])
        teacher = None
        if teacher_tokens is not None:
            index = torch.tensor([m if m is not None else 0 for m in members])
            teacher = teacher_tokens[index]
        decoded = decode(asked, int(round_limits.max()), return_logits, teacher, limits=round_limits)
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
    return ProtocolResult(result, extras)


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
    per_token = info.head_dim * 2 * cache.layers[0].prompt_keys.element_size()  # one head, one layer
    whole = info.num_kv_heads * info.num_layers * per_token
    questions = torch.tensor([len(q) for q in split.questions], dtype=torch.long)
    sample_kept = kept[:, rows.to(kept.device)].cpu()  # [L, B, Hkv]
    step_logits = None
    if logits and logits[0] is not None:
        steps = max(t.shape[0] for t in logits if t is not None)
        step_logits = torch.zeros(len(logits), steps, logits[0].shape[-1])
        for b, t in enumerate(logits):
            step_logits[b, : t.shape[0]] = t
    reports = [_report_rows(report, rows, split.shift, split.width) for report in session.reports]
    return GenerationResult(
        tokens=[trim_at_stop(row, stops) for row in tokens],
        kept=sample_kept,
        prompt_lengths=split.lengths.cpu(),
        kv_bytes_full=(split.lengths.cpu() * whole),
        kv_bytes_kept=sample_kept.sum(dim=(0, 2)) * per_token + questions * whole,
        kv_bytes_allocated=cache.kv_bytes(),
        prefill_seconds=state.seconds - session.compression_seconds + seconds["extend"],
        compression_seconds=session.compression_seconds,
        decode_seconds=seconds["decode"],
        step_logits=step_logits,
        reports=reports,
    )


@PROTOCOLS.register("query_agnostic")
@dataclass
class QueryAgnostic(Protocol):
    """The context compressed alone, then the question part prefilled uncompressed (kvpress' default)."""

    def check(self, pipeline: Pipeline) -> None:
        _refuse_decode_policy(pipeline, self.registry_name)

    def run(self, loaded, pipeline, batch, max_new_tokens=32, *, return_logits=False, record_scores=False,
            teacher_tokens=None, prefill_chunk=None) -> ProtocolResult:  # fmt: skip
        return _context_run(loaded, pipeline, batch, max_new_tokens, False, return_logits, record_scores,
                            teacher_tokens, prefill_chunk)  # fmt: skip


@PROTOCOLS.register("multi_question")
@dataclass
class MultiQuestion(Protocol):
    """One compressed context per ``context_id`` answers each of its questions in turn (compressed once)."""

    groups_contexts: ClassVar[bool] = True

    def check(self, pipeline: Pipeline) -> None:
        _refuse_decode_policy(pipeline, self.registry_name)

    def run(self, loaded, pipeline, batch, max_new_tokens=32, *, return_logits=False, record_scores=False,
            teacher_tokens=None, prefill_chunk=None) -> ProtocolResult:  # fmt: skip
        return _context_run(loaded, pipeline, batch, max_new_tokens, True, return_logits, record_scores,
                            teacher_tokens, prefill_chunk)  # fmt: skip


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


from kvlab.engine import decode_time as _decode_time  # noqa: E402, F401  (registers decode_time)
