"""DMS's threshold selector against the naive rule (``naive.dms``), through a pipeline (the window
protected, a budget as a cap, a layer kept whole), and what kvpress 0.5.5's ``DMSPress`` keeps."""

from __future__ import annotations

import pytest
import torch
from naive.context import make_ctx
from naive.dms import threshold_keep
from support import kvpress_cases

from kvlab.compression.selectors import SELECTORS
from kvlab.pipeline import Pipeline

LENGTHS = [37, 26]


@pytest.mark.parametrize("threshold", [-0.5, 0.0, 0.7])
@pytest.mark.parametrize("count", [3, 12, 40])
def test_threshold_keeps_the_entries_above_it_at_most_the_count(threshold, count):
    ctx = make_ctx(LENGTHS, seed=31)
    gen = torch.Generator().manual_seed(32)
    scores = torch.randn(2, 2, max(LENGTHS), generator=gen)
    scores[:, :, -2:] = float("inf")  # protected
    for b, n in enumerate(LENGTHS):
        scores[b, :, : max(LENGTHS) - n] = float("-inf")  # padding
    counts = torch.tensor([[count, count // 2 + 2], [count, count]])
    selection = SELECTORS.build({"name": "threshold", "threshold": threshold}).select(scores, counts, ctx)
    for b in range(2):
        for h in range(2):
            want = threshold_keep(scores[b, h].tolist(), int(counts[b, h]), threshold)
            assert selection.kept_positions(b, h) == want
            assert int(selection.counts[b, h]) == len(want) <= int(counts[b, h])
    if threshold == 0.0 and count == 40:  # the threshold, not the count, decides: heads differ
        assert len(set(selection.counts.flatten().tolist())) > 1


def dms_node(threshold: float, **budget) -> dict:
    return {
        "budget": {"ratio": 1.0, "window": 4, **budget},
        "importance": {"key_norm": {}},
        "select": {"name": "threshold", "threshold": threshold},
    }


def test_a_pipeline_evicts_below_the_threshold_outside_the_window_and_the_budget_caps_it():
    ctx = make_ctx(LENGTHS, seed=33)
    norms = -ctx.keys.float().norm(dim=-1)  # key_norm's score
    threshold = float(norms[ctx.valid[:, None, :].expand_as(norms)].median())
    free, _ = Pipeline.from_config(dms_node(threshold)).compress(make_ctx(LENGTHS, seed=33))
    capped, _ = Pipeline.from_config(dms_node(threshold, ratio=None, tokens=12)).compress(
        make_ctx(LENGTHS, seed=33)
    )
    T = max(LENGTHS)
    for b, n in enumerate(LENGTHS):
        for h in range(2):
            row = norms[b, h].tolist()
            for t in range(T - n):
                row[t] = float("-inf")
            for t in range(T - 4, T):
                row[t] = float("inf")
            assert free.kept_positions(b, h) == threshold_keep(row, n, threshold)
            assert capped.kept_positions(b, h) == threshold_keep(row, 12, threshold)
    assert bool((capped.counts <= 12).all()) and bool((capped.counts < free.counts).any())


def test_a_layer_kept_whole_keeps_every_entry_under_a_threshold():
    """A pipeline that keeps a layer whole hands the selector its entries as protected (+inf)."""
    pipeline = Pipeline.from_config(dms_node(1e30))
    selection, report = pipeline._keep_all(make_ctx(LENGTHS, seed=34))
    assert selection.counts.tolist() == [[37, 37], [26, 26]] and torch.equal(report.kept, selection.counts)


@pytest.mark.parametrize("case", ["dms", "dms_qwen2"])
def test_dms_keeps_what_kvpress_keeps(case):
    """kvpress 0.5.5's DMSPress around KnormPress through its forward hook (tiny-llama, window 8;
    tiny-qwen2, window 16): the positions outside its masked_key_indices (tests/fixtures/kvpress/)."""
    want = kvpress_cases.recorded()["cases"][case]["kept"]
    got = kvpress_cases.kvlab_prefill_kept(kvpress_cases.CASES[case])
    assert got == want
    assert len({len(head) for layer in got for head in layer}) > 1  # the counts differ by head
