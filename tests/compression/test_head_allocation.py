"""AdaKV and SparseMM head allocators against naive loops written from their papers' formulas."""

import math

import pytest
import torch
from naive.attention import INF, naive_window_scores
from naive.budgets import naive_rank
from naive.context import LENGTHS, make_ctx, sample_lists

from kvlab.compression.allocators import round_to_total
from kvlab.config.artefacts import Artefact
from kvlab.config.errors import ConfigError
from kvlab.pipeline import Pipeline

W = 4


def naive_round_to_total(reals: list[float], total: int) -> list[int]:
    base = [math.floor(x) for x in reals]
    order = sorted(range(len(reals)), key=lambda i: (-(reals[i] - base[i]), i))
    for i in order[: total - sum(base)]:
        base[i] += 1
    return base


def naive_global_counts(rows: list[list[float]], k: int) -> list[int]:
    """Per-head winners of the global top-k over flattened sorted rows (ties: lower flat index)."""
    flat = [(value, h * len(row) + r, h) for h, row in enumerate(rows) for r, value in enumerate(row)]
    flat.sort(key=lambda item: (-item[0], item[1]))
    counts = [0] * len(rows)
    for _, _, h in flat[:k]:
        counts[h] += 1
    return counts


def naive_adakv(signal: list[list[float]], budget: int, alpha: float, variant, normalize, rounding):
    """One sample: signal [Hkv][P] candidate scores -> kept candidates per head."""
    H, P = len(signal), len(signal[0])
    if budget >= P:
        return [P] * H
    rows = [sorted(row, reverse=True) for row in signal]
    floor = int(alpha * budget)
    if variant == "guarantee_topk":
        rows = [[INF] * floor + row[floor:] for row in rows]
        return naive_global_counts(rows, H * budget)
    if normalize:
        rows = [[x * sum(row[:budget]) / sum(row) for x in row] for row in rows]
    counts = naive_global_counts(rows, H * budget)
    if rounding == "nearest":
        return [round(c * (1 - alpha) + floor) for c in counts]
    return naive_round_to_total([c * (1 - alpha) + alpha * budget for c in counts], H * budget)


def adakv_config(tokens, **head):
    return {
        "budget": {"tokens": tokens, "window": W},
        "importance": {
            "attention": {"name": "window_attention", "window": W, "kernel": 5, "pool": "max", "agg": "mean"}
        },
        "allocate": {"head": {"name": "adakv", **head}},
    }


@pytest.mark.parametrize("variant", ["linear_mix", "guarantee_topk"])
@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("rounding", ["exact_total", "nearest"])
def test_adakv_counts_and_kept_sets_match_naive(variant, alpha, normalize, rounding):
    tokens = 13
    ctx = make_ctx(LENGTHS, heads=8, kv_heads=4, seed=41, num_layers=2)
    head = {"alpha": alpha, "variant": variant, "normalize": normalize, "rounding": rounding}
    selection, report = Pipeline.from_config(adakv_config(tokens, **head)).compress(ctx)
    for b, n in enumerate(LENGTHS):
        _, off, q, k, _ = sample_lists(ctx, b)
        scores = naive_window_scores(q, k, ctx.scaling, W, kernel=5, pool="max", agg="mean")
        P = n - W
        signal = [row[:P] for row in scores]
        counts = naive_adakv(signal, tokens - W, alpha, variant, normalize, rounding)
        assert report.kept[b].tolist() == [c + W for c in counts], (b, counts)
        if rounding == "exact_total" or variant == "guarantee_topk":
            assert sum(counts) == 4 * (tokens - W)  # the layer keeps exactly its budget
        for h in range(4):
            want = [off + p for p in sorted(naive_rank(signal[h], counts[h]) + list(range(P, n)))]
            assert selection.kept_positions(b, h) == want


def test_adakv_limits_alpha_one_is_uniform_and_skip_layers_are_uniform():
    ctx = make_ctx(LENGTHS, heads=8, kv_heads=4, seed=42, num_layers=2)
    uniform = {
        "budget": {"tokens": 13, "window": W},
        "importance": {
            "attention": {"name": "window_attention", "window": W, "kernel": 5, "pool": "max", "agg": "mean"}
        },
    }
    want, _ = Pipeline.from_config(uniform).compress(ctx)
    for head in ({"alpha": 1.0}, {"alpha": 0.2, "skip": 1}):
        got, _ = Pipeline.from_config(adakv_config(13, **head)).compress(ctx)
        assert torch.equal(got.indices, want.indices) and torch.equal(got.counts, want.counts)
    ragged, _ = Pipeline.from_config(adakv_config(13, alpha=0.0)).compress(ctx)
    assert len(set(ragged.counts.flatten().tolist())) > 1  # really ragged on random keys


def test_round_to_total_matches_naive():
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        reals = torch.rand(7, generator=gen) * 10
        total = int(reals.sum().round())
        assert round_to_total(reals, total).tolist() == naive_round_to_total(reals.tolist(), total)


# ---------------------------------------------------------------------------------------------
# SparseMM


def visual_heads(path, model="tiny", layers=2, heads=8, kv_heads=4, seed=0, scores=None):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(layers, heads, generator=gen) ** 4 if scores is None else scores
    Artefact("visual_heads", model, layers, heads, kv_heads, {"scores": scores}).save(path)
    return scores


def naive_sparsemm_caps(scores: list[list[float]], kv_heads: int, budget: int, ratio: float, rounding):
    L, H = len(scores), len(scores[0])
    G = H // kv_heads
    total = sum(sum(row) for row in scores)
    s_kv = [[sum(row[j * G + g] / total for g in range(G)) for j in range(kv_heads)] for row in scores]
    min_cache = int(budget * ratio)
    remain = (budget - min_cache) * L * kv_heads
    reals = [s * remain + min_cache for row in s_kv for s in row]
    if rounding == "nearest":
        flat = [round(x) for x in reals]
    else:
        flat = naive_round_to_total(reals, L * kv_heads * budget)
    return [flat[layer * kv_heads : (layer + 1) * kv_heads] for layer in range(L)]


@pytest.mark.parametrize("rounding", ["exact_total", "nearest"])
def test_sparsemm_caps_and_kept_sets_match_naive(tmp_path, rounding):
    path = tmp_path / "vh.safetensors"
    scores = visual_heads(path)
    tokens = 13
    cfg = {
        "budget": {"tokens": tokens, "window": W},
        "importance": {"attention": {"name": "window_attention", "window": W, "kernel": 5}},
        "allocate": {"head": {"name": "sparsemm", "artefact": str(path), "ratio": 0.1, "rounding": rounding}},
    }
    pipe = Pipeline.from_config(cfg)
    caps = naive_sparsemm_caps(scores.double().tolist(), 4, tokens - W, 0.1, rounding)
    if rounding == "exact_total":
        assert sum(map(sum, caps)) == 2 * 4 * (tokens - W)
    assert max(map(max, caps)) > 2 * (tokens - W) // 2  # skewed towards the top heads
    for layer in range(2):
        ctx = make_ctx(LENGTHS, heads=8, kv_heads=4, seed=43 + layer, layer_idx=layer, num_layers=2)
        selection, report = pipe.compress(ctx)
        for b, n in enumerate(LENGTHS):
            _, off, q, k, _ = sample_lists(ctx, b)
            window_scores = naive_window_scores(q, k, ctx.scaling, W, kernel=5)
            P = n - W
            for h in range(4):
                kept = min(caps[layer][h], P)  # a cap above the candidates is clamped
                assert int(report.kept[b, h]) == kept + W
                want = sorted(naive_rank(window_scores[h][:P], kept) + list(range(P, n)))
                assert selection.kept_positions(b, h) == [off + p for p in want]


def test_sparsemm_artefact_errors_are_clear(tmp_path):
    cfg = {
        "budget": {"tokens": 13, "window": W},
        "importance": {"attention": {"name": "window_attention", "window": W}},
        "allocate": {"head": {"name": "sparsemm", "artefact": str(tmp_path / "missing.safetensors")}},
    }
    ctx = make_ctx(LENGTHS, heads=8, kv_heads=4, num_layers=2)
    with pytest.raises(ConfigError, match="does not exist.*kvlab calibrate"):
        Pipeline.from_config(cfg).compress(ctx)
    path = tmp_path / "other.safetensors"
    visual_heads(path, model="some-other-model", layers=3)
    cfg["allocate"]["head"]["artefact"] = str(path)
    with pytest.raises(ConfigError, match="calibrated on model 'some-other-model'.*'tiny'"):
        Pipeline.from_config(cfg).bind_model("tiny")
    with pytest.raises(ConfigError, match="num_layers = 3.*has 2"):
        Pipeline.from_config(cfg).compress(ctx)
    zeros = tmp_path / "zeros.safetensors"
    visual_heads(zeros, scores=torch.zeros(2, 8))
    cfg["allocate"]["head"]["artefact"] = str(zeros)
    with pytest.raises(ConfigError, match="all zero"):
        Pipeline.from_config(cfg).compress(ctx)
