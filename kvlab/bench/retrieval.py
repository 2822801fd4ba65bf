"""``kvlab bench retrieval``: device-resident KV, bytes fetched per step and decode time of chunk retrieval.

For each prompt length, one decoder layer's attention (shapes of Qwen2.5-VL-7B by default: 28
query heads, 4 KV heads, head dim 128) is compressed by each method at the same on-device budget
(``--budget``, a ratio of the prompt) with kvlab's own pipeline, cache and kernels, then decoded
``--steps`` tokens:

- ``full``: every token kept;
- ``snapkv``: SnapKV eviction (window attention, the window inside the budget);
- ``retrieval``: every KV head retrieves (host K/V, device chunk index, ``budget / 8`` chunks
  fetched per step);
- ``hybridkv``: HybridKV (static heads pruned with the text prior, dynamic heads retrieving).

Reported per method: the KV heads that retrieve, the accelerator-resident prompt KV bytes (kept
entries + chunk index + one step's fetch buffer; the reserved decode region is left out for every
method alike), the bytes held in host memory, the K/V bytes fetched from the host per decode
step, and the decode attention time per token of the layer. The prompt is synthetic: random
keys, values and queries, the last 64 tokens text (the question HybridKV's classifier reads) and
the rest visual; in the first ``--static-share`` of the KV heads a few keys are aligned with the
queries, so those heads concentrate their attention as HybridKV's static heads do (random keys
alone spread attention evenly, which the classifier would call dynamic everywhere). On a
CPU-only machine "device" and "host" are the same memory: the figures there show the bytes and
the compute, not a PCIe transfer.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from kvlab.bench.common import DTYPES, add_threads_option, context_label, device_name, parse_list, print_table
from kvlab.cache.layer import CompressedLayer
from kvlab.compression.context import LayerContext
from kvlab.config.loader import resolve
from kvlab.pipeline import Pipeline

METHODS = ("full", "snapkv", "retrieval", "hybridkv")
TEXT_TAIL = 64  # text tokens at the end of the synthetic prompt (HybridKV's text queries)
SALIENT = 16  # keys aligned with the queries in each "static" head


def parse(args: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvlab bench retrieval", description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="4k,16k,32k", help="prompt lengths (comma separated, k = 1024)")
    p.add_argument("--budget", type=float, default=0.1, help="on-device budget, a ratio of the prompt")
    p.add_argument("--methods", default=",".join(METHODS), help="presets to compare (comma separated)")
    p.add_argument("--heads", type=int, default=28, help="query heads (Qwen2.5-VL-7B: 28)")
    p.add_argument("--kv-heads", type=int, default=4, help="KV heads (Qwen2.5-VL-7B: 4)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--static-share", type=float, default=0.5, help="share of KV heads given salient keys")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed")
    p.add_argument("--repeat", type=int, default=3, help="decode runs per method; the fastest is reported")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    add_threads_option(p)
    return p.parse_args(args)


def synthetic_layer(
    T: int, opts: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> LayerContext:
    """One sample's layer: random K/V and queries (the last ``max(window, text)`` held), visual then text."""
    gen = torch.Generator().manual_seed(T)
    H, Hkv, D = opts.heads, opts.kv_heads, opts.head_dim
    held = TEXT_TAIL
    direction = torch.randn(Hkv, 1, D, generator=gen)
    queries = torch.randn(1, H, held, D, generator=gen) + direction.repeat_interleave(H // Hkv, 0)[None]
    keys = torch.randn(1, Hkv, T, D, generator=gen)
    static = round(opts.static_share * Hkv)
    salient = torch.randperm(T - TEXT_TAIL, generator=gen)[:SALIENT]
    keys[0, :static, salient] += (
        4.0 * direction[:static] / direction[:static].norm(dim=-1, keepdim=True) * D**0.5
    )
    modality = torch.ones(1, T, dtype=torch.long)
    modality[:, :2] = 0
    modality[:, T - TEXT_TAIL :] = 0
    return LayerContext(
        layer_idx=0, num_layers=1, queries=queries.to(device, dtype), keys=keys.to(device, dtype),
        values=torch.randn(1, Hkv, T, D, generator=gen).to(device, dtype),
        valid=torch.ones(1, T, dtype=torch.bool, device=device), modality=modality.to(device),
        scaling=D**-0.5, query_start=T - held,
    )  # fmt: skip


def pipeline_for(method: str, ratio: float) -> Pipeline:
    """Preset ``method`` with its budget set to ``ratio`` of the prompt (its window kept)."""
    if method == "full":
        return Pipeline.from_config(None)
    node = resolve([method], [])["model"]["compression"]
    node["budget"] = {**{k: v for k, v in node["budget"].items() if k != "tokens"}, "ratio": ratio}
    return Pipeline.from_config(node)


def measure(
    ctx: LayerContext, pipeline: Pipeline, opts: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """Compress ``ctx`` with ``pipeline``, decode ``--steps`` tokens ``--repeat`` times; the figures."""
    selection, _ = pipeline.compress(ctx)
    gen = torch.Generator().manual_seed(1)
    B, Hkv, _, D = ctx.keys.shape
    steps = [
        (torch.randn(B, Hkv, 1, D, generator=gen).to(device, ctx.keys.dtype),
         torch.randn(B, Hkv, 1, D, generator=gen).to(device, ctx.keys.dtype),
         torch.randn(B, ctx.num_heads, 1, D, generator=gen).to(device, ctx.keys.dtype))
        for _ in range(opts.steps)
    ]  # fmt: skip
    best, layer = None, None
    for _ in range(opts.repeat):
        layer = CompressedLayer(decode_capacity=opts.steps)
        layer.update(ctx.keys, ctx.values)
        layer.compress(selection)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for k, v, q in steps:
            layer.update(k, v)
            layer.decode_attention(q, ctx.scaling)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = (time.perf_counter() - start) / opts.steps
        best = seconds if best is None else min(best, seconds)
    store = layer.offloaded
    figures = store.sample_figures(0) if store is not None else None
    return {
        "heads": figures["heads"] if figures else 0,
        "device": layer.prompt_kv_bytes() + (store.device_bytes() if store is not None else 0),
        "host": layer.offloaded_bytes(),
        "moved": figures["moved_per_step"] if figures else 0.0,
        "seconds": best,
    }


def run(args: list[str]) -> None:
    opts = parse(args)
    torch.set_num_threads(opts.threads)
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[opts.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    methods = [m.strip() for m in opts.methods.split(",")]
    rows = []
    with torch.no_grad():
        for T in parse_list(opts.contexts, int):
            ctx = synthetic_layer(T, opts, device, dtype)
            full = None
            for method in methods:
                got = measure(ctx, pipeline_for(method, opts.budget), opts, device)
                full = got if method == "full" else full
                ref = full or got
                rows.append([
                    context_label(T), method, f"{got['heads']}/{opts.kv_heads}",
                    f"{got['device'] / 2**20:.2f}", f"{got['device'] / ref['device']:.3f}",
                    f"{got['host'] / 2**20:.2f}", f"{got['moved'] / 2**10:.1f}",
                    f"{got['seconds'] * 1e3:.3f}", f"{ref['seconds'] / got['seconds']:.2f}",
                ])  # fmt: skip
    headers = ["context", "method", "retrieving KV heads", "device KV MiB", "device vs full", "host KV MiB",
               "fetched KiB/step", "decode ms/token", "speedup vs full"]  # fmt: skip
    title = (
        f"kvlab bench retrieval: one decoder layer, {opts.heads}/{opts.kv_heads} heads, dim {opts.head_dim}, "
        f"{str(dtype).replace('torch.', '')}, on-device budget {opts.budget:g} of the prompt, {opts.steps} "
        f"decode steps, {device_name(device)}"
    )
    print_table(title, headers, rows)
