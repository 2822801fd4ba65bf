"""LayerContext: everything a compression component may read about one layer's prefill.

Shapes: B batch, H query heads, Hkv KV heads, G = H / Hkv, T padded prompt length, D head dim.
Batches are left padded; ``valid[b, t]`` is False on padding. Attention helpers are memoised so
two components never compute the same attention twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.kernels.window_scores import window_attention_scores


@dataclass
class LayerContext:
    """Inputs of one layer's compression.

    Attributes:
        layer_idx: index of the decoder layer (0-based).
        num_layers: number of decoder layers of the language model.
        queries: post-RoPE queries ``[B, H, T, D]``.
        keys: post-RoPE keys ``[B, Hkv, T, D]`` (GQA heads not repeated).
        values: values ``[B, Hkv, T, D]``.
        valid: ``[B, T]`` bool, False on padding.
        modality: ``[B, T]`` long, 0 text, 1 image, 2 video, -1 padding.
        scaling: softmax scale of the layer (usually ``D ** -0.5``).
        state: per-prompt scratch space shared across layers (reset every prefill), for
            components that carry state from one layer to the next.
        protected: ``[B, T]`` bool, tokens the budget always keeps (window, sinks); set by the
            pipeline before any scorer runs (None outside a pipeline: nothing protected).
        window: ``[B]`` long, the recent window of each sample (``budget.window``, per sample):
            protected by the budget and observed by window scorers; set by the pipeline (None
            outside a pipeline: scorers use their own ``window``).
    """

    layer_idx: int
    num_layers: int
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    modality: torch.Tensor
    scaling: float
    state: dict[str, Any] = field(default_factory=dict)
    protected: torch.Tensor | None = None
    window: torch.Tensor | None = None
    sliding_window: int | None = None
    _memo: dict[Any, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def num_heads(self) -> int:
        return self.queries.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def seq_len(self) -> int:
        return self.keys.shape[2]

    @property
    def lengths(self) -> torch.Tensor:
        """Valid (non-padding) tokens per sample, ``[B]`` long."""
        return self.valid.sum(-1)

    def positions(self) -> torch.Tensor:
        """Position of each token within its own sample, ``[B, T]`` (see :func:`sample_positions`)."""
        return sample_positions(self.valid)

    @property
    def candidates(self) -> torch.Tensor:
        """``[B, T]`` bool: the tokens that compete for the budget (valid and not protected).

        Per-head statistics of the MixKV family (min, max and mean of a score) are taken over
        these tokens: the prompt before the window, ``P = T - W`` tokens, padding excluded.
        """
        if self.protected is None:
            return self.valid
        return self.valid & ~self.protected

    def observation_windows(self, own: int | None, who: str) -> torch.Tensor:
        """The recent window each sample's last queries span, ``[B]`` long, for a window observer.

        Inside a pipeline this is :attr:`window` (the budget's); outside one, the observer's
        ``own`` window. A window of 0 (a budget with no recent window) is raised to 1: an
        observer needs at least the last query.
        """
        if self.window is not None:
            return self.window.clamp(min=1)
        if own is None:
            raise ValueError(
                f"{who} needs a window: set budget.window (or its own window outside a pipeline)"
            )
        return torch.full((self.batch_size,), own, dtype=torch.long, device=self.valid.device)

    def unit_key_mean(self) -> torch.Tensor:
        """Mean of the unit-normalised keys over each sample's valid tokens, ``[B, Hkv, D]`` fp32.

        ``mean_t k_t / ||k_t||`` (window included, padding excluded), shared by MixKV's key
        diversity and its head redundancy; memoised.
        """
        if "unit_key_mean" not in self._memo:
            weight = self.valid.float()[:, None, None, :] / self.key_norms()[:, :, None, :]  # [B, Hkv, 1, T]
            count = self.lengths.clamp(min=1)[:, None, None].float()
            # sum_t k_t / ||k_t|| as one matrix-vector product: the unit keys are never materialised
            self._memo["unit_key_mean"] = (weight @ self.keys_fp32()).squeeze(2) / count
        return self._memo["unit_key_mean"]

    def key_norms(self) -> torch.Tensor:
        """``||k_t||_2`` per (sample, KV head, token), ``[B, Hkv, T]`` fp32, floored at 1e-12 (memoised)."""
        if "key_norms" not in self._memo:
            self._memo["key_norms"] = self.keys_fp32().norm(dim=-1).clamp_min(1e-12)
        return self._memo["key_norms"]

    def keys_fp32(self) -> torch.Tensor:
        """The keys in fp32, ``[B, Hkv, T, D]`` (cast once, shared by the attention helpers)."""
        if "keys_fp32" not in self._memo:
            self._memo["keys_fp32"] = self.keys.float()
        return self._memo["keys_fp32"]

    def window_attention(self, window: int) -> torch.Tensor:
        """Attention probabilities of the last ``window`` queries over all keys, ``[B, H, W, T]`` fp32.

        Causal inside the window, padding keys masked; rows of padding queries (samples shorter
        than the window) are zero. Softmax runs in fp32 on logits computed in fp32 (see the
        16-bit logits would reorder near-ties); the result is memoised per window size.
        """
        key = ("window_attention", window)
        if key not in self._memo:
            self._memo[key] = attention_probs(
                self.queries[:, :, -window:], self, first_query=self.seq_len - window
            )
        return self._memo[key]

    def window_attention_scores(self, window: int) -> torch.Tensor:
        """Attention each key receives from the last ``window`` queries, per query head, ``[B, H, T]`` fp32.

        Equals ``window_attention(window).sum(-2)`` but goes through
        :func:`kvlab.kernels.window_scores.window_attention_scores`, whose Triton kernel (CUDA)
        never materialises the ``[B, H, W, T]`` probabilities; memoised per window size.
        """
        key = ("window_attention_scores", window)
        if key not in self._memo:
            self._memo[key] = window_attention_scores(
                self.queries[:, :, -window:], self.keys, self.valid, self.scaling
            )
        return self._memo[key]

    def cumulative_attention(self, chunk: int = 256) -> torch.Tensor:
        """Column sums of the full causal prompt attention (H2O's accumulated attention), ``[B, H, T]`` fp32.

        Sums over every valid query; computed in chunks of ``chunk`` queries so the ``T x T``
        matrix is never materialised.
        """
        key = ("cumulative_attention",)
        if key not in self._memo:
            T = self.seq_len
            total = torch.zeros(
                self.batch_size, self.num_heads, T, dtype=torch.float32, device=self.keys.device
            )
            for start in range(0, T, chunk):
                probs = attention_probs(self.queries[:, :, start : start + chunk], self, first_query=start)
                total += probs.sum(-2)
            self._memo[key] = total
        return self._memo[key]


def attention_probs(queries: torch.Tensor, ctx: LayerContext, first_query: int) -> torch.Tensor:
    """Softmax attention of ``queries`` ``[B, H, q, D]`` (prompt positions ``first_query + i``) over all keys.

    Returns ``[B, H, q, T]`` fp32 with the causal mask, padding keys masked, and zero rows for
    padding queries.
    """
    B, H, q, D = queries.shape
    keys = ctx.keys_fp32()  # [B, Hkv, T, D]
    T = keys.shape[2]
    # query head h reads KV head h // G: group the queries instead of repeating the keys
    grouped = queries.float().reshape(B, ctx.num_kv_heads, ctx.group_size * q, D)
    logits = (torch.matmul(grouped, keys.transpose(-1, -2)) * ctx.scaling).view(B, H, q, T)
    query_pos = torch.arange(first_query, first_query + q, device=keys.device)
    causal = torch.arange(T, device=keys.device)[None, :] <= query_pos[:, None]  # [q, T]
    allowed = causal[None, None] & ctx.valid[:, None, None, :]
    logits = logits.masked_fill(~allowed, float("-inf"))
    query_valid = ctx.valid[:, first_query : first_query + q]  # [B, q]
    logits = logits.masked_fill(~query_valid[:, None, :, None], 0.0)
    probs = torch.softmax(logits, dim=-1)
    return probs * query_valid[:, None, :, None]


def sample_positions(valid: torch.Tensor) -> torch.Tensor:
    """Position of each token within its own sample, ``[B, T]`` long, from ``valid`` ``[B, T]``.

    0 at a sample's first valid token; padding gets -1. With left padding this is
    ``t - (T - length)``, so a padded sample sees the positions it has alone.
    """
    pos = valid.long().cumsum(-1) - 1
    return pos.masked_fill(~valid, -1)
