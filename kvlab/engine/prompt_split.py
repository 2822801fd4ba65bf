"""A batch split into its contexts and its question parts (the context protocols' bookkeeping).

``query_agnostic`` and ``multi_question`` (:mod:`kvlab.engine.context_protocols`) prefill and
compress each context alone, then put its question on top: :func:`split_prompts` finds the split
in each sample's tokens, :func:`question_block` pads the questions into one block, and
:func:`report_rows` maps a context batch's layer reports back to the samples' padded prompts.
Shapes: B samples, C contexts, T the padded prompt, Tc the padded context, Hkv KV heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvlab.cache.selection import Selection
from kvlab.compression.decision import RouteDecision
from kvlab.config.errors import ConfigError
from kvlab.data.sample import require_questions
from kvlab.engine.protocols import WHERE
from kvlab.models.base import PAD, Batch, PromptProcessor
from kvlab.pipeline import LayerReport

#: per-token model inputs a context batch slices like ``input_ids`` (Qwen2-VL's token types)
PER_TOKEN_INPUTS = ("mm_token_type_ids",)


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


def split_prompts(processor: Any, batch: Batch, group: bool) -> PromptSplit:
    """Split each sample of ``batch`` into context and question part; ``group``: one context per
    ``context_id`` (samples without one keep their own).

    Raises:
        ConfigError: a batch without samples (token-id prompts), a processor that cannot split,
            or samples of one ``context_id`` whose contexts differ.
    """
    samples = batch.samples
    if not samples or not isinstance(processor, PromptProcessor):
        raise ConfigError(
            f"{WHERE}: query_agnostic and multi_question need prompts kvlab can split into context and "
            "question (samples, string prompts or one-turn chats, through kvlab's processor); token-id "
            "prompts and multi-turn chats run only with `model.protocol: query_aware`."
        )
    require_questions(samples, WHERE)
    ids, valid = batch.input_ids, batch.attention_mask.bool()
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
    rows = torch.empty(len(samples), dtype=torch.long, device="cpu")
    for c, members in enumerate(groups):
        rows[members] = c
    reps = [members[0] for members in groups]
    source = batch if len(reps) == len(samples) else processor.collate([samples[r] for r in reps])
    context_counts = torch.tensor([counts[r] for r in reps], dtype=torch.long, device="cpu")
    context = context_batch(source, context_counts)
    Tc = context.input_ids.shape[1]
    shift = (T - lengths) - (Tc - context_counts[rows])
    questions = [row[count:] for row, count in zip(rows_ids, counts, strict=True)]
    return PromptSplit(context, rows, questions, shift, groups, lengths, T)


def context_batch(source: Batch, counts: torch.Tensor) -> Batch:
    """The first ``counts[r]`` valid tokens of each row of ``source`` as a left-padded batch ``[C, Tc]``."""
    ids, valid = source.input_ids, source.attention_mask.bool()
    C, Ts = ids.shape
    Tc = int(counts.max()) if counts.numel() else 0
    lengths = valid.sum(1)
    j = torch.arange(Tc, device="cpu")[None, :]
    pad = Tc - counts[:, None]  # [C, 1]
    keep = j >= pad
    index = ((Ts - lengths)[:, None] + j - pad).clamp(0, max(Ts - 1, 0))

    def take(values: torch.Tensor, fill: int) -> torch.Tensor:
        return values.gather(1, index.to(values.device)).masked_fill(~keep.to(values.device), fill)

    inputs = dict(source.model_inputs)
    for name in PER_TOKEN_INPUTS:
        if torch.is_tensor(inputs.get(name)) and inputs[name].shape == ids.shape:
            inputs[name] = take(inputs[name], 0)
    # any id on padding: masked
    return replace(source, input_ids=take(ids, 0), attention_mask=keep.long(),
                   modality=take(source.modality, PAD), model_inputs=inputs)  # fmt: skip


def question_block(questions: list[list[int] | None], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(ids [R, Q], valid [R, Q])`` of question parts (None: a row with no question)."""
    rows = [q or [] for q in questions]
    width = max([len(q) for q in rows] + [0])
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device="cpu")
    valid = torch.zeros(len(rows), width, dtype=torch.bool, device="cpu")
    for r, q in enumerate(rows):
        if q:
            ids[r, width - len(q) :] = torch.tensor(q, dtype=torch.long, device="cpu")
            valid[r, width - len(q) :] = True
    return ids, valid


def take_columns(scores: torch.Tensor | None, shift: torch.Tensor, width: int) -> torch.Tensor | None:
    """``scores [B, Hkv, Tc]`` placed at the batch's positions, ``[B, Hkv, width]`` (-inf elsewhere)."""
    if scores is None:
        return None
    B, Hkv, Tc = scores.shape
    target = torch.arange(Tc, device=scores.device)[None, :] + shift.to(scores.device)[:, None]
    target = torch.where((target >= 0) & (target < width), target, width)  # outside: a spare column
    out = scores.new_full((B, Hkv, width + 1), float("-inf"))
    out.scatter_(2, target[:, None, :].expand(-1, Hkv, -1), scores)
    return out[..., :width]


def report_rows(report: LayerReport, rows: torch.Tensor, shift: torch.Tensor, width: int) -> LayerReport:
    """A context batch's layer report as the samples' report: row ``b`` from context ``rows[b]``,
    positions moved by ``shift[b]`` into the batch's padded prompt of ``width`` tokens; a store of
    offloaded K/V (retrieval) reports each sample's context's figures."""

    def take(value: torch.Tensor | None) -> torch.Tensor | None:
        return None if value is None else value[rows.to(value.device)]

    selection = report.selection
    if selection is not None:
        counts = take(selection.counts)
        indices = take(selection.indices)
        real = torch.arange(indices.shape[-1], device=indices.device) < counts[..., None]
        moved = indices + shift.to(indices.device)[:, None, None]
        offloaded = selection.offloaded.for_samples(rows) if selection.offloaded is not None else None
        selection = Selection(
            torch.where(real, moved, 0), counts, take(selection.keys), take(selection.values), offloaded
        )
    route = report.route
    if route is not None:
        branches = [route.branches[int(c)] for c in rows]
        route = RouteDecision(branches, take(route.switched), take(route.metric))
    scorer_scores = report.scorer_scores
    if scorer_scores is not None:
        scorer_scores = {k: take_columns(take(v), shift, width) for k, v in scorer_scores.items()}
    return dataclasses.replace(
        report,
        kept=take(report.kept),
        budget=take(report.budget),
        selection=selection,
        scores=take_columns(take(report.scores), shift, width),
        route=route,
        scorer_scores=scorer_scores,
        overshoot=take(report.overshoot),
    )
