"""TOVA (Oren et al. 2024): the prefill scorer against the formula on lists (fp64), the decode policy
against a naive list simulation of the paper's policy (a prompt kept whole growing to its budget,
ragged heads, a padded batch), and the preset end to end: a budget holding the prompt and every
generated token is the full cache; a chunked prefill keeps the same positions; on a tiny model each
layer's prefill keeps the naive top of the score on the queries and keys it saw, and what kvpress
0.5.5's ``TOVAPress`` keeps (with the last token protected, as kvpress protects it)."""

import pytest
import torch
from naive.context import LENGTHS, make_ctx, sample_lists
from naive.tova import naive_tova_decode, naive_tova_scores
from support import e2e, kvpress_cases
from support.decode_steps import compressed_layer, decode_steps
from support.e2e import kvlab_model
from support.presets import budgeted_compression, budgeted_pipeline, retrieval_samples

from kvlab.compression.decode import DECODE_POLICIES
from kvlab.compression.importance import IMPORTANCE
from kvlab.engine.generation import RunOptions, generate
from kvlab.pipeline import Pipeline


def test_tova_scores_match_the_formula():
    ctx = make_ctx(LENGTHS, heads=4, kv_heads=2, seed=3)
    got = IMPORTANCE.build({"name": "tova"}).score(ctx)  # [B, Hkv, T]
    for b in range(2):
        n, off, q, k, _ = sample_lists(ctx, b)
        want = torch.tensor(naive_tova_scores(q, k, ctx.scaling), dtype=torch.float64)
        for h in range(2):  # every KV head gets the layer's row
            torch.testing.assert_close(got[b, h, off:].double(), want, atol=1e-6, rtol=0)


B, HKV, G, D, T = 2, 2, 2, 4, 10


def test_tova_decode_matches_naive_simulation():
    """Sample 0 was kept whole (its budget 12 above its 10 tokens): it grows for two steps, then
    evicts; sample 1 was compressed to ragged heads of 5 and 4 entries and evicts from the first step.
    The attention outputs and the positions left equal the list simulation's."""
    gen = torch.Generator().manual_seed(1)
    state = compressed_layer([[list(range(10)), list(range(10))], [[1, 3, 4, 7, 9], [0, 2, 7, 9]]], T, D, gen)
    policy = DECODE_POLICIES.build({"name": "tova"})
    assert policy.recent == 0
    budget, prompt = torch.tensor([12, 5]), torch.tensor([10, 10])
    policy.seed(state.run, 0, torch.zeros(state.indices.shape), state.indices, budget, prompt)
    state.run.want_decode_attention(policy, policy.capabilities.decode_attention)
    steps = 7
    decode_steps(state, policy, steps, G, gen)
    sizes = [size.tolist() for size in state.sizes]
    assert sizes[0] == [[11, 11], [5, 4]] and sizes[1] == [[12, 12], [5, 4]]
    assert all(size == [[12, 12], [5, 4]] for size in sizes[2:])  # a fixed-size multi-state
    capacity = {(0, 0): 12, (0, 1): 12, (1, 0): 5, (1, 1): 4}
    entries, queries, new_kv = state.naive_inputs()
    want, kept = naive_tova_decode(
        entries, capacity, queries, new_kv, first_position=T, recent=0, scaling=D**-0.5
    )
    for step in range(steps):
        torch.testing.assert_close(
            state.outputs[step][:, :, 0].double(),
            torch.tensor(want[step], dtype=torch.float64),
            atol=1e-5,
            rtol=0,
        )
    tracked = policy.entries(state.run)[0]
    valid = state.layer.slot_valid()
    for (b, h), positions in kept.items():
        assert sorted(tracked.positions[b, h, : valid.shape[-1]][valid[b, h]].tolist()) == positions
    assert any(p >= T for positions in kept.values() for p in positions)  # generated tokens stay too


def test_tova_preset_with_room_for_every_token_is_the_full_cache():
    """The budget holds the prompt and every generated token: nothing is evicted, at prefill or decode."""
    loaded = kvlab_model("tiny-qwen2")
    samples = retrieval_samples(2, 60)
    full = e2e.run(loaded, Pipeline.from_config(None), samples, 6)
    room = int(full.prompt_lengths.max()) + 6
    tova = e2e.run(loaded, budgeted_pipeline("tova", tokens=room), samples, 6)
    assert tova.tokens == full.tokens and torch.equal(tova.step_logits, full.step_logits)
    tight = e2e.run(loaded, budgeted_pipeline("tova", tokens=room - 3), samples, 6)
    assert not torch.equal(tight.step_logits, full.step_logits)  # the longest prompt's state fills up


def test_tova_keeps_the_same_positions_after_a_chunked_prefill():
    """The scorer reads the last query only, which the last chunk holds."""
    loaded = kvlab_model("tiny-qwen2")
    batch = loaded.processor.collate(retrieval_samples(2, 60))
    whole = generate(loaded, budgeted_pipeline("tova", tokens=40), batch, RunOptions(max_new_tokens=4))
    chunked = generate(
        loaded, budgeted_pipeline("tova", tokens=40), batch, RunOptions(max_new_tokens=4, prefill_chunk=64)
    )
    for a, b in zip(whole.reports, chunked.reports, strict=True):
        assert torch.equal(a.selection.indices, b.selection.indices)
        assert torch.equal(a.selection.counts, b.selection.counts)


def test_tova_on_a_tiny_model_keeps_the_top_of_the_last_querys_head_mean():
    """Every layer of a prefill keeps the ``budget`` positions of highest naive TOVA score on the
    queries and keys the layer saw (nothing protected: the last token competes too), the same for
    every KV head, as the paper's ``TOVACache.reduce`` does with the prompt."""
    loaded = kvlab_model("tiny-qwen2")
    budget = 24
    pipeline = budgeted_pipeline("tova", tokens=budget)
    seen = []
    compress = pipeline.compress

    def spy(ctx, record_scores=False):
        seen.append((ctx.queries[0].double().tolist(), ctx.keys[0].double().tolist(), ctx.scaling))
        return compress(ctx, record_scores=record_scores)

    pipeline.compress = spy
    result = e2e.run(loaded, pipeline, retrieval_samples(1, 30), 1)
    n = int(result.prompt_lengths[0])
    assert n > budget and len(seen) == len(result.reports)
    for report, (q, k, scaling) in zip(result.reports, seen, strict=True):
        scores = naive_tova_scores(q, k, scaling)
        want = sorted(sorted(range(n), key=lambda t: (-scores[t], t))[:budget])
        for h in range(len(k)):
            assert report.selection.kept_positions(0, h) == want


@pytest.mark.parametrize("case", ["tova", "tova_llama"])
def test_tova_keeps_what_kvpress_keeps(case):
    """kvpress 0.5.5's TOVAPress hooked on tiny-qwen2 (GQA) and tiny-llama (tests/fixtures/kvpress/)
    keeps what kvlab's prefill keeps with ``budget.window: 1``, every layer and head: kvpress scores
    the last token ``max + 1``, the window protects it."""
    want = kvpress_cases.recorded()["cases"][case]["kept"]
    assert kvpress_cases.kvlab_prefill_kept(kvpress_cases.CASES[case]) == want


def test_the_tova_preset_differs_from_kvpress_by_the_last_token_only():
    """The preset (``window: 0``, the paper) lets the last token compete with its own attention
    weight, where kvpress keeps it whatever its score. On tiny-qwen2 it ranks below the budget in
    every layer: kvlab keeps the next best token in its place and every other kept position is
    kvpress's (on tiny-llama, ``tova_llama``, it ranks inside: the preset keeps kvpress's positions)."""
    case = kvpress_cases.CASES["tova"]
    want = kvpress_cases.recorded()["cases"]["tova"]["kept"]
    got = kvpress_cases.kvlab_prefill_kept(case, budgeted_compression("tova", case.model, tokens=case.kept))
    last = kvpress_cases.LENGTH - 1
    for got_layer, want_layer in zip(got, want, strict=True):
        for mine, theirs in zip(got_layer, want_layer, strict=True):
            assert last in theirs and last not in mine
            assert set(theirs) - set(mine) == {last} and len(set(mine) - set(theirs)) == 1
