"""KVzip (Kim et al. 2025): the reconstruct prefill and the scorers reading the reconstruction.

The naive check is the paper's score written out (``naive.kvzip``): for every chunk, the fp64
softmax of the repeat block's queries over the chosen prompt entries and the block's own keys, the
max over the block's rows and the KV head's query heads, on tiny-qwen2 from the model's own
queries and keys (captured by wrapping the scorer), then the top entries per head. Invariants: a
budget covering the prompt gives the full cache's output, kept counts equal budgets, a padded batch
keeps what each sample keeps alone; the reconstruction forwards count as compression time; the
blocks are the paper's requests; ``multi_question`` reconstructs each context once for all its
questions; what the mode cannot run is refused. Against kvpress 0.5.5's
``KVzipPress`` (``layerwise=True``) on the seeded random prompt (``tests/fixtures/kvpress/``), the
``kvzip`` preset keeps the same positions in every layer and head, in one chunk and in several.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from naive.kvzip import model_topk_kept, reconstruction_scores
from support import e2e, kvpress_cases
from support.questions import QUESTIONS

from kvlab.compression.reconstruction import ReconstructionAttention, ReconstructionScorer, ReconstructionStep
from kvlab.config.errors import ConfigError
from kvlab.data.synthetic import SyntheticRetrieval
from kvlab.engine.generation import RunOptions
from kvlab.engine.protocols import build_protocol
from kvlab.engine.reconstruction import FIRST_REQUEST, NEXT_REQUEST, reconstruction_blocks
from kvlab.pipeline import Pipeline

CHUNK = 64


def kvzip(budget=None, scorer: str = "reconstruction_attention", **prefill) -> Pipeline:
    return Pipeline.from_config(
        {
            "budget": budget or {"tokens": 60, "window": 0, "sinks": 4},
            "importance": {"attention": {"name": scorer}},
            "prefill": {"name": "reconstruct", "chunk": CHUNK, **prefill},
        }
    )


@functools.cache
def items() -> list:
    """Two retrieval samples of several chunks, of different lengths."""
    return (
        SyntheticRetrieval(num_samples=1, context_words=35, seed=5).samples()
        + SyntheticRetrieval(num_samples=1, context_words=60, seed=1).samples()
    )


def run(pipeline, samples, protocol: str = "query_agnostic", steps: int = 3):
    loaded = e2e.kvlab_model("tiny-qwen2")
    batch = loaded.processor.collate(list(samples))
    return build_protocol(protocol).run(
        loaded, pipeline, batch, RunOptions(max_new_tokens=steps, return_logits=True)
    )


@pytest.mark.parametrize(
    ("scope", "scorer"),
    [("chunk", "reconstruction_attention"), ("cache", "reconstruction_attention"),
     ("chunk", "reconstruction_attention_plus")],
)  # fmt: skip
def test_scores_and_kept_positions_follow_the_formula(monkeypatch, scope, scorer):
    """One sample alone: every step's queries and keys at layer 1 replayed through the fp64 loop."""
    layer, sinks = 1, 4
    steps, prompt = [], {}
    observe, score = ReconstructionScorer.observe, ReconstructionScorer.score

    def spy_observe(self, step, run_state):
        if step.layer_idx == layer:
            q = int(step.block_valid.sum())
            inputs = step.hidden_states[0, -q:].clone() if step.hidden_states is not None else None
            steps.append(
                (step.queries[0, :, -q:].clone(), step.block_keys[0, :, -q:].clone(), step.scaling, inputs)
            )
        return observe(self, step, run_state)

    def spy_score(self, ctx):
        out = score(self, ctx)
        if ctx.layer_idx == layer:
            prompt.update(keys=ctx.keys[0].clone(), values=ctx.values[0].clone(), scores=out[0].clone())
        return out

    monkeypatch.setattr(ReconstructionScorer, "observe", spy_observe)
    monkeypatch.setattr(ReconstructionScorer, "score", spy_score)
    result = run(kvzip(scope=scope, scorer=scorer), items()[:1]).result
    loaded = e2e.kvlab_model("tiny-qwen2")
    info = loaded.info
    n = prompt["keys"].shape[1]
    assert len(steps) == -(-n // CHUNK) > 2
    replay = [
        (
            i * CHUNK,
            min(n, (i + 1) * CHUNK),
            prompt["keys"],
            prompt["values"],
            queries,
            block_keys,
            scaling,
            inputs,
        )
        for i, (queries, block_keys, scaling, inputs) in enumerate(steps)
    ]
    plus = None
    if scorer.endswith("plus"):
        plus = loaded.model.model.layers[layer].self_attn.o_proj.weight.detach()
    want = reconstruction_scores(replay, n, info.num_heads, info.num_kv_heads, scope, sinks, plus)
    torch.testing.assert_close(prompt["scores"].double(), want, atol=1e-5, rtol=1e-4)
    report = result.reports[layer]
    for h in range(info.num_kv_heads):
        top = torch.topk(want[h, sinks:], 60 - sinks).indices + sinks
        expected = sorted(list(range(sinks)) + top.tolist())
        assert report.selection.kept_positions(0, h) == expected


def test_scores_in_blocks_of_rows_equal_the_scores_at_once():
    """A step whose rows do not fit ``block_elements`` is scored a few rows at a time, to the same values."""
    gen = torch.Generator().manual_seed(0)
    B, H, Hkv, q, S, D = 2, 4, 2, 9, 7, 8
    block_valid = torch.ones(B, q, dtype=torch.bool)
    block_valid[1, :3] = False  # a left-padded block
    entry_valid = torch.ones(B, S, dtype=torch.bool)
    entry_valid[0, -2:] = False
    step = ReconstructionStep(
        layer_idx=0,
        queries=torch.randn(B, H, q, D, generator=gen),
        block_keys=torch.randn(B, Hkv, q, D, generator=gen),
        block_valid=block_valid,
        keys=torch.randn(B, Hkv, S, D, generator=gen),
        values=torch.randn(B, Hkv, S, D, generator=gen),
        entry_valid=entry_valid,
        columns=torch.arange(S)[None].expand(B, -1),
        scored=torch.ones(B, S, dtype=torch.bool),
        seq_len=S,
        scaling=D**-0.5,
    )
    scorer = ReconstructionAttention()
    small = dataclasses.replace(step, block_elements=B * H * (S + q) * 2)  # two rows at a time
    assert len(list(small.attention_rows())) == 5
    torch.testing.assert_close(scorer.step_scores(small), scorer.step_scores(step), atol=1e-6, rtol=1e-6)


def test_blocks_are_the_papers_requests():
    loaded = e2e.kvlab_model("tiny-qwen2")
    processor = loaded.processor
    tokenizer = processor.tokenizer
    batch = processor.collate(list(items()))
    ids, valid = batch.input_ids, batch.attention_mask.bool()
    blocks = reconstruction_blocks(processor, ids, valid, CHUNK, 8)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "X"}], add_generation_prompt=True, tokenize=False
    )
    opening = tokenizer(rendered.split("X", 1)[1], add_special_tokens=False)["input_ids"]
    first = tokenizer(FIRST_REQUEST, add_special_tokens=False)["input_ids"]
    later = tokenizer(NEXT_REQUEST, add_special_tokens=False)["input_ids"]
    for b in range(ids.shape[0]):
        row = ids[b, valid[b]].tolist()
        for i, (block, block_valid, start, count) in enumerate(blocks):
            chunk = row[i * CHUNK : (i + 1) * CHUNK]
            got = block[b, block_valid[b]].tolist()
            if not chunk:
                assert got == [] and int(count[b]) == 0
                continue
            request = first if i == 0 else later + row[i * CHUNK - 8 : i * CHUNK]
            assert got == request + opening + chunk
            assert int(count[b]) == len(chunk)
            assert ids[b, int(start[b]) : int(start[b]) + len(chunk)].tolist() == chunk


def test_budget_covering_the_prompt_equals_the_full_cache():
    full = run(Pipeline.from_config(None), items())
    whole = run(kvzip(budget={"tokens": 10_000, "window": 0, "sinks": 4}), items())
    assert whole.result.tokens == full.result.tokens
    torch.testing.assert_close(whole.result.step_logits, full.result.step_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(whole.result.kv_bytes_kept, full.result.kv_bytes_kept)


@pytest.mark.parametrize(
    "budget", [{"tokens": 60, "window": 0, "sinks": 4}, {"ratio": 0.3, "window": 0, "sinks": 4}]
)
def test_kept_counts_equal_budgets(budget):
    result = run(kvzip(budget=budget), items())
    contexts = result.context_tokens
    for b in range(len(items())):
        want = 60 if "tokens" in budget else int(0.3 * int(contexts[b]))
        assert (result.result.kept[:, b] == want).all()


def test_padded_batch_keeps_what_each_sample_keeps_alone():
    pipe = kvzip(budget={"ratio": 0.3, "window": 0, "sinks": 4})
    batched = run(pipe, items())
    for b, item in enumerate(items()):
        alone = run(pipe, [item])
        assert batched.result.tokens[b] == alone.result.tokens[0]
        torch.testing.assert_close(
            batched.result.step_logits[b], alone.result.step_logits[0], atol=1e-4, rtol=1e-4
        )
        pad = int(batched.result.prompt_lengths.max()) - int(batched.result.prompt_lengths[b])
        for got, want in zip(batched.result.reports, alone.result.reports, strict=True):
            for h in range(got.selection.counts.shape[1]):
                assert [p - pad for p in got.selection.kept_positions(b, h)] == want.selection.kept_positions(
                    0, h
                )


def test_schedule_global_keeps_what_layerwise_keeps():
    """Every layer observed after the reconstruction, then compressed: a layer-local method keeps the same."""
    budget = {"ratio": 0.3, "window": 0, "sinks": 4}
    layerwise = run(kvzip(budget=budget), items()).result
    node = {
        "budget": budget,
        "importance": {"attention": {"name": "reconstruction_attention"}},
        "prefill": {"name": "reconstruct", "chunk": CHUNK},
        "schedule": "global",
    }
    observed = run(Pipeline.from_config(node), items()).result
    assert observed.tokens == layerwise.tokens
    for got, want in zip(observed.reports, layerwise.reports, strict=True):
        assert torch.equal(got.selection.counts, want.selection.counts)
        assert torch.equal(torch.where(got.selection.mask(), got.selection.indices, -1),
                           torch.where(want.selection.mask(), want.selection.indices, -1))  # fmt: skip


def test_a_chunked_prompt_prefill_keeps_the_same_entries():
    """``model.prefill_chunk`` only chunks the prompt's own forward: the reconstruction scores the same."""
    loaded = e2e.kvlab_model("tiny-qwen2")
    batch = loaded.processor.collate(list(items()))
    pipe = kvzip(budget={"ratio": 0.3, "window": 0, "sinks": 4})
    protocol = build_protocol("query_agnostic")
    whole = protocol.run(loaded, pipe, batch, RunOptions(max_new_tokens=3)).result
    chunked = protocol.run(loaded, pipe, batch, RunOptions(max_new_tokens=3, prefill_chunk=50)).result
    assert chunked.tokens == whole.tokens
    for got, want in zip(chunked.reports, whole.reports, strict=True):
        assert torch.equal(got.selection.counts, want.selection.counts)
        assert torch.equal(torch.where(got.selection.mask(), got.selection.indices, -1),
                           torch.where(want.selection.mask(), want.selection.indices, -1))  # fmt: skip


def test_multi_question_reconstructs_each_context_once(monkeypatch):
    """Compress once, answer many: one reconstruction of the two contexts for four questions, each
    answer the one its question gets alone (``query_agnostic``) on the same compressed context."""
    import kvlab.engine.generation as generation

    runs = []
    reconstruct = generation.reconstruct

    def counted(model, session, processor, input_ids):
        runs.append(input_ids.shape[0])
        return reconstruct(model, session, processor, input_ids)

    monkeypatch.setattr(generation, "reconstruct", counted)
    pipe = kvzip(budget={"tokens": 24, "window": 0, "sinks": 4}, chunk=16)
    shared = run(pipe, QUESTIONS, protocol="multi_question").result
    assert runs == [2]  # the fox context and the colours one, in one batch
    for b, question in enumerate(QUESTIONS):
        alone = run(pipe, [question]).result
        assert shared.tokens[b] == alone.tokens[0]
        assert torch.equal(shared.kept[:, b], alone.kept[:, 0])


def test_model_wide_budgets_rank_every_layer_together():
    """``model_topk`` (KVzip's default budgets) under ``schedule: global``: the layer shares of one
    model-wide ranking of the recorded scores, the heads of each layer sharing it (AdaKV, alpha 0)."""
    node = {
        "budget": {"tokens": 40, "window": 0, "sinks": 4},
        "importance": {"attention": {"name": "reconstruction_attention"}},
        "allocate": {"layer": {"name": "model_topk"}, "head": {"name": "adakv", "alpha": 0.0}},
        "prefill": {"name": "reconstruct", "chunk": CHUNK},
        "schedule": "global",
    }
    loaded = e2e.kvlab_model("tiny-qwen2")
    batch = loaded.processor.collate(list(items()))
    options = RunOptions(max_new_tokens=3, record_scores=True)
    result = build_protocol("query_agnostic").run(loaded, Pipeline.from_config(node), batch, options)
    reports = result.result.reports
    kept = torch.stack([r.kept for r in reports])  # [L, B, Hkv]
    assert len(set(kept.sum(-1).flatten().tolist())) > 1  # layers differ
    T = batch.input_ids.shape[1]
    for b in range(len(items())):
        n = int(result.context_tokens[b])
        first = T - int(result.result.prompt_lengths[b])  # the context's first column in the batch
        assert int(kept[:, b].sum()) == len(reports) * loaded.info.num_kv_heads * 40
        scores = []
        for report in reports:
            layer = report.scorer_scores["attention"][b]  # [Hkv, T] at the batch's columns
            scores.append([[float(x) if 4 <= c - first < n else None for c, x in enumerate(row.tolist())]
                           for row in layer])  # fmt: skip
        want = model_topk_kept(scores, 40 - 4, list(range(first, first + 4)))
        got = [[r.selection.kept_positions(b, h) for h in range(loaded.info.num_kv_heads)] for r in reports]
        assert got == want


def test_the_reconstruction_counts_as_compression_time(monkeypatch):
    """The reconstruction forwards' wall time is compression time, never prefill time."""
    import kvlab.engine.reconstruction as reconstruction

    spent = []
    finish = reconstruction.finish_reconstruction

    def spy(session):
        spent.append(session.scoring_seconds)
        return finish(session)

    monkeypatch.setattr(reconstruction, "finish_reconstruction", spy)
    result = run(kvzip(), items()).result
    assert spent[0] > 0
    assert result.compression_seconds >= spent[0]
    once = run(
        Pipeline.from_config(
            {"budget": {"tokens": 60, "window": 0}, "importance": {"n": {"name": "key_norm"}}}
        ),
        items(),
    )
    assert result.compression_seconds > once.result.compression_seconds


def test_refusals():
    with pytest.raises(ConfigError, match="reconstruct"):  # a reader without the reconstruction
        Pipeline.from_config({"budget": 32, "importance": {"a": {"name": "reconstruction_attention"}}})
    with pytest.raises(ConfigError, match="no scorer reads"):
        Pipeline.from_config(
            {"budget": 32, "importance": {"a": {"name": "key_norm"}}, "prefill": {"name": "reconstruct"}}
        )
    with pytest.raises(ConfigError, match="reconstruct"):
        build_protocol({"name": "decode_time", "interval": 8, "ratio": 0.5}).check(kvzip())
    with pytest.raises(ConfigError, match="scope"):
        kvzip(scope="everything")


@pytest.mark.parametrize("case", ["kvzip", "kvzip_chunked", "kvzip_llama_chunked"])
def test_the_preset_keeps_kvpress_positions(case):
    """The ``kvzip`` preset at kvpress's budget: the positions ``KVzipPress`` keeps (``layerwise=True``)."""
    want = kvpress_cases.recorded()["cases"][case]["kept"]
    assert kvpress_cases.kvlab_prefill_kept(kvpress_cases.CASES[case]) == want
