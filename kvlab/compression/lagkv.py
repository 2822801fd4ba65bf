"""LagKV: an attention-free importance scorer from lag-relative statistics of the keys and values.

Liang et al. 2025 ("LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are
Important", its method section), checked against kvpress 0.5.5's ``LagKVPress`` and the authors'
``lag_kv.py``.
``docs/methods/lagkv.md`` lists where the paper and the reference code differ and what kvlab does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.compression.context import LayerContext
from kvlab.compression.importance import IMPORTANCE, ImportanceScorer
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities

#: scores of the tail (and of every token of a prompt too short to score) start here, above any
#: partition score: ranks are in [0, 1), summed softmaxes in (0, 2)
TAIL_LEVEL = 2.0


def lag_relative_scores(states: torch.Tensor) -> torch.Tensor:
    """One state's score of every token of every partition that has a successor (LagKV's method).

    ``states [Hkv, P, L, D]`` (P partitions of L tokens) -> ``[Hkv, P - 1, L]`` fp32:
    ``softmax_L( std_D( (X_p - min_{p+1}) / (max_{p+1} - min_{p+1}) ) )``, the min and max taken per
    channel over the tokens of the next partition, the standard deviation over the channels
    (unbiased, as ``torch.std`` in both references) and the softmax over the partition's tokens. A
    channel constant over the reference partition divides by 1e-12 instead of 0 (the references give
    NaN).
    """
    reference = states[:, 1:]
    low = reference.amin(dim=2, keepdim=True)  # [Hkv, P - 1, 1, D]
    high = reference.amax(dim=2, keepdim=True)
    normalised = (states[:, :-1] - low) / (high - low).clamp_min(1e-12)
    return normalised.std(dim=-1).softmax(dim=-1)


def partition_ranks(scores: torch.Tensor) -> torch.Tensor:
    """Rank of each token within its partition over its size, ``[..., L] -> [..., L]`` in ``[0, 1)``.

    The lowest score gets 0, the highest ``(L - 1) / L`` (ties: the earlier token ranks lower, a
    stable sort). Comparing ranks across partitions makes a top-k over the whole head take the same
    number of tokens from every partition (one more from the earlier ones when the count does not
    divide): the paper's per-partition top-k, for a budget given per head.
    """
    order = torch.sort(scores, dim=-1, stable=True).indices
    return torch.sort(order, dim=-1, stable=True).indices.float() / scores.shape[-1]


@IMPORTANCE.register("lagkv")
@dataclass
class LagKVScorer(ImportanceScorer):
    """LagKV: each partition's keys and values normalised by the next partition's range.

    For each sample (its own positions, padding excluded) and KV head, the tokens after the
    ``sinks`` are cut into ``P = floor((n - sinks) / lag_size)`` partitions of ``L = lag_size``
    tokens; partition ``p < P`` is scored against partition ``p + 1`` (the paper's method section)::

        K̄_p = (K_p - min(K_{p+1})) / (max(K_{p+1}) - min(K_{p+1}))     per channel
        s_t = softmax_L(std_D(K̄_p))_t + softmax_L(std_D(V̄_p))_t

    ``cross_scoring: false`` (default, the paper's per-partition top-k): the score is the token's
    rank within its partition over ``L`` (:func:`partition_ranks`); ``true``: ``s_t`` itself,
    compared across partitions (kvpress' ``cross_scoring``).

    The last full partition (it has no reference) and the partial one after it, the *tail*, score
    ``TAIL_LEVEL + position / n``, above every partition token and newest first: kept whole when the
    budget allows (the paper keeps it always), its newest tokens when not. A prompt shorter than
    ``sinks + 2 * lag_size`` has nothing to score and gets these recency scores throughout (kvpress;
    the paper does not compress it). The sinks score +inf (the budget protects ``budget.sinks``).

    Reads keys and values only (``chunked_prefill``). Shapes: keys and values ``[B, Hkv, T, D]`` ->
    scores ``[B, Hkv, T]`` fp32 (0 on padding, which the pipeline masks).
    """

    paper: ClassVar[str | None] = papers.LAGKV

    lag_size: int = 128
    sinks: int | None = None
    cross_scoring: bool = False

    budget_settings: ClassVar[dict[str, str]] = {"sinks": "sinks"}
    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=True)  # keys and values only

    def __post_init__(self) -> None:
        if self.lag_size < 2:
            raise ValueError(f"lag_size must be >= 2, got {self.lag_size}")
        if self.sinks is not None and self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")

    def score(self, ctx: LayerContext) -> torch.Tensor:
        B, Hkv, T = ctx.batch_size, ctx.num_kv_heads, ctx.seq_len
        out = torch.zeros(B, Hkv, T, dtype=torch.float32, device=ctx.keys.device)
        keys, values = ctx.keys_fp32(), ctx.values.float()
        for b, n in enumerate(ctx.lengths.tolist()):  # partitions start at each sample's own first token
            if n:
                out[b, :, T - n :] = self.sample_scores(keys[b, :, T - n :], values[b, :, T - n :])
        return out

    def sample_scores(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Scores of one sample without padding: keys and values ``[Hkv, n, D]`` -> ``[Hkv, n]`` fp32."""
        heads, n, dim = keys.shape
        sinks, lag = self.sinks or 0, self.lag_size
        positions = torch.arange(n, device=keys.device, dtype=torch.float32)
        scores = (TAIL_LEVEL + positions / n).expand(heads, n).clone()
        scores[:, :sinks] = float("inf")
        if n < sinks + 2 * lag:
            return scores
        parts = (n - sinks) // lag
        end = sinks + parts * lag

        def scored(states: torch.Tensor) -> torch.Tensor:
            return lag_relative_scores(states[:, sinks:end].reshape(heads, parts, lag, dim))

        lagged = scored(keys) + scored(values)  # [Hkv, P - 1, L]
        if not self.cross_scoring:
            lagged = partition_ranks(lagged)
        scores[:, sinks : end - lag] = lagged.reshape(heads, -1)
        return scores
