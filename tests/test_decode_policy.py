"""Decode policies: `none` appends; `h2o` holds every head's size by evicting the entry with the
lowest accumulated attention, checked against a naive per-(sample, head) list simulation."""

import e2e
import torch
from e2e import kvlab_model
from naive import dot, softmax
from test_methods import samples

from kvlab.compression.decode import DECODE_POLICIES
from kvlab.compression.pipeline import Pipeline
from kvlab.compression.selectors import Selection
from kvlab.engine.cache import CompressedLayer

B, HKV, G, D, T = 2, 2, 2, 4, 10


class OneLayer:
    def __init__(self, layer):
        self.layers = [layer]


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
    layer = CompressedLayer(decode_capacity=2)
    layer.update(keys, values)
    layer.compress(Selection(indices=indices, counts=lengths))
    seeds = torch.rand(B, HKV, K, generator=gen)
    mask = torch.arange(K) < lengths[..., None]
    policy = DECODE_POLICIES.build({"name": "h2o", "recent": 2})
    layer.track_attention(seeds[mask], indices[mask], "mean")
    steps, scaling = 6, D**-0.5
    queries = [torch.randn(B, HKV * G, 1, D, generator=gen) for _ in range(steps)]
    new_kv = [
        (torch.randn(B, HKV, 1, D, generator=gen), torch.randn(B, HKV, 1, D, generator=gen))
        for _ in range(steps)
    ]
    got = []
    for step in range(steps):
        layer.update(*new_kv[step])
        got.append(layer.decode_attention(queries[step], scaling))
        policy.after_step(OneLayer(layer), step)
        assert torch.equal(layer.lengths, lengths) and layer.decode_length == 0
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
    for (b, h), positions in kept.items():
        start, n = int(layer.starts[b, h]), int(layer.lengths[b, h])
        assert sorted(layer.entry_positions[start : start + n].tolist()) == positions


def pipe(decode):
    return Pipeline.from_config(
        {
            "budget": {"tokens": 24, "window": 8},
            "importance": [{"name": "window_attention", "window": 8}],
            "decode": decode,
        }
    )


def test_h2o_decode_holds_the_cache_size_and_none_appends():
    loaded = kvlab_model("tiny-qwen2")
    for decode in ("none", "h2o"):
        pipeline = pipe({"name": decode})
        policy, seen = pipeline.decode_policy, []

        def record(cache, step, after_step=policy.after_step, seen=seen):
            after_step(cache, step)
            seen.append([(layer.lengths.clone(), layer.decode_length) for layer in cache.layers])

        policy.after_step = record
        result = e2e.run(loaded, pipeline, samples(2, 60), 6)
        assert bool((result.kept == 24).all()) and len(seen) == 5
        for step, layers in enumerate(seen):
            for lengths, decode_length in layers:
                assert bool((lengths == 24).all())
                assert decode_length == (step + 1 if decode == "none" else 0)


def test_h2o_decode_padded_batch_equals_one_by_one():
    loaded = kvlab_model("tiny-qwen2")
    e2e.assert_batch_equals_alone(loaded, pipe({"name": "h2o", "recent": 4}), samples(2, 60), 6)
