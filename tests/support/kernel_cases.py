"""The Triton kernels' test cases: input builders, the case lists (small shapes for the
interpreter, real-model shapes sized for a GPU), the tolerances, and every launch the kernel tests
make (:func:`kernel_test_launches`, compiled for sm_80/sm_90 by tests/kernels/test_kernel_compile.py).

Shared by tests/kernels/test_kernels.py (interpreted on CPU, native on a GPU),
tests/kernels/test_kernel_compile.py and the GPU tier (tests/gpu/test_gpu_kernels.py).
"""

from collections.abc import Callable, Iterator

import pytest
import torch

pytest.importorskip("triton")

from kvlab.cache.packed import packed_decode_attention  # noqa: E402
from kvlab.cache.pruned import pruned_decode_attention, query_channels  # noqa: E402
from kvlab.compression.quantizers import KIVI, PerToken  # noqa: E402
from kvlab.compression.selectors import topk_indices  # noqa: E402
from kvlab.compression.turboquant import TurboQuant  # noqa: E402
from kvlab.kernels.decode_attention import ragged_decode_attention_reference  # noqa: E402
from kvlab.kernels.dispatch import kernel_mode  # noqa: E402
from kvlab.kernels.merge import merge_scatter_reference  # noqa: E402
from kvlab.kernels.tl.compaction import compact_kv_triton  # noqa: E402
from kvlab.kernels.tl.decode_attention import ragged_decode_attention_triton  # noqa: E402
from kvlab.kernels.tl.merge import merge_scatter_triton  # noqa: E402
from kvlab.kernels.tl.packed_attention import packed_decode_attention_triton  # noqa: E402
from kvlab.kernels.tl.pruned_attention import pruned_decode_attention_triton  # noqa: E402
from kvlab.kernels.tl.retrieval import chunk_topk_triton, gather_chunks_triton, page_topk_triton  # noqa: E402
from kvlab.kernels.tl.window_scores import window_attention_scores_triton  # noqa: E402
from kvlab.kernels.window_scores import window_attention_scores_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# fp32 agrees to rounding; 16-bit outputs are rounded once, and the native P.V product takes P
# in the cache dtype (FlashAttention's choice), hence the looser 16-bit tolerances
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def assert_close(got, want, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def ragged_inputs(B, Hkv, G, q, D, max_len, dtype, decode_length=3, seed=0):
    """Flat kept K/V with random per-head lengths (head (0, 0) keeps nothing) and a decode region."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (B, Hkv), generator=gen)
    lengths[0, 0] = 0
    N = int(lengths.sum())
    starts = (lengths.flatten().cumsum(0) - lengths.flatten()).view(B, Hkv)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    capacity = decode_length + 2  # unused slots hold garbage the kernel must not read
    return dict(
        query=randn(B, Hkv * G, q, D),
        prompt_keys=randn(N, D),
        prompt_values=randn(N, D),
        starts=starts.to(DEVICE),
        lengths=lengths.to(DEVICE),
        decode_keys=randn(B, Hkv, capacity, D),
        decode_values=randn(B, Hkv, capacity, D),
        decode_length=decode_length,
        scaling=D**-0.5,
    )


# Each case has one dtype (every dtype is covered across the cases): every distinct
# (dtype, head dim) is one more compilation in tests/kernels/test_kernel_compile.py.
DECODE_CASES = [  # B, Hkv, G, q, D, max_len, split, dtype
    (2, 2, 3, 1, 8, 150, None, torch.bfloat16),  # GQA 3, one split per head, D padded to 16
    (2, 2, 2, 2, 12, 150, 64, torch.float16),  # two-token chunk, odd head dim, several splits
    (1, 3, 1, 1, 16, 70, 64, torch.float32),  # MHA, lengths around one split boundary
]
# Real models: every head dim (64 .. 256), GQA group (1, 4, 7, 8) and dtype, prompt lengths that
# are multiples of no block, and the split count the sizing picks on a GPU with GPU_SLOTS
# programs in flight (an H100: 132 SMs x 2), not the interpreter's 4. D, G, dtype, max_len, q:
GPU_SLOTS = 264
REAL_DECODE = [
    (64, 1, torch.bfloat16, 700, 1),
    (64, 8, torch.float32, 1100, 1),
    (80, 7, torch.float16, 900, 2),
    (96, 4, torch.bfloat16, 700, 1),
    (128, 8, torch.bfloat16, 1100, 1),
    (128, 4, torch.float16, 700, 1),
    (128, 1, torch.float32, 900, 1),
    (256, 7, torch.bfloat16, 700, 1),
]


def run_decode(B, Hkv, G, q, D, max_len, split, dtype, slots=None, decode_length=3):
    """``(triton output, reference output)`` of one decode case."""
    inputs = ragged_inputs(B, Hkv, G, q, D, max_len, dtype, decode_length=decode_length)
    got = ragged_decode_attention_triton(**inputs, split_size=split, slots=slots)
    return got, ragged_decode_attention_reference(**inputs)


def run_real_decode(D, G, dtype, max_len, q):
    """A real-shape decode case: head (0, 0) keeps nothing, splits sized for ``GPU_SLOTS``."""
    return run_decode(1, 2, G, q, D, max_len, None, dtype, slots=GPU_SLOTS, decode_length=5)


# --- decode over packed codes (the fused dequantizing kernel) ------------------------------------------
PACKED_QUANTIZERS = {  # int8 / int4 / int2 per token, KIVI-2 (per-channel keys) with a residual
    "int8": PerToken(bits=8, group=32),
    "int4": PerToken(bits=4, group=32, residual=5),
    "int2": PerToken(bits=2, group=8),
    "kivi2": KIVI(bits=2, group=16, residual=20),
    "kivi4_residual_only": KIVI(bits=4, group=16, residual=64),  # every entry in the residual
    "kivi2_paper": KIVI(bits=2, group=32, residual=128),  # KIVI's own setting (GPU tier)
    # TurboQuant at b bits: keys b - 1 codebook bits and the sketch (turbo<b>) or b codebook bits
    # (turbo<b>_mse), values b codebook bits; 3 bits are stored as bit planes; turbo1's keys are
    # the sketch alone
    **{f"turbo{b}": TurboQuant(bits=b, residual=3, seed=b) for b in (1, 2, 3, 4)},
    **{f"turbo{b}_mse": TurboQuant(bits=b, residual=3, seed=b, keys="mse") for b in (2, 3, 4)},
    "turbo3_paper": TurboQuant(bits=3),  # the quantizer's defaults: no residual (GPU tier)
}
PACKED_CASES = [  # B, Hkv, G, q, D, max_len, split, dtype, quantizer: small shapes for the interpreter
    (2, 2, 3, 1, 16, 150, None, torch.bfloat16, "kivi2"),  # GQA 3, body and residual splits sized alike
    (2, 2, 2, 2, 12, 150, 64, torch.float16, "int4"),  # two-token chunk, odd head dim, several splits
    (1, 3, 1, 1, 16, 90, 64, torch.float32, "int8"),
    (1, 2, 4, 1, 16, 100, None, torch.float16, "int2"),
    (1, 2, 2, 1, 16, 60, None, torch.float16, "kivi4_residual_only"),  # no body: no body launch
    (2, 2, 3, 2, 16, 150, 64, torch.float16, "turbo3"),  # TurboQuant: GQA 3, two-token chunk, splits
    (1, 2, 2, 1, 16, 60, None, torch.float32, "turbo1"),  # keys of the sketch alone (no codebook bits)
]
# TurboQuant at 2-4 bits, keys with and without the sketch, bf16 and fp32: ragged heads (one empty),
# GQA 2, several body splits; also against the naive dequantization and attention (test_kernels)
ROTATED_CASES = [  # bits, sketch, dtype
    (bits, sketch, dtype)
    for bits in (2, 3, 4)
    for sketch in (True, False)
    for dtype in (torch.bfloat16, torch.float32)
]
REAL_PACKED = [  # D, G, dtype, max_len, quantizer: real head dims, splits sized for GPU_SLOTS
    (128, 4, torch.bfloat16, 700, "kivi2"),
    (64, 8, torch.float16, 700, "int4"),
    (128, 1, torch.float32, 500, "int8"),
    (128, 4, torch.bfloat16, 700, "turbo3"),
    (128, 1, torch.float32, 500, "turbo4_mse"),
    (64, 8, torch.float16, 700, "turbo2"),
]


def rotated_case(bits: int, sketch: bool, dtype: torch.dtype) -> tuple:
    """The :func:`run_packed` arguments of a :data:`ROTATED_CASES` case."""
    return 2, 2, 2, 1, 16, 90, 32, dtype, f"turbo{bits}" if sketch else f"turbo{bits}_mse"


def packed_inputs(B, Hkv, G, q, D, max_len, dtype, quantizer, decode_length=3):
    """``(inputs, packed)``: :func:`ragged_inputs` and their prompt entries packed by
    :data:`PACKED_QUANTIZERS` ``[quantizer]``."""
    inputs = ragged_inputs(B, Hkv, G, q, D, max_len, dtype, decode_length=decode_length)
    packed = PACKED_QUANTIZERS[quantizer].pack(
        inputs["prompt_keys"], inputs["prompt_values"], inputs["starts"], inputs["lengths"]
    )
    return inputs, packed


def run_packed(B, Hkv, G, q, D, max_len, split, dtype, quantizer, slots=None, decode_length=3):
    """``(triton output, torch-path output)`` of decode attention over ragged inputs packed by
    :data:`PACKED_QUANTIZERS` ``[quantizer]`` (the torch path: per-chunk dequantization + attention)."""
    inputs, packed = packed_inputs(B, Hkv, G, q, D, max_len, dtype, quantizer, decode_length)
    rest = (inputs["decode_keys"], inputs["decode_values"], decode_length, inputs["scaling"])
    got = packed_decode_attention_triton(
        inputs["query"], packed.keys, packed.values, packed.body_starts, packed.body_lengths,
        packed.residual_keys, packed.residual_values, packed.residual_starts, packed.residual_lengths,
        *rest, split_size=split, slots=slots,
    )  # fmt: skip
    with kernel_mode("reference"):
        want = packed_decode_attention(inputs["query"], packed, inputs["starts"], inputs["lengths"], *rest)
    return got, want


def run_real_packed(D, G, dtype, max_len, quantizer):
    """A real-shape packed case: head (0, 0) keeps nothing, splits sized for ``GPU_SLOTS``."""
    return run_packed(1, 2, G, 1, D, max_len, None, dtype, quantizer, slots=GPU_SLOTS, decode_length=5)


# --- decode over channel-pruned keys (ThinK's layout) ----------------------------------------------
PRUNED_CASES = [  # B, Hkv, G, q, D, Dk, max_len, split, dtype: small shapes for the interpreter
    (2, 2, 3, 1, 16, 8, 150, None, torch.bfloat16),  # GQA 3, half the channels (a 16-wide key tile)
    (2, 2, 2, 2, 12, 5, 150, 64, torch.float16),  # two-token chunk, odd dims, several prompt splits
    (1, 3, 1, 1, 16, 16, 70, 64, torch.float32),  # every channel kept
    (1, 2, 4, 1, 32, 20, 100, None, torch.float32),  # a 32-wide key tile
]
REAL_PRUNED = [  # D, Dk, G, dtype, max_len: real head dims at ThinK's 50% (and 40%), GPU split sizing
    (128, 64, 4, torch.bfloat16, 700),
    (64, 32, 8, torch.float16, 700),
    (128, 77, 1, torch.float32, 500),
    (256, 128, 4, torch.float16, 700),  # a 256-wide head: 32-row tiles (shared memory)
]


def run_pruned(B, Hkv, G, q, D, Dk, max_len, split, dtype, slots=None, decode_length=3):
    """``(triton output, torch-path output)`` of decode attention over ragged inputs whose prompt keys
    keep ``Dk`` random channels per (sample, KV head)."""
    inputs = ragged_inputs(B, Hkv, G, q, D, max_len, dtype, decode_length=decode_length)
    gen = torch.Generator().manual_seed(Dk)
    channels = torch.rand(B, Hkv, D, generator=gen).argsort(-1)[..., :Dk].sort(-1).values.to(DEVICE)
    lengths = inputs["lengths"]
    segment = torch.repeat_interleave(torch.arange(B * Hkv, device=DEVICE), lengths.flatten())
    keys = inputs["prompt_keys"].gather(1, channels.view(-1, Dk)[segment])
    query = inputs["query"]
    rest = (
        inputs["prompt_values"],
        inputs["starts"],
        lengths,
        inputs["decode_keys"],
        inputs["decode_values"],
    )
    rest = (*rest, decode_length, inputs["scaling"])
    got = pruned_decode_attention_triton(
        query, query_channels(query, channels), keys, *rest, split_size=split, slots=slots
    )
    with kernel_mode("reference"):
        want = pruned_decode_attention(query, keys, rest[0], channels, *rest[1:])
    return got, want


def run_real_pruned(D, Dk, G, dtype, max_len):
    """A real-shape pruned case: head (0, 0) keeps nothing, splits sized for ``GPU_SLOTS``."""
    return run_pruned(1, 2, G, 1, D, Dk, max_len, None, dtype, slots=GPU_SLOTS, decode_length=5)


def window_inputs(B, Hkv, G, W, T, D, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randn(B, Hkv * G, T, D, generator=gen).to(dtype)[:, :, -W:]  # a strided view
    keys = torch.randn(B, Hkv, T, D, generator=gen).to(dtype)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[-1, : T - W + 2] = False  # the last sample is shorter than its window: padding queries
    return queries.to(DEVICE), keys.to(DEVICE), valid.to(DEVICE)


WINDOW_CASES = [  # B, Hkv, G, W, T, D, split, dtype
    (2, 2, 2, 5, 37, 8, None, torch.float16),
    (1, 1, 3, 7, 131, 12, 64, torch.bfloat16),  # odd head dim, three statistics splits
    (1, 1, 1, 130, 133, 8, None, torch.float32),  # window longer than one 128-row tile
]
REAL_WINDOW = [  # D, G, dtype, W, T: real head dims and groups, GPU split sizing (two splits)
    (64, 4, torch.bfloat16, 16, 1100),
    (80, 7, torch.float16, 8, 1100),
    (96, 1, torch.float32, 32, 1100),
    (128, 8, torch.bfloat16, 8, 1100),
    (256, 4, torch.float16, 8, 1100),
]


def run_window(B, Hkv, G, W, T, D, split, dtype, slots=None):
    """``(triton scores, reference scores, valid)`` of one window-scoring case."""
    queries, keys, valid = window_inputs(B, Hkv, G, W, T, D, dtype)
    got = window_attention_scores_triton(queries, keys, valid, D**-0.5, split_size=split, slots=slots)
    return got, window_attention_scores_reference(queries, keys, valid, D**-0.5), valid


def run_real_window(D, G, dtype, W, T):
    """A real-shape window case (two samples, the last one padded), splits sized for ``GPU_SLOTS``."""
    return run_window(2, 1, G, W, T, D, None, dtype, slots=GPU_SLOTS)


def compaction_inputs(dtype, merged, D, B=2, Hkv=3, T=37):
    """Keys, values, kept positions (None: the first ``count`` rows, a merge's replacements), counts."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(B, Hkv, T, D, generator=gen).to(dtype).to(DEVICE)
    values = torch.randn(B, Hkv, T, D, generator=gen).to(dtype).to(DEVICE)
    counts = torch.randint(1, T, (B, Hkv), generator=gen)
    counts[0, 0] = 0
    indices = topk_indices(torch.rand(B, Hkv, T, generator=gen), counts).to(DEVICE)
    counts = counts.to(DEVICE)
    if merged:  # replacement entries: positions 0 .. count-1 of [B, Hkv, K, D]
        K = int(counts.max())
        keys, values, indices = keys[:, :, :K], values[:, :, :K], None
    return keys, values, indices, counts


COMPACTION_CASES = [  # dtype, merged, D: both layouts in every dtype, a test and a real head dim
    (torch.float32, False, 12),
    (torch.float32, True, 128),
    (torch.float16, False, 128),
    (torch.float16, True, 12),
    (torch.bfloat16, False, 12),
    (torch.bfloat16, True, 128),
]


def merge_inputs(N=7, M=23, D=12, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kept = torch.randn(N, D, generator=gen).to(dtype)
    evicted = torch.randn(M, D, generator=gen).to(dtype)
    target = torch.randint(0, N - 1, (M,), generator=gen)  # row N-1 receives nothing
    return kept, evicted, target


def merge_case(dtype, normalize, weighted, **sizes):
    """Arguments of ``merge_scatter_*``: kept, evicted, target, weights (or None), normalize."""
    kept, evicted, target = merge_inputs(dtype=dtype, **sizes)
    gen = torch.Generator().manual_seed(1)
    ew = torch.rand(target.shape[0], generator=gen) + 0.1 if weighted else None
    kw = torch.rand(kept.shape[0], generator=gen) + 0.5 if weighted else None
    return [t.to(DEVICE) if t is not None else None for t in (kept, evicted, target, ew, kw)] + [normalize]


MERGE_CASES = [  # dtype, normalize, weighted: every pair of the three in one case or another
    (torch.float32, "weights", False),
    (torch.float32, "count", True),
    (torch.float16, "weights", True),
    (torch.float16, "count", False),
    (torch.bfloat16, "weights", False),
    (torch.bfloat16, "count", True),
]


CROWDED_MERGE = dict(N=5, M=700, D=128)  # 700 entries over 4 kept rows, at most 32 per program
CROWDED_RUN = 32


def run_crowded_merge(dtype, normalize):
    """``(triton, reference, arguments)`` of a merge where each kept row absorbs ~175 entries."""
    args = merge_case(dtype, normalize, True, **CROWDED_MERGE)
    return merge_scatter_triton(*args, max_run=CROWDED_RUN), merge_scatter_reference(*args), args


CROWDED_CASES = [(torch.bfloat16, "count"), (torch.float32, "weights")]


# --- chunk retrieval (the retrieve selector): chunk scores + exact top-k, and the chunk gather ---
def topk_inputs(B, Hkv, G, q, D, NC, R, dtype, tie=False, seed=0):
    """Queries ``[B, H, q, D]``, a chunk index ``[R, NC, D]`` over R (sample, KV head) rows, about a
    quarter of the chunks invalid, and per-row counts some of which exceed the valid chunks."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(B, Hkv * G, q, D, generator=gen).to(dtype)
    rows = torch.stack([torch.arange(R) % B, torch.arange(R) % Hkv], -1)
    index = torch.randn(R, NC, D, generator=gen).to(dtype)
    if tie:  # every score equal: the lower chunks win
        query.zero_()
    chunk_valid = torch.rand(R, NC, generator=gen) > 0.25
    n_sel = torch.randint(1, NC + 3, (R,), generator=gen)
    return query.to(DEVICE), index.to(DEVICE), rows.to(DEVICE), chunk_valid.to(DEVICE), n_sel.to(DEVICE), Hkv


# (B, Hkv, G, q, D, NC, R, dtype, tie): GQA 1/2/4/7, q 1 and 2, odd head dims, ties, real head
# dims (64 and 128 with several select tiles); each distinct (dtype, D) is one more compilation
TOPK_CASES = [
    (1, 2, 2, 1, 16, 37, 2, torch.float32, False),
    (2, 3, 4, 2, 12, 90, 5, torch.float16, False),
    (2, 2, 1, 1, 64, 9, 3, torch.bfloat16, False),
    (1, 1, 2, 1, 16, 20, 1, torch.float32, True),
    (1, 4, 7, 1, 128, 600, 4, torch.bfloat16, False),
]


def run_topk(*case):
    return chunk_topk_triton(*topk_inputs(*case))


def page_inputs(B, Hkv, G, q, D, NC, R, dtype, tie=False, seed=0):
    """:func:`topk_inputs` with Quest's page index ``[R, NC, 2, D]`` (per-channel minimum and maximum
    of 16 random keys per page) in place of the mean keys."""
    query, _, rows, chunk_valid, n_sel, Hkv = topk_inputs(B, Hkv, G, q, D, NC, R, dtype, tie, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    keys = torch.randn(R, NC, 16, D, generator=gen)
    index = torch.stack([keys.amin(2), keys.amax(2)], 2).to(dtype)
    return query, index.to(DEVICE), rows, chunk_valid, n_sel, Hkv


# (B, Hkv, G, q, D, NC, R, dtype, tie): MHA (the paper's models) and GQA, q 1 and 2, an odd head
# dim, ties, a 32k prompt's 2048 pages of 16 at head dim 128
PAGE_CASES = [
    (1, 2, 1, 1, 16, 37, 2, torch.float32, False),
    (2, 3, 4, 2, 12, 90, 5, torch.float16, False),
    (1, 1, 2, 1, 16, 20, 1, torch.float32, True),
    (1, 2, 4, 1, 128, 2048, 2, torch.bfloat16, False),
]


def run_page_topk(*case):
    return page_topk_triton(*page_inputs(*case))


def gather_inputs(R, q, S, M, D, chunk, dtype, seed=0):
    """A host store ``[R, M, D]`` (M a multiple of ``chunk``) and chunk ids ``[R, q, S]`` (-1: empty)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(R, M, D, generator=gen).to(dtype)
    values = torch.randn(R, M, D, generator=gen).to(dtype)
    ids = torch.randint(-1, M // chunk, (R, q, S), generator=gen)
    if DEVICE == "cuda":  # the store in page-locked host memory, read by the device
        keys, values = keys.pin_memory(), values.pin_memory()
    return keys, values, ids.to(DEVICE), chunk, torch.device(DEVICE)


# (R, q, S, M, D, chunk, dtype): chunk 8 (HybridKV) and 4, odd and real head dims
GATHER_CASES = [
    (3, 1, 4, 40, 16, 8, torch.float32),
    (2, 2, 3, 24, 12, 4, torch.bfloat16),
    (2, 1, 5, 64, 128, 8, torch.float16),
]


def run_gather(*case):
    return gather_chunks_triton(*gather_inputs(*case))


def kernel_test_launches() -> Iterator[tuple[Callable[..., object], tuple]]:
    """``(function, arguments)`` of every Triton launcher call the kernel tests above make.

    ``tests/kernels/test_kernel_compile.py`` records the launches these calls make and compiles them
    for sm_80 and sm_90.
    """
    yield from ((run_decode, case) for case in DECODE_CASES)
    yield from ((run_real_decode, case) for case in REAL_DECODE)
    yield from ((run_packed, case) for case in PACKED_CASES)
    yield from ((run_packed, rotated_case(*case)) for case in ROTATED_CASES)
    yield from ((run_real_packed, case) for case in REAL_PACKED)
    yield from ((run_pruned, case) for case in PRUNED_CASES)
    yield from ((run_real_pruned, case) for case in REAL_PRUNED)
    yield from ((run_window, case) for case in WINDOW_CASES)
    yield from ((run_real_window, case) for case in REAL_WINDOW)
    yield from ((lambda *c: compact_kv_triton(*compaction_inputs(*c)), case) for case in COMPACTION_CASES)
    yield from ((lambda *c: merge_scatter_triton(*merge_case(*c)), case) for case in MERGE_CASES)
    yield from ((run_crowded_merge, case) for case in CROWDED_CASES)
    yield from ((run_topk, case) for case in TOPK_CASES)
    yield from ((run_page_topk, case) for case in PAGE_CASES)
    yield from ((run_gather, case) for case in GATHER_CASES)
