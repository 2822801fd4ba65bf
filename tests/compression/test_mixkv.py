"""MixKV components against independent naive implementations of the paper's formulas (Sec. 3.2-3.3)."""

import math

import pytest
import torch
from naive.attention import INF, dot, naive_window_scores, norm
from naive.budgets import naive_snapkv_keep
from naive.context import LENGTHS, build, make_ctx, sample_lists

from kvlab.compression.diversity import DIVERSITY
from kvlab.compression.mixers import MIXERS, head_redundancy
from kvlab.pipeline import Pipeline

EPS = 1e-8
W = 4


def naive_minmax(xs: list[float]) -> list[float]:
    lo, hi = min(xs), max(xs)
    return [(x - lo) / (hi - lo + EPS) for x in xs]


def naive_scale_to(xs: list[float], ref: list[float]) -> list[float]:
    factor = (sum(ref) / len(ref)) / (sum(xs) / len(xs) + EPS)
    return [x * factor for x in xs]


def naive_unit_mean(keys: list[list[float]]) -> list[float]:
    units = [[x / norm(k) for x in k] for k in keys]
    return [sum(u[d] for u in units) / len(units) for d in range(len(keys[0]))]


def naive_redundancy_explicit(keys: list[list[float]]) -> float:
    """Mean off-diagonal cosine similarity, the O(T^2) definition (MixKV Eq. 3)."""
    n = len(keys)
    total = sum(
        dot(keys[i], keys[j]) / (norm(keys[i]) * norm(keys[j])) for i in range(n) for j in range(n) if i != j
    )
    return min(max(total / (n * (n - 1)), 0.0), 1.0)


def naive_mixkv(q, k, v, scaling, window, diversity_scale="ex", r_mode="online", r_fixed=0.5, vnorm=True):
    """MixKV Eq. 5 (scales matched as in Sec. 3.3), one unpadded sample: (scores [Hkv][P], r [Hkv])."""
    s_ex_all = naive_window_scores(q, k, scaling, window, kernel=5, pool="avg", agg="mean")
    n = len(k[0])
    P = n - window
    comps, rs = [], []
    for h in range(len(k)):
        s_ex = s_ex_all[h][:P]
        s_imp = list(s_ex)
        if vnorm:
            s_in = naive_scale_to(naive_minmax([norm(v[h][t]) for t in range(P)]), s_ex)
            s_imp = [a + b for a, b in zip(s_ex, s_in, strict=True)]
        mean_unit = naive_unit_mean(k[h])  # over all n tokens, window included
        s_div = [-dot([x / norm(k[h][t]) for x in k[h][t]], mean_unit) for t in range(P)]
        ref = s_ex if diversity_scale == "ex" else s_imp
        s_div = naive_scale_to(naive_minmax(s_div), ref)
        if r_mode == "online":
            r = naive_redundancy_explicit(k[h])
        else:
            r = r_fixed[h] if isinstance(r_fixed, list) else r_fixed
        comps.append([(1 - r) * a + r * b for a, b in zip(s_imp, s_div, strict=True)])
        rs.append(r)
    return comps, rs


def mixkv_config(tokens, diversity_scale="ex", redundancy="online", fixed=0.5, vnorm=True):
    importance = {
        "attention": {"name": "window_attention", "window": W, "kernel": 5, "pool": "avg", "agg": "mean"}
    }
    if vnorm:
        importance["value_norm"] = {}
    return {
        "budget": {"tokens": tokens, "window": W},
        "importance": importance,
        "diversity": {"mean_key_diversity": {}},
        "mixer": {
            "name": "mixkv",
            "extrinsic": "attention",
            "intrinsic": ["value_norm"] if vnorm else [],
            "diversity": ["mean_key_diversity"],
            "diversity_scale": diversity_scale,
            "redundancy": redundancy,
            "fixed_redundancy": fixed,
        },
    }


def test_redundancy_o_td_equals_explicit_off_diagonal_mean():
    ctx = make_ctx(LENGTHS, seed=31, dim=6)
    ctx.keys = ctx.keys + 2.0  # a shared direction: redundancy well above 0
    r = head_redundancy(ctx)
    for b in range(2):
        _, _, _, k, _ = sample_lists(ctx, b)
        for h in range(2):
            assert r[b, h].item() == pytest.approx(naive_redundancy_explicit(k[h]), abs=1e-5)
    assert float(r.min()) > 0.2 and float(r.max()) <= 1.0


def test_redundancy_limits_identical_and_orthogonal_keys():
    ctx = make_ctx([5], dim=8, seed=1)
    ctx.keys = torch.randn(1, 1, 1, 8).expand(1, 2, 5, 8).clone()
    assert torch.allclose(head_redundancy(ctx), torch.ones(1, 2))
    ctx = make_ctx([5], dim=8, seed=1)
    ctx.keys = torch.eye(8)[:5].expand(1, 2, 5, 8).clone() * 3
    assert torch.allclose(head_redundancy(ctx), torch.zeros(1, 2), atol=1e-6)


def test_mean_key_diversity_matches_naive():
    ctx = make_ctx(LENGTHS, seed=32)
    scores = build(DIVERSITY, name="mean_key_diversity").score(ctx)
    for b in range(2):
        n, off, _, k, _ = sample_lists(ctx, b)
        for h in range(2):
            mean_unit = naive_unit_mean(k[h])
            want = [-dot([x / norm(kt) for x in kt], mean_unit) for kt in k[h]]
            torch.testing.assert_close(scores[b, h, off:].double(), torch.tensor(want, dtype=torch.float64))


@pytest.mark.parametrize("diversity_scale", ["ex", "imp"])
@pytest.mark.parametrize("vnorm", [True, False])
def test_mixkv_scores_and_kept_sets_match_naive(diversity_scale, vnorm):
    tokens = 12
    ctx = make_ctx(LENGTHS, seed=33)
    pipe = Pipeline.from_config(mixkv_config(tokens, diversity_scale, vnorm=vnorm))
    selection, report = pipe.compress(ctx, record_scores=True)
    for b in range(2):
        n, off, q, k, v = sample_lists(ctx, b)
        comps, _ = naive_mixkv(q, k, v, ctx.scaling, W, diversity_scale, vnorm=vnorm)
        for h in range(2):
            got = report.scores[b, h, off : off + n - W].double()
            torch.testing.assert_close(got, torch.tensor(comps[h], dtype=torch.float64), atol=1e-5, rtol=1e-5)
            want = [off + p for p in naive_snapkv_keep(comps[h] + [INF] * W, n, W, tokens)]
            assert selection.kept_positions(b, h) == want


@pytest.mark.parametrize("fixed", [0.0, 1.0, 0.5])
def test_mixkv_fixed_redundancy_matches_naive(fixed):
    ctx = make_ctx(LENGTHS, seed=34)
    _, report = Pipeline.from_config(mixkv_config(12, redundancy="fixed", fixed=fixed)).compress(
        ctx, record_scores=True
    )
    for b in range(2):
        n, off, q, k, v = sample_lists(ctx, b)
        comps, _ = naive_mixkv(q, k, v, ctx.scaling, W, r_mode="fixed", r_fixed=fixed)
        for h in range(2):
            got = report.scores[b, h, off : off + n - W].double()
            torch.testing.assert_close(got, torch.tensor(comps[h], dtype=torch.float64), atol=1e-5, rtol=1e-5)


def test_mixkv_ranking_is_invariant_to_the_scale_of_window_attention():
    """Every term scales with s_ex, so sum vs mean over the window keeps the same tokens."""
    ctx = make_ctx(LENGTHS, seed=35)
    mean_cfg = mixkv_config(12)
    sum_cfg = mixkv_config(12)
    sum_cfg["importance"]["attention"]["agg"] = "sum"
    a, _ = Pipeline.from_config(mean_cfg).compress(ctx)
    b, _ = Pipeline.from_config(sum_cfg).compress(ctx)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.counts, b.counts)


def test_integrated_importance_is_window_attention_plus_scaled_vnorm():
    """weighted_sum scaled to the attention role is s_ex + s_in_scaled, over candidates only."""
    ctx = make_ctx(LENGTHS, seed=36)
    cfg = {
        "budget": {"tokens": 12, "window": W},
        "importance": {
            "attention": {"name": "window_attention", "window": W, "kernel": 5, "agg": "mean"},
            "value_norm": {},
        },
        "mixer": {"name": "weighted_sum", "normalize": "scale_to_reference", "reference": "attention"},
    }
    _, report = Pipeline.from_config(cfg).compress(ctx, record_scores=True)
    for b in range(2):
        n, off, q, k, v = sample_lists(ctx, b)
        s_ex = naive_window_scores(q, k, ctx.scaling, W, agg="mean")
        for h in range(2):
            P = n - W
            s_in = naive_scale_to(naive_minmax([norm(v[h][t]) for t in range(P)]), s_ex[h][:P])
            want = [a + c for a, c in zip(s_ex[h][:P], s_in, strict=True)]
            got = report.scores[b, h, off : off + P].double()
            torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=1e-5)


def test_mixer_inputs_and_ranges_are_checked_when_the_config_is_read():
    from kvlab.config.errors import ConfigError

    no_diversity = mixkv_config(12)
    no_diversity["diversity"] = {}
    with pytest.raises(ConfigError, match=r"mixer.diversity names 'mean_key_diversity'.*diversity roles"):
        Pipeline.from_config(no_diversity)
    no_diversity["mixer"]["diversity"] = []
    with pytest.raises(ConfigError, match="mixer.diversity is empty: MixKV mixes in at least one diversity"):
        Pipeline.from_config(no_diversity)
    no_extrinsic = mixkv_config(12)
    no_extrinsic["mixer"]["extrinsic"] = "attn"
    with pytest.raises(ConfigError, match=r"mixer.extrinsic names 'attn'.*Did you mean 'attention'"):
        Pipeline.from_config(no_extrinsic)
    unused = mixkv_config(12)
    unused["mixer"]["intrinsic"] = []
    with pytest.raises(ConfigError, match="exactly one MixKV role.*no role for: value_norm"):
        Pipeline.from_config(unused)
    with pytest.raises(ConfigError, match="fixed_redundancy"):
        build(MIXERS, name="mixkv", extrinsic="a", diversity=["d"], fixed_redundancy=1.5)
    two_weights = mixkv_config(12)
    two_weights["mixer"] = {"name": "weighted_sum", "weights": {"attention": 1.0, "value_norm": 2.0}}
    with pytest.raises(ConfigError, match="weights gives no weight to mean_key_diversity"):
        Pipeline.from_config(two_weights)


def test_mixkv_batch_equals_each_sample_alone():
    from naive.context import sample_ctx

    ctx = make_ctx(LENGTHS, seed=38)
    pipe = Pipeline.from_config(mixkv_config(12))
    batched, _ = pipe.compress(ctx)
    for b in range(2):
        alone, _ = pipe.compress(sample_ctx(ctx, b))
        off = ctx.seq_len - LENGTHS[b]
        assert batched.kept_positions(b, 0) == [off + p for p in alone.kept_positions(0, 0)]
        assert batched.kept_positions(b, 1) == [off + p for p in alone.kept_positions(0, 1)]


def test_math_sanity_of_naive_helpers():
    assert naive_minmax([1.0, 3.0, 2.0]) == pytest.approx([0.0, 1.0, 0.5])
    assert math.isclose(sum(naive_scale_to([1.0, 2.0], [10.0, 30.0])) / 2, 20.0, rel_tol=1e-6)


def test_mixkv_offline_redundancy_reads_the_layer_row_of_a_calibration_artefact(tmp_path):
    from kvlab.config.artefacts import Artefact

    table = torch.tensor([[0.1, 0.9], [0.7, 0.3], [0.5, 0.5], [0.0, 1.0]])  # [L = 4, Hkv = 2]
    path = Artefact("redundancy", "tiny", 4, 4, 2, {"redundancy": table}).save(tmp_path / "r.safetensors")
    cfg = mixkv_config(12, redundancy="offline")
    cfg["mixer"]["artefact"] = str(path)
    pipe = Pipeline.from_config(cfg)
    ctx = make_ctx(LENGTHS, seed=39, layer_idx=1)
    _, report = pipe.compress(ctx, record_scores=True)
    for b in range(2):
        n, off, q, k, v = sample_lists(ctx, b)
        comps, _ = naive_mixkv(q, k, v, ctx.scaling, W, r_mode="offline", r_fixed=table[1].tolist())
        for h in range(2):
            got = report.scores[b, h, off : off + n - W].double()
            torch.testing.assert_close(got, torch.tensor(comps[h], dtype=torch.float64), atol=1e-5, rtol=1e-5)
