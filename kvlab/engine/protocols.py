"""Compression protocols: what part of a prompt is compressed, and when (``model.protocol``).

Every protocol runs the configured pipeline (``model.compression``) on the same tokens: the
prompt is tokenized once, as a whole (chat template, images, answer prefix), and split into its
context and its question part by :meth:`~kvlab.models.processors.ChatProcessor.context_token_count`.
They differ in what the compression sees and when it runs (docs/protocols.md):

- ``query_aware`` (default): the whole prompt, question included, in one prefill; compression
  inside it. What kvlab always did; favours window-attention methods (SnapKV), whose window
  then holds the question (the kvpress FAQ's warning).
- ``query_agnostic`` (:mod:`kvlab.engine.context_protocols`): the context alone is prefilled
  and compressed; the question part
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
This module holds the protocols' base and their registry (importing :mod:`kvlab.engine` registers
every built-in protocol); ``query_aware`` is in :mod:`kvlab.engine.context_protocols`, whose
context run it shares when the pipeline scores with the question (a progressive prefill with
``question: true``, Finch).

Shapes: B samples of the batch, C contexts (B, or fewer under ``multi_question``), T the padded
prompt, Tc the padded context, Q the padded question part, L layers, Hkv KV heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvlab.config.registry import Registry, to_plain
from kvlab.engine.decode_positions import DecodePositions
from kvlab.engine.generation import DEFAULT_OPTIONS, GenerationResult, RunOptions
from kvlab.models.base import Batch, LoadedModel
from kvlab.pipeline import Pipeline

WHERE = "model.protocol"


@dataclass
class ProtocolResult:
    """What a protocol gives for one batch of B samples.

    Attributes:
        result: the :class:`GenerationResult` in the batch's own coordinates (rows = samples,
            kept positions in the padded prompt of ``batch``, ``prompt_lengths`` = whole prompts).
        extras: one dict per sample of protocol-specific fields for the predictions (e.g.
            ``question_tokens``, ``decode_compressions``).
        context_tokens: ``[B]`` long, each sample's context: the first tokens of its prompt, which
            the prefill compressed alone (``query_agnostic``, ``multi_question``); the rest of the
            prompt, its question part, was prefilled on top, uncompressed. None: the prefill
            compressed the whole prompt.
        context_groups: ``multi_question``: the samples that shared one compressed context (the
            indices of each context's samples, in batch order); None otherwise.
        decode_positions: a run with ``record_positions`` whose cache changed during generation
            (``decode_time``'s compressions, or a decode policy that evicts): per sample, the
            positions each decode-time compression removed and those held at its last token
            (:class:`~kvlab.engine.decode_positions.DecodePositions`); None otherwise.
    """

    result: GenerationResult
    extras: list[dict[str, Any]]
    context_tokens: torch.Tensor | None = None
    context_groups: list[list[int]] | None = None
    decode_positions: list[DecodePositions] | None = None


class Protocol:
    """Base class of the protocols (registered in :data:`PROTOCOLS`).

    ``groups_contexts``: the data module must put every sample of a ``context_id`` in one
    batch (``multi_question``). ``splits_prompts``: the protocol compresses each context apart from
    its question (``query_agnostic``, ``multi_question``), so every sample must mark its question.
    """

    registry_name: str = ""
    groups_contexts: ClassVar[bool] = False
    splits_prompts: ClassVar[bool] = False

    def check(self, pipeline: Pipeline) -> None:
        """Refuse a pipeline this protocol cannot run (:class:`ConfigError` naming both fields)."""
        return None

    def run(
        self,
        loaded: LoadedModel,
        pipeline: Pipeline,
        batch: Batch,
        options: RunOptions = DEFAULT_OPTIONS,
    ) -> ProtocolResult:
        """Generate for ``batch`` (a processor's ``collate`` output) as ``options`` say
        (:class:`~kvlab.engine.generation.RunOptions`: the decode limit, logits, scores, teacher
        tokens ``[B, S]``, the prefill's chunks, kept positions after the prefill)."""
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


def sample_limits(batch: Batch, default: int) -> torch.Tensor:
    """``[B]`` long: each sample's ``max_new_tokens`` (``default`` where it has none)."""
    samples = batch.samples
    if not samples:
        return torch.full((batch.input_ids.shape[0],), default, dtype=torch.long, device="cpu")
    return torch.tensor([s.max_new_tokens or default for s in samples], dtype=torch.long, device="cpu")


def cut_at_limits(
    tokens: list[list[int]], limits: torch.Tensor, teacher: torch.Tensor | None
) -> list[list[int]]:
    """Each sample's tokens cut at its own limit (greedy runs; a teacher-forced run keeps its rows)."""
    return tokens if teacher is not None else [row[: int(n)] for row, n in zip(tokens, limits, strict=True)]
