"""``kvlab bench decode --channels 0.5``: decode attention over kept keys with fewer channels.

The pruned-keys table. Per context and budget (ragged heads, each keeping between 0.5x and 1.5x the
budget, as the kernel table of :mod:`kvlab.bench.decode`), one decode step's attention over:

- ``full cache``: ``scaled_dot_product_attention`` over the uncompressed cache (every token, every
  channel), the baseline;
- ``all channels``: the kept entries with every key channel (the token eviction alone: the torch
  path :func:`~kvlab.kernels.decode_attention.ragged_decode_attention_reference` and, on CUDA, the
  ragged Triton kernel);
- ``keys at K%``: the same entries with each head's keys pruned to ``ceil(K * D)`` random channels
  (:mod:`kvlab.cache.pruned`, ThinK's layout: ``[N, Dk]`` keys, ``[N, D]`` values): the torch path
  (:func:`kvlab.cache.pruned.pruned_decode_attention`, the query's channels gathered per step) and,
  on CUDA, the kernel of :mod:`kvlab.kernels.tl.pruned_attention`.

Timed in interleaved rounds after a warm-up round (the median of ``--repeat``), as ms per step, as
ratios to ``all channels`` on the same path and to the full cache; ``KV KiB``: the kept prompt
entries' bytes (keys, values and the channel index). Defaults: 4k and 32k contexts, 10% kept,
Llama-3-8B attention shapes, bf16 on CUDA.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

from kvlab.bench.common import (
    context_label,
    device_name,
    in_mode,
    interleaved,
    ms,
    out_of_memory,
    parse_list,
    print_table,
    ragged_cache,
    resolve,
    triton_note,
)
from kvlab.cache.pruned import prune_key_channels, pruned_decode_attention
from kvlab.compression.channels import kept_channel_count
from kvlab.kernels.decode_attention import (
    RunViews,
    SegmentRuns,
    ragged_decode_attention_reference,
    reads_in_place,
)
from kvlab.kernels.dispatch import triton_available

HEADERS = [
    "context", "budget", "kept/head", "keys", "KV KiB", "torch", "torch vs all channels", "triton",
    "triton vs all channels", "vs full cache",
]  # fmt: skip


def full_cache_call(query: torch.Tensor, T: int, opts: argparse.Namespace, gen: torch.Generator):
    """SDPA over an uncompressed ``T + decoded`` cache, as a call (None if it does not fit)."""
    B, Hkv, D = opts.batch, opts.kv_heads, opts.head_dim
    try:
        kv = [torch.randn(B, Hkv, T + opts.decoded, D, generator=gen).to(query) for _ in range(2)]
    except out_of_memory():
        return None
    return functools.partial(F.scaled_dot_product_attention, query, *kv, enable_gqa=True)


def channel_rows(query, T, budget, keeps, opts, dtype, gen) -> list[list[object]]:
    """One (context, budget) cell: the kept entries with every channel and with each share of the
    key channels, timed through the torch path and (CUDA) the Triton kernels in interleaved rounds."""
    B, Hkv, D, C = opts.batch, opts.kv_heads, opts.head_dim, opts.decoded
    device = query.device
    keys, values, starts, lengths, dk, dv = ragged_cache(B, Hkv, D, T, budget, C, dtype, device, gen)
    kept = int(lengths.sum()) // (B * Hkv)
    width = int(lengths.max())
    runs = SegmentRuns.of(starts, lengths)  # the cache computes them once per compression
    cuda = device.type == "cuda" and triton_available()
    args = (query, keys, values, starts, lengths, dk, dv, C, D**-0.5, width)
    calls = {("all", "torch"): functools.partial(ragged_decode_attention_reference, *args, runs=runs)}
    if cuda:
        from kvlab.kernels.tl.decode_attention import ragged_decode_attention_triton  # triton: optional, CUDA

        calls[("all", "triton")] = functools.partial(ragged_decode_attention_triton, *args)
    full = full_cache_call(query, T, opts, gen)
    if full is not None:
        calls[("full", "torch")] = full
    sizes = {"all": 2 * keys.nbytes}
    for keep in keeps:
        Dk = kept_channel_count(keep, D)
        channels = torch.rand(B, Hkv, D, generator=gen).argsort(-1)[..., :Dk].sort(-1).values.to(device)
        pruned = prune_key_channels(keys, lengths, channels)
        sizes[keep] = pruned.nbytes + values.nbytes + channels.nbytes
        call = (query, pruned, values, channels, starts, lengths, dk, dv, C, D**-0.5, width)
        # the in-place CPU path reads the run views of the buffers, which the cache keeps
        views = RunViews.of(runs, pruned, values) if reads_in_place(query) else None
        torch_path = functools.partial(pruned_decode_attention, runs=views)
        calls[(keep, "torch")] = in_mode("reference", torch_path, *call)
        if cuda:
            calls[(keep, "triton")] = in_mode("triton", pruned_decode_attention, *call)
    seconds = interleaved(calls, device, opts.repeat)

    def ratio(name: object, path: str) -> str:
        found = seconds.get((name, path))
        return "n/a" if found is None else f"{found / seconds[('all', path)]:.2f}"

    def versus_full(name: object) -> str:
        path = "triton" if cuda else "torch"
        if ("full", "torch") not in seconds:
            return "OOM"
        return f"{seconds[('full', 'torch')] / seconds[(name, path)]:.2f}x"

    rows = [
        [context_label(T), f"{budget:.0%}", kept, "all channels" if name == "all" else f"keys at {name:.0%}",
         f"{sizes[name] / 2**10:.1f}", ms(seconds[(name, "torch")]), ratio(name, "torch"),
         ms(seconds.get((name, "triton"))), ratio(name, "triton"), versus_full(name)]
        for name in ["all", *keeps]
    ]  # fmt: skip
    full_ms = ms(seconds.get(("full", "torch"))) if full is not None else "OOM"
    return [[context_label(T), "100%", T, "full cache (sdpa)", "", full_ms, "", "", "", "1.00x"], *rows]


def run_channels(opts: argparse.Namespace) -> None:
    """The pruned-keys table (``--channels``): per context and budget, decode attention over the kept
    entries with every key channel and with each share of them, against the full cache."""
    device, dtype = resolve(opts)
    dtype = dtype if opts.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    keeps = parse_list(opts.channels, float)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for T in parse_list(opts.contexts, int):
        query = torch.randn(opts.batch, opts.heads, 1, opts.head_dim, generator=gen).to(dtype).to(device)
        for budget in parse_list(opts.budgets, float):
            rows += channel_rows(query, T, budget, keeps, opts, dtype, gen)
    title = (
        f"kvlab bench decode --channels on {device_name(device)}, {dtype}: B={opts.batch}, H={opts.heads}, "
        f"Hkv={opts.kv_heads}, D={opts.head_dim}, {opts.decoded} decoded tokens; times in ms (median of "
        f"{opts.repeat} interleaved rounds); vs full cache: the full cache's time over the row's (the "
        "Triton path's on CUDA)"
    )
    print_table(title, HEADERS, rows)
    triton_note(device.type == "cuda" and triton_available())
