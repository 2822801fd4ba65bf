"""Which implementation a kernel call runs: the Triton kernel or its torch reference.

Every kernel module exposes ``<name>_reference`` (pure torch, runs anywhere), ``<name>_triton``
(the Triton kernel) and a dispatcher ``<name>`` with the same signature that asks
:func:`use_triton` which one to run. The mode belongs to the code that runs inside
:func:`kernel_mode` (a :class:`contextvars.ContextVar`, so one run's mode never leaks into
another's):

- ``auto`` (default): Triton when triton is importable and the tensors are on a CUDA device,
  the reference otherwise (CPU tensors, no triton installed).
- ``reference``: always the torch reference (debugging, numerics comparisons).
- ``triton``: always the Triton kernel. On CPU tensors that only works under the Triton
  interpreter (``TRITON_INTERPRET=1`` set before triton is imported), which is how the tests
  run the kernels without a GPU.

``KVLabModule(kernels=...)`` (YAML ``model.kernels``) runs its prediction steps inside
``kernel_mode(kernels)``; tests use :func:`kernel_mode` too (or :func:`set_mode`, which sets the
mode of the current context, for an interactive session). :data:`CALLS` counts which path each
kernel took, so a run (or a test) can check that the kernels it expects actually ran: a
diagnostic counter, only ever added to, never read to decide anything.
"""

from __future__ import annotations

import importlib.util
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from typing import Literal, get_args

import torch

from kvlab.config.errors import ConfigError

Mode = Literal["auto", "reference", "triton"]
MODES: tuple[str, ...] = get_args(Mode)

# (kernel name, "triton" | "reference") -> number of calls in this process
CALLS: Counter[tuple[str, str]] = Counter()

_MODE: ContextVar[Mode] = ContextVar("kvlab_kernel_mode", default="auto")


def check_mode(mode: str) -> Mode:
    """``mode`` if it is one of :data:`MODES`; :class:`ConfigError` naming ``model.kernels`` otherwise."""
    if mode not in MODES:
        raise ConfigError(
            f"model.kernels must be one of {', '.join(MODES)}, got '{mode}'. Use 'auto' (Triton on "
            "CUDA tensors, the torch reference elsewhere) unless you are debugging a kernel."
        )
    return mode  # type: ignore[return-value]


def set_mode(mode: Mode) -> None:
    """Set the dispatch mode of the current context (an interactive session, a test); kvlab's own
    runs use :func:`kernel_mode`, which restores the previous mode."""
    _MODE.set(check_mode(mode))


def get_mode() -> Mode:
    """The current dispatch mode."""
    return _MODE.get()


@contextmanager
def kernel_mode(mode: Mode) -> Iterator[None]:
    """Run a block under ``mode`` and restore the previous mode afterwards."""
    token = _MODE.set(check_mode(mode))
    try:
        yield
    finally:
        _MODE.reset(token)


@cache
def triton_available() -> bool:
    """Whether triton can be imported (it is optional at runtime: the references need torch only)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install (e.g. no driver libraries) means: use the reference
        return False
    return True


def interpreter() -> bool:
    """Whether Triton kernels run in the interpreter (``TRITON_INTERPRET=1``: numpy on the host)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(name: str, *tensors: torch.Tensor) -> bool:
    """Decide the path of one call of kernel ``name`` on ``tensors`` and count it in :data:`CALLS`."""
    mode = _MODE.get()
    if mode == "reference":
        chosen = False
    elif mode == "triton":
        if not triton_available():
            raise RuntimeError(
                f"kernel mode 'triton' requested for {name} but triton is not installed; "
                "install it (pip install triton) or use kernels: auto / reference"
            )
        if not interpreter() and not all(t.is_cuda for t in tensors):
            raise RuntimeError(
                f"kernel mode 'triton' requested for {name} on CPU tensors: Triton kernels need a CUDA "
                "device, or TRITON_INTERPRET=1 set before triton is imported (slow, for tests)"
            )
        chosen = True
    else:
        chosen = all(t.is_cuda for t in tensors) and triton_available()
    CALLS[(name, "triton" if chosen else "reference")] += 1
    return chosen


@contextmanager
def launch_device(tensor: torch.Tensor) -> Iterator[None]:
    """Make ``tensor``'s CUDA device the current one for the block (a no-op on the current device
    and off CUDA).

    Triton launches a kernel on the *current* CUDA device, whatever device its arguments are on:
    a layer on ``cuda:1`` (a model placed there, or spread by a ``device_map``) would otherwise be
    launched on ``cuda:0``. Every dispatcher calls its implementation inside this.
    """
    index = tensor.device.index if tensor.is_cuda else None
    if index is not None and index != torch.cuda.current_device():
        with torch.cuda.device(index):
            yield
    else:
        yield


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether kernels must cast ``tl.dot`` operands of ``dtype`` to fp32 first.

    The Triton 3.x interpreter computes ``tl.dot`` on bf16 operands wrongly (it multiplies the
    raw 16-bit storage); natively bf16 goes to the tensor cores with fp32 accumulation. Under
    the interpreter bf16 operands are therefore upcast (products of 16-bit numbers are exact in
    fp32 either way, so only the P.V rounding differs from the native path).
    """
    return interpreter() and dtype == torch.bfloat16
