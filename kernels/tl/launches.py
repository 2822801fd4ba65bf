"""Record kernel launches and compile them for real NVIDIA targets without a GPU.

The interpreter (``TRITON_INTERPRET=1``) runs kernels in numpy and skips what the GPU compiler
checks (global variables, ``tl.dot`` shapes, register pressure). Triton's compiler itself needs
no GPU: ``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))``
goes down to a cubin with the ``ptxas`` the wheel ships, and ``cuobjdump`` reads its resource
usage (registers, stack and local memory: a non-zero stack means spilled registers).

- :func:`record_launches` wraps every launched kernel (:data:`MODULES`' ``LAUNCHED``) and
  records each launch's grid, argument types, constexprs and options (``num_warps``), running
  the kernel or not.
- :func:`distinct` keeps one launch per compilation; :func:`covering` picks fewer launches that
  still include every (kernel, dtype), every (kernel, 16-bit or fp32, head-dim tile, warps),
  every value of every boolean code-path switch and every code width (:func:`features`).
- :func:`compile_launches` compiles launches for the given targets without the interpreter, one
  subprocess per target running side by side (``python -m kvlab.kernels.tl.launches``), and
  returns one :class:`Compiled` per (launch, target).

``tests/kernels/test_kernel_compile.py`` records the launches of the kernel tests and compiles the
distinct launches (the covering set with ``KVLAB_COMPILE_COVERING=1``) for sm_80 and sm_90.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from typing import Any

MODULES = (
    "kvlab.kernels.tl.decode_attention",
    "kvlab.kernels.tl.packed_attention",
    "kvlab.kernels.tl.rotated_attention",
    "kvlab.kernels.tl.pruned_attention",
    "kvlab.kernels.tl.window_scores",
    "kvlab.kernels.tl.compaction",
    "kvlab.kernels.tl.merge",
    "kvlab.kernels.tl.retrieval",
)
ARCHS = (80, 90)
#: the most shared memory one block may use (bytes, the opt-in maximum): A100 163 KiB, H100 227 KiB
#: (CUDA C Programming Guide, "Compute Capabilities"); a launch asking for more fails at run time
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}


@dataclass(frozen=True)
class Launch:
    """One kernel launch: what the compiler needs (the grid is kept for the limit checks).

    ``signature`` maps every argument to its Triton type (``*bf16``, ``i32``, ``fp32``,
    ``constexpr``); ``constexprs`` holds the compile-time values; ``options`` the launch options
    (``num_warps``, ``num_stages``).
    """

    module: str
    kernel: str
    grid: tuple[int, ...]
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    options: tuple[tuple[str, int], ...]
    aligned: tuple[str, ...] = ()  # arguments specialised as divisible by 16

    def compile_key(self) -> tuple:
        """What makes two launches one compilation (everything but the grid)."""
        return (self.module, self.kernel, self.signature, self.constexprs, self.options, self.aligned)

    @property
    def name(self) -> str:
        consts = ",".join(f"{k}={v}" for k, v in self.constexprs)
        types = sorted({t for _, t in self.signature if t.startswith("*fp") or t.startswith("*bf")})
        return f"{self.kernel}[{'/'.join(types)}]({consts})"

    def dtype(self) -> str:
        """The data's floating dtype: the 16-bit one among the tensor arguments, else fp32.

        (fp32 scratch tensors, e.g. split-K partials, sit beside 16-bit data in some kernels.)
        """
        types = {t[1:] for _, t in self.signature if t in ("*fp32", "*fp16", "*bf16")}
        return next(t for t in ("fp16", "bf16", "fp32") if t in types)


@dataclass(frozen=True)
class Compiled:
    """Result of compiling one launch for ``sm_<arch>``: an error, or the cubin's resource usage."""

    launch: Launch
    arch: int
    error: str | None = None
    registers: int = 0
    stack_bytes: int = 0  # per thread; > 0 means spilled registers
    local_bytes: int = 0
    shared_bytes: int = 0  # per block, what the launch asks of the SM's shared memory
    seconds: float = 0.0  # compile time (near 0 when Triton's cache had it)


def constexpr_names(kernel: Any) -> list[str]:
    """Parameters of a ``@triton.jit`` kernel (jitted or interpreted) annotated ``tl.constexpr``."""
    params = inspect.signature(kernel.fn).parameters.values()
    return [p.name for p in params if "constexpr" in str(p.annotation)]


def launched_kernels() -> dict[tuple[str, str], Any]:
    """``(module, kernel name) -> kernel`` for every kernel a launcher starts."""
    found = {}
    for module in MODULES:
        mod = importlib.import_module(module)
        found.update({(module, k.fn.__name__): k for k in mod.LAUNCHED})
    return found


def _specialise(kernel: Any, name: str, value: object) -> tuple[str, Any]:
    """``(type, "D" | 1 | None)`` as Triton's launcher specialises an argument.

    Integers equal to 1 become constants and integers or pointers divisible by 16 get the
    ``tt.divisibility`` attribute (``"D"``), unless the kernel lists the argument in
    ``do_not_specialize``.
    """
    # triton (optional) is imported where it is used: the compile worker starts without it loaded
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    fixed = name in (getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()) or name in {
        kernel.arg_names[i] if isinstance(i, int) else i
        for i in getattr(kernel, "do_not_specialize", ()) or ()
    }
    kind, spec = native_specialize_impl(BaseBackend, value, False, not fixed, not fixed)
    return ("constexpr", value) if kind == "constexpr" else (kind, spec)


def _launch(module: str, kernel: Any, grid: tuple[int, ...], args: tuple, kwargs: dict) -> Launch:
    names = kernel.arg_names
    consts = set(constexpr_names(kernel))
    bound = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    signature, constexprs, aligned = [], [], []
    for name in names:
        if name in consts:
            kind, spec = "constexpr", bound[name]
        else:
            kind, spec = _specialise(kernel, name, bound[name])
        signature.append((name, kind))
        if kind == "constexpr":
            constexprs.append((name, spec))
        elif spec == "D":
            aligned.append(name)
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
    return Launch(
        module, kernel.fn.__name__, tuple(grid), tuple(signature), tuple(constexprs), options, tuple(aligned)
    )


@contextmanager
def record_launches(execute: bool = True) -> Iterator[list[Launch]]:
    """Record every kernel launch in the block (and run it only if ``execute``)."""
    launches: list[Launch] = []
    kernels = launched_kernels()

    def recorder(module: str, kernel: Any, run: Callable) -> Callable:
        def wrapped(*args, grid, warmup, **kwargs):
            launches.append(_launch(module, kernel, grid, args, kwargs))
            return run(*args, grid=grid, warmup=warmup, **kwargs) if execute else None

        return wrapped

    for (module, _), kernel in kernels.items():
        kernel.run = recorder(module, kernel, kernel.run)  # kernel[grid](...) calls self.run
    try:
        yield launches
    finally:
        for kernel in kernels.values():
            del kernel.run


def distinct(launches: Sequence[Launch]) -> list[Launch]:
    """One launch per compilation (first seen), in order."""
    seen: dict[tuple, Launch] = {}
    for launch in launches:
        seen.setdefault(launch.compile_key(), launch)
    return list(seen.values())


def features(launch: Launch) -> set[tuple]:
    """What a compilation of ``launch`` checks, as :func:`covering` counts it.

    ``(kernel, "dtype", dtype)``, ``(kernel, "tile", "16-bit" | "fp32", BLOCK_D, num_warps)``
    (what decides the register use, hence spills) and ``(kernel, switch, value)`` for every
    boolean constexpr (a code path), except ``UPCAST`` (interpreter only, always off on a GPU),
    and for every code width (``*_BITS``: each unpacks its codes by other code).
    """
    consts, options = dict(launch.constexprs), dict(launch.options)
    width = "fp32" if launch.dtype() == "fp32" else "16-bit"
    found = {("dtype", launch.dtype()), ("tile", width, consts.get("BLOCK_D"), options.get("num_warps"))}
    found |= {
        (k, v) for k, v in consts.items() if (isinstance(v, bool) and k != "UPCAST") or k.endswith("_BITS")
    }
    return {(launch.kernel, *f) for f in found}


def covering(launches: Sequence[Launch]) -> list[Launch]:
    """A small subset of ``launches`` with all their :func:`features` (greedy set cover).

    Picks, while a feature is missing, the launch that adds the most missing ones (the first
    such in ``launches``); returned in the order of ``launches``.
    """
    launches = distinct(launches)
    missing = set().union(*(features(launch) for launch in launches))
    chosen: set[int] = set()
    while missing:
        best = max(range(len(launches)), key=lambda i: (len(features(launches[i]) & missing), -i))
        chosen.add(best)
        missing -= features(launches[best])
    return [launch for i, launch in enumerate(launches) if i in chosen]


_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)")


def _compile_one(item: tuple[Launch, int]) -> Compiled:
    """Compile ``launch`` for ``sm_<arch>`` (no interpreter: run in the worker subprocess)."""
    # triton (optional): imported in the compile worker, after its environment is set
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launch, arch = item
    start = time.perf_counter()
    kernel = importlib.import_module(launch.module).__dict__[launch.kernel]
    signature = dict(launch.signature)
    # what a GPU launch gets: UPCAST (bf16 dot operands cast to fp32) is for the interpreter only
    constexprs = {k: (False if k == "UPCAST" else v) for k, v in launch.constexprs}
    attrs = {
        (i,): [["tt.divisibility", 16]] for i, (n, _) in enumerate(launch.signature) if n in launch.aligned
    }
    try:
        src = ASTSource(kernel, signature, constexprs, attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))
    except Exception as error:  # the compiler's message is the test's failure message
        return Compiled(launch, arch, error=f"{type(error).__name__}: {error}"[:2000])
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", cubin.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    reg, stack, local = (int(x) for x in _RESOURCES.search(usage).groups())
    seconds = round(time.perf_counter() - start, 2)
    shared = int(compiled.metadata.shared)
    return Compiled(
        launch,
        arch,
        registers=reg,
        stack_bytes=stack,
        local_bytes=local,
        shared_bytes=shared,
        seconds=seconds,
    )


def _to_launch(data: dict) -> Launch:
    fields = {
        k: tuple(tuple(x) if isinstance(x, list) else x for x in v)
        for k, v in data.items()
        if k != "module" and k != "kernel"
    }
    return Launch(data["module"], data["kernel"], **fields)


def _stop(process: subprocess.Popen) -> None:
    """Kill ``process`` if it still runs (a timeout or a failed sibling)."""
    if process.poll() is None:
        process.kill()
        process.wait()


def compile_launches(
    launches: Sequence[Launch], archs: Sequence[int] = ARCHS, timeout: float = 600
) -> list[Compiled]:
    """Compile every distinct launch for every ``sm_<arch>`` without the interpreter.

    One subprocess per arch, all running at once (two targets: two cores busy); each imports
    Triton and the kernels once and compiles its launches one after the other.

    Args:
        launches: launches to compile (duplicates are compiled once).
        archs: compute capabilities, e.g. ``(80, 90)``.
        timeout: seconds before the subprocesses are stopped.

    Returns:
        One :class:`Compiled` per (distinct launch, arch), launches in order, arch fastest.
    """
    todo = distinct(launches)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    by_arch = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        source = os.path.join(tmp, "launches.json")
        with open(source, "w") as f:
            json.dump([asdict(launch) for launch in todo], f)
        runs = {}
        for arch in archs:
            out = os.path.join(tmp, f"sm_{arch}.json")
            log = stack.enter_context(open(os.path.join(tmp, f"sm_{arch}.log"), "w+"))
            command = [sys.executable, "-m", __name__, source, str(arch), out]
            process = subprocess.Popen(command, stdout=log, stderr=log, env=env)
            stack.callback(_stop, process)
            runs[arch] = (process, out, log)
        for arch, (process, out, log) in runs.items():
            if process.wait(timeout=timeout) != 0:
                log.seek(0)
                raise RuntimeError(f"the sm_{arch} compile subprocess failed:\n{log.read()[-4000:]}")
            with open(out) as f:
                by_arch[arch] = [
                    Compiled(_to_launch(r["launch"]), **{k: v for k, v in r.items() if k != "launch"})
                    for r in json.load(f)
                ]
    return [by_arch[arch][i] for i in range(len(todo)) for arch in archs]


def main(argv: Sequence[str]) -> None:
    """``python -m kvlab.kernels.tl.launches LAUNCHES.json ARCH OUT.json``: compile for ``sm_ARCH``."""
    source, arch, out = argv
    with open(source) as f:
        launches = [_to_launch(launch) for launch in json.load(f)]
    for module in {launch.module for launch in launches}:
        importlib.import_module(module)
    results = [_compile_one((launch, int(arch))) for launch in launches]
    with open(out, "w") as f:
        json.dump([asdict(r) for r in results], f)


if __name__ == "__main__":
    main(sys.argv[1:])
