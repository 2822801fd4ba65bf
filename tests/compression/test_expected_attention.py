"""Expected Attention against the formula (``naive.expected_attention``: loops in fp64), its model
facts, its one source for the sinks, and what kvpress 0.5.5's ``ExpectedAttentionPress`` keeps."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from naive.context import assert_scores, make_ctx, sample_lists
from naive.expected_attention import expected_attention
from support import kvpress_cases

from kvlab.compression.expected_attention import ExpectedAttentionScorer
from kvlab.config.errors import ConfigError
from kvlab.models.facts import LayerFacts, RotaryTable, rotate_half
from kvlab.pipeline import Pipeline

LENGTHS = [23, 15]
DIM = 8


def with_rotary(ctx, theta: float = 100.0, scaling: float = 1.0, facts=("queries_before_rotation", "rotary")):
    """``ctx`` with a rotary embedding of base ``theta`` among its declared facts."""
    inv_freq = 1.0 / theta ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM)
    table = RotaryTable(inv_freq, scaling)
    return dataclasses.replace(ctx, facts=LayerFacts(provided=facts, rotary_table=table)), inv_freq.tolist()


@pytest.mark.parametrize(
    "covariance, vnorm, epsilon, sinks, n_future, rope_scaling, softmax_scale",
    [
        (True, True, 0.02, 4, 512, 1.0, None),  # the reference's settings
        (False, True, 0.0, 4, 16, 1.0, None),
        (True, False, 0.0, 0, 7, 1.0, None),
        (True, True, 0.5, 2, 3, 1.3, 0.21),  # a scaled rope type, a model's own softmax scale
    ],
)
def test_expected_attention_matches_the_formula(covariance, vnorm, epsilon, sinks, n_future, rope_scaling,
                                                softmax_scale):  # fmt: skip
    ctx, inv_freq = with_rotary(make_ctx(LENGTHS, dim=DIM, seed=11, scale=0.7), scaling=rope_scaling)
    if softmax_scale is not None:
        ctx = dataclasses.replace(ctx, scaling=softmax_scale)
    scorer = ExpectedAttentionScorer(
        n_future_positions=n_future, n_sink=sinks, use_covariance=covariance, use_vnorm=vnorm, epsilon=epsilon
    )
    got = scorer.score(ctx)
    assert got.shape == (2, 2, max(LENGTHS)) and got.dtype == torch.float32
    for b in range(len(LENGTHS)):
        n, off, q, k, v = sample_lists(ctx, b)
        want = expected_attention(
            q, k, v, inv_freq, rope_scaling=rope_scaling, softmax_scale=ctx.scaling, sinks=sinks,
            n_future=n_future, covariance=covariance, vnorm=vnorm, epsilon=epsilon,
        )  # fmt: skip
        assert_scores(got[b, :, off:], want, atol=1e-5)


def test_expected_attention_depends_on_the_future_positions_and_the_covariance():
    """The rotation to the future and the covariance term change the ranking (they are not no-ops)."""
    ctx, _ = with_rotary(make_ctx(LENGTHS, dim=DIM, seed=12, scale=2.0), theta=10.0)
    base = ExpectedAttentionScorer(n_sink=0, use_vnorm=False).score(ctx)
    near = ExpectedAttentionScorer(n_sink=0, use_vnorm=False, n_future_positions=1).score(ctx)
    flat = ExpectedAttentionScorer(n_sink=0, use_vnorm=False, use_covariance=False).score(ctx)
    valid = ctx.valid[:, None, :].expand_as(base)
    assert not torch.allclose(base[valid], near[valid], atol=1e-4)
    assert not torch.allclose(base[valid], flat[valid], atol=1e-4)
    # without the value norm the scores of a head are the expected attention: they sum to 1
    torch.testing.assert_close(base.masked_fill(~valid, 0).sum(-1), torch.ones(2, 2))


def test_queries_before_rotation_invert_the_rotary_embedding():
    """A query rotated as the model does (``q cos + rotate_half(q) sin`` at its position) comes back."""
    ctx, _ = with_rotary(make_ctx(LENGTHS, dim=DIM, seed=13), scaling=1.7)
    before = torch.randn_like(ctx.queries)
    cos, sin = ctx.facts.rotary(ctx.model_positions())  # [B, T, D]
    rotated = before * cos[:, None] + rotate_half(before) * sin[:, None]
    ctx = dataclasses.replace(ctx, queries=rotated)
    torch.testing.assert_close(ctx.queries_before_rotation(), before, atol=1e-5, rtol=1e-5)


def test_a_fact_not_declared_is_refused_with_the_declaration_to_add():
    ctx, _ = with_rotary(make_ctx(LENGTHS, dim=DIM, seed=14), facts=("rotary",))
    with pytest.raises(
        ConfigError, match=r"queries_before_rotation.*model_facts=\(\"queries_before_rotation\",\)"
    ):
        ExpectedAttentionScorer(n_sink=0).score(ctx)
    with pytest.raises(ConfigError, match="'projections'.*not declared"):
        ctx.facts.projections  # noqa: B018


def test_n_sink_restates_the_budget_sinks():
    node = {
        "budget": {"tokens": 16, "window": 2, "sinks": 3},
        "importance": {"expected": {"name": "expected_attention"}},
    }
    assert Pipeline.from_config(node).importance["expected"].n_sink == 3
    node["importance"]["expected"]["n_sink"] = 4
    with pytest.raises(ConfigError, match="n_sink = 4 differs from model.compression.budget.sinks = 3"):
        Pipeline.from_config(node)


def test_expected_attention_is_refused_with_a_chunked_prefill_and_declares_its_facts():
    caps = ExpectedAttentionScorer.capabilities
    assert not caps.chunked_prefill
    assert caps.model_facts == ("queries_before_rotation", "rotary")
    assert caps.describe() == "model_facts=queries_before_rotation+rotary"


def test_expected_attention_refuses_a_model_with_a_3d_rotary_embedding():
    """tiny-qwen2-vl (M-RoPE) is refused when the pipeline is bound, before the model loads."""
    node = {
        "budget": {"tokens": 24, "window": 4, "sinks": 4},
        "importance": {"expected": {"name": "expected_attention"}},
    }
    with pytest.raises(ConfigError) as error:
        Pipeline.from_config(node).bind_model("tiny-qwen2-vl")
    message = str(error.value)
    assert message.startswith(
        "model.compression.importance.expected (expected_attention) reads the model fact"
    )
    assert "tiny-qwen2-vl cannot provide: its rotary embedding is 3-D (M-RoPE" in message
    assert "Run this method on a model that has it" in message


@pytest.mark.parametrize("case", ["expected_attention", "expected_attention_mean"])
def test_expected_attention_keeps_what_kvpress_keeps(case):
    """kvpress 0.5.5's ExpectedAttentionPress hooked on the plain model (tests/fixtures/kvpress/)
    keeps what kvlab's prefill keeps, every layer and head: tiny-qwen2 (GQA) with the reference's
    settings and epsilon 0.02, tiny-llama with 2 sinks, 64 future positions, no covariance or value
    norm. kvpress projects the layer's input hidden states with ``q_proj``, kvlab rotates the
    post-RoPE queries back; kvpress pads its sinks at ``max + 1``, kvlab scores them ``+inf``."""
    want = kvpress_cases.recorded()["cases"][case]["kept"]
    assert kvpress_cases.kvlab_prefill_kept(kvpress_cases.CASES[case]) == want
