"""Compression protocols (``model.protocol``, docs/protocols.md) on the tiny models.

Invariants: with a budget that keeps every entry each protocol gives the full cache's tokens and
logits; ``multi_question`` equals each question run alone on the same compressed context and
compresses it once; ``decode_time`` keeps its stated size and, at a compression, chooses what a
prefill of the same tokens chooses with the same method.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.cli import TINY, TINY_MODEL, predict, write_jsonl
from support.e2e import kvlab_model
from support.questions import CONTEXT, QUESTIONS, sample

import kvlab.data.kvpress  # noqa: F401  (registers the kvpress dataset)
from kvlab.api import load_pipeline
from kvlab.cli.prompt_example import QUESTION_LINE, describe_prompt
from kvlab.config.errors import ConfigError
from kvlab.data.contexts import ContextBatchSampler, check_contexts, context_batches
from kvlab.data.long_prompts import truncate_left
from kvlab.data.sample import Sample
from kvlab.engine.generation import RunOptions
from kvlab.engine.protocols import PROTOCOLS, build_protocol, protocol_node
from kvlab.models.base import Batch
from kvlab.models.processors import ChatProcessor
from kvlab.pipeline import Pipeline
from kvlab.runner.fingerprint import check_run, fingerprint_fields, record_run

UNLIMITED = {"budget": {"tokens": 10_000, "window": 4}}


def run(protocol, pipeline, samples, steps=6, **kwargs):
    loaded = kvlab_model("tiny-qwen2")
    batch = loaded.processor.collate(list(samples))
    return build_protocol(protocol).run(
        loaded, pipeline, batch, RunOptions(max_new_tokens=steps, return_logits=True, **kwargs)
    )


def assert_same(result, expected, b=None, e=None):
    """Sample ``b`` of ``result`` has sample ``e`` of ``expected``'s tokens and the logits they were
    chosen from (every sample when None)."""
    for r in range(len(result.tokens)) if b is None else [b]:
        x = r if e is None else e
        assert result.tokens[r] == expected.tokens[x]
        n = len(expected.tokens[x])
        torch.testing.assert_close(
            result.step_logits[r, :n], expected.step_logits[x, :n], atol=1e-5, rtol=1e-5
        )


# ---- configuration ---------------------------------------------------------------------------
def test_protocol_nodes_and_config_errors():
    assert protocol_node(None) == {"name": "query_aware"}
    assert protocol_node("query_agnostic") == {"name": "query_agnostic"}
    node = protocol_node({"name": "decode_time", "interval": 32, "ratio": 0.5})
    assert node == {"name": "decode_time", "interval": 32, "target_size": None, "ratio": 0.5}
    assert set(PROTOCOLS.names()) == {"query_aware", "query_agnostic", "multi_question", "decode_time"}
    bad = [
        ("query_agnostc", "Did you mean 'query_agnostic'"),
        ({"name": "decode_time", "interval": 0, "ratio": 0.5}, "model.protocol.interval"),
        ({"name": "decode_time", "interval": 8}, "model.protocol.target_size / model.protocol.ratio"),
        ({"name": "decode_time", "target_size": 8, "ratio": 0.5}, "exactly one"),
        ({"name": "decode_time", "ratio": 1.5}, "model.protocol.ratio"),
        ({"name": "query_aware", "interval": 8}, "has no parameter 'interval'"),
    ]
    for node, message in bad:
        with pytest.raises(ConfigError, match=message):
            build_protocol(node)


@pytest.mark.parametrize(
    "protocol, preset, overrides, message",
    [
        ("query_agnostic", "snapkv", {"decode": {"name": "h2o"}}, "model.compression.decode = h2o"),
        ("multi_question", "snapkv", {"decode": {"name": "h2o"}}, "model.compression.decode = h2o"),
        ({"name": "decode_time", "interval": 32, "target_size": 64}, "full", {}, "has no scorer"),
        ({"name": "decode_time", "interval": 32, "target_size": 64}, "adakv", {}, "allocate.head = adakv"),
        ({"name": "decode_time", "interval": 32, "target_size": 64}, "lookm", {}, "model.compression"),
        ({"name": "decode_time", "interval": 8, "target_size": 64}, "snapkv", {}, "interval = 8 is below"),
        ({"name": "decode_time", "interval": 64, "target_size": 8}, "snapkv", {}, "target_size = 8 is below"),
        ({"name": "decode_time", "interval": 64, "ratio": 0.5}, "david", {}, "route"),
        (
            {"name": "decode_time", "interval": 64, "ratio": 0.5},
            "expected_attention",
            {},
            r"importance.expected \(expected_attention\) reads the model fact 'queries_before_rotation'",
        ),
        (
            {"name": "decode_time", "interval": 64, "ratio": 0.5},
            "knorm",
            {"importance": {"heavy": {"name": "cumulative_attention"}}, "mixer": {"name": "weighted_sum"}},
            "importance.heavy",
        ),
    ],
)
def test_protocols_refuse_pipelines_they_cannot_run(protocol, preset, overrides, message):
    pipeline = load_pipeline(preset, overrides)
    with pytest.raises(ConfigError, match=message):
        build_protocol(protocol).check(pipeline)


def test_module_validates_the_protocol_before_loading_the_model(monkeypatch):
    import kvlab.models
    from kvlab.runner.module import KVLabModule

    monkeypatch.setattr(kvlab.models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(ConfigError, match="model.protocol.ratio"):
        KVLabModule("tiny-llama", {"preset": "knorm"}, protocol={"name": "decode_time", "ratio": 2.0})
    with pytest.raises(ConfigError, match="allocate.head = adakv"):
        KVLabModule("tiny-llama", {"preset": "adakv"}, protocol={"name": "decode_time", "ratio": 0.5})
    module = KVLabModule("tiny-llama", {"preset": "snapkv"}, protocol="multi_question")
    assert module.protocol.registry_name == "multi_question" and module.protocol.groups_contexts


# ---- the split of a prompt into context and question part -----------------------------------
def test_the_question_part_is_the_question_the_assistant_opening_and_the_answer_prefix():
    processor = kvlab_model("tiny-qwen2").processor
    s = QUESTIONS[0]
    ids = processor.prompt_ids(s)
    split = processor.context_token_count(s, ids)
    tokenizer = processor.tokenizer
    context, question = tokenizer.decode(ids[:split]), tokenizer.decode(ids[split:])
    # the context's trailing space merges with the question's first word: that token is the question's
    assert context.endswith(CONTEXT.rstrip()) and "What" not in context
    assert question == " What jumps over the dog?<|im_end|>\n<|im_start|>assistant\nAnswer:"
    assert processor.prompt_text(s).endswith(
        "<|im_start|>assistant\nAnswer:"
    )  # the assistant turn starts with it
    text, n = describe_prompt(processor, s)
    assert QUESTION_LINE in text and n == len(ids)
    assert text.split(QUESTION_LINE)[1].endswith("Answer:")


def test_raw_prompts_split_at_the_question_and_put_the_answer_prefix_on_a_new_line():
    from support.tokenizers import bos_tokenizer

    processor = ChatProcessor(bos_tokenizer(None))
    s = sample("a", "What jumps?", answer_prefix="Answer:")
    assert processor.prompt_text(s) == CONTEXT + "What jumps?\nAnswer:"
    ids = processor.prompt_ids(s)
    split = processor.context_token_count(s, ids)
    assert processor.tokenizer.decode(ids[split:]) == " What jumps?\nAnswer:"  # the merged space too
    whole = Sample(id="w", prompt=CONTEXT)  # no question: the whole prompt is the context
    assert processor.context_token_count(whole, processor.prompt_ids(whole)) == len(
        processor.prompt_ids(whole)
    )


# ---- query_agnostic and multi_question -------------------------------------------------------
def test_every_protocol_with_an_unlimited_budget_gives_the_full_cache():
    """A padded batch: questions of 4 lengths over 2 contexts, an answer prefix, a per-sample limit."""
    full = run("query_aware", Pipeline.from_config(None), QUESTIONS, steps=8).result
    assert len(full.tokens[1]) <= 3  # its own max_new_tokens
    snapkv = load_pipeline("snapkv", UNLIMITED)
    decode_time = {"name": "decode_time", "interval": 4, "target_size": 10_000}  # compresses twice
    for protocol in ("query_agnostic", "multi_question", decode_time):
        assert_same(run(protocol, snapkv, QUESTIONS, steps=8).result, full)


def test_vision_language_contexts_keep_their_images_and_positions():
    """Qwen2-VL (M-RoPE positions): images sit in the context; two questions share it."""
    from PIL import Image

    loaded = kvlab_model("tiny-qwen2-vl")
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    context = "Look at the picture. The sky is blue today. "
    samples = [
        sample("a", "What color?", context, images=[image], answer_prefix="It is", context_id="x"),
        sample("b", "Which sky?", context, images=[image], context_id="x"),
        sample("c", "Q?", "Short. "),
    ]
    batch = loaded.processor.collate(samples)
    valid = batch.attention_mask[0].bool()
    ids, modality = batch.input_ids[0][valid].tolist(), batch.modality[0][valid]
    split = loaded.processor.context_token_count(samples[0], ids)
    assert bool((modality[:split] == 1).any()) and not bool((modality[split:] == 1).any())  # images: context
    assert loaded.processor.tokenizer.decode(ids[split:]).endswith("assistant\nIt is")
    full = build_protocol("query_aware").run(
        loaded, Pipeline.from_config(None), batch, RunOptions(max_new_tokens=5, return_logits=True)
    )
    snapkv = load_pipeline("snapkv", UNLIMITED)
    out = build_protocol("multi_question").run(
        loaded, snapkv, batch, RunOptions(max_new_tokens=5, return_logits=True)
    )
    assert_same(out.result, full.result)


def test_query_agnostic_compresses_the_context_alone():
    budget = 24
    snapkv = load_pipeline("snapkv", {"budget": {"tokens": budget, "window": 4}})
    protocol = run("query_agnostic", snapkv, QUESTIONS)
    out, extras = protocol.result, protocol.extras
    loaded = kvlab_model("tiny-qwen2")
    batch = loaded.processor.collate(QUESTIONS)
    T = batch.input_ids.shape[1]
    for b, s in enumerate(QUESTIONS):
        q = extras[b]["question_tokens"]
        assert q == len(loaded.processor.prompt_ids(s)) - loaded.processor.context_token_count(
            s, loaded.processor.prompt_ids(s)
        )
        length = int(out.prompt_lengths[b])
        assert bool((out.kept[:, b] == min(budget, length - q)).all())  # the context's budget
        whole = out.kv_bytes_full[b] // length  # one token, every layer and head
        L, _, Hkv = out.kept.shape
        assert (
            out.kv_bytes_kept[b] * L * Hkv == (out.kept[:, b].sum() + q * L * Hkv) * whole
        )  # question on top
        for report in out.reports:  # kept positions: in the batch's padded prompt, before the question
            positions = report.selection.kept_positions(b, 0)
            assert positions and max(positions) < T - q and min(positions) >= T - length


def test_multi_question_equals_each_question_alone_on_its_compressed_context(monkeypatch):
    snapkv = load_pipeline("snapkv", {"budget": {"tokens": 24, "window": 4}})
    calls = []
    original = Pipeline.compress

    def counted(self, ctx, **kwargs):
        calls.append(ctx.batch_size)
        return original(self, ctx, **kwargs)

    monkeypatch.setattr(Pipeline, "compress", counted)
    protocol = run("multi_question", snapkv, QUESTIONS)
    layers = kvlab_model("tiny-qwen2").info.num_layers
    assert calls == [2] * layers  # two contexts (fox, colors), each layer compressed once
    assert [e["context_questions"] for e in protocol.extras] == [3, 3, 3, 1]
    out = protocol.result
    for b, s in enumerate(QUESTIONS):
        alone = run("query_agnostic", snapkv, [s]).result
        assert_same(out, alone, b, 0)
        assert torch.equal(out.kept[:, b], alone.kept[:, 0])


def test_the_python_api_takes_a_protocol_and_sample_prompts():
    import kvlab

    model = kvlab.load_model("tiny-qwen2")
    pipeline = kvlab.load_pipeline("snapkv", {"budget": {"tokens": 24, "window": 4}})
    shared = kvlab.compress_and_generate(  # 3: the limit one Sample carries (another is refused)
        model, pipeline, QUESTIONS, max_new_tokens=3, protocol="multi_question"
    )
    for s, out in zip(QUESTIONS, shared, strict=True):
        [alone] = kvlab.compress_and_generate(model, pipeline, s, max_new_tokens=3, protocol="query_agnostic")
        assert out.token_ids == alone.token_ids and out.kept_positions == alone.kept_positions
        assert out.prompt_ids == alone.prompt_ids == model.processor.prompt_ids(s)
    with pytest.raises(ConfigError, match="token-id prompts"):
        kvlab.compress_and_generate(model, pipeline, [[1, 2, 3, 4]], protocol="query_agnostic")


# ---- decode_time -----------------------------------------------------------------------------
@pytest.mark.parametrize("target", [{"target_size": 20}, {"ratio": 0.3}])
def test_decode_time_keeps_the_stated_size(target):
    knorm = load_pipeline("knorm", {"budget": {"tokens": 10_000, "window": 4}})  # prefill keeps everything
    protocol = {"name": "decode_time", "interval": 4, **target}
    out = run(protocol, knorm, QUESTIONS[3:] + QUESTIONS[:1], steps=10)
    prompt = out.result.prompt_lengths
    for b, extra in enumerate(out.extras):
        assert len(out.result.tokens[b]) == 10  # no eos: each sample lived through both compressions
        assert extra["decode_compressions"] == 2  # after 4 and 8 fed tokens
        size = 20 if "target_size" in target else int(0.3 * (int(prompt[b]) + 8))
        assert extra["decode_kept_per_layer_head"] == [[size] * 2] * 3


def test_decode_time_chooses_what_a_prefill_of_the_same_tokens_chooses():
    """After W fed tokens, decode-time SnapKV (window W: the W decoded tokens' captured attention)
    keeps what query-aware SnapKV keeps when prefilling the prompt and those W tokens, so the
    following logits agree."""
    W, target = 6, 30
    loaded = kvlab_model("tiny-qwen2")
    s = QUESTIONS[0]
    prefill_all = load_pipeline("snapkv", {"budget": {"tokens": 10_000, "window": W}})
    decode_time = run(
        {"name": "decode_time", "interval": W, "target_size": target}, prefill_all, [s], steps=W + 4
    )
    fed = decode_time.result.tokens[0][:W]
    assert decode_time.extras[0]["decode_compressions"] == 1
    ids = loaded.processor.prompt_ids(s) + fed
    batch = Batch(
        torch.tensor([ids]),
        torch.ones(1, len(ids), dtype=torch.long),
        torch.zeros(1, len(ids), dtype=torch.long),
    )
    snapkv = load_pipeline("snapkv", {"budget": {"tokens": target, "window": W}})
    aware = (
        build_protocol("query_aware")
        .run(loaded, snapkv, batch, RunOptions(max_new_tokens=4, return_logits=True))
        .result
    )
    assert decode_time.result.tokens[0][W:] == aware.tokens[0][: len(decode_time.result.tokens[0]) - W]
    torch.testing.assert_close(
        decode_time.result.step_logits[0, W + 1 :], aware.step_logits[0, 1:4], atol=1e-4, rtol=1e-4
    )


# ---- data module, fingerprint, CLI -----------------------------------------------------------
def test_contexts_are_batched_whole_and_must_agree():
    samples = [QUESTIONS[0], QUESTIONS[3], QUESTIONS[1], QUESTIONS[2]]
    assert context_batches([s.context_id for s in samples], 1) == [[0, 2, 3], [1]]
    assert context_batches([s.context_id for s in samples], 2) == [[0, 2, 3, 1]]
    sampler = ContextBatchSampler([3, 0, 1, 2], 1, context_ids=[s.context_id for s in samples])
    assert list(sampler) == [[3, 0, 2], [1]] and len(sampler) == 2  # the indices Lightning's sampler gives
    check_contexts(samples)
    with pytest.raises(ConfigError, match="share context_id 'fox'"):
        check_contexts([QUESTIONS[0], sample("x", "Why?", context="Another text. ", context_id="fox")])


def test_truncate_left_keeps_the_question():
    processor = kvlab_model("tiny-qwen2").processor
    s = QUESTIONS[2]
    short, dropped = truncate_left(processor, s, len(processor.prompt_ids(s)) - 10)
    assert dropped > 0 and short.question == s.question and short.prompt.endswith(s.question)
    assert len(processor.prompt_ids(short)) <= len(processor.prompt_ids(s)) - 10


def test_fingerprint_records_the_protocol_and_older_runs_resume_as_query_aware(tmp_path):
    config = {
        "model": {"model": "tiny-llama", "protocol": {"name": "decode_time", "interval": 8, "ratio": 0.5}}
    }
    fields = fingerprint_fields(config)
    assert fields["model"]["protocol"] == {
        "name": "decode_time",
        "interval": 8,
        "target_size": None,
        "ratio": 0.5,
    }
    old = fingerprint_fields({"model": {"model": "tiny-llama"}})
    record_run(tmp_path, old)  # a run recorded before model.protocol existed
    check_run(tmp_path, fingerprint_fields({"model": {"model": "tiny-llama", "protocol": "query_aware"}}))
    with pytest.raises(ConfigError, match="model.protocol.name"):
        check_run(
            tmp_path, fingerprint_fields({"model": {"model": "tiny-llama", "protocol": "query_agnostic"}})
        )


def test_cli_predicts_query_agnostic_and_multi_question(tmp_path):
    predict(tmp_path, "--config", "snapkv.yaml", *TINY, "--model.protocol", "query_agnostic",
            "--model.compression.budget.tokens", "40", "--model.compression.budget.window", "8",
            "--data.dataset", "{name: synthetic_retrieval, num_samples: 2, context_words: 60}")  # fmt: skip
    run_dir = tmp_path / "runs" / "exp" / "snapkv"
    records = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(
        r["protocol"] == "query_agnostic" and r["question_tokens"] > 0 for r in records
    )
    recorded = json.loads((run_dir / "run.json").read_text())["fields"]["model"]["protocol"]
    assert recorded == {"name": "query_agnostic"}

    shared = {"context": CONTEXT, "answer_prefix": "Answer:", "answer": ["fox"], "max_new_tokens": 3}
    rows = [{**shared, "question": q} for q in ("What jumps?", "Who sleeps?")]
    rows.append({"context": "Short note. ", "question": "Why?", "answer": "because"})
    data = write_jsonl(tmp_path / "kvpress.jsonl", rows)
    predict(tmp_path, "--config", "knorm.yaml", *TINY_MODEL, "--model.max_new_tokens", "3",  # the rows' own
            "--model.protocol", "multi_question", "--data.dataset", f"{{name: kvpress, path: {data}}}",
            "--data.batch_size", "1")  # fmt: skip
    run_dir = tmp_path / "runs" / "exp" / "knorm"
    records = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == ["0", "1", "2"]
    assert [r["context_questions"] for r in records] == [2, 2, 1]
    assert [r["batch_size"] for r in records] == [2, 2, 1]  # one context per batch, all its questions
    assert all(r["output_tokens"] <= 3 for r in records[:2])
    example = (run_dir / "prompt_example.txt").read_text()
    assert QUESTION_LINE.strip() in example and "Answer:" in example.split(QUESTION_LINE.strip())[1]
