"""A quantized layer (``model.compression.quantize``) in the ragged cache: what it holds and reads.

Decode attention over the codes (each body run dequantized a chunk of segments at a time, the
residual read in place, parts merged by log-sum-exp) equals the plain ragged attention over the
same entries dequantized, for equal and ragged heads, a block of queries and the attention
variants; checkpoints restore it; the storage held, measured from the tensors' own storages,
stays under a ceiling computed from the bits, and falls with them.
"""

import pytest
import torch
from naive.quantization import naive_group_round_trip

from kvlab.cache.layer import CompressedLayer
from kvlab.cache.options import AttentionOptions
from kvlab.cache.packed import CHUNK_SEGMENTS, packed_decode_attention
from kvlab.cache.selection import Selection
from kvlab.compression.quantizers import KIVI, PerToken
from kvlab.compression.selectors import topk_indices
from kvlab.compression.turboquant import TurboQuant
from kvlab.kernels.decode_attention import ragged_decode_attention_reference

B, HKV, G, D = 2, 3, 2, 16
QUANTIZERS = {
    "kivi2": KIVI(bits=2, group=4, residual=4),
    "int4": PerToken(bits=4, group=8, residual=2),
    "int8": PerToken(bits=8, group=16),
    "turbo3": TurboQuant(bits=3, residual=3),
}


def compressed_layer(counts, quantizer, T=40, seed=0, decode=2, sliding_window=None):
    """A layer compressed to ``counts [B][Hkv]`` random entries of a ``T``-token prefill, then
    ``decode`` appended tokens; with its dense prefill K/V."""
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(B, HKV, T, D, generator=g), torch.randn(B, HKV, T, D, generator=g)
    counts = torch.tensor(counts)
    selection = Selection(
        topk_indices(torch.rand(B, HKV, T, generator=g), counts), counts, quantizer=quantizer
    )
    layer = CompressedLayer(decode_capacity=4)
    layer.update(keys, values)
    layer.compress(selection, sliding_window)
    for _ in range(decode):
        layer.update(torch.randn(B, HKV, 1, D, generator=g), torch.randn(B, HKV, 1, D, generator=g))
    return layer


def reference(layer, query, scaling, **options):
    keys, values = layer.packed.dense()
    return ragged_decode_attention_reference(
        query, keys, values, layer.starts, layer.lengths, layer.decode_keys, layer.decode_values,
        layer.decode_length, scaling, **options,
    )  # fmt: skip


@pytest.mark.parametrize("quantizer", list(QUANTIZERS))
@pytest.mark.parametrize(
    "counts", [[[9, 9, 9], [9, 9, 9]], [[5, 17, 0], [40, 3, 12]]], ids=["equal", "ragged"]
)
def test_decode_over_codes_equals_attention_over_the_dequantized_entries(counts, quantizer):
    layer = compressed_layer(counts, QUANTIZERS[quantizer])
    assert layer.prompt_keys is None and layer.packed is not None  # the flat buffers are released
    assert torch.equal(layer.lengths, torch.tensor(counts))
    for q in (1, 2):
        query = torch.randn(B, HKV * G, q, D, generator=torch.Generator().manual_seed(q))
        got = layer.decode_attention(query, 0.25)
        torch.testing.assert_close(got, reference(layer, query, 0.25), atol=1e-5, rtol=1e-5)
    # an attention variant reads the dequantized layout through the masked path
    options = AttentionOptions(softcap=5.0)
    got = layer.decode_attention(query, 0.25, options)
    torch.testing.assert_close(got, reference(layer, query, 0.25, softcap=5.0), atol=1e-5, rtol=1e-5)


def test_many_segments_are_dequantized_in_chunks():
    """Chunks of one segment give the attention of one chunk over all of them."""
    layer = compressed_layer([[12, 12, 12], [12, 12, 30]], QUANTIZERS["int4"])
    assert B * HKV <= CHUNK_SEGMENTS  # the layer's own call: one chunk per run
    query = torch.randn(B, HKV * G, 1, D, generator=torch.Generator().manual_seed(3))
    args = (query, layer.packed, layer.starts, layer.lengths, layer.decode_keys, layer.decode_values,
            layer.decode_length, 0.25)  # fmt: skip
    chunked = packed_decode_attention(*args, chunk=1)
    torch.testing.assert_close(chunked, layer.decode_attention(query, 0.25), atol=1e-6, rtol=1e-6)


def test_checkpoint_and_restore_keep_the_codes():
    layer = compressed_layer([[8, 8, 8], [8, 8, 8]], QUANTIZERS["kivi2"], decode=1)
    state = layer.checkpoint()
    query = torch.randn(B, HKV * G, 1, D, generator=torch.Generator().manual_seed(4))
    layer.update(torch.randn(B, HKV, 1, D), torch.randn(B, HKV, 1, D))
    before = layer.decode_attention(query, 0.25)
    layer.restore(state)
    assert layer.packed is state["packed"] and layer.decode_length == 1
    layer.update(torch.randn(B, HKV, 1, D), torch.randn(B, HKV, 1, D))
    assert layer.decode_attention(query, 0.25).shape == before.shape


def test_slot_operations_refuse_a_quantized_layer():
    layer = compressed_layer([[8, 8, 8], [8, 8, 8]], QUANTIZERS["int8"])
    with pytest.raises(RuntimeError, match="model.compression.quantize"):
        layer.slot_valid()


def held_bytes(layer: CompressedLayer) -> int:
    """Bytes of every storage the layer references (each counted once): what it really holds,
    measured from the tensors' storages, not from their shapes."""
    seen, total = set(), 0

    def visit(obj, depth=0):
        nonlocal total
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif depth < 3 and hasattr(obj, "__dict__") and not isinstance(obj, type):
            for value in vars(obj).values():
                visit(value, depth + 1)

    for name in (
        "prompt_keys",
        "prompt_values",
        "packed",
        "decode_keys",
        "decode_values",
        "starts",
        "lengths",
    ):
        visit(getattr(layer, name))
    return total


@pytest.mark.parametrize(
    ("quantizer", "bits_per_number"),
    [
        ("int8", 8 + 2 * 32 / 16),
        ("int4", 4 + 2 * 32 / 8),
        ("kivi2", 2 + 2 * 32 / 4),
    ],  # codes + scale, zero (fp32)
)
def test_memory_held_stays_under_the_ceiling_of_the_bits(quantizer, bits_per_number):
    """A long ragged prompt: the storage a quantized layer holds is at most its codes and group
    parameters at ``bits_per_number``, plus the residual, decode region and offsets in full precision."""
    counts = [[200, 120, 64], [256, 32, 180]]
    plain = compressed_layer(counts, None, T=256)
    layer = compressed_layer(counts, QUANTIZERS[quantizer], T=256)
    q = QUANTIZERS[quantizer]
    kept = sum(map(sum, counts))
    residual = int((layer.lengths - layer.packed.body_lengths).sum())
    assert residual <= B * HKV * (q.residual + q.row_group)
    decode = 2 * B * HKV * 4 * D * 4
    offsets = 6 * B * HKV * 8  # starts, lengths of the layer, the body and the residual
    ceiling = (kept - residual) * 2 * D * bits_per_number / 8 + residual * 2 * D * 4 + decode + offsets
    measured = held_bytes(layer)
    assert measured <= ceiling, (measured, ceiling)
    assert measured == layer.kv_bytes()  # what the cache reports is what it holds
    assert held_bytes(plain) == plain.kv_bytes()
    # fp32 entries are 32 bits a number: the held bytes fall with the bits
    assert measured < held_bytes(plain) * (bits_per_number + 4) / 32


# --- KIVI's streaming residual: decoded tokens folded into the codes ---------------------------------
FOLD = KIVI(bits=2, group=4, residual=4)
FOLD_COUNTS = [[5, 17, 0], [11, 3, 9]]  # ragged, an empty head, heads under the residual


def naive_segment(keys, values, quantizer):
    """One segment's entries ``[n, D]`` as a pack then dequantization gives them, naively: the oldest
    ``group * floor((n - residual) / group)`` rows round-tripped group by group (keys per channel,
    values per token), the rest as they are."""
    n_q = quantizer.group * (max(keys.shape[0] - quantizer.residual, 0) // quantizer.group)
    out = []
    for x, along in ((keys, "tokens"), (values, "channels")):
        body = x[:n_q]
        if n_q:
            _, deq = naive_group_round_trip(body.tolist(), quantizer.bits, quantizer.group, along, x.dtype)
            body = torch.tensor(deq, dtype=x.dtype)
        out.append(torch.cat([body, x[n_q:]]))
    return out, n_q


def decoded_layers(sliding_window=None):
    """The quantized layer and the same layer unquantized (its fp entries), and a step function
    appending the same random token to both."""
    layers = [compressed_layer(FOLD_COUNTS, q, decode=0, sliding_window=sliding_window) for q in (FOLD, None)]
    gen = torch.Generator().manual_seed(5)

    def step():
        k, v = torch.randn(B, HKV, 1, D, generator=gen), torch.randn(B, HKV, 1, D, generator=gen)
        for layer in layers:
            layer.update(k, v)

    return layers[0], layers[1], step


def test_kivi_folds_every_group_of_decoded_tokens_as_if_quantized_offline():
    layer, plain, step = decoded_layers()
    counts = torch.tensor(FOLD_COUNTS)
    g = FOLD.group
    for s in range(1, 12):
        step()
        folded = g * ((s - 1) // g)
        assert (layer.folded, layer.decode_length) == (folded, s - folded)
        assert torch.equal(layer.lengths, counts + folded)
        if s not in (4, 5, 11):  # before the first fold, after it, after the second (naive loops: slow)
            continue
        dense_keys, dense_values = layer.packed.dense()
        want_bytes = torch.zeros(B, dtype=torch.long)
        for b in range(B):
            for h in range(HKV):
                k, v = plain.segment(b, h)
                decoded = slice(0, folded)
                k = torch.cat([k, plain.decode_keys[b, h, decoded]])
                v = torch.cat([v, plain.decode_values[b, h, decoded]])
                (want_k, want_v), n_q = naive_segment(k, v, FOLD)
                start, n = int(layer.starts[b, h]), int(layer.lengths[b, h])
                assert torch.equal(dense_keys[start : start + n], want_k)
                assert torch.equal(dense_values[start : start + n], want_v)
                assert int(layer.packed.body_lengths[b, h]) == n_q
                coded = min(n_q, int(counts[b, h]))  # prompt entries in the codes
                row = 2 * (D * FOLD.bits / 8 + 2 * 4 * D / g)  # keys + values: codes, fp32 scale + zero
                want_bytes[b] += round(coded * row) + (int(counts[b, h]) - coded) * 2 * D * 4
        assert torch.equal(layer.packed.sample_bytes(layer.folded), want_bytes)
        assert torch.equal(layer.decode_keys[:, :, : s - folded], plain.decode_keys[:, :, folded:s])
        query = torch.randn(B, HKV * G, 1, D, generator=torch.Generator().manual_seed(s))
        torch.testing.assert_close(
            layer.decode_attention(query, 0.25), reference(layer, query, 0.25), atol=1e-5, rtol=1e-5
        )
    assert held_bytes(layer) == layer.kv_bytes()  # what the cache reports is what it holds
    # kv_bytes_kept: prompt entries folded into the codes are charged at their packed size
    first = compressed_layer(FOLD_COUNTS, FOLD, decode=0)
    assert (layer.packed.sample_bytes(layer.folded) < first.packed.sample_bytes()).all()


def test_a_checkpoint_taken_before_a_fold_restores_its_decode_entries():
    layer, _, step = decoded_layers()
    for _ in range(2):
        step()
    state = layer.checkpoint()
    query = torch.randn(B, HKV * G, 1, D, generator=torch.Generator().manual_seed(9))
    before = layer.decode_attention(query, 0.25)
    for _ in range(5):  # folds at the fifth
        step()
    assert layer.folded == FOLD.group
    layer.restore(state)
    assert layer.folded == 0 and layer.decode_length == 2
    torch.testing.assert_close(layer.decode_attention(query, 0.25), before, atol=0, rtol=0)


def test_a_sliding_layer_folds_the_positions_with_the_entries():
    layer, plain, step = decoded_layers(sliding_window=6)
    T = 40
    for _ in range(5):
        step()
    assert layer.folded == FOLD.group
    for b in range(B):
        for h in range(HKV):
            start, n = int(layer.starts[b, h]), int(layer.lengths[b, h])
            p_start, p_n = int(plain.starts[b, h]), int(plain.lengths[b, h])
            want = torch.cat([plain.prompt_positions[p_start : p_start + p_n], torch.arange(T, T + 4)])
            assert torch.equal(layer.prompt_positions[start : start + n], want)
