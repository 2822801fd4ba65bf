"""Decode policies: `none` appends; `h2o` holds every head's size by evicting the entry with the
lowest accumulated attention, checked against a naive per-(sample, head) list simulation. The
prefill and decode steps run separately give what `generate` gives."""

import torch
from naive.attention import dot, softmax
from support import e2e
from support.e2e import kvlab_model
from support.presets import retrieval_samples

from kvlab.cache.cache import CompressedCache
from kvlab.cache.selection import Selection
from kvlab.cache.state import RunState
from kvlab.compression.decode import DECODE_POLICIES, ScoredEntries
from kvlab.engine.attention import kvlab_attention
from kvlab.engine.generation import RunOptions, decode, generate, prefill
from kvlab.engine.session import CompressionSession, compression_session
from kvlab.pipeline import Pipeline

B, HKV, G, D, T = 2, 2, 2, 4, 10
STORAGE = {
    "keys",
    "values",
    "prompt_keys",
    "prompt_values",
    "starts",
    "lengths",
    "decode_keys",
    "decode_values",
}


def naive_h2o(prompt, counts, seeds, queries, new_kv, recent, scaling):
    """Per (b, h): entries [pos, key, value, score]; returns the attention outputs and final positions."""
    entries = {
        (b, h): [
            [p, prompt[0][b][h][p], prompt[1][b][h][p], seeds[b][h][i]] for i, p in enumerate(counts[b][h])
        ]
        for b in range(B)
        for h in range(HKV)
    }
    outputs = []
    for step, (q, (k, v)) in enumerate(zip(queries, new_kv, strict=True)):
        pos = T + step
        out = [[None] * (HKV * G) for _ in range(B)]
        for (b, h), ents in entries.items():
            ents.append([pos, k[b][h], v[b][h], 0.0])
            added = [0.0] * len(ents)
            for g in range(G):
                probs = softmax([dot(q[b][h * G + g], e[1]) * scaling for e in ents])
                out[b][h * G + g] = [
                    sum(p * e[2][d] for p, e in zip(probs, ents, strict=True)) for d in range(D)
                ]
                added = [a + p / G for a, p in zip(added, probs, strict=True)]
            for e, a in zip(ents, added, strict=True):
                e[3] += a
            candidates = [e for e in ents if e[0] <= pos - recent]
            victim = min(candidates, key=lambda e: e[3]) if candidates else min(ents, key=lambda e: e[0])
            ents.remove(victim)
        outputs.append(out)
    return outputs, {key: sorted(e[0] for e in ents) for key, ents in entries.items()}


def test_h2o_decode_matches_naive_simulation():
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(B, HKV, T, D, generator=gen), torch.randn(B, HKV, T, D, generator=gen)
    counts = [[[0, 2, 3, 7, 9], [1, 4, 8, 9]], [[5, 6, 9], [0, 1, 2, 3, 8, 9]]]  # ragged heads
    K = max(len(c) for row in counts for c in row)
    indices = torch.tensor([[c + [0] * (K - len(c)) for c in row] for row in counts])
    lengths = torch.tensor([[len(c) for c in row] for row in counts])
    cache = CompressedCache(num_layers=1, decode_capacity=2)
    layer = cache.layers[0]
    layer.update(keys, values)
    layer.compress(Selection(indices=indices, counts=lengths))
    seeds = torch.rand(B, HKV, K, generator=gen)
    policy = DECODE_POLICIES.build({"name": "h2o", "recent": 2})
    run = RunState(cache=cache, valid=torch.ones(B, T, dtype=torch.bool), modality=torch.zeros(B, T))
    session = CompressionSession(run, pipeline=None)
    policy.seed(run, 0, seeds, indices)  # the selection's layout: slot s is the s-th kept entry
    run.want_decode_attention(policy, policy.capabilities.decode_attention)  # as the engine's start_decoding
    policy.start(run)
    attention = torch.nn.Module()
    attention.layer_idx = 0  # what the attention function reads of a transformers attention module
    steps, scaling = 6, D**-0.5
    queries = [torch.randn(B, HKV * G, 1, D, generator=gen) for _ in range(steps)]
    new_kv = [
        (torch.randn(B, HKV, 1, D, generator=gen), torch.randn(B, HKV, 1, D, generator=gen))
        for _ in range(steps)
    ]
    got = []
    for step in range(steps):
        layer.update(*new_kv[step])
        with compression_session(session):  # the decode attention hands the policy its probabilities
            out, _ = kvlab_attention(attention, queries[step], *new_kv[step], None, scaling)
        got.append(out.transpose(1, 2))
        policy.after_step(run, step)
        assert torch.equal(layer.lengths, lengths) and layer.decode_length == 0
        assert run.take_decode_attention() == {}  # taken by the policy
    want, kept = naive_h2o(
        (keys.double().tolist(), values.double().tolist()),
        counts,
        seeds.double().tolist(),
        [q[:, :, 0].double().tolist() for q in queries],
        [(k[:, :, 0].double().tolist(), v[:, :, 0].double().tolist()) for k, v in new_kv],
        recent=2,
        scaling=scaling,
    )
    for step in range(steps):
        torch.testing.assert_close(
            got[step][:, :, 0].double(), torch.tensor(want[step], dtype=torch.float64), atol=1e-5, rtol=0
        )
    tracked = policy.entries(run)[0]  # the policy's bookkeeping follows the cache's moves
    for (b, h), positions in kept.items():
        slots = tracked.positions[b, h, : int(layer.lengths[b, h])].tolist()
        assert sorted(slots) == positions
        for stored, pos in zip(layer.segment(b, h)[0], slots, strict=True):
            assert torch.equal(stored, keys[b, h, pos] if pos < T else new_kv[pos - T][0][b, h, 0])


def pipe(decode, window=8):
    """SnapKV at 24 tokens per head; h2o's recent window is the budget's ``window``."""
    return Pipeline.from_config(
        {
            "budget": {"tokens": 24, "window": window},
            "importance": {"attention": {"name": "window_attention"}},
            "decode": decode,
        }
    )


def test_h2o_decode_holds_the_cache_size_and_none_appends():
    loaded = kvlab_model("tiny-qwen2")
    for name in ("none", "h2o"):
        pipeline = pipe({"name": name})
        policy, seen = pipeline.decode_policy, []

        def record(run, step, after_step=policy.after_step, seen=seen):
            after_step(run, step)
            seen.append([(layer.lengths.clone(), layer.decode_length) for layer in run.cache.layers])

        policy.after_step = record
        result = e2e.run(loaded, pipeline, retrieval_samples(2, 60), 6)
        assert bool((result.kept == 24).all()) and len(seen) == 5
        for step, layers in enumerate(seen):
            for lengths, decode_length in layers:
                assert bool((lengths == 24).all())
                assert decode_length == (step + 1 if name == "none" else 0)


def test_h2o_decode_padded_batch_equals_one_by_one():
    loaded = kvlab_model("tiny-qwen2")
    e2e.assert_batch_equals_alone(loaded, pipe({"name": "h2o"}, window=4), retrieval_samples(2, 60), 6)


def test_h2o_scores_live_in_the_policy_state_not_in_the_cache():
    loaded = kvlab_model("tiny-qwen2")
    pipeline = pipe({"name": "h2o"}, window=4)
    state = prefill(loaded, pipeline, loaded.processor.collate(retrieval_samples(2, 60)), decode_capacity=4)
    decode(state, 4)
    entries = pipeline.decode_policy.entries(state.session.run)
    assert sorted(entries) == list(range(len(state.cache.layers)))
    for layer_idx, layer in enumerate(state.cache.layers):
        tensors = {name for name, value in vars(layer).items() if torch.is_tensor(value)}
        assert tensors <= STORAGE, f"the cache holds more than K/V and offsets: {tensors - STORAGE}"
        assert isinstance(entries[layer_idx], ScoredEntries)
        assert entries[layer_idx].scores.shape[:2] == layer.lengths.shape
    assert not any(torch.is_tensor(value) for value in vars(state.cache).values())


def test_prefill_then_decode_equals_generate():
    loaded = kvlab_model("tiny-qwen2")
    batch = loaded.processor.collate(retrieval_samples(2, 60))
    teacher = torch.tensor([[5, 9, 2, 7], [1, 1, 3, 8]])
    for decode_node in ("none", "h2o"):
        pipeline = pipe({"name": decode_node}, window=4)
        for forced in (None, teacher):
            want = generate(
                loaded,
                pipeline,
                batch,
                RunOptions(max_new_tokens=6, return_logits=True, teacher_tokens=forced),
            )
            state = prefill(loaded, pipeline, batch, decode_capacity=6)
            assert torch.equal(state.logits.cpu(), want.step_logits[:, 0])
            assert torch.equal(state.cache.kept_tokens().cpu(), want.kept)
            got = decode(state, 6, return_logits=True, teacher_tokens=forced)
            assert torch.equal(got.step_logits.cpu(), want.step_logits)
            assert got.tokens.shape[1] == (6 if forced is None else 4)
            trimmed = [
                row[: len(tokens)] for row, tokens in zip(got.tokens.tolist(), want.tokens, strict=True)
            ]
            assert trimmed == want.tokens  # generate only cuts each row at its first eos
