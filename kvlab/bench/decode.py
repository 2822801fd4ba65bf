"""``kvlab bench decode``: one decode step's attention over a compressed cache.

Per context length and budget (fraction of the prompt kept per KV head, ragged: each head keeps
between 0.5x and 1.5x the budget) it times

- ``triton``: :func:`kvlab.kernels.tl.decode_attention.ragged_decode_attention_triton` (CUDA only),
- ``reference``: the torch reference (gathers every head's segment, padded to the longest),
- ``sdpa full``: ``scaled_dot_product_attention`` over the uncompressed cache (the baseline a
  compression method must beat),
- ``sdpa padded``: SDPA over the same kept tokens padded to the longest head with a mask (what
  a masked, kvpress-style layout costs),

and reports the Triton kernel's achieved bandwidth (K/V bytes read / time) as a fraction of the
device's peak. Defaults: Llama-3-8B attention shapes (32 query heads, 8 KV heads, head dim 128),
bf16 on CUDA; ``--quick`` runs small shapes in fp32 on CPU in seconds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlab.bench.common import (
    base_parser,
    context_label,
    device_name,
    ms,
    out_of_memory,
    parse_list,
    peak_bandwidth,
    print_table,
    resolve,
    time_call,
    triton_note,
)
from kvlab.kernels.compaction import segment_starts
from kvlab.kernels.decode_attention import ragged_decode_attention_reference
from kvlab.kernels.dispatch import triton_available

HEADERS = [
    "context", "budget", "kept/head", "triton", "reference", "sdpa full", "sdpa padded",
    "triton GB/s", "% of peak", "speedup vs sdpa full",
]  # fmt: skip


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


def padded(flat, starts, lengths, decode, width):
    """``[B, Hkv, width + C, D]``: kept tokens padded to the longest head, then the decode tokens."""
    rows = (starts[..., None] + torch.arange(width, device=flat.device)).clamp(max=flat.shape[0] - 1)
    return torch.cat([flat[rows], decode], dim=2)


def sdpa(query, keys, values, mask=None):
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)


def time_full_cache(query, T, C, opts, device, dtype, gen) -> float | None:
    """SDPA over an uncompressed ``T + C`` cache (None if it does not fit)."""
    B, Hkv, D = opts.batch, opts.kv_heads, opts.head_dim
    try:
        kv = [torch.randn(B, Hkv, T + C, D, generator=gen).to(dtype).to(device) for _ in range(2)]
        return time_call(sdpa, (query, *kv), device, repeat=opts.repeat)
    except out_of_memory():
        return None


def bench_row(query, T, budget, full, opts, device, dtype, gen, peak) -> list[object]:
    """Times of one (context, budget) cell and the Triton kernel's bandwidth."""
    B, H, Hkv, D, C = opts.batch, opts.heads, opts.kv_heads, opts.head_dim, opts.decoded
    keys, values, starts, lengths, dk, dv = ragged_cache(B, Hkv, D, T, budget, C, dtype, device, gen)
    width = int(lengths.max())
    args = (query, keys, values, starts, lengths, dk, dv, C, D**-0.5, width)
    reference = time_call(ragged_decode_attention_reference, args, device, repeat=opts.repeat)
    slot = torch.arange(width + C, device=device)
    visible = (slot < lengths[..., None]) | (slot >= width)  # [B, Hkv, width + C]
    mask = visible.repeat_interleave(H // Hkv, 1)[:, :, None, :]  # [B, H, 1, width + C]
    padded_kv = (padded(keys, starts, lengths, dk, width), padded(values, starts, lengths, dv, width))
    sdpa_padded = time_call(sdpa, (query, *padded_kv, mask), device, repeat=opts.repeat)
    triton_s = bandwidth = None
    if device.type == "cuda" and triton_available():
        from kvlab.kernels.tl.decode_attention import ragged_decode_attention_triton

        triton_s = time_call(ragged_decode_attention_triton, args, device, repeat=opts.repeat)
        bandwidth = (keys.numel() + dk.numel()) * 2 * keys.element_size() / triton_s / 1e9
    return [
        context_label(T),
        f"{budget:.0%}",
        int(lengths.sum()) // (B * Hkv),
        ms(triton_s),
        ms(reference),
        "OOM" if full is None else ms(full),
        ms(sdpa_padded),
        "n/a" if bandwidth is None else f"{bandwidth:.0f}",
        "n/a" if bandwidth is None or peak is None else f"{bandwidth / peak:.0%}",
        "n/a" if triton_s is None or full is None else f"{full / triton_s:.2f}x",
    ]


def run(args: list[str]) -> None:
    p = base_parser("kvlab bench decode", __doc__, "4k,32k,128k", repeat=20)
    p.add_argument("--budgets", default="0.05,0.10,0.25", help="kept fraction of the prompt per KV head")
    p.add_argument("--decoded", type=int, default=16, help="tokens already decoded (decode region)")
    p.add_argument("--peak-gbs", type=float, default=None, help="peak memory bandwidth (GB/s) if not known")
    opts = p.parse_args(args)
    device, dtype = resolve(opts)
    peak = peak_bandwidth(device, opts.peak_gbs)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for T in parse_list(opts.contexts, int):
        query = torch.randn(opts.batch, opts.heads, 1, opts.head_dim, generator=gen).to(dtype).to(device)
        full = time_full_cache(query, T, opts.decoded, opts, device, dtype, gen)
        for budget in parse_list(opts.budgets, float):
            rows.append(bench_row(query, T, budget, full, opts, device, dtype, gen, peak))
    title = (
        f"kvlab bench decode on {device_name(device)}, {dtype}: B={opts.batch}, H={opts.heads}, "
        f"Hkv={opts.kv_heads}, D={opts.head_dim}, {opts.decoded} decoded tokens; "
        f"times in ms (median of {opts.repeat})"
    )
    print_table(title, HEADERS, rows)
    triton_note(device.type == "cuda" and triton_available())
