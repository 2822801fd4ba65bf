"""PrefixKV's global prefix configuration: per-layer KV sizes from one cumulative-priority threshold.

PrefixKV (Wang et al. 2024, "PrefixKV: Adaptive Prefix KV Cache is What Vision
Instruction-Following Models Need for Efficient Generation", arXiv 2412.03409) scores every
token of layer ``l`` by the attention it receives, averaged over the layer's heads (Sec. 3.2)::

    I_l[n] = mean_h sum_m softmax_n(q_l^{h,m} . k_l^{h,n})        (causal, every prompt query m)

normalises it (``w_l = I_l / sum_n I_l[n]``), sorts it descending (the "priority sequence")
and calls ``C_l[k]``, the mass of the ``k`` top-ranked tokens, the cumulative priority. One
threshold ``p`` is shared by all layers: layer ``l`` keeps the shortest prefix reaching it,
``k_l(p) = min{k : C_l[k] >= p}`` (Eq. 1), and ``p`` is chosen so that the layers' sizes add
up to the budget. The paper finds ``p`` by bisection (Algorithm 1) and then scales the sizes to
the budget; kvlab also solves it exactly: rank ``k`` of layer ``l`` is kept at threshold ``p``
iff ``E_l[k] = C_l[k - 1] < p`` (the mass ranked above it), so meeting a total of ``K`` tokens
is taking the ``K`` smallest ``E_l[k]`` over all (layer, rank) pairs (:func:`solve_exact`).
Both solvers give the same sizes whenever an exact threshold exists (tested).

Protected tokens (the budget's sinks and recent window; PrefixKV's release protects one sink
and the last prompt token) are placed first in every layer's priority sequence, so their mass
counts before the ranked tokens and every layer keeps them.

This module holds the solver (pure functions on one sample, ``[L, n]`` tensors) and the
components built on it: the scorer ``layer_cumulative_attention``, the online allocator
``prefix_threshold`` (solves on the current input; needs ``schedule: global``) and the offline
allocator ``prefix_calibrated`` (per-layer kept fractions from a ``prefixkv_layer_ratios``
calibration artefact, written by :mod:`kvlab.calibration.prefixkv`). The decode rule is
:mod:`kvlab.compression.decode_prefixkv`. Choices and paper ambiguities:
``docs/methods/prefixkv.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

from kvlab.compression.allocators import (
    LAYER_ALLOCATORS,
    LayerAllocator,
    layer_signal,
    require_every_layer,
    round_to_total,
)
from kvlab.compression.context import LayerContext
from kvlab.compression.importance import IMPORTANCE, ImportanceScorer
from kvlab.config import papers
from kvlab.config.artefacts import UsesArtefact
from kvlab.config.capabilities import Capabilities
from kvlab.config.errors import ConfigError

RATIOS_KIND = "prefixkv_layer_ratios"  # calibration artefact: budgets [R], ratios [R, L] (kept fractions)


# --- the solver (one sample) ---------------------------------------------------------------------
def layer_importance(cumulative: torch.Tensor) -> torch.Tensor:
    """PrefixKV's ``I_l``: column sums of the causal prompt attention ``[B, H, T]`` averaged over
    every query head -> ``[B, T]`` fp32 (the same vector for all KV heads of the layer)."""
    return cumulative.float().mean(1)


def exclusive_priority(importance: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
    """``E [L, n]`` fp64: for rank ``k`` of each layer's priority sequence, the mass ranked above it.

    Args:
        importance: ``[L, n]`` non-negative importance of one sample's ``n`` valid tokens per layer.
        protected: ``[n]`` bool, tokens every layer keeps (sinks, recent window).

    Ranks ``0 .. |P| - 1`` are the protected tokens (``E = -inf``: always kept); the others follow
    in descending importance (ties to the lower position, as the top-k selector breaks them),
    ``E = protected mass + mass of the better-ranked tokens``. ``E`` is non-decreasing along
    each row, so any threshold keeps a prefix of every layer.
    """
    w = importance.double().clamp(min=0)
    w = w / w.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)
    held = w[:, protected].sum(-1, keepdim=True)  # [L, 1]
    ranked = torch.sort(w[:, ~protected], dim=-1, descending=True, stable=True).values
    exclusive = held + torch.cumsum(ranked, -1) - ranked
    first = torch.full((w.shape[0], int(protected.sum())), float("-inf"), dtype=w.dtype, device=w.device)
    return torch.cat([first, exclusive], -1)


def threshold_counts(E: torch.Tensor, p: float) -> torch.Tensor:
    """``k_l(p) = min{k : C_l[k] >= p} = #{k : E_l[k] < p}`` per layer, ``[L]`` long (Eq. 1)."""
    return (p > E).sum(-1)


def solve_exact(E: torch.Tensor, total: int) -> torch.Tensor:
    """Layer sizes ``[L]`` summing to ``total``: the ``total`` smallest ``E_l[k]`` over all pairs.

    Equivalent to the threshold ``p`` just above the ``total``-th smallest ``E`` (exact, no
    tolerance, no rescaling). Ties go to the lower layer, then the lower rank (stable sort of the
    layer-major flattening), which keeps the result monotone in ``total``.
    """
    L, n = E.shape
    order = torch.sort(E.reshape(-1), stable=True).indices[:total]
    return torch.bincount(order // n, minlength=L)


@dataclass(frozen=True)
class Bisection:
    """Result of :func:`solve_bisect`: sizes ``counts [L]`` at threshold ``p`` after ``steps`` halvings."""

    counts: torch.Tensor
    p: float
    steps: int


def solve_bisect(E: torch.Tensor, total: int, tol_tokens: int = 1, max_iter: int = 64) -> Bisection:
    """PrefixKV's Algorithm 1: bisect ``p`` in [0, 1] until ``|sum_l k_l(p) - total| < tol_tokens``.

    ``delta = sum_l k_l(p) - total``: below 0 raises the lower bound, above 0 lowers the upper
    one. ``tol_tokens = 1`` asks for an exact hit (the paper's ``delta == 0``); the release
    stops at 5 tokens summed over layers and has no step limit (its loop can spin forever when
    no such ``p`` exists); kvlab stops after ``max_iter`` halvings. The sizes may then miss
    ``total``; :func:`rescale` scales them to it (the paper's "scale the configuration").
    """
    lo, hi = 0.0, 1.0
    counts = threshold_counts(E, 0.5)
    p, steps = 0.5, 0
    for steps in range(1, max_iter + 1):  # noqa: B007  (the step count is returned)
        p = (lo + hi) / 2
        counts = threshold_counts(E, p)
        delta = int(counts.sum()) - total
        if abs(delta) < tol_tokens:
            break
        if delta < 0:
            lo = p
        else:
            hi = p
    return Bisection(counts, p, steps)


def fit_to_total(real: torch.Tensor, low: int, high: int, total: int) -> torch.Tensor:
    """Integers within ``[low, high]`` summing to ``total``, as close to ``real [L]`` as possible.

    ``real`` is scaled to the total, clamped to the bounds, shifted by one common amount until
    the clamped values add up again (bisection on the shift) and rounded by largest remainder
    (each entry is the floor or the ceiling of its real value, so the bounds hold).
    """
    L = real.numel()
    if not L * low <= total <= L * high:
        raise ValueError(f"a total of {total} cannot be split into {L} sizes within [{low}, {high}]")
    x = real.double().clamp(min=0)
    x = x * (total / x.sum()) if x.sum() > 0 else torch.full_like(x, total / L)
    below, above = -float(high), float(high)  # sum(clamp(x + shift)) is non-decreasing in shift
    shift = 0.0
    for _ in range(200):
        gap = float((x + shift).clamp(low, high).sum()) - total
        if abs(gap) < 1e-9:
            break
        below, above = (shift, above) if gap < 0 else (below, shift)
        shift = (below + above) / 2
    return round_to_total((x + shift).clamp(low, high), total)


def rescale(
    counts: torch.Tensor, total: int, low: int, high: int, how: Literal["largest_remainder", "evicted_floor"]
) -> torch.Tensor:
    """Scale bisection sizes ``counts [L]`` to the budget ``total`` (the paper's last step).

    ``largest_remainder`` (kvlab): proportional, then :func:`fit_to_total`, so the total is
    exact. ``evicted_floor`` (the release, ``forget_l <- floor(forget_l * target / sum forget)``
    on evicted counts ``n - k_l``): keeps at most ``L`` tokens more than ``total``.
    """
    if int(counts.sum()) == total:
        return counts
    if how == "largest_remainder":
        return fit_to_total(counts.double(), low, high, total)
    evicted = (high - counts).double()
    target = counts.numel() * high - total
    if evicted.sum() > 0:
        evicted = torch.floor(evicted * target / evicted.sum())
    return (high - evicted.long()).clamp(low, high)


def gini(importance: torch.Tensor) -> torch.Tensor:
    """Gini coefficient of each layer's priority sequence, ``[L]`` (logged only; Sec. 3.2, Fig. 2).

    The discrete area form ``G = (2 / n) sum_k C[k] - 1 - 1 / n``: 0 for uniform importance,
    ``1 - 1 / n`` when one token holds everything. ``importance`` is ``[L, n]``.
    """
    n = importance.shape[-1]
    w = importance.double().clamp(min=0)
    w = w / w.sum(-1, keepdim=True)
    C = torch.cumsum(torch.sort(w, -1, descending=True).values, -1)
    return 2.0 / n * C.sum(-1) - 1.0 - 1.0 / n


def global_sizes(
    importance: torch.Tensor,
    protected: torch.Tensor,
    total: int,
    solver: Literal["exact", "bisect"] = "exact",
    tol_tokens: int = 1,
    max_iter: int = 64,
    how: Literal["largest_remainder", "evicted_floor"] = "largest_remainder",
) -> torch.Tensor:
    """One sample's layer sizes ``[L]`` (protected tokens included) for a total of ``total`` tokens.

    ``importance [L, n]`` over the sample's valid tokens, ``protected [n]`` bool. ``total`` must
    lie in ``[L |P|, L n]``.
    """
    L, n = importance.shape
    held = int(protected.sum())
    if not L * held <= total <= L * n:
        raise ValueError(f"a total of {total} tokens over {L} layers of {n} tokens ({held} protected each)")
    E = exclusive_priority(importance, protected)
    if solver == "exact":
        return solve_exact(E, total)
    found = solve_bisect(E, total, tol_tokens, max_iter)
    return rescale(found.counts, total, held, n, how)


# --- components ----------------------------------------------------------------------------------
@IMPORTANCE.register("layer_cumulative_attention")
@dataclass
class LayerCumulativeAttentionScorer(ImportanceScorer):
    """PrefixKV's importance: attention each token received, averaged over all query heads of the layer.

    ``s_t = mean_h sum_i softmax(q_i^h K^T / sqrt(D))_t`` over every valid prompt query ``i``
    (PrefixKV Sec. 3.2, after Elastic Cache; H2O's accumulated attention with the mean taken over
    all ``H`` query heads, not per GQA group). One vector per layer, broadcast to ``[B, Hkv, T]``:
    every KV head keeps the same positions. Early tokens are seen by more queries and favoured;
    that bias is the paper's. Per-head selection (a kvlab extension) is the existing
    ``cumulative_attention`` scorer with ``gqa: mean``: its mean over KV heads is the same
    ``I_l``, so the PrefixKV allocators see the same curves.
    """

    paper: ClassVar[str | None] = papers.PREFIXKV

    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=False)  # every query's attention row

    def score(self, ctx: LayerContext) -> torch.Tensor:
        shared = layer_importance(ctx.cumulative_attention())  # [B, T]
        return shared[:, None, :].expand(-1, ctx.num_kv_heads, -1).contiguous()


@dataclass
class ThresholdObservations:
    """What ``prefix_threshold`` saw of one prompt (``schedule: global``): ``valid [B, T]``, each observed
    layer's ``I_l [B, T]`` by layer index, the protected tokens ``[B, T]``, and the solved layer
    budgets ``[B]`` by layer index once the first layer is compressed."""

    valid: torch.Tensor
    importance: dict[int, torch.Tensor] = field(default_factory=dict)
    protected: torch.Tensor | None = None
    sizes: dict[int, torch.Tensor] | None = None


@LAYER_ALLOCATORS.register("prefix_threshold")
@dataclass
class PrefixThresholdAllocator(LayerAllocator):
    """PrefixKV online: one cumulative-priority threshold over all layers, solved on the current input.

    Per sample with ``n`` valid tokens and per-head budget ``c`` (protected tokens included),
    the layers keep ``L c`` tokens in total (the same total as ``uniform``), split by the global
    threshold of :func:`global_sizes` over each layer's ``I_l`` (the ``signal`` score's mean over
    KV heads: ``layer_cumulative_attention`` in the presets; any non-negative attention mass
    works, non-finite values such as a scorer's +inf on protected tokens count as 0, negative
    scores as 0). ``solver: exact`` ranks every
    (layer, rank) pair; ``bisect`` is the paper's Algorithm 1 (``tol_tokens``, ``max_iter``)
    followed by ``rescale`` (``largest_remainder``: exact total; ``evicted_floor``: the release).

    Needs every layer's scores before the first layer is compressed: ``schedule: global`` (a
    kvlab extension; the paper runs this search offline on calibration samples, see
    ``prefix_calibrated``). The pipeline shows each layer's scores to :meth:`observe`.
    Returns the layer's ``[B]`` budgets. On models with sliding-window layers, those layers
    keep their window (``sliding_layers: window``, outside the budget as for every method) and
    the threshold is shared by the full-attention layers (``L`` = their count);
    ``sliding_layers: compress`` is refused (a sliding layer's candidates are its window, not
    the prompt the threshold ranks).
    """

    paper: ClassVar[str | None] = papers.PREFIXKV

    solver: Literal["exact", "bisect"] = "exact"
    tol_tokens: int = 1
    max_iter: int = 64
    rescale: Literal["largest_remainder", "evicted_floor"] = "largest_remainder"
    signal: str = "mixed"

    # every layer's scores (seen through observe) before the first layer is compressed
    capabilities: ClassVar[Capabilities] = Capabilities(needs_all_layers=True, observes_layers=True)
    # ranks each layer's whole prompt, which a sliding layer compressed in its window does not offer
    compresses_sliding_layers: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.tol_tokens < 1 or self.max_iter < 1:
            raise ValueError(f"tol_tokens and max_iter must be >= 1, got {self.tol_tokens}, {self.max_iter}")

    def observe(self, ctx: LayerContext, scores: dict[str, torch.Tensor], mixed: torch.Tensor) -> None:
        """Keep layer ``ctx.layer_idx``'s ``I_l [B, T]`` (mean of the signal over KV heads) for the solve."""
        signal = layer_signal(self.signal, scores, mixed)
        if ctx.sliding_window is not None:
            raise ConfigError(
                "model.compression.allocate.layer 'prefix_threshold' ranks each layer's whole prompt, but "
                f"layer {ctx.layer_idx} is a sliding-window layer compressed within its window "
                "(model.compression.sliding_layers: compress). Set model.compression.sliding_layers: window "
                "(sliding layers keep their window; the threshold is shared by the full-attention layers)."
            )
        seen = ctx.run.owned(self, lambda: ThresholdObservations(ctx.valid))
        signal = signal.float().masked_fill(~torch.isfinite(signal), 0.0)  # e.g. SnapKV's +inf window
        seen.importance[ctx.layer_idx] = signal.mean(1).masked_fill(~ctx.valid, 0.0)
        seen.protected = ctx.protected if ctx.protected is not None else torch.zeros_like(ctx.valid)

    def allocate(self, budget, lengths, protected, ctx):
        seen = ctx.run.owned(self, lambda: ThresholdObservations(ctx.valid))
        require_every_layer(
            seen.importance, ctx, "prefix_threshold", "the scores",
            " (or use the offline `prefix_calibrated` allocator with a calibration artefact)",
        )  # fmt: skip
        if seen.sizes is None:
            layers = sorted(seen.importance)  # every layer the pipeline compresses (all observed)
            seen.sizes = dict(zip(layers, self.sizes(seen, budget, lengths, layers), strict=True))
        return seen.sizes[ctx.layer_idx].to(lengths.device)

    def sizes(
        self, seen: ThresholdObservations, budget: torch.Tensor, lengths: torch.Tensor, layers: list[int]
    ) -> torch.Tensor:
        """``[len(layers), B]`` budgets of ``layers`` for every sample from the observed ``I_l``
        (``seen``), the per-head budgets ``[B]`` and prompt lengths ``[B]`` (a sample whose budget
        covers it keeps all): the layers keep ``len(layers) x budget`` tokens in total."""
        device = seen.valid.device
        importance = torch.stack([seen.importance[layer].to(device) for layer in layers])  # [L, B, T]
        L = len(layers)
        out = budget.to(device)[None].repeat(L, 1)
        for b, (c, n) in enumerate(zip(budget.tolist(), lengths.tolist(), strict=True)):
            if c >= n:
                continue
            valid = seen.valid[b]
            out[:, b] = global_sizes(
                importance[:, b, valid],
                seen.protected[b, valid].to(device),
                L * c,
                self.solver,
                self.tol_tokens,
                self.max_iter,
                self.rescale,
            )
        return out


@LAYER_ALLOCATORS.register("prefix_calibrated")
@dataclass
class PrefixCalibratedAllocator(LayerAllocator, UsesArtefact):
    """PrefixKV offline (the paper's default): per-layer kept fractions ``R_l`` from calibration.

    The artefact (``kvlab calibrate --config prefixkv_layer_ratios``, kind
    ``prefixkv_layer_ratios``) holds, for each calibrated budget ``r_i`` (a kept fraction), the
    mean over calibration samples of each layer's kept fraction under the global threshold. A
    sample with ``n`` tokens and per-head budget ``c`` uses the row whose budget gives ``c``
    (``floor(r_i n) == c``: the configured ratio); ``interpolate: linear`` interpolates between
    rows (and the implied ``r = 0``, ``r = 1`` rows) for other budgets (token budgets), ``none``
    refuses them. Layer ``l`` then keeps ``R_l n`` tokens, rounded (``largest_remainder``) so
    the layers keep exactly ``L c`` tokens, each within [protected, ``n``]; ``rounding:
    nearest`` is the release's independent ``n - round((1 - R_l) n)`` (total off by up to
    ``L / 2``). Layer sizes are known before prefill: the layerwise schedule works. Refused on
    models with sliding-window layers (the online ``prefix_threshold`` handles them).
    """

    paper: ClassVar[str | None] = papers.PREFIXKV
    # the calibrated ratios split the budget as if every layer were a full-attention layer
    compresses_sliding_layers: ClassVar[bool] = False

    artefact: str = "auto"
    interpolate: Literal["none", "linear"] = "none"
    rounding: Literal["largest_remainder", "nearest"] = "largest_remainder"

    artefact_kind = RATIOS_KIND

    def allocate(self, budget, lengths, protected, ctx):
        if ctx.sliding_window is not None:
            raise ConfigError(
                f"{self._where()}: layer {ctx.layer_idx} of this model is a sliding-window layer, and the "
                "calibrated ratios split the budget over every layer as if all were full-attention layers, "
                "so the layers kvlab compresses would not keep the total asked for. Use the online "
                "allocator (`--config prefixkv_online`: the threshold is shared by the full-attention "
                "layers; sliding layers keep their window)."
            )
        artefact = self.artefact_for(ctx)
        budgets, ratios = artefact.tensors["budgets"].double(), artefact.tensors["ratios"].double()
        calibrated = artefact.settings.get("calibration") or {}
        out = budget.clone()
        rows = zip(budget.tolist(), lengths.tolist(), protected.tolist(), strict=True)
        for b, (c, n, held) in enumerate(rows):
            if c >= n:
                continue
            want = min(int(calibrated.get("sinks", 1)) + int(calibrated.get("window", 1)), n)
            if held != want:
                raise ConfigError(
                    f"{self._where()}: the ratios were calibrated with {want} protected tokens (sinks "
                    f"{calibrated.get('sinks', 1)} + window {calibrated.get('window', 1)}), but this run's "
                    f"budget protects {held}, so the calibrated sizes do not apply. Set "
                    "model.compression.budget.sinks / window to the calibrated values, or calibrate with "
                    "this budget's (`kvlab calibrate --config prefixkv_layer_ratios`, sinks/window)."
                )
            fractions = self.fractions(budgets, ratios, c, n)  # [L]
            if self.rounding == "nearest":
                sizes = (n - torch.round((1 - fractions) * n)).long().clamp(held, n)
            else:
                sizes = fit_to_total(fractions * n, held, n, ctx.num_layers * c)
            out[b] = int(sizes[ctx.layer_idx])
        return out

    def fractions(self, budgets: torch.Tensor, ratios: torch.Tensor, c: int, n: int) -> torch.Tensor:
        """Kept fraction of every layer ``[L]`` for a per-head budget of ``c`` out of ``n`` tokens."""
        hits = [i for i, r in enumerate(budgets.tolist()) if int(r * n) == c]
        if hits:
            return ratios[min(hits, key=lambda i: abs(float(budgets[i]) - c / n))]
        if self.interpolate == "none":
            calibrated = ", ".join(f"{r:g}" for r in budgets.tolist())
            raise ConfigError(
                f"{self._where()}: a budget of {c} of {n} tokens (ratio {c / n:.4f}) is not one the artefact "
                f"was calibrated for (ratios {calibrated}). Use one of those ratios, calibrate this one "
                "(calibration.budgets), or set `interpolate: linear` on the allocator."
            )
        r = c / n
        grid, rows = budgets, ratios
        L = rows.shape[1]
        if not bool((grid <= 0).any()):  # r = 0 keeps nothing but the protected tokens
            grid, rows = torch.cat([grid.new_zeros(1), grid]), torch.cat([rows.new_zeros(1, L), rows])
        if not bool((grid >= 1).any()):  # r = 1 keeps everything
            grid, rows = torch.cat([grid, grid.new_ones(1)]), torch.cat([rows, rows.new_ones(1, L)])
        order = torch.argsort(grid)
        grid, rows = grid[order], rows[order]
        at = torch.tensor(r, dtype=grid.dtype, device=grid.device)
        i = int(torch.searchsorted(grid, at).clamp(1, len(grid) - 1))
        t = (r - float(grid[i - 1])) / max(float(grid[i] - grid[i - 1]), 1e-12)
        return rows[i - 1] + t * (rows[i] - rows[i - 1])
