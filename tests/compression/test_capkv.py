"""CAPKV against the formula (``naive.capkv``: loops in fp64), a batch against its samples alone, its
one source for the sinks, its refusals, and what kvpress 0.5.5's ``CapPress`` keeps."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from naive.capkv import capkv
from naive.context import assert_scores, make_ctx, sample_ctx, sample_lists
from support import kvpress_cases

from kvlab.compression.capkv import CapKVScorer
from kvlab.config.errors import ConfigError
from kvlab.models.facts import LayerFacts, RotaryTable
from kvlab.pipeline import Pipeline

LENGTHS = [23, 15]
DIM = 8
FACTS = ("queries_before_rotation", "rotary")


def with_rotary(ctx, theta: float = 100.0, scaling: float = 1.0):
    """``ctx`` with a rotary embedding of base ``theta`` among its facts, and its ``inv_freq`` as a list."""
    inv_freq = 1.0 / theta ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM)
    facts = LayerFacts(provided=FACTS, rotary_table=RotaryTable(inv_freq, scaling))
    return dataclasses.replace(ctx, facts=facts), inv_freq.tolist()


@pytest.mark.parametrize(
    "tau, sinks, n_future, epsilon, rope_scaling",
    [
        (5.0, 4, 512, 1e-6, 1.0),  # the reference's settings
        (0.0, 0, 7, 0.0, 1.0),  # uniform weights: the leverage alone
        (12.0, 2, 3, 0.3, 1.3),  # a sharp anchor, a large epsilon, a scaled rope type
    ],
)
def test_capkv_matches_the_formula(tau, sinks, n_future, epsilon, rope_scaling):
    ctx, inv_freq = with_rotary(make_ctx(LENGTHS, dim=DIM, seed=21, scale=0.8), scaling=rope_scaling)
    scorer = CapKVScorer(tau=tau, n_future_positions=n_future, n_sink=sinks, epsilon=epsilon)
    got = scorer.score(ctx)
    assert got.shape == (2, 2, max(LENGTHS)) and got.dtype == torch.float32
    for b in range(len(LENGTHS)):
        n, off, q, k, v = sample_lists(ctx, b)
        want = capkv(
            q, k, v, inv_freq, rope_scaling=rope_scaling, tau=tau, sinks=sinks, n_future=n_future,
            epsilon=epsilon,
        )  # fmt: skip
        assert_scores(got[b, :, off:], want, atol=1e-5)
        assert not got[b, :, :off].any()  # padding scores 0


def test_a_score_is_the_log_determinant_its_entry_adds():
    """With every weight 1 (tau 0) and no epsilon, ``-log(1 - s_t) = log det A - log det(A - v_t v_t^T)``
    (the matrix determinant lemma): the leverage ranks entries by their share of ``log det A``."""
    ctx, _ = with_rotary(make_ctx(LENGTHS, heads=2, kv_heads=2, dim=DIM, seed=25))
    got = CapKVScorer(tau=0.0, n_sink=0, epsilon=0.0).score(ctx).double()
    for b in range(len(LENGTHS)):
        n, off, _, _, _ = sample_lists(ctx, b)
        for h in range(2):
            v = ctx.values[b, h, off:].double()  # [n, D]
            capacity = torch.eye(DIM, dtype=torch.float64) + v.T @ v
            for t in range(n):
                gain = torch.logdet(capacity) - torch.logdet(capacity - torch.outer(v[t], v[t]))
                torch.testing.assert_close(-torch.log1p(-got[b, h, off + t]), gain, atol=1e-5, rtol=1e-5)


def test_capkv_padded_batch_equals_each_sample_alone():
    ctx, _ = with_rotary(make_ctx(LENGTHS, dim=DIM, seed=22))
    scorer = CapKVScorer()
    batched = scorer.score(ctx)
    for b in range(len(LENGTHS)):
        alone = scorer.score(dataclasses.replace(sample_ctx(ctx, b), facts=ctx.facts))
        tail = batched[b, :, ctx.seq_len - alone.shape[-1] :]
        torch.testing.assert_close(tail, alone[0], atol=1e-6, rtol=1e-5)


def test_the_anchor_the_temperature_and_the_future_positions_change_the_ranking():
    """Each part of the formula is not a no-op: other queries, tau 0 and one future position each
    change the scores past the sinks."""
    ctx, _ = with_rotary(make_ctx(LENGTHS, dim=DIM, seed=23, scale=2.0), theta=10.0)
    flipped = dataclasses.replace(ctx, queries=-ctx.queries, _memo={})  # its own memoised queries
    base = CapKVScorer(n_sink=0).score(ctx)
    others = [
        CapKVScorer(n_sink=0).score(flipped),
        CapKVScorer(n_sink=0, tau=0.0).score(ctx),
        CapKVScorer(n_sink=0, n_future_positions=1).score(ctx),
    ]
    valid = ctx.valid[:, None, :].expand_as(base)
    for other in others:
        assert not torch.allclose(base[valid], other[valid], rtol=1e-3)


def test_a_sample_holding_only_sinks_scores_them_inf_and_nothing_nan():
    ctx, _ = with_rotary(make_ctx([9, 3], dim=DIM, seed=24))
    got = CapKVScorer(n_sink=4).score(ctx)
    assert not got.isnan().any()
    assert torch.equal(got[1, :, -3:], torch.full((2, 3), float("inf")))
    assert not got[1, :, :-3].any()


def test_n_sink_restates_the_budget_sinks():
    node = {"budget": {"tokens": 16, "window": 0, "sinks": 3}, "importance": {"capkv": {}}}
    assert Pipeline.from_config(node).importance["capkv"].n_sink == 3
    node["importance"]["capkv"]["n_sink"] = 4
    with pytest.raises(ConfigError, match="n_sink = 4 differs from model.compression.budget.sinks = 3"):
        Pipeline.from_config(node)


@pytest.mark.parametrize(
    "field, value", [("tau", -1.0), ("tau", float("nan")), ("n_future_positions", 0), ("epsilon", -0.1)]
)
def test_bad_parameters_are_refused_when_the_pipeline_is_built(field, value):
    node = {"budget": {"tokens": 16, "window": 0, "sinks": 4}, "importance": {"capkv": {field: value}}}
    with pytest.raises(ConfigError, match=field):
        Pipeline.from_config(node)


def test_capkv_declares_its_facts_and_is_refused_on_a_3d_rotary_embedding():
    caps = CapKVScorer.capabilities
    assert not caps.chunked_prefill and caps.model_facts == FACTS
    node = {"budget": {"tokens": 24, "window": 0, "sinks": 4}, "importance": {"capkv": {}}}
    with pytest.raises(ConfigError, match=r"importance.capkv \(capkv\) reads the model fact.*M-RoPE"):
        Pipeline.from_config(node).bind_model("tiny-qwen2-vl")


@pytest.mark.parametrize("case", ["capkv", "capkv_llama"])
def test_capkv_keeps_what_kvpress_keeps(case):
    """kvpress 0.5.5's CapPress hooked on the plain model (tests/fixtures/kvpress/) keeps what
    kvlab's prefill keeps, every layer and head: tiny-qwen2 (GQA) with the reference's settings,
    tiny-llama with 2 sinks, 64 future positions, tau 2 and epsilon 1e-3. kvpress projects the
    layer's input hidden states with ``q_proj``, kvlab rotates the post-RoPE queries back; kvpress
    pads its sinks at ``max + 1``, kvlab scores them ``+inf``."""
    want = kvpress_cases.recorded()["cases"][case]["kept"]
    assert kvpress_cases.kvlab_prefill_kept(kvpress_cases.CASES[case]) == want
