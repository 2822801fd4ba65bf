"""SimLayerKV (Zhang et al. 2024, arXiv 2410.13846): the ``sink_recent_mass`` layer metric against a
naive fp64 computation and the per-layer ``threshold`` rule."""

import pytest
import torch
from naive.context import make_ctx

from kvlab.cache.state import RunState
from kvlab.compression.routing import LAYER_METRICS, ROUTE_RULES
from kvlab.config.errors import ConfigError


def naive_mass(ctx, window: int, sinks: int, tokens: int) -> list[float]:
    """Per sample: the mean over the last ``window`` queries and the query heads of the fp64
    softmax attention (causal, padding masked) on the first ``sinks`` and last ``tokens - sinks``
    valid tokens."""
    out = []
    B, H, T, _ = ctx.queries.shape
    group = H // ctx.keys.shape[1]
    for b in range(B):
        n = int(ctx.valid[b].sum())
        pad = T - n
        q = ctx.queries[b, :, pad:].double()  # [H, n, D]
        k = ctx.keys[b, :, pad:].double()
        keep = [j for j in range(n) if j < sinks or j >= n - (tokens - sinks)]
        r = min(window, n)
        total = 0.0
        for h in range(H):
            for i in range(n - r, n):
                logits = (k[h // group, : i + 1] @ q[h, i]) * ctx.scaling
                probs = torch.softmax(logits, dim=0)
                total += float(sum(probs[j] for j in keep if j <= i))
        out.append(total / (H * r))
    return out


@pytest.mark.parametrize("window, sinks, tokens", [(4, 2, 8), (6, 0, 5), (3, 4, 30)])
def test_sink_recent_mass_matches_naive_fp64(window, sinks, tokens):
    ctx = make_ctx([21, 13], seed=7)
    metric = LAYER_METRICS.build(
        {"name": "sink_recent_mass", "window": window, "sinks": sinks, "tokens": tokens}
    )
    got = metric.measure(ctx)
    assert got.tolist() == pytest.approx(naive_mass(ctx, window, sinks, tokens), rel=1e-5, abs=1e-6)
    if tokens >= 21:  # sinks + recent cover every token: all the mass
        assert got.tolist() == pytest.approx([1.0, 1.0], rel=1e-5)


def test_sink_recent_mass_needs_a_token_count():
    metric = LAYER_METRICS.build({"name": "sink_recent_mass", "window": 4, "sinks": 4})
    with pytest.raises(ConfigError, match="budget.tokens"):
        metric.measure(make_ctx([10]))


class Sequence:
    """A stand-in metric that returns the given values ``[layer][b]``."""

    def __init__(self, values):
        self.values = values

    def measure(self, ctx):
        return torch.tensor(self.values[ctx.layer_idx])


def test_threshold_rule_decides_each_layer_on_its_own():
    """Lazy layers need not be contiguous; NaN and a tie go to `full` (strictly above); no state."""
    rule = ROUTE_RULES.build({"name": "threshold", "threshold": 0.9})
    assert rule.branch_names == ("full", "lazy")
    values = [[0.95, 0.2], [0.5, 0.91], [0.97, float("nan")], [0.9, 0.99]]
    rule._metric = Sequence(values)
    run = RunState()
    got = []
    for layer in range(4):
        decision = rule.decide(make_ctx([6, 4], layer_idx=layer, run=run))
        got.append(decision.branches)
        assert decision.switched.tolist() == [name == "lazy" for name in decision.branches]
        torch.testing.assert_close(decision.metric, torch.tensor(values[layer]), equal_nan=True)
    assert got == [["lazy", "full"], ["full", "lazy"], ["lazy", "full"], ["full", "lazy"]]
