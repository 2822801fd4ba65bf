"""Chunk retrieval (HybridKV's dynamic heads, the `retrieve` selector and `retrieval` preset): the
chunk choice against a brute-force search, decode attention against a loop, the sanity checks (a
budget covering every chunk equals the full cache), accounting, and the predictions of a run. The
kernels (chunk scores + top-k, gather) are tested against their references in
tests/kernels/test_kernels.py and compiled for sm_80/sm_90 by tests/kernels/test_kernel_compile.py."""

import json

import pytest
import torch
from naive.attention import dot, naive_attention
from naive.retrieval import assert_attends_to, naive_chunk_choice
from support import e2e
from support.e2e import kvlab_model
from support.retrieval_layers import retrieval_layer

import kvlab
from kvlab.cli.main import main
from kvlab.compression import retrieval as retrieval_module
from kvlab.compression.retrieval import ChunkStore, RetrieveSelector
from kvlab.compression.retrieval_index import MeanKeyIndex
from kvlab.config.loader import resolve
from kvlab.data.synthetic import SyntheticRetrieval
from kvlab.kernels import dispatch
from kvlab.kernels.retrieval import chunk_scores_reference
from kvlab.pipeline import Pipeline
from kvlab.pipeline.report import LayerReport
from kvlab.pipeline.routed import combine_selections

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def restore_mode():
    previous = dispatch.get_mode()
    yield
    dispatch.set_mode(previous)


def test_chunk_score_is_the_mean_logit_of_its_tokens():
    """q . mean_j k_j == mean_j q . k_j: ranking chunks by mean keys ranks them by mean logits."""
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 1, 21, 8, generator=gen)
    region = torch.ones(1, 21, dtype=torch.bool)
    store = ChunkStore.build(keys, keys, torch.tensor([[0, 0]]), region, torch.tensor([1]), 8, MeanKeyIndex())
    query = torch.randn(1, 2, 1, 8, generator=gen)
    scores = chunk_scores_reference(query, store.index, store.rows, store.chunk_valid, 1)[0, 0]
    qbar = query[0, :, 0].mean(0).tolist()
    for c, tokens in enumerate([range(0, 8), range(8, 16), range(16, 21)]):
        want = sum(dot(qbar, keys[0, 0, j].tolist()) for j in tokens) / len(tokens)
        assert float(scores[c]) == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("local", ["none", "protected"])
def test_decode_attends_to_the_chunks_a_brute_force_search_picks(local):
    lengths, counts = [23, 17], [[9, 30], [13, 8]]  # (0, 1) keeps its whole prompt
    layer, query, ctx, scores, decoded = retrieval_layer(lengths, counts, local=local)
    store = layer.offloaded
    assert sorted(map(tuple, store.rows.tolist())) == [(0, 0), (1, 0), (1, 1)]
    got = layer.decode_attention(query, ctx.scaling)
    T, G, chunk = ctx.seq_len, 2, 4
    for b, n in enumerate(lengths):
        off = T - n
        for h in range(2):
            prompt = list(range(n))
            held = (
                [j for j in prompt if scores[b, h, off + j] == float("inf")] if local == "protected" else []
            )
            if counts[b][h] >= n:
                chosen_tokens = prompt
            else:
                region = [j for j in prompt if j not in held]
                q_group = [query[b, h * G + g, 0].tolist() for g in range(G)]
                n_sel = (counts[b][h] - len(held)) // chunk
                chosen = naive_chunk_choice(
                    q_group, [ctx.keys[b, h, off + j].tolist() for j in region], chunk, n_sel
                )
                chosen_tokens = held + [region[j] for c in chosen for j in range(c * chunk, c * chunk + chunk)
                                        if j < len(region)]  # fmt: skip
            assert_attends_to(got, query, ctx, decoded, (b, h, G), [off + j for j in chosen_tokens])
    assert store.steps == 1


def test_fetch_covering_every_chunk_attends_over_everything(monkeypatch):
    """A retrieval budget holding every chunk gives the full cache's attention (decode and end to end)."""
    build = ChunkStore.build

    def every_chunk(keys, values, rows, region, n_sel, chunk, ranker):
        return build(keys, values, rows, region, torch.full_like(n_sel, 10**6), chunk, ranker)

    monkeypatch.setattr(ChunkStore, "build", staticmethod(every_chunk))
    full_layer, _, _, _, _ = retrieval_layer([23, 17], [[99, 99], [99, 99]])
    assert full_layer.offloaded is None
    layer, query, ctx, _, _ = retrieval_layer([23, 17], [[9, 5], [13, 8]], local="protected")
    want = full_layer.decode_attention(query, ctx.scaling)
    torch.testing.assert_close(layer.decode_attention(query, ctx.scaling), want, atol=1e-5, rtol=1e-5)
    loaded = kvlab_model("tiny-qwen2")
    items = SyntheticRetrieval(num_samples=2, context_words=60, seed=1).samples()
    full = e2e.run(loaded, Pipeline.from_config(None), items, 5)
    node = resolve(["retrieval"], [])["model"]["compression"]
    node["budget"] = {"tokens": 24, "window": 0}
    got = e2e.run(loaded, Pipeline.from_config(node), items, 5)
    assert got.reports[0].selection.offloaded is not None
    assert got.tokens == full.tokens
    torch.testing.assert_close(got.step_logits, full.step_logits, atol=1e-4, rtol=1e-4)


def test_padded_question_block_and_several_queries_per_step():
    """q = 2 new tokens in one call, the first a padding entry in sample 1 (a padded block of
    questions): each real query sees its causal decode entries and the chunks it picks itself."""
    layer, _, ctx, _, decoded = retrieval_layer([23, 17], [[9, 9], [13, 8]], steps=1)
    gen = torch.Generator().manual_seed(9)
    block = torch.randn(2, 2, 2, 8, generator=gen), torch.randn(2, 2, 2, 8, generator=gen)
    block_valid = torch.tensor([[True, True], [False, True]])
    layer.expect_block(block_valid)
    layer.update(*block)
    layer.expect_block(None)
    query = torch.randn(2, 4, 2, 8, generator=gen)
    got = layer.decode_attention(query, ctx.scaling)
    counts, T, G, chunk = [[9, 9], [13, 8]], ctx.seq_len, 2, 4
    for b, n in enumerate([23, 17]):
        off = T - n
        for h in range(2):
            for i in range(2):
                if not block_valid[b, i]:
                    continue
                q_group = [query[b, h * G + g, i].tolist() for g in range(G)]
                region = [ctx.keys[b, h, off + j].tolist() for j in range(n)]
                chosen = naive_chunk_choice(q_group, region, chunk, counts[b][h] // chunk)
                tokens = [j for c in chosen for j in range(c * chunk, min(c * chunk + chunk, n))]
                entries = [(decoded[0][0][b, h, 0], decoded[0][1][b, h, 0])]
                entries += [(block[0][b, h, j], block[1][b, h, j]) for j in range(i + 1) if block_valid[b, j]]
                keys = [ctx.keys[b, h, off + j].tolist() for j in tokens] + [k.tolist() for k, _ in entries]
                values = [ctx.values[b, h, off + j].tolist() for j in tokens] + [
                    v.tolist() for _, v in entries
                ]
                for g in range(G):
                    want = naive_attention(query[b, h * G + g, i].tolist(), keys, values, ctx.scaling)
                    torch.testing.assert_close(got[b, h * G + g, i], torch.tensor(want, dtype=torch.float32),
                                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_store_accounting_and_host_memory():
    layer, query, ctx, _, _ = retrieval_layer([24, 16], [[9, 30], [13, 8]], chunk=4)  # whole chunks only
    store = layer.offloaded
    assert store.host_keys.device.type == "cpu" and not store.host_keys.is_pinned()  # no CUDA here
    R, M, D = 3, 24, 8
    assert store.host_keys.shape == (R, M, D)
    assert store.offloaded_bytes() == layer.offloaded_bytes() == 2 * R * M * D * 4
    NC = M // 4
    fetch = [9 // 4, 13 // 4, 8 // 4]
    row_fixed = NC * D * 4 + NC + M + 8 + 16
    assert store.device_bytes() == sum(row_fixed + n * 4 * D * 2 * 4 for n in fetch)
    without = sum(t.numel() * t.element_size() for t in (layer.prompt_keys, layer.prompt_values,
                  layer.decode_keys, layer.decode_values, layer.starts, layer.lengths))  # fmt: skip
    assert layer.kv_bytes() == without + store.device_bytes()
    layer.decode_attention(query, ctx.scaling)
    layer.decode_attention(query, ctx.scaling)
    moved = [f * 4 * D * 2 * 4 for f in fetch]  # every fetched chunk is full here
    assert store.sample_figures(0)["moved_per_step"] == moved[0]
    assert store.sample_figures(1)["moved_per_step"] == moved[1] + moved[2]
    assert store.sample_figures(1)["heads"] == 2


def test_a_route_keeps_the_store_for_its_own_heads():
    layer, _, ctx, scores, _ = retrieval_layer([23, 17], [[9, 9], [9, 9]])
    retrieve = RetrieveSelector(chunk=4).select(scores, torch.full((2, 2), 9), ctx)
    keep_all = RetrieveSelector(chunk=4).select(scores, torch.full((2, 2), 99), ctx)
    choice = torch.tensor([[0, 1], [1, 1]])  # (0, 0) from the retrieving branch only
    combined = combine_selections([retrieve, keep_all], choice, ctx)
    assert combined.offloaded.rows.tolist() == [[0, 0]]
    assert combined.counts.tolist() == [[0, 23], [17, 17]]
    assert (
        combine_selections([keep_all, retrieve], torch.zeros(2, 2, dtype=torch.long), ctx).offloaded is None
    )


def predict(tmp_path, preset, model, dataset, *args):
    main(["predict", "--config", preset, "--model.model", model, "--model.max_new_tokens", "3",
          "--trainer.enable_progress_bar", "false", "--data.dataset", dataset, "--data.batch_size", "2",
          "--run.dir", str(tmp_path), "--run.experiment", "exp", "--run.method", preset, *args])  # fmt: skip
    run = tmp_path / "exp" / preset
    records = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    return records, json.loads((run / "metrics.json").read_text())


def test_predictions_record_heads_device_and_offloaded_bytes(tmp_path):
    dataset = "{name: synthetic_image_qa, num_samples: 2, images_per_sample: 2}"
    records, metrics = predict(tmp_path, "hybridkv", "tiny-qwen2-vl", dataset,
                               "--model.compression.budget", "{tokens: 24, window: 4}",
                               "--model.compression.route.rule.theta", "0.5")  # fmt: skip
    layers = 2
    for r in records:
        heads = r["route_heads_per_layer"]
        assert set(heads) == {"static", "dynamic"} and len(heads["static"]) == layers
        assert [s + d for s, d in zip(heads["static"], heads["dynamic"], strict=True)] == [2] * layers
        assert r["retrieval_heads_per_layer"] == heads["dynamic"]
        assert len(r["retrieval_bytes_per_step_per_layer"]) == layers
        assert r["kv_bytes_device"] >= r["kv_bytes_kept"]
        assert (r["kv_bytes_offloaded"] > 0) == (sum(heads["dynamic"]) > 0)
    assert metrics["kv_bytes_offloaded"] == sum(r["kv_bytes_offloaded"] for r in records)
    assert metrics["kv_bytes_device"] == sum(r["kv_bytes_device"] for r in records)


def test_records_of_a_pipeline_without_retrieval_are_unchanged():
    report = LayerReport(0, torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    assert kvlab.load_pipeline("snapkv").report([report], torch.tensor([10])).samples == [{}]


def test_bench_retrieval_prints_a_table(capsys):
    main(["bench", "retrieval", "--contexts", "256", "--steps", "2", "--repeat", "1", "--heads", "4",
          "--kv-heads", "2", "--head-dim", "16"])  # fmt: skip
    out = capsys.readouterr().out
    assert "| full |" in out and "| snapkv |" in out and "| retrieval |" in out and "| hybridkv |" in out


def test_retrieve_selector_is_in_the_registry_and_dispatch_counts_its_kernels():
    dispatch.CALLS.clear()
    layer, query, ctx, _, _ = retrieval_layer([23, 17], [[9, 9], [9, 9]])
    layer.decode_attention(query, ctx.scaling)
    assert dispatch.CALLS[("chunk_topk", "reference")] == 1
    assert dispatch.CALLS[("gather_chunks", "reference")] == 1
    assert retrieval_module.RetrieveSelector.registry_name == "retrieve"


@pytest.mark.parametrize("protocol", ["query_agnostic", "multi_question"])
def test_cost_fields_are_recorded_under_the_context_protocols(protocol):
    """The context compressed alone keeps its store: each question reports its context's retrieving
    heads, device, host and fetched bytes (they were all 0 when the context's report dropped it)."""
    from support.questions import QUESTIONS

    loaded = kvlab_model("tiny-qwen2")
    pipeline = kvlab.load_pipeline("retrieval", {"budget.tokens": 32, "budget.window": 8})
    outputs = kvlab.compress_and_generate(loaded, pipeline, QUESTIONS, max_new_tokens=3, protocol=protocol)
    fox = [o.reported for o, s in zip(outputs, QUESTIONS, strict=True) if s.context_id == "fox"]
    for reported in fox:
        assert all(heads == 2 for heads in reported["retrieval_heads_per_layer"])  # every KV head
        assert reported["kv_bytes_offloaded"] > 0 and reported["retrieval_bytes_per_step"] > 0
        assert reported["kv_bytes_device"] > 0
    if protocol == "multi_question":  # one context compressed once: its questions report the same store
        assert len({r["kv_bytes_offloaded"] for r in fox}) == 1
