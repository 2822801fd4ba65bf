"""PrefixKV's offline configuration: per-layer kept fractions measured on calibration samples.

PrefixKV (Wang et al. 2024, arXiv 2412.03409, Sec. 3.3 and Tables 5-7) solves the global
threshold on a few calibration samples, averages each layer's kept fraction over them and
reuses those fractions for every input. ``kvlab calibrate --config prefixkv_layer_ratios``
does this with the statistic below and writes an artefact of kind ``prefixkv_layer_ratios``::

    budgets     [R]        float64  the calibrated budgets r (fraction of the prompt KEPT)
    ratios      [R, L]     float32  mean over samples of each layer's kept fraction k_l / n
    per_sample  [R, N, L]  float32  the same per calibration sample (std / mad as in Table 7)
    thresholds  [R, N]     float32  each sample's threshold p (the smallest mass left out)

Every ratio in kvlab is a kept fraction. The released PrefixKV configs
(``confs/prefixkv_<model>_<x>.json``) store the fraction EVICTED per layer, under a file
suffix ``x`` that is the evicted fraction too (``_0.8`` is the 20% budget);
:func:`artefact_from_released_configs` converts them (``kept = 1 - x``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvlab.calibration.statistics import CALIBRATIONS, CalibrationBatch, CalibrationStatistic
from kvlab.compression.context import LayerContext
from kvlab.compression.prefixkv import RATIOS_KIND, exclusive_priority, global_sizes, layer_importance
from kvlab.config.artefacts import Artefact
from kvlab.config.errors import ConfigError

PAPER_BUDGETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # the kept budgets of Tables 1-2


@CALIBRATIONS.register(RATIOS_KIND)
@dataclass
class PrefixLayerRatios(CalibrationStatistic):
    """PrefixKV layer ratios: per budget, each layer's kept fraction under the global threshold.

    For every calibration prompt (``n`` tokens) and budget ``r``: ``I_l`` (attention each token
    received, averaged over query heads; ``layer_cumulative_attention``), the protected tokens
    (first ``sinks`` and last ``window`` tokens), a total of ``L max(floor(r n), |P|)`` tokens
    split by :func:`~kvlab.compression.prefixkv.global_sizes` (``solver``: ``exact`` or the
    paper's ``bisect``), and the kept fractions ``k_l / n``. The artefact holds their mean over
    samples (the release's configs are consistent with that mean; its aggregation script is not
    released). ``sinks`` and ``window`` must match the budget the artefact is used with (the
    presets: 1 and 1, the release's ``start_size`` and last prompt token).
    """

    budgets: tuple[float, ...] = PAPER_BUDGETS
    sinks: int = 1
    window: int = 1
    solver: Literal["exact", "bisect"] = "exact"

    def __post_init__(self) -> None:
        if not self.budgets or not all(0.0 < r <= 1.0 for r in self.budgets):
            raise ValueError(f"budgets must be kept fractions in (0, 1], got {self.budgets}")
        if len(set(self.budgets)) != len(self.budgets):
            raise ValueError(f"budgets are listed twice: {self.budgets}")
        if self.sinks < 0 or self.window < 0:
            raise ValueError(f"sinks and window must be >= 0, got {self.sinks}, {self.window}")

    def start(self, num_layers: int, num_heads: int, num_kv_heads: int) -> None:
        self._layers: dict[int, torch.Tensor] = {}
        self._rows: list[torch.Tensor] = []  # per sample: [R, L] kept fractions
        self._thresholds: list[torch.Tensor] = []  # per sample: [R]

    def observe(self, ctx: LayerContext, batch: CalibrationBatch) -> None:
        self._layers[ctx.layer_idx] = layer_importance(ctx.cumulative_attention()).cpu()
        if ctx.layer_idx != ctx.num_layers - 1:
            return
        importance = torch.stack([self._layers[layer] for layer in range(ctx.num_layers)])  # [L, B, T]
        valid = ctx.valid.cpu()
        for b in range(ctx.batch_size):
            n = int(valid[b].sum())
            position = torch.arange(n)
            protected = (position < self.sinks) | (position >= n - self.window)
            sample = importance[:, b, valid[b]]
            rows, thresholds = [], []
            for r in self.budgets:
                c = min(max(int(r * n), int(protected.sum())), n)
                sizes = global_sizes(sample, protected, ctx.num_layers * c, self.solver)
                rows.append(sizes.double() / n)
                thresholds.append(self.threshold(sample, protected, sizes))
            self._rows.append(torch.stack(rows))
            self._thresholds.append(torch.tensor(thresholds))
        self._layers = {}

    @staticmethod
    def threshold(importance: torch.Tensor, protected: torch.Tensor, sizes: torch.Tensor) -> float:
        """The threshold ``p`` of a solution: the smallest mass ranked below a kept prefix (1 if none)."""
        E = exclusive_priority(importance, protected)
        n = E.shape[1]
        first_out = [float(E[layer, k]) for layer, k in enumerate(sizes.tolist()) if k < n]
        return min(first_out, default=1.0)

    def result(self) -> dict[str, torch.Tensor]:
        if not self._rows:
            raise ConfigError(
                "calibration 'prefixkv_layer_ratios' saw no sample; give it a dataset of prompts."
            )
        per_sample = torch.stack(self._rows, 1)  # [R, N, L]
        return {
            "budgets": torch.tensor(self.budgets, dtype=torch.float64),
            "ratios": per_sample.mean(1).float(),
            "per_sample": per_sample.float(),
            "thresholds": torch.stack(self._thresholds, 1).float(),
        }


def artefact_from_released_configs(
    evicted: dict[float, list[float]],
    model: str,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    tolerance: float = 0.002,
) -> Artefact:
    """A ``prefixkv_layer_ratios`` artefact from the released PrefixKV configs (evicted fractions).

    Args:
        evicted: ``{x: [L floats]}``, the file suffix ``x`` of ``confs/prefixkv_<model>_<x>.json``
            (the EVICTED fraction) -> the list in that file (each layer's evicted fraction).
        model / num_layers / num_heads / num_kv_heads: the kvlab model the artefact is for.
        tolerance: the most a config's mean kept fraction may differ from its budget ``1 - x``.

    The artefact stores kept fractions: ``budget = 1 - x`` and ``ratio_l = 1 - value_l``.

    Raises:
        ConfigError: a config with another layer count, or whose mean does not match its name.
    """
    budgets, rows = [], []
    for x, values in sorted(evicted.items(), key=lambda item: -item[0]):
        if len(values) != num_layers:
            raise ConfigError(
                f"the released PrefixKV config for evicted fraction {x} has {len(values)} layers, but model "
                f"'{model}' has {num_layers}; it was made for another model."
            )
        kept = 1.0 - torch.tensor(values, dtype=torch.float64)
        if abs(float(kept.mean()) - (1.0 - x)) > tolerance:
            raise ConfigError(
                f"the released PrefixKV config for evicted fraction {x} keeps {float(kept.mean()):.4f} of "
                f"the tokens on average, not {1.0 - x:.4f}: its values are not evicted fractions of that "
                "budget."
            )
        budgets.append(round(1.0 - x, 10))  # 1 - 0.8 is 0.19999999999999996 in floating point
        rows.append(kept)
    return Artefact(
        kind=RATIOS_KIND,
        model=model,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        tensors={"budgets": torch.tensor(budgets, dtype=torch.float64), "ratios": torch.stack(rows).float()},
        settings={"source": "released PrefixKV configs (evicted fractions, converted: kept = 1 - x)"},
    )
