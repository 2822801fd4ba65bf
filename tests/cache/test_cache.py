"""CompressedCache: ragged storage, memory accounting, decode attention against dense references,
the slot layout and eviction that decode policies use."""

import torch
import torch.nn.functional as F

from kvlab.cache.cache import CompressedCache
from kvlab.cache.layer import CompressedLayer
from kvlab.cache.selection import Selection
from kvlab.compression.selectors import topk_indices


def random_selection(B, Hkv, T, counts, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(B, Hkv, T, generator=gen)
    return Selection(indices=topk_indices(scores, counts), counts=counts)


def filled_layer(B=2, Hkv=2, T=40, D=8, counts=None, capacity=4, dtype=torch.float32):
    torch.manual_seed(0)
    keys = torch.randn(B, Hkv, T, D, dtype=dtype)
    values = torch.randn(B, Hkv, T, D, dtype=dtype)
    layer = CompressedLayer(decode_capacity=capacity)
    layer.update(keys, values)
    counts = counts if counts is not None else torch.tensor([[5, 17], [0, 40]])[:B, :Hkv]
    selection = random_selection(B, Hkv, T, counts)
    layer.compress(selection)
    return layer, keys, values, selection


def test_segments_hold_exactly_the_selected_tokens():
    layer, keys, values, selection = filled_layer()
    for b in range(2):
        for h in range(2):
            k, v = layer.segment(b, h)
            kept = selection.kept_positions(b, h)
            assert torch.equal(k, keys[b, h, kept])
            assert torch.equal(v, values[b, h, kept])


def test_memory_is_the_kept_tokens_not_the_largest_head():
    D, capacity = 8, 4
    layer, *_ = filled_layer(D=D, capacity=capacity)
    kept = 5 + 17 + 0 + 40
    element = 4
    expected_prompt = kept * D * 2 * element
    assert layer.prompt_kv_bytes() == expected_prompt
    overhead = 2 * 2 * 2 * 8  # starts + lengths, int64 [B, Hkv]
    decode = 2 * 2 * capacity * D * 2 * element
    assert layer.kv_bytes() == expected_prompt + decode + overhead


def test_memory_falls_with_the_budget():
    sizes = []
    for budget in (40, 20, 10, 5):
        layer, *_ = filled_layer(counts=torch.full((2, 2), budget))
        sizes.append(layer.prompt_kv_bytes())
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] == 8 * sizes[3]


def test_logical_length_counts_prompt_and_decode_tokens():
    layer, *_ = filled_layer()
    assert layer.get_seq_length() == 40
    layer.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    assert layer.get_seq_length() == 41
    assert layer.decode_length == 1


def test_decode_appends_without_reallocating_the_prompt_buffer():
    layer, *_ = filled_layer(capacity=2)
    prompt_ptr = layer.prompt_keys.data_ptr()
    decode_ptr = layer.decode_keys.data_ptr()
    layer.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    layer.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    assert layer.decode_keys.data_ptr() == decode_ptr  # within capacity: written in place
    layer.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))  # exceeds: decode region grows
    assert layer.prompt_keys.data_ptr() == prompt_ptr
    assert layer.decode_keys.shape[2] >= 3 and layer.decode_length == 3


def dense_reference(query, layer, keys, values, selection, new_keys, new_values, scaling):
    """Per (b, query head) attention over the kept tokens gathered densely, then the decode tokens."""
    B, H, q, D = query.shape
    Hkv = keys.shape[1]
    G = H // Hkv
    out = torch.zeros(B, H, q, D)
    for b in range(B):
        for h in range(H):
            kv = h // G
            kept = selection.kept_positions(b, kv)
            k = torch.cat([keys[b, kv, kept], new_keys[b, kv]])
            v = torch.cat([values[b, kv, kept], new_values[b, kv]])
            n_prompt = len(kept)
            for i in range(q):
                visible = n_prompt + new_keys.shape[2] - q + i + 1
                attn = torch.softmax((k[:visible] @ query[b, h, i]) * scaling, dim=0)
                out[b, h, i] = attn @ v[:visible]
    return out


def test_ragged_decode_attention_matches_dense_reference_with_gqa():
    B, Hkv, G, T, D = 2, 2, 3, 40, 8
    layer, keys, values, selection = filled_layer(B, Hkv, T, D, capacity=8)
    new_k, new_v = torch.randn(B, Hkv, 3, D), torch.randn(B, Hkv, 3, D)
    for step in range(2):  # one token, then a two-token chunk
        layer.update(new_k[:, :, step : step * 2 + 1], new_v[:, :, step : step * 2 + 1])
    query = torch.randn(B, Hkv * G, 2, D)
    scaling = D**-0.5
    got = layer.decode_attention(query, scaling)
    want = dense_reference(query, layer, keys, values, selection, new_k, new_v, scaling)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_ragged_attention_with_everything_kept_equals_sdpa_over_the_full_cache():
    B, Hkv, G, T, D = 2, 2, 2, 24, 16
    layer, keys, values, _ = filled_layer(B, Hkv, T, D, counts=torch.full((B, Hkv), T))
    new_k, new_v = torch.randn(B, Hkv, 1, D), torch.randn(B, Hkv, 1, D)
    layer.update(new_k, new_v)
    query = torch.randn(B, Hkv * G, 1, D)
    full_k = torch.cat([keys, new_k], 2).repeat_interleave(G, 1)
    full_v = torch.cat([values, new_v], 2).repeat_interleave(G, 1)
    want = F.scaled_dot_product_attention(query, full_k, full_v)
    got = layer.decode_attention(query, D**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_storage_halves_memory_and_attention_stays_close():
    layer32, *_ = filled_layer(dtype=torch.float32)
    layer16, *_ = filled_layer(dtype=torch.bfloat16)
    assert layer16.prompt_kv_bytes() * 2 == layer32.prompt_kv_bytes()


def test_cache_reports_kept_tokens_per_layer():
    cache = CompressedCache(num_layers=2, decode_capacity=2)
    for layer in cache.layers:
        layer.update(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4))
        layer.compress(random_selection(1, 2, 10, torch.tensor([[3, 7]])))
    assert cache.kept_tokens().tolist() == [[[3, 7]], [[3, 7]]]
    assert cache.prompt_kv_bytes() == 2 * (3 + 7) * 4 * 2 * 4


def slot_values(layer):
    """Values of every stored entry in the slot layout, ``[B, Hkv, K + decode_length, D]``."""
    rows, _ = layer.slot_rows()
    return torch.cat([layer.prompt_values[rows], layer.decode_values[:, :, : layer.decode_length]], 2)


def test_attention_probs_are_the_decode_attention_weights_in_the_slot_layout():
    B, Hkv, G, T, D = 2, 2, 3, 40, 8
    layer, *_ = filled_layer(B, Hkv, T, D, capacity=2)  # ragged heads, one of them empty
    layer.update(torch.randn(B, Hkv, 1, D), torch.randn(B, Hkv, 1, D))
    query, scaling = torch.randn(B, Hkv * G, 1, D), D**-0.5
    probs = layer.attention_probs(query, scaling)  # [B, Hkv, G, 1, K + 1]
    valid = layer.slot_valid()
    assert probs.shape == (B, Hkv, G, 1, layer.prompt_slots + 1) and valid.shape == (B, Hkv, probs.shape[-1])
    assert bool((probs.masked_select(~valid[:, :, None, None]) == 0).all())
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, Hkv, G, 1))
    mixed = (probs[..., None] * slot_values(layer)[:, :, None, None]).sum(-2)  # [B, Hkv, G, 1, D]
    want = layer.decode_attention(query, scaling)
    torch.testing.assert_close(mixed.reshape(B, Hkv * G, 1, D), want, atol=1e-5, rtol=1e-5)


def test_evict_one_moves_the_newest_token_into_the_victim_slot():
    layer, *_ = filled_layer(capacity=2)  # kept [[5, 17], [0, 40]]
    new_k, new_v = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8)
    layer.update(new_k, new_v)
    before = slot_values(layer).clone()
    newest = layer.prompt_slots  # K + decode_length - 1
    victim = torch.tensor([[3, newest], [newest, 0]])  # a prompt slot, the newest token itself
    layer.evict_one(victim)
    assert layer.decode_length == 0 and layer.lengths.tolist() == [[5, 17], [0, 40]]
    after = slot_values(layer)
    for b, h in ((0, 0), (1, 1)):
        want = before[b, h, : layer.lengths[b, h]].clone()
        want[victim[b, h]] = new_v[b, h, 0]
        assert torch.equal(after[b, h, : layer.lengths[b, h]], want)
        assert torch.equal(layer.segment(b, h)[0][victim[b, h]], new_k[b, h, 0])
    assert torch.equal(after[0, 1, :17], before[0, 1, :17])  # the newest token was the victim
