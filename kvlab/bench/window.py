"""``kvlab bench window``: window-attention scores at prefill (SnapKV-style scorers).

Times :func:`kvlab.kernels.window_scores.window_attention_scores_reference` (materialises the
``[B, H, W, T]`` fp32 probabilities, several temporaries of that size) against the two-pass
Triton kernel (``O(H * T)`` extra memory, CUDA only), and reports the peak memory each
allocates beyond its inputs (CUDA) and the size of the fp32 probabilities the reference builds.
Defaults: Llama-3-8B shapes (32 query heads, 8 KV heads, head dim 128), window 32, bf16 on
CUDA; ``--quick`` runs small shapes in fp32 on CPU.
"""

from __future__ import annotations

import torch

from kvlab.bench.common import (
    base_parser,
    context_label,
    device_name,
    ms,
    out_of_memory,
    parse_list,
    print_table,
    resolve,
    time_call,
    triton_note,
)
from kvlab.kernels.dispatch import triton_available
from kvlab.kernels.window_scores import window_attention_scores_reference

MIB = 2**20
HEADERS = [
    "context", "triton", "reference", "speedup", "triton peak MiB", "reference peak MiB",
    "W x T x H fp32 MiB",
]  # fmt: skip


def measure(fn, args, device: torch.device, repeat: int) -> tuple[float | None, float | None]:
    """(median seconds, peak MiB allocated beyond what was live before; None on CPU), None on OOM."""
    try:
        peak = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            fn(*args)
            torch.cuda.synchronize(device)
            peak = (torch.cuda.max_memory_allocated(device) - before) / MIB
        return time_call(fn, args, device, warmup=1, repeat=repeat), peak
    except out_of_memory():
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None, None


def memory_cell(seconds: float | None, mib: float | None) -> str:
    return "OOM" if seconds is None else ("n/a" if mib is None else f"{mib:.0f}")


def run(args: list[str]) -> None:
    p = base_parser("kvlab bench window", __doc__, "8k,32k,128k", repeat=5)
    p.add_argument("--window", type=int, default=32)
    opts = p.parse_args(args)
    device, dtype = resolve(opts)
    B, H, Hkv, D, W = opts.batch, opts.heads, opts.kv_heads, opts.head_dim, opts.window
    has_triton = device.type == "cuda" and triton_available()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for T in parse_list(opts.contexts, int):
        inputs = (
            torch.randn(B, H, W, D, generator=gen).to(dtype).to(device),
            torch.randn(B, Hkv, T, D, generator=gen).to(dtype).to(device),
            torch.ones(B, T, dtype=torch.bool, device=device),
            D**-0.5,
        )
        ref_s, ref_mib = measure(window_attention_scores_reference, inputs, device, opts.repeat)
        tri_s = tri_mib = None
        if has_triton:
            from kvlab.kernels.tl.window_scores import window_attention_scores_triton  # triton: optional

            tri_s, tri_mib = measure(window_attention_scores_triton, inputs, device, opts.repeat)
        rows.append(
            [
                context_label(T),
                ms(tri_s) if has_triton else "n/a",
                "OOM" if ref_s is None else ms(ref_s),
                "n/a" if tri_s is None or ref_s is None else f"{ref_s / tri_s:.1f}x",
                memory_cell(tri_s, tri_mib) if has_triton else "n/a",
                memory_cell(ref_s, ref_mib),
                f"{B * H * W * T * 4 / MIB:.0f}",
            ]
        )
    title = (
        f"kvlab bench window on {device_name(device)}, {dtype}: B={B}, H={H}, Hkv={Hkv}, D={D}, "
        f"window {W}; times in ms (median of {opts.repeat}), memory in MiB"
    )
    print_table(title, HEADERS, rows)
    triton_note(has_triton)
