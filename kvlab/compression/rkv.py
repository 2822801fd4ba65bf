"""R-KV (Cai et al. 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models", arXiv
2505.24133): decode-time eviction by importance and redundancy.

A reasoning model's long output repeats itself; R-KV compresses the cache while it is generated.
Every ``B_buffer`` decoded tokens the cached entries are scored and the cache is cut back to its
budget, the ``α`` newest tokens always kept (they are also the observation window):

- importance: the attention the ``α`` newest queries pay to each older entry, softmax over the
  older entries, averaged over the ``α`` queries and max-pooled over neighbouring positions
  (SnapKV's pooling, kernel 7): ``I_j = maxpool_7( (1/α) sum_{i in window} softmax_j(q_i k_j / sqrt(D)) )``;
- redundancy: per entry, the mean cosine similarity of its key to the other stored keys,
  normalised over the entries with a softmax:
  ``R_j = softmax_j( (1/n) sum_i c_ij )``, ``c_ij = cos(k_i, k_j)`` for ``i != j`` (0 on the
  diagonal); for each key ``i`` the newest key ``j`` with ``c_ij > 0.5`` gets ``c_ij = 0``
  (the newest of a group of near-duplicates is the one spared);
- the score ``S_j = λ I_j - (1 - λ) R_j`` (λ = 0.1 in the paper); the entries of lowest ``S`` go.

kvlab's periodic eviction is the shared step's (:class:`~kvlab.compression.decode.ScoredEviction`
with ``every = B_buffer``): a layer's rows evict once every ``every`` steps, each keeping its
``capacity - every + 1`` entries of highest ``S`` (``recent = α`` newest positions first), so the
cache never holds more than its capacity after a step (checked by the tests after every step);
the paper's ``B_budget`` retained tokens with a buffer of ``B_buffer`` on top correspond to a kvlab
budget of ``B_budget + B_buffer - 1``. The policy only adds its scores: :meth:`RKVDecodePolicy.update`
accumulates the importance over the ``recent`` steps before each eviction and
:meth:`RKVDecodePolicy.eviction_scores` mixes it with the redundancy of the keys stored then
(:func:`key_redundancy`). The prompt is whatever the prefill pipeline kept (the ``rkv`` preset:
SnapKV to the same budget when the prompt is longer, else kept whole; the cache then grows to the
budget while generating, :func:`~kvlab.compression.decode.grow_to_budget`); its entries compete
with the generated ones.

Where the reference code (``Zefan-Cai/R-KV``, ``R1KV.update_kv`` and ``cal_similarity``; the
HuggingFace, vLLM and SGLang ports share them) and the paper differ, or kvlab cannot follow them
(``docs/methods/rkv.md``):

- λ: the paper's 0.1 (the code defaults to ``mix_lambda`` 0.07);
- GQA: the code takes the max over a group's query heads of the *logits* before the softmax;
  kvlab reads the decode attention it recorded (probabilities per query head) and averages the
  group's probabilities (SnapKV's ``gqa: mean``);
- the softmax of the importance is over the entries older than the window, as in the code: each
  recorded probability row is renormalised over them;
- the threshold rule: the code's ``retain_direction="last"`` zeroes, for each key, its similarity
  to the newest key above the threshold, but when no key is above it, it zeroes the similarity to
  slot 0 (``max`` of a masked index row that is all 0); kvlab zeroes nothing then;
- the redundancy softmax is over every stored entry (window included) and the importance over
  the older ones, both as in the code; the paper does not say;
- the first eviction, when fewer than ``α`` decoded queries preceded it, averages the ones seen
  over ``α`` (the code would use prompt queries from its own window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvlab.cache.layer import CompressedLayer
from kvlab.cache.state import RunState
from kvlab.compression.decode import DECODE_POLICIES, ScoredEntries, ScoredEviction, grow_to_budget
from kvlab.config import papers


def key_redundancy(
    keys: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, threshold: float | None = 0.5
) -> torch.Tensor:
    """R-KV's redundancy of every stored entry, ``[B, Hkv, S]`` fp32 (higher: more redundant; 0 on
    empty slots).

    ``R_j = softmax_j( (1/n) sum_i c_ij )`` over the ``n`` valid entries of a (sample, KV head), ``c_ij``
    the cosine similarity of keys ``i`` and ``j`` (``k / (||k|| + 1e-8)``, fp32), 0 for ``i == j``;
    with a ``threshold``, for each key ``i`` the entry ``j`` of newest position among those with
    ``c_ij > threshold`` gets ``c_ij = 0`` (None: no such rule).

    Args:
        keys: ``[B, Hkv, S, D]`` the stored keys in slot layout.
        valid: ``[B, Hkv, S]`` bool, the slots holding an entry.
        positions: ``[B, Hkv, S]`` long, each entry's position (the "newest" of the rule).
        threshold: the similarity above which a pair is a near-duplicate.
    """
    unit = keys.float()
    unit = unit / (unit.norm(dim=-1, keepdim=True) + 1e-8)
    S = unit.shape[-2]
    pair = valid[..., :, None] & valid[..., None, :] & ~torch.eye(S, dtype=torch.bool, device=keys.device)
    similarity = (unit @ unit.transpose(-1, -2)).masked_fill(~pair, 0)  # [B, Hkv, S, S]
    if threshold is not None:
        similar = pair & (similarity > threshold)
        newest = (
            positions[..., None, :].expand_as(similarity).masked_fill(~similar, -1).argmax(-1)
        )  # [B, Hkv, S]
        spared = F.one_hot(newest, S).bool() & similar.any(-1, keepdim=True)
        similarity = similarity.masked_fill(spared, 0)
    mean = similarity.sum(-2) / valid.sum(-1, keepdim=True).clamp(min=1)  # over the rows i
    return torch.softmax(mean.masked_fill(~valid, float("-inf")), -1).nan_to_num(0.0)


@DECODE_POLICIES.register("rkv")
@dataclass
class RKVDecodePolicy(ScoredEviction):
    """R-KV at decode: every ``every`` steps, keep the entries of highest ``λ I - (1 - λ) R``.

    After each step the shared periodic step (:class:`~kvlab.compression.decode.ScoredEviction`,
    ``every > 1``) stores the new token and calls :meth:`update`; at a layer's eviction step its
    rows holding more than ``capacity - every + 1`` entries keep that many, ranked by
    :meth:`eviction_scores`, the ``recent`` (α) newest always kept. Capacity: the layer's budget
    where the prefill kept the whole prompt, else its kept count
    (:func:`~kvlab.compression.decode.grow_to_budget`). Inside a pipeline ``recent`` is
    ``budget.window``. Formulas and the reference-code differences: the module docstring.

    Attributes:
        every: decode steps between two evictions (the paper's buffer; at least ``recent``).
        mix_lambda: λ, the importance's weight.
        kernel: the max-pooling width of the importance over neighbouring positions (odd).
        threshold: the similarity above which the newest similar key is spared (None: no rule).
    """

    paper: ClassVar[str | None] = papers.RKV

    recent: int = 8
    every: int = 128
    mix_lambda: float = 0.1
    kernel: int = 7
    threshold: float | None = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.every < 2:
            raise ValueError(f"rkv evicts periodically: every must be >= 2, got {self.every}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"kernel must be an odd width >= 1, got {self.kernel}")
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ValueError(f"mix_lambda must be in [0, 1], got {self.mix_lambda}")

    def start(self, run: RunState) -> None:
        if self.every < self.recent:
            raise ValueError(
                f"rkv: every ({self.every}) must be at least the observation window recent ({self.recent}), "
                "so that the window's queries fall between two evictions"
            )
        super().start(run)

    def capacity(self, kept: torch.Tensor, budget: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The layer budget where the prefill kept the whole prompt, else the kept count."""
        return grow_to_budget(kept, budget, lengths)

    def update(self, entries: ScoredEntries, probs: torch.Tensor, layer: CompressedLayer) -> None:
        """Accumulate the importance over the ``recent`` steps before each row's eviction (``scores``
        is 0 before them, per row by ``entries.countdown``): the step's attention ``probs [B, Hkv, G,
        q, S]`` renormalised over the entries outside the window of the coming eviction, the group's
        heads averaged, ``/ recent``."""
        S = probs.shape[-1]
        countdown = entries.countdown  # [B, Hkv]
        observe = (countdown < self.recent)[..., None]  # [B, Hkv, 1]
        window_start = layer.cumulative_length + countdown - self.recent  # newest at eviction - recent + 1
        older = (entries.positions[:, :, :S] < window_start[..., None])[:, :, None, None]  # [B, Hkv, 1, 1, S]
        observed = probs.float() * older
        observed = observed / observed.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        added = entries.scores[:, :, :S] + observed.mean(2).sum(2) / self.recent
        entries.scores[:, :, :S] = torch.where(observe, added, 0.0)

    def eviction_scores(self, entries: ScoredEntries, layer: CompressedLayer) -> torch.Tensor:
        """``λ maxpool(I) - (1 - λ) R`` per slot, ``[B, Hkv, S]``: the accumulated importance pooled
        over position order (``kernel``), the redundancy of the stored keys (:func:`key_redundancy`)."""
        valid = layer.slot_valid()  # [B, Hkv, S]
        S = valid.shape[-1]
        positions = entries.positions[:, :, :S]
        importance = entries.scores[:, :, :S].masked_fill(~valid, 0)
        order = positions.masked_fill(~valid, torch.iinfo(positions.dtype).max).argsort(-1)  # by position
        ordered = importance.gather(-1, order).flatten(0, 1)[:, None]  # [B * Hkv, 1, S]
        pooled = F.max_pool1d(ordered, self.kernel, stride=1, padding=self.kernel // 2).view_as(importance)
        importance = torch.empty_like(pooled).scatter_(-1, order, pooled)
        redundancy = key_redundancy(layer.slot_keys(), valid, positions, self.threshold)
        return self.mix_lambda * importance - (1 - self.mix_lambda) * redundancy
