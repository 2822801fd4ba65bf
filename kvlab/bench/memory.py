"""``kvlab bench memory``: KV bytes and decode time of ragged per-head budgets vs the full cache vs masking.

For each prompt length and method (AdaKV and SparseMM head budgets by default, at an average
budget of ``--budget`` tokens per head) on a built-in model, this runs kvlab's prefill ->
compress -> greedy decode and reports what ``CompressedCache.kv_bytes()`` allocates and the
decode time per step, against

- ``full``: kvlab with no compression (the same code path, every token kept);
- ``masked``: the same kept tokens held the way kvpress holds AdaKV's selection: full-size
  K/V buffers (a transformers ``DynamicCache``) with the evicted entries hidden by an attention
  mask at decode. Its bytes are the full cache's plus the mask.

The prompt is seeded random token ids (memory and time do not depend on the words). SparseMM
needs visual-head scores; the bench uses seeded synthetic scores skewed like real ones (a few
heads hold most of the mass), since it measures memory, not quality.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch

import kvlab
from kvlab.bench.common import add_threads_option, context_label, parse_list, print_table
from kvlab.calibration.synthetic import synthetic_visual_heads
from kvlab.engine.masking import MASKS, load_masked_model


def parse(args: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvlab bench memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-qwen2", help="built-in model (random weights are fine)")
    p.add_argument("--contexts", default="2k,8k,32k", help="prompt lengths (comma separated, k = 1024)")
    p.add_argument("--budget", type=int, default=128, help="average tokens per head (window included)")
    p.add_argument("--methods", default="adakv,sparsemm", help="presets with ragged head budgets")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3, help="decode runs per method; the fastest is reported")
    add_threads_option(p)
    return p.parse_args(args)


def pipeline_for(method: str, budget: int, info: Any, directory: str) -> kvlab.Pipeline:
    """Preset ``method`` at ``budget`` tokens per head (SparseMM: seeded synthetic visual heads)."""
    overrides: dict[str, Any] = {"budget.tokens": budget}
    head = kvlab.compression_config(method).get("allocate", {}).get("head", {})
    if head.get("name") == "sparsemm":
        overrides["allocate.head.artefact"] = synthetic_visual_heads(info, directory)
    return kvlab.load_pipeline(method, overrides)


def prompt_batch(loaded: Any, T: int, batch: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(T)
    vocab = loaded.model.config.get_text_config().vocab_size
    ids = torch.randint(100, vocab, (batch, T), generator=gen)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "modality": torch.zeros_like(ids),
        "model_inputs": {},
    }


def masked_decode(
    model_name: str, batch: dict[str, Any], reports: list[Any], tokens: list[list[int]], steps: int
):
    """(bytes, seconds per step) of the masked baseline for the kept sets in ``reports``."""
    from transformers import DynamicCache

    B, T = batch["input_ids"].shape
    loaded = load_masked_model(model_name, reports, T)
    cache = DynamicCache()
    with torch.no_grad():
        loaded.model(input_ids=batch["input_ids"], past_key_values=cache, use_cache=True, logits_to_keep=1)
        start = time.perf_counter()
        for step in range(steps):
            token = torch.tensor([[row[min(step, len(row) - 1)]] for row in tokens])
            pos = torch.full((B, 1), T + step)
            loaded.model(input_ids=token, position_ids=pos, past_key_values=cache, use_cache=True)
        seconds = (time.perf_counter() - start) / steps
    kv = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
    return kv + sum(m.numel() for m in MASKS.values()), seconds


def fastest(loaded: Any, pipe: Any, batch: dict[str, Any], opts: argparse.Namespace) -> tuple[Any, float]:
    """(result, seconds per decode step) of the fastest of ``opts.repeat`` runs (one decode per run)."""
    from kvlab.engine.generation import generate

    best = None
    for _ in range(opts.repeat):
        result = generate(loaded, pipe, batch, max_new_tokens=opts.steps + 1)
        if best is None or result.decode_seconds < best.decode_seconds:
            best = result
    return best, best.decode_seconds / opts.steps


def run(args: list[str]) -> None:
    opts = parse(args)
    torch.set_num_threads(opts.threads)
    loaded = kvlab.load_model(opts.model)  # attention routed through kvlab
    info = loaded.info
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for T in parse_list(opts.contexts, int):
            batch = prompt_batch(loaded, T, opts.batch)
            full, full_step = fastest(loaded, kvlab.load_pipeline("full"), batch, opts)
            rows.append(
                [
                    context_label(T),
                    "full",
                    T,
                    T,
                    f"{full.kv_bytes_allocated / 2**20:.2f}",
                    "1.000",
                    f"{full_step * 1e3:.2f}",
                    "1.00",
                    "",
                ]
            )
            for method in opts.methods.split(","):
                pipe = pipeline_for(method, opts.budget, info, directory)
                result, step = fastest(loaded, pipe, batch, opts)
                kept = result.kept.float()
                masked = [masked_decode(opts.model, batch, result.reports, result.tokens, opts.steps)
                          for _ in range(opts.repeat)]  # fmt: skip
                masked_bytes, masked_step = min(masked, key=lambda m: m[1])
                rows.append(
                    [
                        context_label(T),
                        method,
                        f"{kept.mean():.1f}",
                        f"{int(kept.min())}..{int(kept.max())}",
                        f"{result.kv_bytes_allocated / 2**20:.2f}",
                        f"{result.kv_bytes_allocated / full.kv_bytes_allocated:.3f}",
                        f"{step * 1e3:.2f}",
                        f"{full_step / step:.2f}",
                        f"{masked_bytes / 2**20:.2f} MiB, {masked_step * 1e3:.2f} ms",
                    ]
                )
    headers = ["context", "method", "kept/head mean", "kept/head range", "kv MiB", "kv vs full",
               "decode ms/step", "decode speedup vs full", "masked: kv, ms/step"]  # fmt: skip
    title = (
        f"kvlab bench memory: {opts.model} ({info.num_layers} layers, "
        f"{info.num_heads}/{info.num_kv_heads} heads, "
        f"dim {info.head_dim}), batch {opts.batch}, average budget {opts.budget} tokens/head, "
        f"{opts.steps} decode steps, {torch.get_num_threads()} CPU threads"
    )
    print_table(title, headers, rows)
