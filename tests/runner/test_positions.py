"""Kept positions (``model.record_positions``): the side file, its reader, the shard merge, Jaccard in
``kvlab compare`` across protocols, every protocol's rows against an independent reconstruction (a
query-aware prefill of the same tokens, the cache's own positions of sliding layers), and keydiff's
anchor compared index by index with kvpress' formula."""

import json
import math

import numpy as np
import pytest
import torch
from naive.attention import dot, norm
from naive.context import LENGTHS, build, make_ctx, sample_lists
from support import e2e
from support.cli import TINY, write_jsonl
from support.questions import QUESTIONS

from kvlab.api import load_pipeline
from kvlab.cli.main import main
from kvlab.compression.diversity import DIVERSITY
from kvlab.config.errors import ConfigError
from kvlab.data.synthetic import SyntheticRetrieval
from kvlab.engine.generation import RunOptions
from kvlab.engine.protocols import build_protocol
from kvlab.models.prompts import collate_ids
from kvlab.pipeline import Pipeline
from kvlab.runner import positions
from kvlab.runner.positions import (
    KeptPositions,
    append_rows,
    decode_row,
    encode_row,
    jaccard,
    kept_masks,
    mean_jaccard,
    merge_positions,
    position_rows,
    read_positions,
)


def naive_jaccard(a, b):
    a, b = set(a), set(b)
    return len(a & b) / len(a | b) if a | b else 1.0


def random_mask(seed, shape=(3, 2, 21)):
    return np.random.default_rng(seed).random(shape) < 0.4


# ---------------------------------------------------------------------------------------------
# format, reader, merge


def test_encode_decode_roundtrip_and_plain_rows():
    mask = random_mask(0)
    row = json.loads(json.dumps(encode_row("s1", mask)))
    kept = decode_row(row)
    assert kept.shape == (3, 2, 21) and np.array_equal(kept.mask(), mask)
    assert kept.positions(2, 1) == np.flatnonzero(mask[2, 1]).tolist()
    lists = [[np.flatnonzero(mask[layer, h]).tolist() for h in range(2)] for layer in range(3)]
    plain = {"id": "s1", "prompt_tokens": 21, "positions": lists}
    assert np.array_equal(decode_row(plain).packed, kept.packed)  # another framework's rows read the same
    with pytest.raises(ValueError, match="unknown encoding"):
        decode_row({**row, "encoding": "rle"})


def test_jaccard_matches_sets():
    a, b = random_mask(1), random_mask(2)
    b[0, 0] = a[0, 0] = False  # both empty -> 1
    A, B = (
        KeptPositions(np.packbits(a, -1, bitorder="little"), 21),
        KeptPositions(np.packbits(b, -1, bitorder="little"), 21),
    )
    values = jaccard(A, B)
    for layer in range(3):
        for head in range(2):
            expected = naive_jaccard(np.flatnonzero(a[layer, head]), np.flatnonzero(b[layer, head]))
            assert values[layer, head] == pytest.approx(expected)
    other = KeptPositions(np.packbits(random_mask(3, (3, 2, 22)), -1, bitorder="little"), 22)
    overlap = mean_jaccard({"x": A, "y": A, "z": A}, {"x": B, "y": A, "z": other})
    assert (overlap.samples, overlap.skipped) == (2, 1) and overlap.mean == pytest.approx(
        (values.sum() + 6) / 12
    )
    assert overlap.mean_end == overlap.mean and overlap.reason is None  # nothing evicted after the prefill
    none = mean_jaccard({"x": A}, {"q": B})
    assert (none.mean, none.samples, none.skipped) == (None, 0, 0) and "no sample id in common" in none.reason
    assert "differ in prompt tokens" in mean_jaccard({"z": A}, {"z": other}).reason


def test_jaccard_is_over_the_context_positions_both_runs_compressed():
    """A context-alone row (Tc < T) against a whole-prompt row: only the first Tc positions count,
    before and after a decode-time run's evictions."""
    whole, context = random_mask(4), random_mask(5)[..., :13]  # T = 21, Tc = 13
    a = decode_row(encode_row("s", whole, protocol="query_aware"))
    b = decode_row(encode_row("s", context, prompt_tokens=21, protocol="query_agnostic"))
    assert (b.prompt_tokens, b.context_tokens, b.shape) == (21, 13, (3, 2, 21))
    assert np.array_equal(b.context_mask(), context) and b.mask()[..., 13:].all()
    values = jaccard(a, b)
    for layer in range(3):
        for head in range(2):
            kept_a = np.flatnonzero(whole[layer, head, :13])
            assert values[layer, head] == pytest.approx(
                naive_jaccard(kept_a, np.flatnonzero(context[layer, head]))
            )
    final = random_mask(6, (3, 2, 25))  # decode_time: held at its last token, 4 generated tokens in
    c = decode_row(encode_row("s", whole, protocol="decode_time", final=(4, final)))
    end = jaccard(b, c, end=True)
    for layer in range(3):
        for head in range(2):
            kept_c = np.flatnonzero(final[layer, head, :13])
            assert end[layer, head] == pytest.approx(
                naive_jaccard(np.flatnonzero(context[layer, head]), kept_c)
            )
    assert mean_jaccard({"s": b}, {"s": c}).mean_end == pytest.approx(end.mean())


def test_shards_merge_in_order_without_loss_or_duplicates(tmp_path):
    rows = {i: encode_row(f"s{i}", random_mask(i)) for i in range(5)}
    append_rows(tmp_path / positions.POSITIONS, [rows[0]])  # a resumed run's earlier rows
    append_rows(tmp_path / positions.shard_name(1), [rows[3], rows[1]])
    append_rows(tmp_path / positions.shard_name(0), [rows[2], rows[0]])  # s0 re-run after a crash
    with (tmp_path / positions.shard_name(0)).open("a") as f:
        f.write(json.dumps(rows[4])[:40])  # a line cut short by a crash
    assert sorted(read_positions(tmp_path)) == ["s0", "s1", "s2", "s3"]  # unmerged shards are read too
    merge_positions(tmp_path, order=[f"s{i}" for i in range(5)])
    lines = (tmp_path / positions.POSITIONS).read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["s0", "s1", "s2", "s3"]
    assert not positions.shard_paths(tmp_path)
    merged = read_positions(tmp_path)
    assert all(np.array_equal(merged[f"s{i}"].mask(), random_mask(i)) for i in range(4))


# ---------------------------------------------------------------------------------------------
# positions = the layer reports' selections, in each sample's own coordinates


def test_positions_equal_the_selections_of_the_reports():
    loaded = e2e.kvlab_model("tiny-llama")
    samples = SyntheticRetrieval(num_samples=2, context_words=20, seed=5).samples()
    samples[1].prompt = samples[1].prompt[-120:]  # a shorter prompt: left padding in the batch
    pipeline = Pipeline.from_config(
        {"budget": {"tokens": 16, "window": 4}, "importance": {"attention": {"name": "window_attention"}}}
    )
    batch = loaded.processor.collate(samples)
    from kvlab.engine.generation import generate

    result = generate(loaded, pipeline, batch, RunOptions(max_new_tokens=1))
    masks = kept_masks(result.reports, batch.attention_mask, result.prompt_lengths)
    T = batch.attention_mask.shape[1]
    for b in range(2):
        n = int(batch.attention_mask[b].sum())
        kept = decode_row(encode_row(samples[b].id, masks[b]))
        assert kept.shape == (len(result.reports), result.kept.shape[2], n)
        assert (n < T) == (b == 1)  # the second sample is left-padded
        for layer, report in enumerate(result.reports):
            for h in range(result.kept.shape[2]):
                expected = [p - (T - n) for p in report.selection.kept_positions(b, h)]  # padding removed
                assert kept.positions(layer, h) == expected
                assert len(expected) == int(result.kept[layer, b, h])
    with pytest.raises(RuntimeError, match="cannot be mapped"):
        kept_masks(result.reports, batch.attention_mask, result.prompt_lengths + 1)


# ---------------------------------------------------------------------------------------------
# keydiff's anchor, index by index against kvpress' KeyDiffPress formula


def naive_keydiff(k, n, anchor):
    """``-cos(k_t, a)`` over one head's n valid keys; ``a`` = mean of unit keys or of raw keys."""
    dim = len(k[0])
    if anchor == "unit_mean":
        a = [sum(k[t][d] / norm(k[t]) for t in range(n)) / n for d in range(dim)]
    else:
        a = [sum(k[t][d] for t in range(n)) / n for d in range(dim)]
    return [-dot(k[t], a) / (norm(k[t]) * norm(a)) for t in range(n)]


@pytest.mark.parametrize("anchor", ["unit_mean", "raw_mean"])
def test_keydiff_scores_match_the_anchor_formula(anchor):
    ctx = make_ctx(LENGTHS, seed=10)
    node = {"name": "keydiff"} if anchor == "unit_mean" else {"name": "keydiff", "anchor": anchor}
    scores = build(DIVERSITY, **node).score(ctx)  # the default is the paper's unit_mean
    for b in range(2):
        n, off, _, k, _ = sample_lists(ctx, b)
        for h in range(2):
            expected = naive_keydiff(k[h], n, anchor)
            expected = torch.tensor(expected, dtype=torch.float64)
            torch.testing.assert_close(scores[b, h, off:].double(), expected, atol=1e-5, rtol=0)


def test_keydiff_anchors_differ_and_unknown_anchor_is_refused():
    ctx = make_ctx([24], kv_heads=1, seed=3)
    ctx.keys[0, 0] += 2.0  # a shared offset, and a few large keys that pull a raw mean towards them
    ctx.keys[0, 0, :3] *= 12.0
    unit = build(DIVERSITY, name="keydiff").score(ctx)[0, 0].argsort(descending=True)[:8]
    raw = build(DIVERSITY, name="keydiff", anchor="raw_mean").score(ctx)[0, 0].argsort(descending=True)[:8]
    assert set(unit.tolist()) != set(raw.tolist())
    with pytest.raises(ConfigError, match="anchor"):
        build(DIVERSITY, name="keydiff", anchor="mean")


def test_keydiff_on_a_tiny_model_keeps_kvpress_positions():
    """Every layer's kept positions equal a naive top-k of kvpress' score (mean of unit keys) on
    the keys the layer saw, window protected, ties to the lower position."""
    loaded = e2e.kvlab_model("tiny-llama")
    samples = SyntheticRetrieval(num_samples=1, context_words=15, seed=9).samples()
    budget, window = 14, 4
    pipeline = Pipeline.from_config(
        {"budget": {"tokens": budget, "window": window}, "diversity": {"keydiff": {}}}
    )
    seen = []
    compress = pipeline.compress

    def spy(ctx, record_scores=False):
        seen.append(ctx.keys[0].double().tolist())  # [Hkv][T][D], one unpadded sample
        return compress(ctx, record_scores=record_scores)

    pipeline.compress = spy
    batch = loaded.processor.collate(samples)
    from kvlab.engine.generation import generate

    result = generate(loaded, pipeline, batch, RunOptions(max_new_tokens=1))
    kept = decode_row(
        encode_row("s", kept_masks(result.reports, batch.attention_mask, result.prompt_lengths)[0])
    )
    n = kept.prompt_tokens
    assert n > budget and len(seen) == len(result.reports)
    for layer, keys in enumerate(seen):
        for h, k in enumerate(keys):
            scores = naive_keydiff(k, n, "unit_mean")
            candidates = sorted(range(n - window), key=lambda t: (-scores[t], t))[: budget - window]
            assert kept.positions(layer, h) == sorted(candidates + list(range(n - window, n)))


# ---------------------------------------------------------------------------------------------
# end to end: the side file of a run, resume, and kvlab compare's Jaccard


def run(tmp, method, config, *args):
    options = ["--model.max_new_tokens", "2", "--model.fidelity", "false", "--model.verify", "off"]
    where = ["--run.dir", str(tmp / "runs"), "--run.experiment", "exp", "--run.method", method]
    main(["predict", "--config", config, *TINY, *options, "--model.record_positions", "true", *where, *args])


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("positions")
    rows = [
        {"id": f"s{i}", "prompt": f"{'river stone ' * (12 + 4 * i)} what was it?", "answers": ["x"]}
        for i in range(3)
    ]
    data = ["--data.dataset", f"{{name: jsonl, path: {write_jsonl(tmp / 'd.jsonl', rows)}}}"]
    snap = ["--model.compression.budget", "{tokens: 16, window: 4}"]
    run(tmp, "snapkv", "snapkv", *data, *snap)
    for name in ("predictions.jsonl", positions.POSITIONS):  # as if killed after the first sample
        path = tmp / "runs" / "exp" / "snapkv" / name
        path.write_text(path.read_text().splitlines()[0] + "\n")
    run(tmp, "snapkv", "snapkv", *data, *snap)  # resumed: samples 2 and 3 only
    run(tmp, "snapkv_again", "snapkv", *data, *snap, "--data.batch_size", "3")
    run(tmp, "random", "random", *data, "--model.compression.budget", "{tokens: 16, window: 4}")
    return tmp / "runs" / "exp"


def test_run_writes_one_row_per_sample_and_keeps_predictions_clean(experiment):
    lines = (experiment / "snapkv" / positions.POSITIONS).read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [
        "s0",
        "s1",
        "s2",
    ]  # resumed, nothing lost or doubled
    records = [
        json.loads(line) for line in (experiment / "snapkv" / "predictions.jsonl").read_text().splitlines()
    ]
    assert all(positions.RECORD_FIELD not in r for r in records)
    kept = read_positions(experiment / "snapkv")
    for record in records:
        sample = kept[record["id"]]
        assert sample.prompt_tokens == record["prompt_tokens"]
        counts = sample.mask().sum(-1)  # [L, H]
        assert counts.tolist() == record["kept_per_layer_head"]


def test_compare_reports_jaccard(experiment, capsys):
    main(["compare", str(experiment), "--no-plots"])
    out = capsys.readouterr().out
    assert "Kept positions" in out
    rows = {(r["run_a"], r["run_b"]): r for r in _csv(experiment / "positions_overlap.csv")}
    same = rows[("snapkv", "snapkv_again")]
    assert float(same["mean_jaccard"]) == 1.0 and same["samples"] == "3"  # batched or resumed: the same
    assert float(rows[("random", "snapkv")]["mean_jaccard"]) < 1.0
    assert math.isclose(
        float(rows[("random", "snapkv")]["mean_jaccard"]),
        float(rows[("random", "snapkv_again")]["mean_jaccard"]),
    )


def _csv(path):
    import csv

    return list(csv.DictReader(path.open()))


# ---------------------------------------------------------------------------------------------
# every protocol, each against an independent reconstruction


def protocol_rows(protocol, pipeline, samples, steps=6):
    """``(ProtocolResult, {id: KeptPositions})`` of one padded batch of ``samples`` on tiny-qwen2."""
    loaded = e2e.kvlab_model("tiny-qwen2")
    batch = loaded.processor.collate(list(samples))
    name = protocol if isinstance(protocol, str) else protocol["name"]
    out = build_protocol(protocol).run(
        loaded, pipeline, batch, RunOptions(max_new_tokens=steps, record_positions=True)
    )
    rows = [json.loads(json.dumps(row)) for row in position_rows(out, batch, name)]
    assert all(row["protocol"] == name for row in rows)
    return out, {row["id"]: decode_row(row) for row in rows}


def aware_kept(pipeline, ids):
    """``[L, Hkv, len(ids)]``: what a ``query_aware`` prefill of the token ids ``ids`` alone keeps."""
    loaded = e2e.kvlab_model("tiny-qwen2")
    batch = collate_ids(loaded, [ids])
    result = build_protocol("query_aware").run(loaded, pipeline, batch, RunOptions(max_new_tokens=1)).result
    return kept_masks(result.reports, batch.attention_mask, result.prompt_lengths)[0]


SNAPKV = {"budget": {"tokens": 24, "window": 4}}


def test_query_agnostic_records_the_context_and_the_question_apart():
    """The context's kept set is what a prefill of the context's tokens alone keeps; the question part
    after it is recorded as held whole, never as evicted."""
    snapkv = load_pipeline("snapkv", SNAPKV)
    out, kept = protocol_rows("query_agnostic", snapkv, QUESTIONS)
    processor = e2e.kvlab_model("tiny-qwen2").processor
    for b, s in enumerate(QUESTIONS):
        row, ids = kept[s.id], processor.prompt_ids(s)
        q = out.extras[b]["question_tokens"]
        assert (row.prompt_tokens, row.context_tokens) == (len(ids), len(ids) - q)
        assert row.context_id is None and row.context_shared_by is None
        assert np.array_equal(row.context_mask(), aware_kept(snapkv, ids[: row.context_tokens]))
        assert row.mask()[..., row.context_tokens :].all()  # the question part: held whole
        assert row.context_mask().sum(-1).tolist() == out.result.kept[:, b].tolist()


def test_multi_question_records_one_row_per_question_on_the_shared_context():
    snapkv = load_pipeline("snapkv", SNAPKV)
    _, shared = protocol_rows("multi_question", snapkv, QUESTIONS)
    _, alone = protocol_rows("query_agnostic", snapkv, QUESTIONS)
    for s in QUESTIONS:
        row = shared[s.id]
        assert row.context_id == s.context_id
        assert row.context_shared_by == (["a", "b", "c"] if s.context_id == "fox" else ["d"])
        assert (row.prompt_tokens, row.context_tokens) == (
            alone[s.id].prompt_tokens,
            alone[s.id].context_tokens,
        )
        assert np.array_equal(row.packed, alone[s.id].packed)  # the one compression, as if alone
    assert np.array_equal(shared["a"].packed, shared["c"].packed)
    assert mean_jaccard(shared, alone).mean == 1.0


def test_decode_time_records_what_a_prefill_of_the_same_tokens_keeps():
    """After W fed tokens (the prefill keeping everything) decode-time SnapKV keeps what a query-aware
    prefill of the prompt and those W tokens keeps: the rest is the first eviction; the final set is
    what the second compression kept plus the tokens fed after it."""
    W, target, steps = 6, 30, 15
    prefill_all = load_pipeline("snapkv", {"budget": {"tokens": 10_000, "window": W}})
    s = QUESTIONS[0]
    protocol = {"name": "decode_time", "interval": W, "target_size": target}
    out, kept = protocol_rows(protocol, prefill_all, [s], steps=steps)
    row, tokens = kept[s.id], out.result.tokens[0]
    assert len(tokens) == steps and out.extras[0]["decode_compressions"] == 2  # after 6 and 12 fed tokens
    assert row.context_mask().all()  # the prefill kept everything
    ids = e2e.kvlab_model("tiny-qwen2").processor.prompt_ids(s)
    T = len(ids)
    first, second = row.evictions
    assert (first.step, first.removed.tokens, second.step, second.removed.tokens) == (
        W,
        T + W,
        2 * W,
        T + 2 * W,
    )
    snapkv = load_pipeline("snapkv", {"budget": {"tokens": target, "window": W}})
    kept_first = aware_kept(snapkv, ids + tokens[:W])
    assert np.array_equal(first.removed.mask(), ~kept_first)
    held = np.concatenate([kept_first, np.ones((*kept_first.shape[:2], W), dtype=bool)], -1)
    assert not (second.removed.mask() & ~held).any() and second.removed.mask().sum(-1).max() == W
    assert row.final_step == steps - 1 and row.final.tokens == T + steps - 1
    final = row.final.mask()
    after_second = held & ~second.removed.mask()
    assert np.array_equal(final[..., : T + 2 * W], after_second) and final[..., T + 2 * W :].all()
    assert after_second.sum(-1).tolist() == out.extras[0]["decode_kept_per_layer_head"]


def test_decode_time_positions_equal_the_cache_positions_of_sliding_layers(monkeypatch):
    """Gemma 3's sliding layers store each entry's position in the cache: after every decode-time
    compression of a padded batch they hold exactly the recorded kept sets (the log never reads them)."""
    from support.attention_variants import build, prompts, tokenizer

    import kvlab
    from kvlab.cache.layer import CompressedLayer

    loaded = kvlab.wrap_model(build("gemma3-text"), tokenizer(), name="gemma3-text")
    rows = prompts()  # 23, 17 and 9 tokens: left padding
    batch = collate_ids(loaded, rows)
    T = batch.input_ids.shape[1]
    snapshots = []  # per sliding layer's compression: [B][Hkv] stored positions (padded prompt coordinates)
    keep_slots = CompressedLayer.keep_slots

    def spy(layer, keep):
        keep_slots(layer, keep)
        if layer.prompt_positions is not None:  # a sliding layer
            slots, valid = layer.slot_rows()
            stored = layer.prompt_positions[slots]  # [B, Hkv, K]
            B, Hkv, _ = stored.shape
            snapshots.append([[stored[b, h][valid[b, h]].tolist() for h in range(Hkv)] for b in range(B)])

    monkeypatch.setattr(CompressedLayer, "keep_slots", spy)
    pipeline = Pipeline.from_config(
        {"budget": {"tokens": 10_000, "window": 2}, "importance": {"key_norm": {"name": "key_norm"}}}
    )
    protocol = build_protocol({"name": "decode_time", "interval": 3, "target_size": 4})
    out = protocol.run(loaded, pipeline, batch, RunOptions(max_new_tokens=8, record_positions=True))
    layer_types = loaded.model.config.layer_types
    sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    assert len(snapshots) == 2 * len(sliding)  # after 3 and 6 fed tokens
    prefill = kept_masks(out.result.reports, batch.attention_mask, out.result.prompt_lengths)

    def fed(mask, tokens):  # ``tokens`` more generated tokens in the cache, every head holding them
        return np.concatenate([mask, np.ones((*mask.shape[:2], tokens), dtype=bool)], -1)

    for b, record in enumerate(out.decode_positions):
        pad = T - len(rows[b])
        assert len(out.result.tokens[b]) == 8 and [e.step for e in record.evictions] == [3, 6]
        held = prefill[b]
        for e, eviction in enumerate(record.evictions):
            held = fed(held, 3)
            removed = eviction.removed.numpy()
            assert removed.any() and not (removed & ~held).any()  # only what was held is removed
            held = held & ~removed
            for k, layer in enumerate(sliding):
                for h, stored in enumerate(snapshots[e * len(sliding) + k][b]):
                    assert [p - pad for p in stored] == np.flatnonzero(held[layer, h]).tolist()
        assert record.final_step == 7 and np.array_equal(record.final.numpy(), fed(held, 1))  # 7th fed token


# ---------------------------------------------------------------------------------------------
# decode policies that evict: the recorded final sets against the cache's own entries


def _held(layer, seen, b, h, pad, T, length):
    """The positions (sample ``b``'s own coordinates) of the entries the cache holds for (b, h), found
    by matching each stored key to the one key the layer was given for that position."""
    keys = torch.cat([layer.segment(b, h)[0], layer.decode_keys[b, h, : layer.decode_length]])
    table = [
        (p, given[b, h, i])
        for start, given in seen
        for i, p in enumerate(range(start, start + given.shape[2]))
        if p >= pad
    ]
    held = []
    for key in keys:
        match = [p for p, ref in table if torch.equal(ref, key)]
        assert len(match) == 1
        held.append(match[0] - pad if match[0] < T else length + match[0] - T)
    return sorted(held)


@pytest.mark.parametrize(
    "compression",
    [
        {"budget": {"tokens": 24, "window": 4}, "decode": {"name": "h2o"}},
        {"budget": {"ratio": 0.4, "window": 4}, "decode": {"name": "fixed_index_evict", "distance": 3}},
        # the 82-token sample is kept whole and grows to 84 entries first (rows evicting apart)
        {
            "budget": {"tokens": 84, "window": 0},
            "importance": {"attention": {"name": "tova"}},
            "decode": {"name": "tova"},
        },
        # periodic: several entries of a row evicted at once, every 3 steps, rows on their own schedules
        {"budget": {"tokens": 84, "window": 2}, "decode": {"name": "rkv", "every": 3}},
    ],
    ids=["h2o", "fixed_index_evict", "tova", "rkv"],
)
def test_decode_policy_evictions_are_in_the_final_positions(compression, monkeypatch):
    """A padded batch whose samples stop at different steps: each sample's recorded final set is what
    the cache held (read from its stored keys) when its last token was computed; the cache after
    generation is that set less the eviction after the last fed token (one entry, or up to ``every``
    for a periodic eviction); prompt positions the decode evicted are absent."""
    from dataclasses import replace

    from kvlab.cache.layer import CompressedLayer
    from kvlab.compression.decode import DecodePolicy

    loaded = e2e.kvlab_model("tiny-qwen2")
    samples = SyntheticRetrieval(num_samples=2, context_words=40, seed=5).samples()
    samples = [replace(samples[0], max_new_tokens=8), replace(samples[1], max_new_tokens=5)]
    samples[1].prompt = samples[1].prompt[-150:]  # shorter: left padding in the batch
    batch = loaded.processor.collate(samples)
    valid = batch.attention_mask.bool()
    T, lengths = valid.shape[1], valid.sum(-1).tolist()
    assert lengths == [215, 82]
    scorer = {"attention": {"name": "window_attention"}}
    pipeline = Pipeline.from_config({"importance": scorer, **compression})
    given: dict[int, list] = {}  # id(layer) -> [(first position, keys [B, Hkv, q, D])]
    update = CompressedLayer.update

    def spy_update(layer, key_states, value_states, *args, **kwargs):
        given.setdefault(id(layer), []).append((layer.cumulative_length, key_states.detach().clone()))
        return update(layer, key_states, value_states, *args, **kwargs)

    def held_now(cache):  # [b][layer][head] -> positions
        return [
            [
                [_held(layer, given[id(layer)], b, h, T - lengths[b], T, lengths[b]) for h in range(2)]
                for layer in cache.layers
            ]
            for b in range(2)
        ]

    before_step, caches = [], []  # what each step's forward read (the step's token in), by step
    after_step = type(pipeline.decode_policy).after_step

    def spy_step(policy, run, step):
        before_step.append(held_now(run.cache))
        caches.append(run.cache)
        return after_step(policy, run, step)

    monkeypatch.setattr(CompressedLayer, "update", spy_update)
    monkeypatch.setattr(type(pipeline.decode_policy), "after_step", spy_step)
    assert isinstance(pipeline.decode_policy, DecodePolicy)
    out, kept = protocol_rows("query_aware", pipeline, samples, steps=8)
    assert [len(t) for t in out.result.tokens] == [8, 5] and len(before_step) == 7
    prefill = kept_masks(out.result.reports, batch.attention_mask, out.result.prompt_lengths)
    evicted_prompt = 0
    for b, s in enumerate(samples):
        row = kept[s.id]
        last = len(out.result.tokens[b]) - 1
        assert row.final_step == last and row.evictions == [] and row.final.tokens == lengths[b] + last
        final = row.final.mask()
        for layer in range(final.shape[0]):
            for h in range(2):
                want = before_step[last - 1][b][layer][h]  # the cache the last token was computed from
                assert np.flatnonzero(final[layer, h]).tolist() == want
                prompt_kept = set(np.flatnonzero(prefill[b][layer, h]).tolist())
                gone = prompt_kept - set(want)
                assert set(want) - set(range(lengths[b], lengths[b] + last)) <= prompt_kept
                evicted_prompt += len(gone)
        assert np.array_equal(row.at_end().mask(), final[..., : lengths[b]])
    assert evicted_prompt > 0  # the decode evicted prompt positions, and they are absent
    end = held_now(caches[-1])  # the cache after generation: the longest sample's last eviction in it
    final = kept[samples[0].id].final.mask()
    h2o = compression["decode"]["name"] == "h2o"  # evicts from every head at every step
    at_most = compression["decode"].get("every", 1)  # a periodic eviction drops up to `every` at once
    for layer in range(final.shape[0]):
        for h in range(2):
            recorded = set(np.flatnonzero(final[layer, h]).tolist())
            gone = recorded - set(end[0][layer][h])
            assert set(end[0][layer][h]) <= recorded and (len(gone) == 1 if h2o else len(gone) <= at_most)


# ---------------------------------------------------------------------------------------------
# end to end: every protocol's side file, and kvlab compare across protocols


@pytest.fixture(scope="module")
def protocols_experiment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("protocols")
    context = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 2
    rows = [
        {"context": context, "question": "What jumps?", "answer": "fox"},
        {"context": context, "question": "Who sleeps in the sun?", "answer": "cat"},
        {"context": "A short note about colors and shapes. " * 2, "question": "Name one.", "answer": "red"},
    ]
    data = ["--data.dataset", f"{{name: kvpress, path: {write_jsonl(tmp / 'kvpress.jsonl', rows)}}}"]
    snap = ["--model.compression.budget", "{tokens: 16, window: 4}", "--model.max_new_tokens", "10"]
    for method, protocol in [
        ("aware", "query_aware"),
        ("agnostic", "query_agnostic"),
        ("multi", "multi_question"),
        ("decode", "{name: decode_time, interval: 4, target_size: 12}"),
    ]:
        run(tmp, method, "snapkv", *data, *snap, "--model.protocol", protocol)
    other = [{"id": "x", "prompt": "river stone " * 20, "answers": ["x"]}]
    other_data = f"{{name: jsonl, path: {write_jsonl(tmp / 'other.jsonl', other)}}}"
    run(tmp, "other", "snapkv", "--data.dataset", other_data, *snap)
    return tmp / "runs" / "exp"


def test_every_protocol_writes_its_rows(protocols_experiment):
    kept = {m: read_positions(protocols_experiment / m) for m in ("aware", "agnostic", "multi", "decode")}
    for rows in kept.values():
        assert sorted(rows) == ["0", "1", "2"] and {r.protocol for r in rows.values()} != {None}
    for sample_id in ("0", "1", "2"):
        aware, agnostic, multi = (kept[m][sample_id] for m in ("aware", "agnostic", "multi"))
        assert aware.context_tokens == aware.prompt_tokens == agnostic.prompt_tokens
        assert agnostic.context_tokens < agnostic.prompt_tokens  # the question part, held whole
        assert np.array_equal(agnostic.packed, multi.packed)
    assert [kept["multi"][i].context_shared_by for i in "012"] == [["0", "1"], ["0", "1"], ["2"]]
    decode = kept["decode"]["0"]
    assert [e.step for e in decode.evictions] == [4, 8] and decode.final_step == 9  # 10 tokens, no stop


def test_compare_sets_every_protocol_side_by_side(protocols_experiment, capsys):
    main(["compare", str(protocols_experiment), "--no-plots"])
    assert "Kept positions" in capsys.readouterr().out
    rows = {(r["run_a"], r["run_b"]): r for r in _csv(protocols_experiment / "positions_overlap.csv")}
    assert len(rows) == 10
    kept = {m: read_positions(protocols_experiment / m) for m in ("aware", "agnostic", "multi", "decode")}
    for (a, b), row in rows.items():
        if "other" in (a, b):
            assert row["mean_jaccard"] == "n/a" and "no sample id in common" in row["note"]
            continue
        assert row["samples"] == "3" and row["note"] == ""
        for column, end in (("mean_jaccard", False), ("mean_jaccard_end", True)):
            values = []
            for sample_id in ("0", "1", "2"):
                x, y = kept[a][sample_id], kept[b][sample_id]
                n = min(x.context_tokens, y.context_tokens)
                sets = [_kept_at(k, n, end) for k in (x, y)]
                values += [naive_jaccard(sa, sb) for sa, sb in zip(*sets, strict=True)]
            assert float(row[column]) == pytest.approx(np.mean(values), abs=1e-4)
    assert float(rows[("agnostic", "multi")]["mean_jaccard"]) == 1.0
    decode_aware = rows[("aware", "decode")]
    assert float(decode_aware["mean_jaccard"]) != float(decode_aware["mean_jaccard_end"])  # evictions count


def _kept_at(kept, n, end):
    """Per (layer, head), the kept positions below ``n``, from the row's lists (the prefill's or the
    final decode-time set)."""
    mask = kept.final.mask() if end and kept.final is not None else kept.context_mask()
    return [np.flatnonzero(head[:n]).tolist() for layer in mask for head in layer]
