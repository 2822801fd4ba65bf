"""GPU tier: every Triton kernel, compiled natively (no interpreter), against its torch reference at
real-model shapes (skipped without CUDA).

tests/kernels/test_kernels.py runs the kernels on small shapes (interpreted on CPU, native on a GPU); here
the shapes are those of real models: head dims 64, 80, 96, 128 and 256, GQA groups 1, 4, 7 and 8,
one and two queries per step, prompt lengths that are multiples of no block (up to 33k tokens, so
the split-K decode runs many splits), bf16 / fp16 / fp32, a (sample, head) that keeps nothing,
padded samples. The references run on the GPU too (the torch paths). Tolerances are those of
tests/kernels/test_kernels.py: fp32 1e-5, fp16 2e-3, bf16 2e-2 (outputs rounded once to 16 bits, and
the native P.V product takes P in the cache dtype, as FlashAttention does); window scores
``atol 1e-5, rtol 1e-4`` in fp32 whatever the input dtype; compaction, chunk top-k and gather
exactly.
"""

import pytest
import torch

pytest.importorskip("triton")

from gpu_support import needs_cuda  # noqa: E402
from support.kernel_cases import (  # noqa: E402
    DEVICE,
    assert_close,
    compaction_inputs,
    gather_inputs,
    merge_case,
    ragged_inputs,
    run_packed,
    run_pruned,
    topk_inputs,
    window_inputs,
)

from kvlab.kernels import dispatch  # noqa: E402
from kvlab.kernels.compaction import compact_kv_reference  # noqa: E402
from kvlab.kernels.decode_attention import ragged_decode_attention_reference  # noqa: E402
from kvlab.kernels.merge import merge_scatter_reference  # noqa: E402
from kvlab.kernels.retrieval import chunk_topk_reference, gather_chunks_reference  # noqa: E402
from kvlab.kernels.tl.compaction import compact_kv_triton  # noqa: E402
from kvlab.kernels.tl.decode_attention import ragged_decode_attention_triton  # noqa: E402
from kvlab.kernels.tl.merge import merge_scatter_triton  # noqa: E402
from kvlab.kernels.tl.retrieval import chunk_topk_triton, gather_chunks_triton  # noqa: E402
from kvlab.kernels.tl.window_scores import window_attention_scores_triton  # noqa: E402
from kvlab.kernels.window_scores import window_attention_scores_reference  # noqa: E402

pytestmark = [pytest.mark.gpu, needs_cuda]
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True, scope="module")
def native():
    assert DEVICE == "cuda" and not dispatch.interpreter(), "the GPU tier runs the kernels natively"


# Ragged decode attention: D, GQA group, queries per step, longest kept prompt, dtype, batch, KV heads.
# Head (0, 0) keeps nothing; lengths are drawn in [1, max_len); 5 decoded tokens (+2 unused slots).
DECODE = [
    (64, 1, 1, 1100, BF16, 2, 3),
    (64, 8, 2, 4100, FP16, 2, 3),
    (64, 4, 1, 700, FP32, 2, 3),
    (80, 7, 1, 2100, BF16, 2, 3),
    (80, 1, 2, 900, FP32, 2, 3),
    (96, 4, 1, 3000, FP16, 2, 3),
    (96, 8, 1, 1500, BF16, 2, 3),
    (128, 4, 1, 33000, BF16, 1, 8),  # Llama-3-8B attention at 32k: many splits per head
    (128, 4, 2, 4100, FP16, 2, 3),
    (128, 1, 1, 2100, FP32, 2, 3),
    (128, 7, 1, 1100, FP32, 2, 3),
    (256, 4, 1, 2100, BF16, 2, 3),
    (256, 8, 1, 1100, FP16, 2, 3),
    (256, 1, 1, 700, FP32, 2, 3),
]


@pytest.mark.parametrize("D, G, q, max_len, dtype, B, Hkv", DECODE)
def test_ragged_decode_attention_at_real_model_shapes(D, G, q, max_len, dtype, B, Hkv):
    inputs = ragged_inputs(B, Hkv, G, q, D, max_len, dtype, decode_length=5, seed=D + G)
    got = ragged_decode_attention_triton(**inputs)
    want = ragged_decode_attention_reference(**inputs)
    assert got.shape == (B, Hkv * G, q, D) and got.dtype == dtype
    assert_close(got, want, dtype)


# Decode over packed codes (the fused kernel: uniform codes dequantized in registers, TurboQuant's
# read in the rotated basis) against the torch path (on CUDA: the entries dequantized into the flat
# layout, then the masked fp32 attention): D, group, queries, longest kept prompt, dtype, batch, KV
# heads, format (support.kernel_cases.PACKED_QUANTIZERS).
PACKED = [
    (128, 4, 1, 33000, BF16, 1, 8, "kivi2_paper"),  # Llama-3-8B attention at 32k, KIVI-2
    (128, 4, 2, 4100, FP16, 2, 3, "int4"),
    (64, 8, 1, 2100, BF16, 2, 3, "int8"),
    (96, 7, 1, 1500, FP16, 2, 3, "kivi2_paper"),
    (128, 1, 1, 2100, FP32, 2, 3, "int2"),
    (128, 4, 1, 100, BF16, 2, 3, "kivi2_paper"),  # every entry in the residual: no body launch
    (128, 4, 1, 33000, BF16, 1, 8, "turbo3_paper"),  # TurboQuant-3 at 32k (rotated-basis kernel)
    (128, 4, 2, 4100, FP16, 2, 3, "turbo4_mse"),  # keys without the sketch, 3-bit planes
    (64, 8, 1, 2100, FP32, 2, 3, "turbo2"),
]


@pytest.mark.parametrize("D, G, q, max_len, dtype, B, Hkv, quantizer", PACKED)
def test_packed_decode_attention_at_real_model_shapes(D, G, q, max_len, dtype, B, Hkv, quantizer):
    got, want = run_packed(B, Hkv, G, q, D, max_len, None, dtype, quantizer, decode_length=5)
    assert got.shape == (B, Hkv * G, q, D) and got.dtype == dtype
    assert_close(got, want, dtype)


# Decode over channel-pruned keys (ThinK's layout) against the torch path (on CUDA: the masked fp32
# attention with the selected queries): batch, KV heads, group, queries, D, kept key channels,
# longest kept prompt, dtype.
PRUNED = [
    (1, 8, 4, 1, 128, 64, 33000, BF16),  # Llama-3-8B attention at 32k, ThinK's 50%
    (2, 3, 4, 2, 128, 77, 4100, FP16),
    (2, 3, 8, 1, 64, 32, 2100, BF16),
    (2, 3, 7, 1, 96, 40, 1500, FP32),
    (2, 3, 1, 1, 256, 128, 1100, BF16),
]


@pytest.mark.parametrize("B, Hkv, G, q, D, Dk, max_len, dtype", PRUNED)
def test_pruned_decode_attention_at_real_model_shapes(B, Hkv, G, q, D, Dk, max_len, dtype):
    got, want = run_pruned(B, Hkv, G, q, D, Dk, max_len, None, dtype, decode_length=5)
    assert got.shape == (B, Hkv * G, q, D) and got.dtype == dtype
    assert_close(got, want, dtype)


# Window scores: batch (the last sample padded), KV heads, group, window, prompt length, D, dtype.
WINDOW = [
    (2, 2, 4, 32, 4100, 64, BF16),
    (1, 3, 7, 16, 2100, 80, FP16),
    (2, 2, 1, 64, 3000, 96, FP32),
    (1, 8, 4, 32, 8200, 128, BF16),
    (2, 1, 8, 8, 1100, 256, FP16),
    (1, 2, 4, 130, 2100, 128, FP32),  # a window longer than one 128-row tile
]


@pytest.mark.parametrize("B, Hkv, G, W, T, D, dtype", WINDOW)
def test_window_scores_at_real_model_shapes(B, Hkv, G, W, T, D, dtype):
    queries, keys, valid = window_inputs(B, Hkv, G, W, T, D, dtype, seed=T)
    got = window_attention_scores_triton(queries, keys, valid, D**-0.5)
    want = window_attention_scores_reference(queries, keys, valid, D**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    valid_queries = valid[:, T - W :].sum(-1).float()[:, None].expand(-1, Hkv * G)
    torch.testing.assert_close(got.sum(-1), valid_queries, atol=1e-3, rtol=1e-5)


COMPACTION = [
    (dtype, merged, D) for dtype in (BF16, FP16, FP32) for merged in (False, True) for D in (64, 128, 256)
]


@pytest.mark.parametrize("dtype, merged, D", COMPACTION)
def test_compaction_at_real_model_shapes(dtype, merged, D):
    keys, values, indices, counts = compaction_inputs(dtype, merged, D, B=2, Hkv=8, T=3000)
    got = compact_kv_triton(keys, values, indices, counts)
    want = compact_kv_reference(keys, values, indices, counts)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


MERGE = [  # dtype, normalize, weighted, kept rows, merged entries, D
    (BF16, "weights", False, 1000, 5000, 128),
    (FP16, "count", True, 700, 9000, 64),
    (FP32, "weights", True, 1000, 3000, 256),
    (FP32, "count", False, 300, 7000, 80),
]


@pytest.mark.parametrize("dtype, normalize, weighted, N, M, D", MERGE)
def test_merge_at_real_model_shapes(dtype, normalize, weighted, N, M, D):
    args = merge_case(dtype, normalize, weighted, N=N, M=M, D=D)
    assert_close(merge_scatter_triton(*args), merge_scatter_reference(*args), dtype)


TOPK = [  # B, Hkv, G, q, D, chunks, retrieving rows, dtype: 32k tokens in 8-token chunks
    (1, 8, 4, 1, 128, 4000, 8, BF16),
    (2, 3, 7, 2, 64, 1100, 6, FP16),
    (1, 4, 1, 1, 256, 2500, 4, FP32),
    (2, 2, 8, 1, 96, 700, 4, BF16),
]


@pytest.mark.parametrize("case", TOPK)
def test_chunk_topk_at_real_model_shapes(case):
    inputs = topk_inputs(*case)
    assert torch.equal(chunk_topk_triton(*inputs), chunk_topk_reference(*inputs))


GATHER = [  # rows, queries, chunks fetched, host tokens per row, D, chunk, dtype
    (8, 1, 400, 8000, 128, 8, BF16),
    (6, 2, 100, 4096, 64, 8, FP16),
    (4, 1, 250, 2000, 256, 8, FP32),
]


@pytest.mark.parametrize("case", GATHER)
def test_gather_from_pinned_host_memory_at_real_model_shapes(case):
    inputs = gather_inputs(*case)
    assert inputs[0].is_pinned()
    got, want = gather_chunks_triton(*inputs), gather_chunks_reference(*inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
