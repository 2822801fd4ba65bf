"""A channel-pruned layer (``model.compression.channels``) in the ragged cache: what it holds and reads.

The kept prompt keys are stored as ``[N, Dk]`` rows (each (sample, KV head) its own channels),
values and decoded tokens with every channel. Decode attention (the in-place CPU path and the
masked path of the attention variants) equals the naive attention over dense keys whose pruned
channels are zero (``naive/think.py``), at the model's scaling, for equal and ragged heads, a block
of queries and fp32 / fp64 / bf16. The storage held, measured from the tensors' own storages,
is what ``kv_bytes`` reports and falls by the pruned channels; checkpoints restore it.
"""

import pytest
import torch
from naive.think import naive_pruned_attention

from kvlab.cache.layer import CompressedLayer
from kvlab.cache.options import AttentionOptions
from kvlab.cache.pruned import pruned_decode_attention, query_channels
from kvlab.cache.selection import Selection
from kvlab.compression.selectors import topk_indices

B, HKV, G, D = 2, 3, 2, 16
SCALING = D**-0.5


def random_channels(keep: int, seed: int) -> torch.Tensor:
    """``[B, Hkv, keep]`` ascending random channels, a different set per (sample, head)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, HKV, D, generator=g).argsort(-1)[..., :keep].sort(-1).values


def pruned_layer(counts, keep=8, T=40, seed=0, decode=2, dtype=torch.float32, sliding_window=None):
    """A layer compressed to ``counts [B][Hkv]`` random entries of a ``T``-token prefill, each head's
    keys pruned to ``keep`` random channels, then ``decode`` appended tokens; with the dense K/V
    (prompt, decode) it was given."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, HKV, T, D, generator=g).to(dtype)
    values = torch.randn(B, HKV, T, D, generator=g).to(dtype)
    counts = torch.tensor(counts)
    indices = topk_indices(torch.rand(B, HKV, T, generator=g), counts)
    channels = random_channels(keep, seed) if keep is not None else None
    layer = CompressedLayer(decode_capacity=4)
    layer.update(keys, values)
    layer.compress(Selection(indices, counts, channels=channels), sliding_window)
    decoded = []
    for _ in range(decode):
        k = torch.randn(B, HKV, 1, D, generator=g).to(dtype)
        v = torch.randn(B, HKV, 1, D, generator=g).to(dtype)
        layer.update(k, v)
        decoded.append((k, v))
    return layer, (keys, values, indices, counts, channels), decoded


def naive(layer_inputs, decoded, query, visible=None):
    """``[B, H, q, D]`` fp64: each query row over its head's kept entries (pruned channels zero) and
    the decoded tokens up to its own (``visible(b, h, p)``: whether prompt position ``p`` is seen)."""
    keys, values, indices, counts, channels = layer_inputs
    _, H, q, _ = query.shape
    out = torch.zeros(B, H, q, D, dtype=torch.float64)
    t = len(decoded)
    for b in range(B):
        for head in range(H):
            h = head // G
            positions = [int(p) for p in indices[b, h, : int(counts[b, h])]]
            if visible is not None:
                positions = [p for p in positions if visible(b, h, p)]
            pk = [keys[b, h, p].double().tolist() for p in positions]
            pv = [values[b, h, p].double().tolist() for p in positions]
            for i in range(q):
                seen = decoded[: t - q + i + 1]
                dk = [k[b, h, 0].double().tolist() for k, _ in seen]
                dv = [v[b, h, 0].double().tolist() for _, v in seen]
                out[b, head, i] = torch.tensor(
                    naive_pruned_attention(
                        query[b, head, i].double().tolist(), pk, pv, channels[b, h].tolist(), dk, dv, SCALING
                    ),
                    dtype=torch.float64,
                )
    return out


def test_the_kept_keys_are_stored_with_their_heads_channels():
    layer, (keys, _, indices, counts, channels), _ = pruned_layer([[5, 17, 0], [40, 3, 12]])
    assert layer.prompt_keys.shape == (int(counts.sum()), 8) and layer.prompt_values.shape[1] == D
    assert layer.decode_keys.shape[-1] == D  # decoded tokens keep every channel
    for b in range(B):
        for h in range(HKV):
            start, n = int(layer.starts[b, h]), int(counts[b, h])
            expected = keys[b, h, indices[b, h, :n]][:, channels[b, h]]
            assert torch.equal(layer.prompt_keys[start : start + n], expected)


def test_query_channels_take_each_heads_kv_heads_channels():
    channels = random_channels(5, 1)
    query = torch.randn(B, HKV * G, 3, D)
    selected = query_channels(query, channels)
    for b in range(B):
        for head in range(HKV * G):
            assert torch.equal(selected[b, head], query[b, head][:, channels[b, head // G]])


@pytest.mark.parametrize("keep", [8, 12, 3], ids=["two-slices", "overlapping-slices", "matmul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "counts", [[[9, 9, 9], [9, 9, 9]], [[5, 17, 0], [40, 3, 12]]], ids=["equal", "ragged"]
)
def test_decode_over_pruned_keys_equals_attention_over_zeroed_channels(counts, dtype, keep):
    """The CPU path attends the values in slices of the kept channels' width (8 of 16: two; 12:
    two overlapping) or, for keys narrower than a quarter of the values (3), by one matmul."""
    layer, inputs, decoded = pruned_layer(counts, keep=keep, dtype=dtype)
    tolerance = {torch.bfloat16: 2e-2, torch.float32: 1e-5, torch.float64: 1e-10}[dtype]
    for q in (1, 2):
        query = torch.randn(B, HKV * G, q, D, generator=torch.Generator().manual_seed(q)).to(dtype)
        expected = naive(inputs, decoded, query)
        torch.testing.assert_close(
            layer.decode_attention(query, SCALING).double(), expected, atol=tolerance, rtol=0
        )
        masked = pruned_decode_attention(  # without the runs: the masked path (what CUDA tensors take)
            query, layer.prompt_keys, layer.prompt_values, layer.key_channels, layer.starts, layer.lengths,
            layer.decode_keys, layer.decode_values, layer.decode_length, SCALING,
        )  # fmt: skip
        torch.testing.assert_close(masked.double(), expected, atol=max(tolerance, 1e-5), rtol=0)


def test_a_sliding_window_hides_the_entries_outside_it():
    layer, inputs, decoded = pruned_layer([[12, 30, 7], [20, 5, 40]], sliding_window=16)
    query = torch.randn(B, HKV * G, 1, D, generator=torch.Generator().manual_seed(9))
    options = AttentionOptions(sliding_window=16)
    got = layer.decode_attention(query, SCALING, options)
    newest = 40 + len(decoded) - 1  # the query's position: after the prompt and the decoded tokens

    def visible(b, h, p):
        return p > newest - 16

    torch.testing.assert_close(got.double(), naive(inputs, decoded, query, visible), atol=1e-5, rtol=0)


def test_keeping_every_channel_attends_as_the_unpruned_layer():
    pruned, _, _ = pruned_layer([[5, 17, 0], [40, 3, 12]], keep=D)
    plain, _, _ = pruned_layer([[5, 17, 0], [40, 3, 12]], keep=None)
    query = torch.randn(B, HKV * G, 1, D, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(
        pruned.decode_attention(query, SCALING), plain.decode_attention(query, SCALING)
    )


def held_bytes(layer: CompressedLayer) -> int:
    """Bytes of every storage the layer references (each once), from the tensors' storages."""
    seen, total = set(), 0
    for name in (
        "prompt_keys",
        "prompt_values",
        "decode_keys",
        "decode_values",
        "starts",
        "lengths",
        "key_channels",
    ):
        tensor = getattr(layer, name)
        if tensor is not None and tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            total += tensor.untyped_storage().nbytes()
    return total


@pytest.mark.parametrize("keep", [4, 8, 12])
def test_the_bytes_held_fall_by_the_pruned_channels(keep):
    counts = [[200, 120, 64], [256, 32, 180]]
    plain, _, _ = pruned_layer(counts, keep=None, T=256)
    layer, _, _ = pruned_layer(counts, keep=keep, T=256)
    kept = sum(map(sum, counts))
    assert held_bytes(layer) == layer.kv_bytes() and held_bytes(plain) == plain.kv_bytes()
    saved = kept * (D - keep) * 4  # fp32 key channels not stored
    index = B * HKV * keep * 8  # the channel index, int64
    assert plain.kv_bytes() - layer.kv_bytes() == saved - index
    assert layer.prompt_kv_bytes() == kept * (keep + D) * 4 + index


def test_checkpoint_and_restore_keep_the_pruned_keys():
    layer, inputs, decoded = pruned_layer([[8, 8, 8], [8, 8, 8]], decode=1)
    query = torch.randn(B, HKV * G, 1, D, generator=torch.Generator().manual_seed(4))
    state = layer.checkpoint()
    layer.update(torch.randn(B, HKV, 1, D), torch.randn(B, HKV, 1, D))
    layer.restore(state)
    assert layer.key_channels is state["key_channels"] and layer.decode_length == 1
    expected = naive(inputs, decoded, query)
    torch.testing.assert_close(layer.decode_attention(query, SCALING).double(), expected, atol=1e-5, rtol=0)


def test_slot_operations_refuse_a_pruned_layer():
    layer, _, _ = pruned_layer([[8, 8, 8], [8, 8, 8]])
    with pytest.raises(RuntimeError, match="model.compression.channels"):
        layer.slot_valid()
