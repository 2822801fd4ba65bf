"""Calibration statistics of how a reading VLM (``smollm2-reader``) uses its heads.

- ``hybridkv_head_classes``: HybridKV's text-centric sparsity ``S`` (Zeng et al. 2026, Eq. 2-3;
  :func:`kvlab.compression.hybridkv.text_centric_sparsity`, the ``text_sparsity`` rule's own
  computation) of every KV head on each calibration prompt. HybridKV classifies heads per input
  (``S >= theta``: static, pruned once; otherwise dynamic, retrieved); the artefact records, over
  the set, each head's mean ``S`` (``score [L, Hkv]``) and the share of prompts on which it is
  static (``static_share [L, Hkv]``), i.e. which heads the method prunes or retrieves on this
  model, and how stable that is.
- ``image_attention``: for every teacher-forced answer token and query head, the attention mass
  on all image tokens (``image [L, H]``) and on the image cells that show the answer (``target
  [L, H]``), averaged over the answer's tokens, then over samples: the heads that look at the
  image, and at the glyphs being read, while the model reads. ``docs/calibration.md`` compares
  them with SparseMM's visual heads (``visual_heads``, the top-1 hit rule).

Both are registered in :data:`~kvlab.calibration.statistics.CALIBRATIONS`; their configs for
``smollm2-reader`` are ``kvlab/calibration/configs/reader_*.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.calibration.statistics import CALIBRATIONS, CalibrationBatch, CalibrationStatistic
from kvlab.compression.context import LayerContext, attention_probs
from kvlab.compression.hybridkv import text_centric_sparsity


@CALIBRATIONS.register("hybridkv_head_classes")
@dataclass
class HybridKVHeadClasses(CalibrationStatistic):
    """``score [L, Hkv]`` (mean ``S``) and ``static_share [L, Hkv]`` (share of prompts with
    ``S >= theta``), fp32; ``topk``, ``text``, ``min_text`` and ``gqa`` as the ``text_sparsity`` rule
    (the ``hybridkv`` preset's values by default)."""

    theta: float = 0.9
    topk: float = 0.05
    text: str = "trailing"
    min_text: int = 8
    gqa: str = "mean"

    def start(self, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
        self._score = torch.zeros(num_layers, num_kv_heads, dtype=torch.float64)
        self._static = torch.zeros(num_layers, num_kv_heads, dtype=torch.float64)
        self._samples = torch.zeros(num_layers, dtype=torch.long)

    def observe(self, ctx: LayerContext, batch: CalibrationBatch) -> None:
        score = (
            text_centric_sparsity(ctx, self.topk, self.text, self.min_text, self.gqa).double().cpu()
        )  # [B, Hkv]
        self._score[ctx.layer_idx] += score.sum(0)
        self._static[ctx.layer_idx] += (score >= self.theta).double().sum(0)
        self._samples[ctx.layer_idx] += ctx.batch_size

    def result(self) -> dict[str, torch.Tensor]:
        count = self._samples.clamp(min=1)[:, None]
        return {"score": (self._score / count).float(), "static_share": (self._static / count).float()}


@CALIBRATIONS.register("image_attention")
@dataclass
class ImageAttention(CalibrationStatistic):
    """``image [L, H]`` and ``target [L, H]`` fp32: each query head's attention mass from the
    reference answer's tokens on all image tokens and on the target tokens (the cells showing the
    answer), mean over answer tokens, then over samples."""

    needs_answers = True
    needs_targets = True

    def start(self, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
        self._image = torch.zeros(num_layers, num_heads, dtype=torch.float64)
        self._target = torch.zeros(num_layers, num_heads, dtype=torch.float64)
        self._samples = 0

    def observe(self, ctx: LayerContext, batch: CalibrationBatch) -> None:
        T, n = ctx.seq_len, int(batch.answer_tokens.max())
        if n == 0 or batch.targets is None:
            return
        probs = attention_probs(ctx.last_queries(n, "the image-attention statistic"), ctx, first_query=T - n)
        image = ctx.modality > 0  # [B, T]
        for b in range(ctx.batch_size):
            answer = int(batch.answer_tokens[b])
            if answer == 0:
                continue
            rows = probs[b, :, n - answer :]  # [H, answer, T]
            self._image[ctx.layer_idx] += rows[..., image[b]].sum(-1).mean(-1).double().cpu()
            self._target[ctx.layer_idx] += (
                rows[..., batch.targets[b].to(rows.device)].sum(-1).mean(-1).double().cpu()
            )
        if ctx.layer_idx == 0:
            self._samples += int((batch.answer_tokens > 0).sum())

    def result(self) -> dict[str, torch.Tensor]:
        count = max(self._samples, 1)
        return {"image": (self._image / count).float(), "target": (self._target / count).float()}
