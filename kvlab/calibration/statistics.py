"""Calibration statistics: what ``kvlab calibrate`` measures per (layer, head) over a calibration set.

A statistic sees every layer's :class:`~kvlab.compression.context.LayerContext` during prefill
(the full cache is kept; nothing is compressed) through :class:`Recorder`, and returns named
tensors for the artefact. Registered statistics:

- ``visual_heads`` (SparseMM): how often each query head's strongest attention, from the
  tokens of the reference answer, lands on the image tokens of the region the answer is about.
- ``redundancy`` (MixKV offline r̄): each KV head's key redundancy, averaged over samples.

PrefixKV/HybridKV statistics register here the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvlab.compression.context import LayerContext, attention_probs
from kvlab.compression.mixers import head_redundancy
from kvlab.config.registry import Registry


@dataclass
class CalibrationBatch:
    """What a statistic may know about the batch beyond the layer context.

    Attributes:
        answer_tokens: ``[B]`` how many trailing tokens of each sample are the teacher-forced
            reference answer (0 when the statistic does not need answers).
        targets: ``[B, T]`` bool, the prompt tokens the answer is about (e.g. the image tokens
            of the asked region), or None.
    """

    answer_tokens: torch.Tensor
    targets: torch.Tensor | None = None


class CalibrationStatistic:
    """Base class: accumulate with :meth:`observe`, return the artefact tensors from :meth:`result`."""

    registry_name: str = ""
    needs_answers: bool = False
    needs_targets: bool = False
    #: text needle-in-a-haystack statistics: the targets are the prompt tokens of the needle, the
    #: sentence that holds the reference answer (:func:`needle_targets`); implies ``needs_answers``
    needs_needle: bool = False

    def start(self, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
        """Reset the accumulators for a model of this shape."""
        raise NotImplementedError

    def observe(self, ctx: LayerContext, batch: CalibrationBatch) -> None:
        """Add one layer of one batch."""
        raise NotImplementedError

    def result(self) -> dict[str, torch.Tensor]:
        """The artefact tensors (documented per statistic)."""
        raise NotImplementedError


CALIBRATIONS: Registry[CalibrationStatistic] = Registry("calibration statistic", "calibration")


@CALIBRATIONS.register("visual_heads")
@dataclass
class VisualHeadScores(CalibrationStatistic):
    """SparseMM visual-head scores, ``scores [L, H]`` fp32 (mean over samples).

    For every reference-answer token t of a sample and every (layer, query head): if the key
    with the highest attention from t (causal, over the whole prompt) is one of the sample's
    target tokens R (the image tokens of the region the answer is about), add ``1 / |R|``
    (SparseMM's "hit" rule, Wang et al. 2025). A sample's score is its sum over answer
    tokens; the artefact holds the mean over samples.

    Deviation, documented in docs/calibration.md: SparseMM decodes OCR text greedily and
    matches generated tokens to OCR boxes; kvlab teacher-forces the reference answer of a
    grounded question (the answer depends on one image region), so calibration does not need a
    model that can already read.
    """

    needs_answers = True
    needs_targets = True

    def start(self, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
        self._sum = torch.zeros(num_layers, num_heads, dtype=torch.float64)
        self._samples = 0

    def observe(self, ctx: LayerContext, batch: CalibrationBatch) -> None:
        T = ctx.seq_len
        n = int(batch.answer_tokens.max())
        if n == 0 or batch.targets is None:
            return
        queries = ctx.last_queries(n, "the retrieval-head statistics")  # [B, H, n, D]
        probs = attention_probs(queries, ctx, first_query=T - n)  # [B, H, n, T]
        top = probs.argmax(-1)  # [B, H, n]
        for b in range(ctx.batch_size):
            region = batch.targets[b].to(top.device)
            size = int(region.sum())
            answer = int(batch.answer_tokens[b])
            if size == 0 or answer == 0:
                continue
            hits = region[top[b, :, n - answer :]].double().sum(-1)  # [H]
            self._sum[ctx.layer_idx] += hits.cpu() / size
        if ctx.layer_idx == 0:
            self._samples += int((batch.answer_tokens > 0).sum())

    def result(self) -> dict[str, torch.Tensor]:
        return {"scores": (self._sum / max(self._samples, 1)).float()}


@CALIBRATIONS.register("redundancy")
@dataclass
class KeyRedundancy(CalibrationStatistic):
    """MixKV's offline head redundancy ``[L, Hkv]`` fp32: r̄ (MixKV Eq. 4) averaged over samples."""

    def start(self, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
        self._sum = torch.zeros(num_layers, num_kv_heads, dtype=torch.float64)
        self._samples = torch.zeros(num_layers, dtype=torch.long)

    def observe(self, ctx: LayerContext, batch: CalibrationBatch) -> None:
        self._sum[ctx.layer_idx] += head_redundancy(ctx).double().sum(0).cpu()
        self._samples[ctx.layer_idx] += ctx.batch_size

    def result(self) -> dict[str, torch.Tensor]:
        return {"redundancy": (self._sum / self._samples.clamp(min=1)[:, None]).float()}


class Recorder:
    """A stand-in for a :class:`~kvlab.pipeline.spec.Pipeline` that keeps the full cache
    and shows every prefill layer to a statistic. Everything else is the full pipeline's."""

    def __init__(self, statistic: CalibrationStatistic, full_pipeline: Any):
        self.statistic = statistic
        self.full = full_pipeline
        self.batch: CalibrationBatch | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.full, name)

    def compress(self, ctx: LayerContext, record_scores: bool = False):
        assert self.batch is not None, "set Recorder.batch before running a batch"
        self.statistic.observe(ctx, self.batch)
        return self.full.compress(ctx, record_scores)


def needle_sentence(prompt: str, answer: str) -> str:
    """The sentence of ``prompt`` that holds ``answer`` (its first occurrence): from the character
    after the previous sentence end (``.``, ``!``, ``?`` or a line break) through the next ``.``,
    ``!`` or ``?``. ``synthetic_retrieval``'s needle "The secret code for <key> is <value>.".

    Raises:
        ValueError: ``answer`` does not occur in ``prompt`` (the sample is not a needle task).
    """
    at = prompt.find(answer)
    if at < 0:
        raise ValueError(
            f"the reference answer {answer!r} does not occur in the prompt: the needle statistics need a "
            "needle-in-a-haystack task whose answer is copied from the context (e.g. synthetic_retrieval)."
        )
    start = max(prompt.rfind(mark, 0, at) for mark in ".!?\n") + 1
    ends = [e for e in (prompt.find(mark, at + len(answer)) for mark in ".!?") if e >= 0]
    end = min(ends) + 1 if ends else len(prompt)
    return prompt[start:end].strip()


def needle_targets(prompt_ids: torch.Tensor, needle_ids: list[int]) -> torch.Tensor:
    """``[T]`` bool: the ``len(needle_ids)`` prompt tokens where the needle sits, found as HeadKV's
    retrieval-head detection finds it (Fu et al. 2024, ``find_needle_idx``): the window of that
    length whose set of token ids overlaps the needle's most (the last such window on a tie), so
    a needle tokenised differently inside the prompt (a leading space) is still found."""
    ids = prompt_ids.tolist()
    span, wanted = len(needle_ids), set(needle_ids)
    best, start = -1.0, 0
    for i in range(max(len(ids) - span + 1, 1)):
        overlap = len(set(ids[i : i + span]) & wanted) / len(wanted)
        if overlap >= best:
            best, start = overlap, i
    targets = torch.zeros(len(ids), dtype=torch.bool)
    targets[start : start + span] = True
    return targets


def region_targets(modality: torch.Tensor, meta: dict[str, Any], tokens_per_image: int) -> torch.Tensor:
    """``[T]`` bool: the image tokens of the region a ``synthetic_image_qa`` question asks about.

    ``meta`` names the ``image_index`` and the ``region`` (``top left`` ... ``bottom right``);
    image tokens are laid out row-major on a square grid of ``tokens_per_image`` cells
    (LLaVA patches, Qwen2-VL merged patches), so the region is one quadrant of that grid.
    A ``smollm2-reader`` task's ``meta["answer_cells"]`` (``[image, cell]`` pairs) names the
    image tokens that show the answer instead.
    """
    if "answer_cells" in meta:
        image_positions = torch.nonzero(modality == 1).flatten()
        cells = meta["answer_cells"]
        images = len(meta.get("image_cells", ())) or image_positions.numel() // tokens_per_image
        if image_positions.numel() != images * tokens_per_image or any(
            not (0 <= i < images and 0 <= c < tokens_per_image) for i, c in cells
        ):
            raise ValueError(
                f"answer_cells name cells of {tokens_per_image}-token images, but the prompt has "
                f"{image_positions.numel()} image tokens for {images} images: the reader tasks' answer cells "
                "fit smollm2-reader only (16 tokens per image); calibrate another model on other data."
            )
        targets = torch.zeros_like(modality, dtype=torch.bool)
        targets[image_positions[[i * tokens_per_image + c for i, c in cells]]] = True
        return targets
    side = math.isqrt(tokens_per_image)
    if side * side != tokens_per_image:
        raise ValueError(f"region targets need a square token grid, got {tokens_per_image} tokens per image")
    image_positions = torch.nonzero(modality == 1).flatten()
    first = int(meta.get("image_index", 0)) * tokens_per_image
    positions = image_positions[first : first + tokens_per_image]
    rows = torch.arange(tokens_per_image) // side
    cols = torch.arange(tokens_per_image) % side
    region = str(meta["region"])
    in_rows = rows >= side / 2 if region.startswith("bottom") else rows < side / 2
    in_cols = cols >= side / 2 if region.endswith("right") else cols < side / 2
    targets = torch.zeros_like(modality, dtype=torch.bool)
    targets[positions[(in_rows & in_cols)[: len(positions)]]] = True
    return targets
