"""Finch (Corallo and Papotti 2024): the progressive prefill with the question appended to every chunk.

The naive check is Finch's loop written out: chunk by chunk, the question's fp64 attention over
the kept entries, the chunk and itself (each row normalised by the keys it sees), the GQA group's
mean, the top ``budget`` entries kept; the same positions as the engine, on tiny-qwen2, from the
model's own K/V and queries (captured by wrapping the scorer). The cache never holds more than
``budget + chunk`` entries besides the question's; a padded batch keeps what each sample keeps
alone; SnapKV per chunk is YAML; what a progressive prefill cannot run is refused.
"""

from __future__ import annotations

import functools

import pytest
import torch
from support import e2e

from kvlab.compression.finch import QuestionAttentionScorer
from kvlab.config.errors import ConfigError
from kvlab.data.synthetic import SyntheticRetrieval
from kvlab.engine.generation import RunOptions
from kvlab.engine.protocols import build_protocol
from kvlab.pipeline import Pipeline

BUDGET, CHUNK = 24, 40


def finch(budget: int = BUDGET, chunk: int = CHUNK, **prefill) -> Pipeline:
    return Pipeline.from_config(
        {
            "budget": {"tokens": budget, "window": 0},
            "importance": {"attention": {"name": "question_attention"}},
            "prefill": {"name": "progressive", "chunk": chunk, "question": True, **prefill},
        }
    )


@functools.cache
def items() -> list:
    """A 60-word and a 35-word retrieval sample (contexts of several chunks, of different lengths)."""
    return (
        SyntheticRetrieval(num_samples=1, context_words=60, seed=1).samples()
        + SyntheticRetrieval(num_samples=1, context_words=35, seed=5).samples()
    )


def run(pipeline, samples, record=None):
    loaded = e2e.kvlab_model("tiny-qwen2")
    batch = loaded.processor.collate(list(samples))
    return build_protocol("query_aware").run(
        loaded, pipeline, batch, RunOptions(max_new_tokens=3, return_logits=True)
    )


def naive_finch(steps, budget: int, heads: int, kv_heads: int) -> list[list[int]]:
    """Finch's loop for one sample and one layer, in fp64. ``steps``: per chunk, the chunk's keys
    ``[Hkv, c, D]``, the question's queries ``[H, Q, D]`` and keys ``[Hkv, Q, D]``, the scaling.
    Returns the kept chunk-relative prompt positions per KV head after the last chunk."""
    G = heads // kv_heads
    kept = [torch.zeros(0, dtype=torch.long) for _ in range(kv_heads)]
    kept_keys = [None] * kv_heads
    first = 0
    for chunk_keys, q_queries, q_keys, scaling in steps:
        c = chunk_keys.shape[1]
        for h in range(kv_heads):
            positions = torch.cat([kept[h], torch.arange(first, first + c)])
            keys = (
                chunk_keys[h].double()
                if kept_keys[h] is None
                else torch.cat([kept_keys[h], chunk_keys[h].double()])
            )
            score = torch.zeros(len(positions), dtype=torch.float64)
            for g in range(G):
                qh = q_queries[h * G + g].double()
                for i in range(qh.shape[0]):
                    seen = torch.cat([keys, q_keys[h, : i + 1].double()])
                    probs = torch.softmax(seen @ qh[i] * scaling, dim=0)
                    score += probs[: len(positions)] * seen.shape[0] / G
            if len(positions) > budget:
                top = torch.sort(torch.topk(score, budget, sorted=True).indices).values
                positions, keys = positions[top], keys[top]
            kept[h], kept_keys[h] = positions, keys
        first += c
    return [k.tolist() for k in kept]


def test_finch_keeps_the_positions_of_its_loop(monkeypatch):
    """One sample alone: capture each step's context (entries, question) at layer 1, replay the loop."""
    seen = []
    score = QuestionAttentionScorer.score

    def spy(self, ctx):
        if ctx.layer_idx == 1:
            n = int(ctx.valid.sum())
            view = ctx.question
            q = int(view.valid.sum())
            seen.append(
                (
                    ctx.keys[0, :, -n:].clone(),
                    view.queries[0, :, -q:].clone(),
                    view.keys[0, :, -q:].clone(),
                    ctx.scaling,
                )
            )
        return score(self, ctx)

    monkeypatch.setattr(QuestionAttentionScorer, "score", spy)
    result = run(finch(), items()[:1])
    loaded = e2e.kvlab_model("tiny-qwen2")
    info = loaded.info
    steps, held = [], 0
    for keys, q_queries, q_keys, scaling in seen:  # the chunk's keys are the entries after the held ones
        steps.append((keys[:, held:], q_queries, q_keys, scaling))
        held = min(BUDGET, keys.shape[1])
    assert len(steps) > 2  # several chunks
    want = naive_finch(steps, BUDGET, info.num_heads, info.num_kv_heads)
    report = result.result.reports[1]
    assert int(result.context_tokens[0]) < int(result.result.prompt_lengths[0])  # the question came after
    got = [report.selection.kept_positions(0, h) for h in range(info.num_kv_heads)]
    assert got == want


def test_budget_covering_the_context_equals_the_full_cache():
    full = run(Pipeline.from_config(None), items())
    whole = run(finch(budget=10_000), items())
    assert whole.result.tokens == full.result.tokens
    torch.testing.assert_close(whole.result.step_logits, full.result.step_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(whole.result.kv_bytes_kept, full.result.kv_bytes_kept)


def test_the_cache_never_holds_more_than_budget_plus_chunk(monkeypatch):
    """Every layer's step attends over at most budget + chunk entries, plus the question's."""
    import kvlab.engine.progressive as progressive

    sizes = []
    attend = progressive.prefill_attention

    def spy(query, key, *args, **kwargs):
        sizes.append((key.shape[2], query.shape[2]))
        return attend(query, key, *args, **kwargs)

    monkeypatch.setattr(progressive, "prefill_attention", spy)
    run(finch(), items())
    question = max(q for _, q in sizes) - CHUNK
    assert max(k for k, _ in sizes) <= BUDGET + CHUNK + question
    assert len({k for k, _ in sizes}) > 1


@pytest.mark.parametrize("pipeline", ["finch", "snapkv_per_chunk"])
def test_padded_batch_keeps_what_each_sample_keeps_alone(pipeline):
    if pipeline == "finch":
        pipe = finch()
    else:  # SnapKV compressing per chunk: YAML only; chunk 16 < window 20 (held queries)
        pipe = Pipeline.from_config(
            {
                "budget": {"tokens": 32, "window": 20},
                "importance": {"attention": {"name": "window_attention"}},
                "prefill": {"name": "progressive", "chunk": 16},
            }
        )
    batched = run(pipe, items())
    for b, item in enumerate(items()):
        alone = run(pipe, [item])
        assert batched.result.tokens[b] == alone.result.tokens[0]
        assert torch.equal(batched.result.kept[:, b], alone.result.kept[:, 0])
        pad = int(batched.result.prompt_lengths.max()) - int(batched.result.prompt_lengths[b])
        for got, want in zip(batched.result.reports, alone.result.reports, strict=True):
            n = got.selection.counts[b]
            assert torch.equal(n, want.selection.counts[0])
            for h in range(n.shape[0]):
                assert [p - pad for p in got.selection.kept_positions(b, h)] == want.selection.kept_positions(
                    0, h
                )


def test_refusals():
    with pytest.raises(ConfigError, match="question"):  # a question reader without the question
        Pipeline.from_config({"budget": 32, "importance": {"attention": {"name": "question_attention"}}})
    with pytest.raises(ConfigError, match="no scorer reads it"):
        Pipeline.from_config(
            {
                "budget": 32,
                "importance": {"a": {"name": "key_norm"}},
                "prefill": {"name": "progressive", "question": True},
            }
        )
    with pytest.raises(ConfigError, match="allocate.head"):
        Pipeline.from_config(
            {
                "budget": {"tokens": 32, "window": 4},
                "importance": {"a": {"name": "window_attention"}},
                "allocate": {"head": {"name": "adakv"}},
                "prefill": {"name": "progressive"},
            }
        )
    with pytest.raises(ConfigError, match="query_aware"):
        build_protocol("query_agnostic").check(finch())
    with pytest.raises(ConfigError, match="prefill_chunk"):
        loaded = e2e.kvlab_model("tiny-qwen2")
        batch = loaded.processor.collate(items())
        build_protocol("query_aware").run(
            loaded, finch(), batch, RunOptions(max_new_tokens=2, prefill_chunk=32)
        )
