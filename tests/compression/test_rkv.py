"""R-KV (Cai et al. 2025): the key redundancy against the formula on lists (fp64), the decode policy
against a naive list simulation of the periodic eviction (a prompt kept whole growing to its budget,
ragged compressed heads, a padded batch), the budget held after every decode step, and the preset
end to end on a tiny model (the budget after every step, a padded batch equal to each sample alone,
the evictions recorded for ``positions.jsonl``)."""

import pytest
import torch
from naive.rkv import naive_redundancy, naive_rkv_decode
from support import e2e
from support.decode_steps import compressed_layer, decode_steps
from support.e2e import kvlab_model
from support.presets import budgeted_compression, retrieval_samples

from kvlab.compression.decode import DECODE_POLICIES
from kvlab.compression.rkv import key_redundancy
from kvlab.engine.generation import decode, prefill
from kvlab.pipeline import Pipeline

B, HKV, G, D, T = 2, 2, 2, 4, 10


def test_key_redundancy_matches_the_formula():
    """Random keys with near-duplicates (so the threshold rule applies), padded slots ignored."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 9, D, generator=gen)
    keys[:, :, 5] = keys[:, :, 1] + 0.05 * torch.randn(2, 3, D, generator=gen)  # near-duplicates
    valid = torch.ones(2, 3, 9, dtype=torch.bool)
    valid[1, :, 7:] = False
    positions = torch.randperm(9, generator=gen).expand(2, 3, 9)
    for threshold in (0.5, None):
        got = key_redundancy(keys, valid, positions, threshold)
        for b in range(2):
            for h in range(3):
                n = int(valid[b, h].sum())
                want = naive_redundancy(
                    keys[b, h, :n].double().tolist(), positions[b, h, :n].tolist(), threshold
                )
                torch.testing.assert_close(
                    got[b, h, :n].double(), torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=0
                )
                assert bool((got[b, h, n:] == 0).all())


def test_rkv_decode_matches_naive_simulation_and_holds_the_budget_after_every_step():
    """Sample 0 was kept whole (budget 14 above its 10 tokens): it grows for four steps, then evicts
    every 4 steps down to 11; sample 1 was compressed to ragged heads of 7 and 6 entries and evicts
    from the first step, down to 4 and 3. Outputs, sizes after every step and the positions left
    equal the list simulation's; no row ever holds more than its budget after a step."""
    gen = torch.Generator().manual_seed(1)
    counts = [[list(range(10)), list(range(10))], [[0, 1, 3, 4, 6, 7, 9], [0, 2, 5, 7, 8, 9]]]
    state = compressed_layer(counts, T, D, gen)
    policy = DECODE_POLICIES.build({"name": "rkv", "every": 4, "recent": 2})
    budget, prompt = torch.tensor([14, 7]), torch.tensor([10, 10])
    policy.seed(state.run, 0, torch.zeros(state.indices.shape), state.indices, budget, prompt)
    state.run.want_decode_attention(policy, policy.capabilities.decode_attention)
    policy.record_evictions(state.run)
    steps = 13
    decode_steps(state, policy, steps, G, gen)
    got, sizes = state.outputs, state.sizes
    capacity = {(0, 0): 14, (0, 1): 14, (1, 0): 7, (1, 1): 6}
    held_budget = torch.tensor([[14, 14], [7, 6]])
    assert all(bool((size <= held_budget).all()) for size in sizes)  # the budget after every step
    entries, queries, new_kv = state.naive_inputs()
    want, held, kept = naive_rkv_decode(
        entries, capacity, queries, new_kv,
        first_position=T, scaling=D**-0.5, recent=2, every=4, mix_lambda=0.1, kernel=7,
    )  # fmt: skip
    for step in range(steps):
        torch.testing.assert_close(
            got[step][:, :, 0].double(), torch.tensor(want[step], dtype=torch.float64), atol=1e-5, rtol=0
        )
        assert sizes[step].tolist() == [[held[step][(b, h)] for h in range(HKV)] for b in range(B)]
    assert [s[0, 0].item() for s in sizes] == [11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13, 14, 11]
    assert [s[1, 0].item() for s in sizes] == [4, 5, 6, 7] * 3 + [4]
    tracked = policy.entries(state.run)[0]
    valid = state.layer.slot_valid()
    for (b, h), positions in kept.items():
        assert sorted(tracked.positions[b, h, : valid.shape[-1]][valid[b, h]].tolist()) == positions
    assert any(p < T for positions in kept.values() for p in positions)  # prompt entries compete and stay
    record = policy.evicted_positions(state.run)
    evicted = record.steps[4][0][1, 0]  # sample 1, head 0 evicts 4 entries at step 4
    assert int((evicted >= 0).sum()) == 4


def rkv_every(tokens: int, every: int) -> Pipeline:
    """The R-KV preset at a ``tokens`` budget, evicting every ``every`` decode steps."""
    node = budgeted_compression("rkv", tokens=tokens)
    node["decode"]["every"] = every
    return Pipeline.from_config(node)


@pytest.mark.parametrize("tokens", [40, 300])
def test_rkv_preset_holds_its_budget_after_every_decode_step(tokens):
    """On a tiny model, a compressed prompt (budget 40) and prompts kept whole that grow to the
    budget (300): after every decode step each (sample, KV head) holds at most the budget, and it
    does evict (the cache is not simply appended to)."""
    loaded = kvlab_model("tiny-qwen2")
    pipeline = rkv_every(tokens, 16)
    state = prefill(loaded, pipeline, loaded.processor.collate(retrieval_samples(2, 60)), decode_capacity=40)
    held = []
    decode(
        state,
        40,
        on_step=lambda *_: held.append([layer.slot_valid().sum(-1) for layer in state.cache.layers]),
    )
    sizes = torch.stack([torch.stack(step) for step in held])  # [steps, L, B, Hkv]
    assert int(sizes.amax()) <= tokens
    assert int(sizes[-1].amax()) < int(state.cache.layers[0].cumulative_length)  # it evicted


def test_rkv_padded_batch_equals_one_by_one():
    """Each row's schedule and scores depend on its own entries only: a padded batch gives each
    sample the tokens and logits it gets alone (the kept prompt counts are not compared: an eviction
    moves every row's decode entries into its prompt region, whichever rows were due)."""
    loaded = kvlab_model("tiny-qwen2")
    items = retrieval_samples(2, 60)
    for tokens in (40, 290):
        pipeline = rkv_every(tokens, 8)
        batched = e2e.run(loaded, pipeline, items, 24)
        for b, item in enumerate(items):
            alone = e2e.run(loaded, pipeline, [item], 24)
            assert batched.tokens[b] == alone.tokens[0]
            torch.testing.assert_close(batched.step_logits[b], alone.step_logits[0], atol=1e-4, rtol=1e-4)
