"""HeadKV: the head budgets and the retrieval-reasoning statistic against their formulas
(``naive.headkv``: loops in fp64), the budget's total, batched equals unbatched, and the refusal
without an artefact."""

from __future__ import annotations

import pytest
import torch
from naive.context import make_ctx, sample_ctx
from naive.headkv import headkv_capacities, retrieval_reasoning_score
from support.needle_statistics import check_needle_statistic

from kvlab.compression.allocators import HEAD_ALLOCATORS
from kvlab.config.artefacts import Artefact
from kvlab.pipeline import Pipeline

SCORES = torch.rand(3, 4, generator=torch.Generator().manual_seed(1)) ** 3  # [L, H]: skewed


@pytest.mark.parametrize(("beta", "temp"), [(1.01, 1.0), (1.2, 1.0), (2.0, 0.5), (5.0, 2.0)])
@pytest.mark.parametrize("free", [16, 40, 97])
def test_capacities_match_the_formula(beta, temp, free):
    want = headkv_capacities(SCORES.double().tolist(), 2, free, beta, temp)
    nearest = HEAD_ALLOCATORS.build({"name": "headkv", "beta": beta, "temp": temp, "rounding": "nearest"})
    assert nearest.capacities(SCORES, 2, free).flatten().tolist() == [round(x) for x in want]
    exact = HEAD_ALLOCATORS.build({"name": "headkv", "beta": beta, "temp": temp})
    caps = exact.capacities(SCORES, 2, free).flatten()
    assert int(caps.sum()) == 6 * free  # the budget over the model
    assert all(abs(int(c) - x) < 1 for c, x in zip(caps, want, strict=True))  # floor or ceiling
    assert all(int(c) >= free - int(free // beta) for c in caps)  # every head keeps its base


def test_retrieval_reasoning_statistic_matches_the_loops():
    check_needle_statistic(
        "retrieval_reasoning_heads", retrieval_reasoning_score, seed=4, spans=[(13, 9), (11, 8)]
    )


def test_a_batch_keeps_what_each_sample_keeps_alone(tmp_path):
    path = Artefact("retrieval_reasoning_heads", "toy", 3, 4, 2, {"scores": SCORES}).save(tmp_path / "h.st")
    node = {
        "budget": {"ratio": 0.5, "window": 3},
        "importance": {"attention": {"name": "window_attention", "kernel": 7, "pool": "max", "agg": "mean"}},
        "allocate": {"head": {"name": "headkv", "artefact": str(path)}},
    }
    pipeline = Pipeline.from_config(node)
    for layer in range(3):
        ctx = make_ctx([37, 26], seed=layer, layer_idx=layer, num_layers=3)
        batched, _ = pipeline.compress(ctx)
        for b in range(2):
            alone, _ = pipeline.compress(sample_ctx(ctx, b))
            pad = ctx.seq_len - int(ctx.valid[b].sum())
            for h in range(2):
                assert [p - pad for p in batched.kept_positions(b, h)] == alone.kept_positions(0, h)
