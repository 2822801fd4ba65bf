"""Compactor's leverage scorer against the naive loop of its formula (``naive.leverage``, fp64), its
model fact, batched equals alone, and what kvpress 0.5.5's ``LeverageScorePress`` keeps."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from naive.context import assert_scores, build, make_ctx, sample_ctx
from naive.leverage import leverage, zscore
from support import kvpress_cases

from kvlab.compression.cur import gaussian_sketch
from kvlab.compression.importance import IMPORTANCE
from kvlab.config.errors import ConfigError
from kvlab.models.facts import LayerFacts, RotaryTable, rotate_half

LENGTHS = [37, 26]
DIM = 8


def rotated(ctx, theta: float = 100.0):
    """``ctx`` whose keys are its own keys (taken as pre-RoPE) rotated at the model's positions, with
    the rotary table among its facts; and the pre-RoPE keys ``[B, Hkv, T, D]``."""
    table = RotaryTable(1.0 / theta ** (torch.arange(0, DIM, 2, dtype=torch.float32) / DIM))
    cos, sin = table(ctx.model_positions())  # [B, T, D]
    before = ctx.keys
    keys = before * cos[:, None] + rotate_half(before) * sin[:, None]
    facts = LayerFacts(provided=("keys_before_rotation",), rotary_table=table)
    return dataclasses.replace(ctx, keys=keys, facts=facts), before


@pytest.mark.parametrize("sketch, ridge", [(48, 1e-2), (5, 1e-2), (None, 1e-2), (None, 0.5)])
def test_leverage_matches_the_formula(sketch, ridge):
    ctx, before = rotated(make_ctx(LENGTHS, dim=DIM, seed=21, layer_idx=3))
    got = build(IMPORTANCE, name="leverage", sketch_dimension=sketch, ridge=ridge, seed=4).score(ctx)
    assert got.shape == (2, 2, max(LENGTHS)) and got.dtype == torch.float32
    G = None if sketch is None else gaussian_sketch(DIM, sketch, 4, 3).double().tolist()
    for b, n in enumerate(LENGTHS):
        off = max(LENGTHS) - n
        keys = before[b, :, off:].double().tolist()
        want = zscore([leverage(keys[h], G, ridge) for h in range(2)])
        assert_scores(got[b, :, off:], want, atol=1e-4)
        assert not got[b, :, :off].any()  # padding scores 0


def test_with_a_wide_sketch_and_a_small_ridge_the_leverage_does_not_depend_on_the_sketch():
    """r >= D: the sketched keys span the keys' column space; the ridge is what remains of the draw."""
    ctx, _ = rotated(make_ctx(LENGTHS, dim=DIM, seed=22))
    exact = build(IMPORTANCE, name="leverage", sketch_dimension=None, ridge=1e-9).score(ctx)
    for seed in (0, 1):
        sketched = build(IMPORTANCE, name="leverage", sketch_dimension=32, ridge=1e-9, seed=seed).score(ctx)
        torch.testing.assert_close(sketched, exact, atol=1e-3, rtol=0)
    narrow = build(IMPORTANCE, name="leverage", sketch_dimension=3, ridge=1e-9).score(ctx)
    assert not torch.allclose(narrow, exact, atol=1e-2)  # a sketch narrower than D is an approximation


def test_leverage_sample_alone_equals_its_batch():
    ctx, _ = rotated(make_ctx(LENGTHS, dim=DIM, seed=23))
    scorer = build(IMPORTANCE, name="leverage", sketch_dimension=6)
    batched = scorer.score(ctx)
    for b in range(2):
        alone = sample_ctx(ctx, b)
        alone = dataclasses.replace(alone, facts=ctx.facts)
        got = scorer.score(alone)
        torch.testing.assert_close(batched[b, :, ctx.seq_len - got.shape[-1] :], got[0], atol=1e-5, rtol=1e-5)


def test_leverage_reads_the_declared_fact_only():
    ctx = make_ctx(LENGTHS, dim=DIM)
    with pytest.raises(ConfigError, match=r"keys_before_rotation.*model_facts=\(\"keys_before_rotation\",\)"):
        build(IMPORTANCE, name="leverage").score(ctx)


@pytest.mark.parametrize(
    "params, fragment",
    [({"ridge": 0.0}, "ridge must be > 0"), ({"sketch_dimension": 0}, "sketch_dimension must be >= 1")],
)
def test_leverage_refuses_bad_parameters(params, fragment):
    with pytest.raises(ConfigError, match=fragment):
        build(IMPORTANCE, name="leverage", **params)


@pytest.mark.parametrize("case", ["leverage", "leverage_qwen2"])
def test_leverage_keeps_what_kvpress_keeps(case):
    """kvpress 0.5.5's LeverageScorePress through its forward hook on tiny-llama (16-dim heads, its
    48-column sketch) and tiny-qwen2 (GQA, a 12-column sketch), handed kvlab's seeded sketch
    (tests/fixtures/kvpress/make_kept.py); kvlab's prefill reads the keys rotated back."""
    want = kvpress_cases.recorded()["cases"][case]["kept"]
    assert kvpress_cases.kvlab_prefill_kept(kvpress_cases.CASES[case]) == want
