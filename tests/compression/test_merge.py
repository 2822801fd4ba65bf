"""LOOK-M merge selector: a hand-computed example, a naive per-(sample, head) loop, and invariants."""

import math

import pytest
import torch
from naive.attention import dot, norm
from naive.budgets import naive_rank
from naive.context import make_ctx

from kvlab.compression.context import LayerContext
from kvlab.compression.merge import MergeSelector

RULES = ["averaged", "pivotal", "weighted"]


def hand_ctx():
    """Hand example: kept c1=(1,0), c2=(0,1); evicted e1=(2,.1), e2=(1,.2), e3=(.1,3)."""
    keys = torch.tensor([[1, 0], [2, 0.1], [0, 1], [1, 0.2], [0.1, 3]])
    values = torch.tensor([[1, 1], [2, 2], [0, 0], [4, 0], [3, 3]])
    T = keys.shape[0]
    return LayerContext(
        layer_idx=0,
        num_layers=1,
        queries=torch.zeros(1, 1, T, 2),
        keys=keys[None, None],
        values=values[None, None].float(),
        valid=torch.ones(1, T, dtype=torch.bool),
        modality=torch.zeros(1, T, dtype=torch.long),
        scaling=1.0,
    )


EXPECTED = {  # (k_c1, k_c2, v_c1, v_c2) computed by hand
    "averaged": ([1.333333, 0.1], [0.05, 2.0], [2.333333, 1.0], [1.5, 1.5]),
    "pivotal": ([1.166667, 0.05], [0.025, 1.5], [1.666667, 1.0], [0.75, 0.75]),
    "weighted": ([1.326028, 0.098664], [0.049972, 1.999167], [2.306609, 0.999168], [1.499167, 1.499167]),
}


@pytest.mark.parametrize("rule", RULES)
def test_hand_example(rule):
    ctx = hand_ctx()
    scores = torch.tensor([[[1.0, 0, 1, 0, 0]]])  # keep positions 0 and 2
    sel = MergeSelector(rule=rule).select(scores, torch.tensor([[2]]), ctx)
    assert sel.kept_positions(0, 0) == [0, 2]
    k1, k2, v1, v2 = (torch.tensor(x) for x in EXPECTED[rule])
    torch.testing.assert_close(sel.keys[0, 0], torch.stack([k1, k2]), atol=1e-5, rtol=0)
    torch.testing.assert_close(sel.values[0, 0], torch.stack([v1, v2]), atol=1e-5, rtol=0)


def naive_merge(k, v, kept, valid, rule, filt):
    """One (sample, head): lists of floats -> merged (keys, values) of the kept positions, in order."""
    evicted = [i for i in range(len(k)) if valid[i] and i not in kept]

    def cos(a, b):
        return dot(a, b) / (max(norm(a), 1e-6) * max(norm(b), 1e-6))

    match = {}
    for i in evicted:
        sims = [cos(k[i], k[c]) for c in kept]
        best = max(sims)
        match[i] = (kept[sims.index(best)], best)  # first maximum = lowest position
    if filt == "mean_max_sim" and evicted:
        mean = sum(s for _, s in match.values()) / len(evicted)
        match = {i: m for i, m in match.items() if m[1] >= mean}
    out = []
    for x in (k, v):
        rows = []
        for c in kept:
            total, n = list(x[c]), 0
            for i, (target, s) in match.items():
                if target != c:
                    continue
                n += 1
                for d in range(len(total)):
                    src = {"averaged": x[i][d], "pivotal": (x[i][d] + x[c][d]) / 2, "weighted": s * x[i][d]}
                    total[d] += src[rule]
            rows.append([t / (n + 1) for t in total])
        out.append(rows)
    return out


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("filt", ["none", "mean_max_sim"])
def test_merge_matches_naive_loop_per_sample_and_head(rule, filt):
    ctx = make_ctx([23, 15], seed=3)
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(2, 2, 23, generator=gen).masked_fill(~ctx.valid[:, None], float("-inf"))
    counts = torch.tensor([[7, 9], [5, 6]])
    sel = MergeSelector(rule=rule, filter=filt, chunk=5).select(scores, counts, ctx)
    for b in range(2):
        for h in range(2):
            kept = naive_rank(scores[b, h].tolist(), int(counts[b, h]))
            assert sel.kept_positions(b, h) == kept
            want_k, want_v = naive_merge(
                ctx.keys[b, h].double().tolist(),
                ctx.values[b, h].double().tolist(),
                kept,
                ctx.valid[b].tolist(),
                rule,
                filt,
            )
            n = len(kept)
            torch.testing.assert_close(
                sel.keys[b, h, :n].double(), torch.tensor(want_k, dtype=torch.float64), atol=1e-5, rtol=0
            )
            torch.testing.assert_close(
                sel.values[b, h, :n].double(), torch.tensor(want_v, dtype=torch.float64), atol=1e-5, rtol=0
            )


@pytest.mark.parametrize("rule", RULES)
def test_merging_a_token_into_itself_is_the_identity(rule):
    ctx = make_ctx([12], kv_heads=1, seed=1)
    ctx.keys[0, 0, 6:] = ctx.keys[0, 0, :6]  # evicted tokens 6..11 duplicate kept tokens 0..5
    ctx.values[0, 0, 6:] = ctx.values[0, 0, :6]
    scores = torch.arange(12, 0, -1).float()[None, None]
    sel = MergeSelector(rule=rule).select(scores, torch.tensor([[6]]), ctx)
    assert sel.kept_positions(0, 0) == list(range(6))
    torch.testing.assert_close(sel.keys[0, 0], ctx.keys[0, 0, :6])
    torch.testing.assert_close(sel.values[0, 0], ctx.values[0, 0, :6])


def test_averaged_merge_conserves_the_sum_and_holds_the_budget():
    ctx = make_ctx([19, 11], seed=2)
    gen = torch.Generator().manual_seed(2)
    scores = torch.rand(2, 2, 19, generator=gen).masked_fill(~ctx.valid[:, None], float("-inf"))
    scores[0, 0, 0] = 2.0  # position 0 kept in a row with padding slots (their index is 0 too)
    counts = torch.tensor([[4, 6], [3, 11]])
    sel = MergeSelector(rule="averaged").select(scores, counts, ctx)
    assert torch.equal(sel.counts, counts)
    kept = sel.kept_mask(19)  # not a scatter of sel.mask(): padding slots (index 0, False) would unset 0
    unit = torch.nn.functional.normalize(ctx.keys, dim=-1)
    for b in range(2):
        for h in range(2):
            n = int(counts[b, h])
            pos = sel.kept_positions(b, h)
            sims = unit[b, h] @ unit[b, h, pos].T
            fan_in = torch.bincount(sims.argmax(-1)[ctx.valid[b] & ~kept[b, h]], minlength=n) + 1
            total = (sel.keys[b, h, :n] * fan_in[:, None]).sum(0)
            torch.testing.assert_close(total, ctx.keys[b, h][ctx.valid[b]].sum(0), atol=1e-4, rtol=0)
    assert math.isfinite(float(sel.keys.sum()))
