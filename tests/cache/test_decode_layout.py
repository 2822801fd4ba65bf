"""Decode attention read through strided views of the flat cache (no per-step gather): equal to a
naive per-(sample, head) loop over an independent list model of what each head stores, for equal
and ragged heads, with decode tokens, a block of queries, after ``evict_one``, after
``keep_slots``, with padding entries (``decode_valid``) and after ``checkpoint`` / ``restore``;
the runs the layer is cut into; ``kv_bytes()`` against the buffers."""

import pytest
import torch

from kvlab.cache.cache import CompressedCache
from kvlab.cache.layer import CompressedLayer
from kvlab.cache.selection import Selection
from kvlab.compression.selectors import topk_indices
from kvlab.kernels.decode_attention import SegmentRuns

B, HKV, G, T, D = 2, 2, 2, 24, 8
EQUAL = [[9, 9], [9, 9]]
RAGGED = [[5, 17], [0, 24]]  # head (1, 0) keeps nothing, head (1, 1) everything
PER_SAMPLE = [[6, 6], [11, 11]]  # equal within a sample (ratio budgets on prompts of two lengths)
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 2e-3}


class Model:
    """What each (sample, head) stores, kept apart from the cache: ``prompt[b][h]`` and
    ``decode[b][h]`` lists of ``(key, value, real)`` in slot order (see ``CompressedLayer.slot_valid``)."""

    def __init__(self, keys, values, selection):
        self.prompt = [
            [
                [(keys[b, h, p], values[b, h, p], True) for p in selection.kept_positions(b, h)]
                for h in range(HKV)
            ]
            for b in range(B)
        ]
        self.decode = [[[] for _ in range(HKV)] for _ in range(B)]

    def append(self, keys, values, valid=None):
        for b in range(B):
            for h in range(HKV):
                for i in range(keys.shape[2]):
                    real = True if valid is None else bool(valid[b, i])
                    self.decode[b][h].append((keys[b, h, i], values[b, h, i], real))

    def evict(self, victim, K):
        """``evict_one``: the newest entry moves into the victim's slot, the decode list shrinks."""
        for b in range(B):
            for h in range(HKV):
                newest, slot = self.decode[b][h].pop(), int(victim[b, h])
                if slot < K:
                    self.prompt[b][h][slot] = newest
                elif slot - K < len(self.decode[b][h]):
                    self.decode[b][h][slot - K] = newest

    def keep(self, keep, K):
        """``keep_slots``: the kept slots, in slot order, become the prompt; the decode list empties."""
        for b in range(B):
            for h in range(HKV):
                slots = self.prompt[b][h] + [None] * (K - len(self.prompt[b][h])) + self.decode[b][h]
                self.prompt[b][h] = [e for e, k in zip(slots, keep[b, h].tolist(), strict=True) if k]
                self.decode[b][h] = []

    def attention(self, query, scaling):
        """Naive loop in fp64: query ``i`` of a block of ``q`` sees the prompt and the decode entries
        up to its own, padding entries hidden (but its own)."""
        out = torch.zeros(query.shape, dtype=torch.float64)
        q = query.shape[2]
        for b in range(B):
            for head in range(query.shape[1]):
                h = head // (query.shape[1] // HKV)
                decode = self.decode[b][h]
                for i in range(q):
                    own = len(decode) - q + i
                    seen = self.prompt[b][h] + [
                        e for j, e in enumerate(decode[: own + 1]) if e[2] or j == own
                    ]
                    keys = torch.stack([e[0] for e in seen]).double()
                    values = torch.stack([e[1] for e in seen]).double()
                    weights = torch.softmax(keys @ query[b, head, i].double() * scaling, 0)
                    out[b, head, i] = weights @ values
        return out


def filled(counts, dtype=torch.float32, steps=3, seed=0):
    """A compressed layer (decode region of 2, so it grows) after ``steps`` decode tokens, and its model."""
    gen = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(B, HKV, T, D, generator=gen).to(dtype) for _ in range(2))
    counts = torch.tensor(counts)
    selection = Selection(indices=topk_indices(torch.rand(B, HKV, T, generator=gen), counts), counts=counts)
    layer = CompressedLayer(decode_capacity=2)
    layer.update(keys, values)
    layer.compress(selection)
    model = Model(keys, values, selection)
    for _ in range(steps):
        append(layer, model, 1, gen, dtype)
    return layer, model, gen


def append(layer, model, q, gen, dtype, valid=None):
    new = [torch.randn(B, HKV, q, D, generator=gen).to(dtype) for _ in range(2)]
    layer.update(*new)
    model.append(*new, valid)
    return torch.randn(B, HKV * G, q, D, generator=gen).to(dtype)


def assert_attention(layer, model, query, dtype=torch.float32):
    scaling = D**-0.5
    got = layer.decode_attention(query, scaling)
    assert got.dtype == query.dtype and got.shape == query.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), model.attention(query, scaling), atol=tol, rtol=tol)


@pytest.mark.parametrize("counts", [EQUAL, RAGGED, PER_SAMPLE], ids=["equal", "ragged", "per_sample"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_attention_equals_the_naive_loop(counts, dtype):
    layer, model, gen = filled(counts, dtype)
    assert_attention(layer, model, append(layer, model, 1, gen, dtype), dtype)
    assert_attention(
        layer, model, append(layer, model, 3, gen, dtype), dtype
    )  # a block: causal among its own


@pytest.mark.parametrize("counts", [EQUAL, RAGGED])
def test_attention_after_evict_one_and_after_keep_slots(counts):
    layer, model, gen = filled(counts)
    query = append(layer, model, 1, gen, torch.float32)
    victim = torch.tensor([[1, layer.prompt_slots + 3], [layer.prompt_slots + 1, 2]])
    victim[1, 0] = layer.prompt_slots  # head (1, 0) may hold no prompt entry: evict its oldest decode entry
    model.evict(victim, layer.prompt_slots)
    layer.evict_one(victim)
    assert_attention(layer, model, query)
    valid = layer.slot_valid()
    keep = valid & (torch.rand(valid.shape, generator=gen) < 0.6)
    model.keep(keep, layer.prompt_slots)
    layer.keep_slots(keep)
    assert_attention(layer, model, append(layer, model, 1, gen, torch.float32))


@pytest.mark.parametrize("counts", [EQUAL, RAGGED])
def test_attention_with_padding_entries_in_the_decode_region(counts):
    layer, model, gen = filled(counts)
    cache = CompressedCache(num_layers=1)
    cache.layers[0] = layer
    valid = torch.tensor([[False, True, True], [True, True, True]])  # a left-padded block of questions
    with cache.appending_valid(valid):
        query = append(layer, model, 3, gen, torch.float32, valid)
    assert layer.decode_valid is not None
    assert_attention(layer, model, query)
    assert_attention(layer, model, append(layer, model, 1, gen, torch.float32))


@pytest.mark.parametrize("counts", [EQUAL, RAGGED])
def test_attention_after_restoring_a_checkpoint(counts):
    layer, model, gen = filled(counts)
    cache = CompressedCache(num_layers=1)
    cache.layers[0] = layer
    checkpoint = cache.checkpoint()
    saved = [[list(model.prompt[b][h]) for h in range(HKV)] for b in range(B)]
    saved_decode = [[list(model.decode[b][h]) for h in range(HKV)] for b in range(B)]
    append(layer, model, 1, gen, torch.float32)
    layer.evict_one(torch.zeros(B, HKV, dtype=torch.long))  # writes in place: into copies
    layer.keep_slots(layer.slot_valid())  # new segments (starts / lengths) before the restore
    cache.restore(checkpoint)
    model.prompt, model.decode = saved, saved_decode
    assert_attention(layer, model, append(layer, model, 1, gen, torch.float32))


def test_runs_cover_equal_heads_with_one_view_and_ragged_heads_with_one_per_length():
    def runs(counts):
        counts = torch.tensor(counts)
        flat = counts.flatten()
        return SegmentRuns.of((flat.cumsum(0) - flat).view(counts.shape), counts)

    dense = runs([[9, 9, 9], [9, 9, 9]])
    assert dense.dense and len(dense.runs) == 1 and dense.runs[0].count == 6 and dense.width == 9
    assert [r.count for r in runs([[6, 6], [11, 11]]).runs] == [2, 2]
    ragged = runs([[5, 17], [0, 24]])
    assert not ragged.dense and [r.length for r in ragged.runs] == [5, 17, 0, 24] and ragged.width == 24
    gapped = SegmentRuns.of(torch.tensor([[0, 10, 20]]), torch.tensor([[8, 8, 8]]))  # stride 10 > length
    assert [(r.count, r.stride) for r in gapped.runs] == [(3, 10)]


def test_the_views_read_the_flat_buffer_in_place():
    layer, *_ = filled(EQUAL)
    (run,) = layer.segment_runs().runs
    view = run.view(layer.prompt_keys)
    assert view.shape == (B * HKV, 9, D) and view.data_ptr() == layer.prompt_keys.data_ptr()
    assert torch.equal(view.reshape(-1, D), layer.prompt_keys)
    assert layer.segment_runs() is layer.segment_runs()  # kept while starts / lengths stay
    layer.keep_slots(layer.slot_valid() & (torch.arange(layer.slot_valid().shape[-1]) < 4))
    assert layer.segment_runs().runs[0].length == 4  # new lengths: new runs


def test_kv_bytes_fall_with_the_budget_and_are_the_buffers():
    sizes = []
    for budget in (24, 12, 6, 3):
        layer, *_ = filled([[budget, budget], [budget, budget]], steps=0)
        buffers = (layer.prompt_keys, layer.prompt_values, layer.decode_keys, layer.decode_values,
                   layer.starts, layer.lengths)  # fmt: skip
        assert layer.kv_bytes() == sum(t.numel() * t.element_size() for t in buffers)
        assert layer.prompt_kv_bytes() == B * HKV * budget * D * 2 * 4  # no padding stored
        sizes.append(layer.prompt_kv_bytes())
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 8 * sizes[-1]


def test_bench_decode_model_table(capsys):
    from kvlab.cli.main import main

    main(["bench", "decode", "--model", "tiny-llama", "--contexts", "128", "--steps", "2", "--repeat", "1",
          "--budgets", "0.5", "--methods", "adakv"])  # fmt: skip
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 128 ")]
    assert [row.split(" | ")[1] for row in rows] == [
        "transformers DynamicCache + sdpa", "DynamicCache, last 50% kept", "kvlab full", "kvlab adakv 50%"
    ]  # fmt: skip
    assert [row.split(" | ")[5] for row in rows][0] == "1.00"  # ratios to DynamicCache, the first row
    assert "min of 1 interleaved rounds" in out and "- 128: kvlab full " in out  # fastest round; targets


def test_bench_decode_model_table_times_packed_entries(capsys):
    from kvlab.cli.main import main

    main(["bench", "decode", "--model", "tiny-llama", "--contexts", "128", "--steps", "2", "--repeat", "1",
          "--budgets", "0.5", "--methods", "snapkv", "--quantize", "{name: per_token, bits: 4}"])  # fmt: skip
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 128 ")]
    by_label = {row[1]: row for row in rows}
    plain, packed = by_label["kvlab snapkv 50%"], by_label["kvlab snapkv 50% name=per_token, bits=4"]
    assert packed[2] == plain[2]  # the same kept entries per head
    assert float(packed[3]) < 0.5 * float(plain[3])  # KV MiB


def test_target_lines_check_the_issue_targets():
    from kvlab.bench.decode import target_lines

    seconds = {"transformers DynamicCache + sdpa": 1.0, "DynamicCache, last 10% kept": 0.5,
               "kvlab full": 1.01, "kvlab snapkv 10%": 0.59, "kvlab adakv 50%": 1.02,
               "kvlab adakv 10%": 0.7}  # fmt: skip
    lines = target_lines("4k", seconds, 1.0, [0.5, 0.1], check_kept=True)
    assert lines[0] == "4k: kvlab full 1.01x DynamicCache (<= 1.02x: met)"
    assert "4k: kvlab snapkv 10% 0.59x DynamicCache (<= 0.6x: met)" in lines
    assert "4k: kvlab adakv 10% 0.70x DynamicCache (<= 0.6x: NOT met)" in lines
    assert "4k: kvlab adakv 10% 0.69x kvlab full (< 1: met)" in lines
    assert not any("adakv 50%" in line for line in lines)  # the AdaKV target is below 50%
    assert not any("0.6x" in line for line in target_lines("1k", seconds, 1.0, [0.1], check_kept=False))


def test_plain_cpu_calls_read_in_place_and_variants_take_the_masked_path(monkeypatch):
    """A plain call on CPU never gathers (no call of the padded path); soft-capping, sinks and padding
    entries in the decode region always take it (the strided path implements none of them)."""
    import kvlab.kernels.decode_attention as decode_attention
    from kvlab.cache.options import AttentionOptions

    masked = []
    padded = decode_attention.padded_decode_attention

    def spy(*args, **kwargs):
        masked.append(sorted(k for k, v in kwargs.items() if v is not None))
        return padded(*args, **kwargs)

    monkeypatch.setattr(decode_attention, "padded_decode_attention", spy)
    for counts in (EQUAL, RAGGED, PER_SAMPLE):
        layer, model, gen = filled(counts)
        assert_attention(layer, model, append(layer, model, 1, gen, torch.float32))
        assert_attention(layer, model, append(layer, model, 2, gen, torch.float32))
    assert masked == []
    query = append(layer, model, 1, gen, torch.float32)
    layer.decode_attention(query, D**-0.5, AttentionOptions(softcap=30.0))
    layer.decode_attention(query, D**-0.5, AttentionOptions(sinks=torch.zeros(HKV * G)))
    assert [("softcap" in m, "sinks" in m) for m in masked] == [(True, False), (False, True)]
    cache = CompressedCache(num_layers=1)
    cache.layers[0] = layer
    with cache.appending_valid(torch.tensor([[False, True], [True, True]])):
        query = append(layer, model, 2, gen, torch.float32, torch.tensor([[False, True], [True, True]]))
    assert_attention(layer, model, query)
    assert "decode_valid" in masked[-1]
