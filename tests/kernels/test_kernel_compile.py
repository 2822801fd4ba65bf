"""The Triton kernels compile for real GPUs (sm_80, sm_90) without one, and launch as a GPU needs.

The interpreter that runs tests/kernels/test_kernels.py on CPU skips what the GPU compiler checks. Here
the launches those tests make are recorded (argument types, constants and options, as Triton's
launcher specialises them; nothing runs) and every distinct one (a covering set with
``KVLAB_COMPILE_COVERING=1``) is compiled by Triton down to a cubin for sm_80 and sm_90
(:mod:`kvlab.kernels.tl.launches`, one subprocess per target without the interpreter). The
cubins' resource usage shows spilled registers.
"""

import os
import time

import pytest
import torch

pytest.importorskip("triton")

from support.kernel_cases import GPU_SLOTS, kernel_test_launches, ragged_inputs, window_inputs  # noqa: E402

from kvlab.kernels.tl import common  # noqa: E402
from kvlab.kernels.tl.compaction import compact_kv_triton  # noqa: E402
from kvlab.kernels.tl.decode_attention import ragged_decode_attention_triton  # noqa: E402
from kvlab.kernels.tl.launches import (  # noqa: E402
    ARCHS,
    SHARED_LIMIT,
    compile_launches,
    constexpr_names,
    covering,
    distinct,
    features,
    launched_kernels,
    record_launches,
)
from kvlab.kernels.tl.window_scores import window_attention_scores_triton  # noqa: E402

# what may be a tl.constexpr: tile sizes, the head dim, code-path switches, and the bit widths of
# TurboQuant's codebook indices (a quantizer's setting: one compilation per width, unrolled unpacking)
BLOCKS = {"ROWS", "BLOCK_N", "BLOCK_D", "BLOCK_DK", "BLOCK_S", "BLOCK_G", "BLOCK_W", "BLOCK_T", "BLOCK_M"}
SWITCHES = {"UPCAST", "PRECISION", "HAS_INDEX", "HAS_W", "HAS_DEN", "DEN_IS_W", "FINISH", "HAS_KW", "SKETCH"}
WIDTHS = {"K_BITS", "V_BITS"}
ALLOWED_CONSTEXPRS = BLOCKS | SWITCHES | WIDTHS | {"D"}
# the sizes that change with the data: a constexpr among them would compile per prompt or step
DATA_SIZES = {
    "T",
    "S",
    "W",
    "n_splits",
    "split",
    "decode_length",
    "Q",
    "B",
    "total_rows",
    "n_blocks",
    "n_rows",
}


def test_only_tile_sizes_the_head_dim_and_switches_are_constexpr():
    for (_, name), kernel in launched_kernels().items():
        consts = set(constexpr_names(kernel))
        assert consts <= ALLOWED_CONSTEXPRS, f"{name}: {consts - ALLOWED_CONSTEXPRS} are tl.constexpr"
        assert not consts & DATA_SIZES


def record(calls):
    """Launches recorded (not run) while ``calls`` (``(function, arguments)`` pairs) run."""
    with record_launches(execute=False) as launches:
        for fn, args in calls:
            fn(*args)
    return launches


def test_prompt_length_split_count_decode_length_and_batch_do_not_recompile():
    """Launches that differ only in data sizes have the same compile key (one compilation)."""

    def decode(B, max_len, decode_length, split):
        inputs = ragged_inputs(B, 2, 4, 1, 64, max_len, torch.float16, decode_length=decode_length)
        return ragged_decode_attention_triton(**inputs, split_size=split)

    def window(B, T, W):
        queries, keys, valid = window_inputs(B, 2, 4, W, T, 64, torch.float16)
        return window_attention_scores_triton(queries, keys, valid, 0.125, split_size=64)

    shorter = record([(decode, (1, 100, 1, 64)), (window, (1, 100, 9))])
    longer = record([(decode, (3, 1000, 17, 128)), (window, (2, 1000, 12))])
    assert [launch.grid for launch in shorter] != [launch.grid for launch in longer]
    assert [launch.compile_key() for launch in shorter] == [launch.compile_key() for launch in longer]


@pytest.mark.parametrize(
    "longest, programs, slots, want",
    [
        (700, 2, 4, (384, 2)),  # the interpreter's 4 slots
        (700, 2, 264, (256, 3)),  # an H100: 264 slots, splits down to the 256-token minimum
        (32_000, 8, 264, (1024, 32)),  # one sample, 8 KV heads, 32k tokens: 256 programs
        (32_000, 512, 264, (32_000, 1)),  # a batch that fills the device alone: no split
        (2**26, 1, 10**6, (1088, 61681)),  # more slots than grid dimension 1 holds: capped
    ],
)
def test_split_sizing_fills_the_device_and_respects_the_grid_limit(longest, programs, slots, want):
    split, count = common.split_size_for(longest, programs, slots, minimum=256, block=64)
    assert (split, count) == want
    assert count <= common.MAX_GRID_YZ and split * count >= longest


def test_grids_stay_within_cuda_limits_at_4m_tokens():
    """Every launch at 4M tokens (8 KV heads, GQA 4, head dim 128) fits CUDA's grid limits."""
    T, Hkv, G, D, meta = 4 * 2**20, 8, 4, 128, torch.device("meta")
    keys = torch.empty(1, Hkv, T, D, dtype=torch.bfloat16, device=meta)
    counts = torch.full((1, Hkv), T)
    with record_launches(execute=False) as launches:
        window_attention_scores_triton(
            torch.empty(1, Hkv * G, 32, D, dtype=torch.bfloat16, device=meta),
            keys,
            torch.empty(1, T, dtype=torch.bool, device=meta),
            0.1,
            slots=GPU_SLOTS,
        )
        compact_kv_triton(keys, keys, None, counts)
        ragged_decode_attention_triton(
            torch.empty(1, Hkv * G, 1, D, dtype=torch.bfloat16, device=meta),
            keys.view(-1, D),
            keys.view(-1, D),
            (torch.arange(Hkv) * T)[None],
            counts,
            keys,
            keys,
            1,
            0.1,
            max_prompt_length=T,
            slots=GPU_SLOTS,
        )
    assert {launch.kernel for launch in launches} == {
        "_row_stats",
        "_column_sums",
        "_compact",
        "_decode_partial",
        "_decode_combine",
    }
    for launch in launches:
        assert launch.grid[0] < 2**31 and all(n <= common.MAX_GRID_YZ for n in launch.grid[1:]), launch
    assert max(launch.grid[0] for launch in launches) > common.MAX_GRID_YZ  # 4M tokens need the 1-D grids


# The suite compiles every distinct recorded launch for both targets (about 110 cubins, 1-2 min on
# 2 cores). KVLAB_COMPILE_COVERING=1 compiles only the covering set (every kernel x dtype, every
# kernel x 16-bit/fp32 x head-dim tile x warps, every code-path switch value: launches.features),
# about 60% of the compile time, for quick local iterations.
COMPILE_ALL = os.environ.get("KVLAB_COMPILE_COVERING", "0") in ("", "0")


@pytest.fixture(scope="module")
def recorded():
    """Every launch tests/kernels/test_kernels.py makes (recorded, not run)."""
    return record(kernel_test_launches())


def test_the_compiled_launches_cover_every_kernel_dtype_tile_and_code_path(recorded):
    assert {launch.kernel for launch in recorded} == {name for _, name in launched_kernels()}
    assert {launch.dtype() for launch in recorded} == {"fp32", "fp16", "bf16"}
    chosen = covering(recorded)
    assert len(chosen) < len(distinct(recorded))
    assert set().union(*map(features, chosen)) == set().union(*map(features, recorded))


def describe(r):
    warps = dict(r.launch.options).get("num_warps")
    return (
        f"sm_{r.arch} {r.launch.name} warps={warps}: {r.registers} registers, {r.stack_bytes} B stack, "
        f"{r.local_bytes} B local, {r.shared_bytes} B shared ({r.seconds} s)"
    )


def test_every_kernel_launch_compiles_for_sm80_and_sm90_without_spills(recorded):
    """Compile errors fail; so do spilled registers (stack or local memory in the cubin's resource
    usage) at head dims <= 128, 16-bit and fp32 alike (head dim 256 is reported, not checked), and
    a launch asking for more shared memory than the architecture gives one block (at any head
    dim: such a launch compiles, then fails on the GPU)."""
    launches = distinct(recorded) if COMPILE_ALL else covering(recorded)
    start = time.perf_counter()
    results = compile_launches(launches)
    print(f"\n{len(results)} (launch, target) pairs compiled in {time.perf_counter() - start:.0f} s")
    print("\n".join(describe(r) for r in results))
    assert len(results) == len(ARCHS) * len(launches)
    failed = [f"sm_{r.arch} {r.launch.name}: {r.error}" for r in results if r.error]
    assert not failed, "\n".join(failed)
    spilled = [
        describe(r)
        for r in results
        if (r.stack_bytes or r.local_bytes) and dict(r.launch.constexprs)["D"] <= 128
    ]
    assert not spilled, "\n".join(spilled)
    too_big = [
        f"{describe(r)}: {r.shared_bytes} B of shared memory > {SHARED_LIMIT[r.arch]}"
        for r in results
        if r.shared_bytes > SHARED_LIMIT[r.arch]
    ]
    assert not too_big, "\n".join(too_big)
