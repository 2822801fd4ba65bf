"""Shared Triton helpers: dot products that survive the interpreter, launch sizing."""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from kvlab.kernels.dispatch import interpreter


@triton.jit
def dot(a, b, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32; fp32 operands in IEEE precision (no TF32 rounding).

    ``UPCAST`` casts both operands to fp32 first (bf16 under the interpreter, see
    :func:`kvlab.kernels.dispatch.dot_upcast`, passed by the launchers).
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")


def pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum) (tile sizes must be powers of two)."""
    return max(minimum, triton.next_power_of_2(max(n, 1)))


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
