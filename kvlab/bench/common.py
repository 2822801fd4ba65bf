"""Shared bench helpers: timing (interleaved rounds, kernel modes), device peak bandwidth, table
printing, random ragged caches."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from kvlab.kernels.dispatch import kernel_mode
from kvlab.kernels.types import segment_starts

# Peak HBM/GDDR bandwidth in GB/s from the vendors' data sheets, matched by substring of
# torch.cuda.get_device_name(); the first match wins, so specific names come first.
PEAK_GBS: list[tuple[str, float]] = [
    ("GH200", 4000.0),  # the 96 GB HBM3 part (its name contains "H200")
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM5 (named "H100 80GB HBM3")
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("RTX 4090", 1008.0),
    ("V100", 900.0),
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_name(device: torch.device) -> str:
    """Human-readable device name (the GPU's name, or ``CPU (n threads)``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


def peak_bandwidth(device: torch.device, override: float | None = None) -> float | None:
    """Peak memory bandwidth in GB/s (``override`` if given; None when unknown or on CPU)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((gbs for key, gbs in PEAK_GBS if key in name), None)


def time_call(
    fn: Callable[..., object], args: Sequence[object], device: torch.device, warmup: int = 3, repeat: int = 10
) -> float:
    """Median wall time of ``fn(*args)`` in seconds (CUDA-synchronised on GPU)."""
    for _ in range(warmup):
        fn(*args)
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def out_of_memory() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "did not fit" (CUDA OOM, host allocation failure)."""
    return (torch.cuda.OutOfMemoryError, MemoryError)


def ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.3f}"


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A GitHub-markdown table (pastes straight into docs/benchmarks.md)."""
    print(f"\n{title}\n")
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---" for _ in headers) + "|")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def parse_list(text: str, kind: type) -> list:
    """``"4096,32768"`` -> ``[4096, 32768]`` (``k`` suffix allowed for integers: ``32k``)."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        if kind is int and item.endswith("k"):
            out.append(int(item[:-1]) * 1024)
        else:
            out.append(kind(item))
    return out


def base_parser(prog: str, doc: str, contexts: str | None, repeat: int | None) -> argparse.ArgumentParser:
    """Options every attention bench shares (shapes default to Llama-3-8B's attention).

    A bench with several scenarios passes None for ``contexts`` / ``repeat`` and fills in each
    scenario's default after parsing.
    """
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("--contexts", default=contexts, help="prompt lengths (comma separated, k = 1024)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--repeat", type=int, default=repeat, help="timed calls (the median is reported)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--quick", action="store_true", help="CPU-sized run: 1k/4k contexts, 8/2 heads, dim 64")
    return p


def resolve(opts: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """Apply ``--quick`` to ``opts`` and pick the device and dtype."""
    if opts.quick:
        opts.contexts, opts.heads, opts.kv_heads, opts.head_dim = "1k,4k", 8, 2, 64
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return device, DTYPES[opts.dtype or ("bfloat16" if device.type == "cuda" else "float32")]


def context_label(T: int) -> str:
    return f"{T // 1024}k" if T % 1024 == 0 else str(T)


def triton_note(has_triton: bool) -> None:
    if not has_triton:
        print("\nThe Triton columns need a CUDA device (on CPU the kernels are only interpreter-checked).")


def add_threads_option(parser: argparse.ArgumentParser, default: int = 1) -> None:
    """``--threads`` (default 1): CPU intra-op threads; apply with ``torch.set_num_threads``.

    On a shared machine multi-threaded small ops stall on busy cores, so one thread gives the
    steadier figures.
    """
    parser.add_argument("--threads", type=int, default=default, help=f"CPU threads (default {default})")


def ragged_cache(B, Hkv, D, T, budget, decoded, dtype, device, gen):
    """Flat kept K/V with per-head lengths in [0.5, 1.5] x budget x T, plus a decode region."""
    mean = max(1, round(budget * T))
    lengths = (mean * (0.5 + torch.rand(B, Hkv, generator=gen))).round().long().clamp(1, T)
    N = int(lengths.sum())

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    lengths = lengths.to(device)
    starts = segment_starts(lengths)
    return randn(N, D), randn(N, D), starts, lengths, randn(B, Hkv, decoded, D), randn(B, Hkv, decoded, D)


def interleaved(
    calls: dict[tuple[str, str], Callable[[], object]], device: torch.device, repeat: int
) -> dict[tuple[str, str], float]:
    """Median seconds of each call, timed in ``repeat`` rounds that run every call once in turn
    (after a warm-up round), so a load change on a shared machine hits them alike."""
    times: dict[tuple[str, str], list[float]] = {name: [] for name in calls}
    for round_ in range(repeat + 1):
        for name, call in calls.items():
            seconds = time_call(call, (), device, warmup=0, repeat=1)
            if round_:
                times[name].append(seconds)
    return {name: statistics.median(values) for name, values in times.items()}


def in_mode(mode: str, fn: Callable[..., torch.Tensor], *args: object) -> Callable[[], torch.Tensor]:
    """``fn(*args)`` run under kernel mode ``mode``."""

    def call() -> torch.Tensor:
        with kernel_mode(mode):
            return fn(*args)

    return call
