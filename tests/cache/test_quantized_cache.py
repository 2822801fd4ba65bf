"""A quantized layer (``model.compression.quantize``) in the ragged cache: what it holds and reads.

Decode attention over the codes (each body run dequantized a chunk of segments at a time, the
residual read in place, parts merged by log-sum-exp) equals the plain ragged attention over the
same entries dequantized, for equal and ragged heads, a block of queries and the attention
variants; checkpoints restore it; the storage held, measured from the tensors' own storages,
stays under a ceiling computed from the bits, and falls with them.
"""

import pytest
import torch

from kvlab.cache.layer import CompressedLayer
from kvlab.cache.options import AttentionOptions
from kvlab.cache.packed import CHUNK_SEGMENTS, packed_decode_attention
from kvlab.cache.selection import Selection
from kvlab.compression.quantizers import KIVI, PerToken, TurboQuant
from kvlab.compression.selectors import topk_indices
from kvlab.kernels.decode_attention import ragged_decode_attention_reference

B, HKV, G, D = 2, 3, 2, 16
QUANTIZERS = {
    "kivi2": KIVI(bits=2, group=4, residual=4),
    "int4": PerToken(bits=4, group=8, residual=2),
    "int8": PerToken(bits=8, group=16),
    "turbo3": TurboQuant(bits=3, residual=3),
}


def compressed_layer(counts, quantizer, T=40, seed=0, decode=2):
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
    layer.compress(selection)
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
