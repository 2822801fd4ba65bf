"""Head statistics on needle-in-a-haystack prompts: which heads read the needle while the answer
is copied out of it (``needs_needle``: the reference answer teacher-forced after the prompt, the
needle's prompt tokens as targets; :func:`~kvlab.calibration.statistics.needle_targets`).

- ``duo_attention_heads``: DuoAttention's retrieval-head scores (Xiao et al. 2024), estimated
  without the paper's gate optimisation: each query head's attention mass from the answer tokens
  on the needle (``docs/calibration.md`` says what this replaces and what it costs).
- ``retrieval_reasoning_heads``: HeadKV's retrieval-reasoning scores (Fu et al. 2024):
  the attention each answer token pays the needle among its ``k`` strongest keys (``k`` the
  needle's length), as the authors' ``retrieval_head_detection_r2.py`` computes it.

The consumers are the head allocators of :mod:`kvlab.compression.duo_attention` and
:mod:`kvlab.compression.headkv`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.calibration.reading import ImageAttention
from kvlab.calibration.statistics import CALIBRATIONS, CalibrationBatch, CalibrationStatistic
from kvlab.compression.context import LayerContext, attention_probs


@CALIBRATIONS.register("duo_attention_heads")
@dataclass
class NeedleAttention(ImageAttention):
    """``scores [L, H]`` fp32: for every teacher-forced answer token and query head, the attention
    mass on the needle's prompt tokens, mean over the answer's tokens, then over samples (the
    ``target`` mass of :class:`~kvlab.calibration.reading.ImageAttention`, with the needle as the
    target). A streaming head (sinks and recent tokens only) cannot put mass there; a head that
    copies the answer out of the needle puts most of its mass there."""

    needs_targets = False
    needs_needle = True

    def result(self) -> dict[str, torch.Tensor]:
        return {"scores": super().result()["target"]}


@CALIBRATIONS.register("retrieval_reasoning_heads")
@dataclass
class RetrievalReasoningScores(CalibrationStatistic):
    """HeadKV's retrieval-reasoning head scores ``scores [L, H]`` fp32 (Fu et al. 2024).

    Wu et al.'s retrieval score credits a head when its single strongest key, while the model
    copies an answer token, is that token in the needle. HeadKV's score (the R2 score of the
    authors' ``retrieval_head_detection_r2.py``) widens it for answers that need reasoning over
    the needle: for every answer token ``t`` (teacher-forced here), the needle's ``k`` tokens
    ``R`` (``k = |R|``), and each query head, with ``a_t`` the head's attention from ``t``::

        score += sum_{i in topk(a_t, k), i in R} 10 a_t[i] / (k n)      (n: the answer's tokens)

    summed over the answer's tokens; the artefact holds the mean over samples (the authors
    average each head's scores over their needle tests). The needle is the prompt's sentence
    holding the answer (``needs_needle``; docs/calibration.md).
    """

    needs_needle = True

    def start(self, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
        self._sum = torch.zeros(num_layers, num_heads, dtype=torch.float64)
        self._samples = 0

    def observe(self, ctx: LayerContext, batch: CalibrationBatch) -> None:
        T, n = ctx.seq_len, int(batch.answer_tokens.max())
        if n == 0 or batch.targets is None:
            return
        who = "the retrieval-reasoning statistic"
        probs = attention_probs(ctx.last_queries(n, who), ctx, first_query=T - n)  # [B, H, n, T]
        for b in range(ctx.batch_size):
            answer, needle = int(batch.answer_tokens[b]), batch.targets[b].to(probs.device)
            k = int(needle.sum())
            if answer == 0 or k == 0:
                continue
            top = probs[b, :, n - answer :].double().topk(k, dim=-1)  # [H, answer, k]
            hits = top.values * needle[top.indices]
            self._sum[ctx.layer_idx] += (10.0 * hits.sum((-1, -2)) / (k * answer)).cpu()
        if ctx.layer_idx == 0:
            self._samples += int((batch.answer_tokens > 0).sum())

    def result(self) -> dict[str, torch.Tensor]:
        return {"scores": (self._sum / max(self._samples, 1)).float()}
