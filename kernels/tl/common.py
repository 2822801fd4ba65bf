"""Shared Triton helpers: constants, dot products that survive the interpreter, launch sizing.

Launch sizing is plain Python (no device query) given a number of parallel slots, so the split
counts and grids a GPU would get are testable on a CPU with an explicit slot count.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from kvlab.kernels.dispatch import interpreter

LOG2E = 1.4426950408889634
# finite "minus infinity" for running maxima (exp2(EMPTY - EMPTY) is 1, not nan); a tl.constexpr,
# because @triton.jit code can read no other kind of global
EMPTY = tl.constexpr(-1.0e30)
MIN_DOT = 16  # tl.dot needs M, N and K >= 16: row tiles and head dims are padded to it
MAX_GRID_YZ = 65535  # CUDA limit of grid dimensions 1 and 2 (dimension 0 allows 2**31 - 1)
MAX_GRID_X = 2**31 - 1


@triton.jit
def dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` accumulated in fp32, with ``tl.dot`` input precision ``PRECISION``.

    ``PRECISION`` comes from :func:`dot_precision`. ``UPCAST`` casts both operands to fp32 first
    (bf16 under the interpreter, see :func:`kvlab.kernels.dispatch.dot_upcast`).
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision for operands of ``dtype``: always ``ieee`` (exact products).

    16-bit operands go to the tensor cores exactly either way. fp32 keeps IEEE products (no
    TF32 rounding): with the stride-1 head dim specialised, 8 warps and no software pipelining
    (:func:`launch_options`) the FMA path compiles without spills on sm_80 and sm_90, whereas
    ``tf32x3`` spilled 64-96 bytes per thread in the window column sums at head dim 96
    (measured on the cubins, ``tests/kernels/test_kernel_compile.py``).
    """
    return "ieee"


def pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum) (tile sizes must be powers of two)."""
    return max(minimum, triton.next_power_of_2(max(n, 1)))


def head_block(head_dim: int) -> int:
    """Tile width over the head dimension: a power of two >= 16 (``tl.dot``'s K), masked past D."""
    return pow2(head_dim, MIN_DOT)


def launch_options(block_d: int, dtype: torch.dtype, logits: int = 0) -> dict[str, int]:
    """``num_warps`` and ``num_stages`` of a program with ``[rows, block_d]`` operand tiles.

    ``logits`` is the size of the program's fp32 logits tile (``rows x keys``). Warps: 2 for
    operand tiles up to 32 wide (4 split a 16 x 16 tile so finely that sm_80 spills), 4 at 64,
    8 from a 128-wide head on; 8 for fp32 operands from 64 wide on (the IEEE dot is scalar
    FMAs, which hold more per thread than the tensor cores' fragments); and at least one warp
    per 1024 logits (32 fp32 values per thread), so a 128-row window tile gets 8 warps at any
    head dim. fp32 runs without software pipelining, whose prefetched tiles spill. Checked on
    the sm_80 and sm_90 cubins by ``tests/kernels/test_kernel_compile.py``: no spills at head dims <= 128.
    """
    warps = 2 if block_d <= 32 else 4 if block_d <= 64 else 8
    if dtype == torch.float32 and block_d >= 64:
        warps = 8
    warps = max(warps, min(8, pow2(logits // 1024)))
    return dict(num_warps=warps, num_stages=1 if dtype == torch.float32 else 3)


def split_size_for(longest: int, programs: int, slots: int, minimum: int, block: int) -> tuple[int, int]:
    """Split-K sizing: ``(tokens per split, number of splits)``.

    Args:
        longest: tokens of the longest sequence a program group walks (prompt + decode).
        programs: programs per split (e.g. ``B * Hkv`` row tiles).
        slots: programs that keep the device busy (:func:`parallel_slots`).
        minimum: fewest tokens per split (below it the partials cost more than they save).
        block: the key tile; the split is a multiple of it.

    The split count fills ``slots`` when ``programs`` alone does not, and never exceeds the
    65535 programs grid dimension 1 allows (splits run on dimension 1).
    """
    wanted = max(1, -(-slots // max(programs, 1)))
    split = max(minimum, -(-longest // wanted), -(-longest // MAX_GRID_YZ))
    split = -(-split // block) * block
    return split, max(1, -(-longest // split))


def check_grid(grid: tuple[int, ...]) -> tuple[int, ...]:
    """``grid`` if CUDA can launch it (dimension 0 < 2**31, dimensions 1 and 2 <= 65535)."""
    limits = (MAX_GRID_X, MAX_GRID_YZ, MAX_GRID_YZ)
    if any(n > limit for n, limit in zip(grid, limits, strict=False)):
        raise ValueError(f"grid {grid} exceeds the CUDA launch limits {limits[: len(grid)]}")
    return grid


@cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def parallel_slots(device: torch.device) -> int:
    """Programs that keep the device busy: 2 per streaming multiprocessor (4 on the interpreter).

    Used to size split-K grids so that a small batch of long heads still fills the GPU.
    """
    if device.type != "cuda" or interpreter():
        return 4
    return 2 * _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
