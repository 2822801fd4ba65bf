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

``kvlab bench memory --prefill`` measures something else: the peak process memory (resident set
size high-water mark, as runs report it on CPU) of one prefill of a padded batch of long prompts
(sample ``i`` has ``floor(T * (1 - spread * i))`` tokens, so every sample but the first is
padded), compression included, for each prompt length, batch size and method (``--methods``, at
``--budget``: ``full,snapkv,finch --budget 0.1`` gives the full cache, SnapKV and Finch at 10% on
the same prompts, with their peaks' ratios to the full cache's). A method that scores with the
question (a progressive prefill with ``question: true``, Finch) reads the last ``--question``
tokens of each prompt as its question: the rest is its context, prefilled chunk by chunk with
the question appended, then the question on top (as the ``query_aware`` protocol runs it); the
other methods prefill the same tokens in one forward. Each point runs in a fresh Python process
(the high-water mark is per process), which the bench kills when its resident set passes
``--rss-limit`` GiB, so a point that would exhaust the machine is reported, not run to the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil
import torch
from transformers import DynamicCache

import kvlab
from kvlab.bench.common import add_threads_option, context_label, parse_list, print_table
from kvlab.calibration.synthetic import synthetic_visual_heads
from kvlab.config.errors import ConfigError
from kvlab.engine.generation import RunOptions, extend, generate, prefill
from kvlab.engine.masking import load_masked_model
from kvlab.engine.prefill_plan import check_prefill_chunk
from kvlab.engine.prompt_split import context_batch
from kvlab.metrics.cost import process_peak_rss_bytes, process_rss_bytes
from kvlab.models.base import PAD, Batch


def parse(args: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvlab bench memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-qwen2", help="built-in model (random weights are fine)")
    p.add_argument("--contexts", default="2k,8k,32k", help="prompt lengths (comma separated, k = 1024)")
    p.add_argument(
        "--budget",
        default=None,
        help="tokens per head (window included; default 128), or a share of the prompt "
        "below 1 (0.1); --prefill: default each preset's own, never applied to full",
    )
    p.add_argument("--methods", default=None,
                   help="presets (comma separated): with ragged head budgets (default adakv,sparsemm); "
                        "--prefill: any, full included (default snapkv)")  # fmt: skip
    p.add_argument("--steps", type=int, default=16, help="decode steps timed")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3, help="decode runs per method; the fastest is reported")
    p.add_argument("--prefill", action="store_true", help="peak process memory of a padded prefill instead")
    p.add_argument("--batches", default="1,4", help="--prefill: batch sizes (comma separated)")
    p.add_argument("--spread", type=float, default=0.125, help="--prefill: sample i has T * (1 - spread * i)")
    p.add_argument(
        "--question", type=int, default=64, help="--prefill: Finch's question is each prompt's last N tokens"
    )
    p.add_argument("--prefill-chunk", type=int, default=None, help="--prefill: model.prefill_chunk")
    p.add_argument("--rss-limit", type=float, default=12.0, help="--prefill: kill a point past this many GiB")
    add_threads_option(p)
    return p.parse_args(args)


def budget_overrides(budget: str | None) -> dict[str, Any]:
    """The pipeline overrides of ``--budget``: an integer >= 1 is tokens per head, a number in
    (0, 1) a share of the prompt; None: none.

    Raises:
        ConfigError: any other value.
    """
    if budget is None:
        return {}
    try:
        value = float(budget)
    except ValueError:
        value = float("nan")
    if value.is_integer() and value >= 1:
        return {"budget.tokens": int(value)}
    if 0 < value < 1:
        return {"budget.ratio": value}
    raise ConfigError(
        f"--budget {budget}: give tokens per head (an integer >= 1, e.g. 128) or a share of the "
        "prompt between 0 and 1 (e.g. 0.1)."
    )


def pipeline_for(method: str, budget: str, info: Any, directory: str) -> kvlab.Pipeline:
    """Preset ``method`` at ``budget`` (:func:`budget_overrides`; SparseMM: seeded synthetic visual heads)."""
    overrides = budget_overrides(budget)
    head = kvlab.compression_config(method).get("allocate", {}).get("head", {})
    if head.get("name") == "sparsemm":
        overrides["allocate.head.artefact"] = synthetic_visual_heads(info, directory)
    return kvlab.load_pipeline(method, overrides)


def prompt_batch(loaded: Any, T: int, batch: int) -> Batch:
    gen = torch.Generator().manual_seed(T)
    vocab = loaded.model.config.get_text_config().vocab_size
    ids = torch.randint(100, vocab, (batch, T), generator=gen)
    return Batch(ids, torch.ones_like(ids), torch.zeros_like(ids))


def masked_decode(model_name: str, batch: Batch, reports: list[Any], tokens: list[list[int]], steps: int):
    """(bytes, seconds per step) of the masked baseline for the kept sets in ``reports``."""
    B, T = batch.input_ids.shape
    loaded, masks = load_masked_model(model_name, reports, T)
    cache = DynamicCache()
    with torch.no_grad():
        loaded.model(input_ids=batch.input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        start = time.perf_counter()
        for step in range(steps):
            token = torch.tensor([[row[min(step, len(row) - 1)]] for row in tokens])
            pos = torch.full((B, 1), T + step)
            loaded.model(input_ids=token, position_ids=pos, cache=cache, use_cache=True)
        seconds = (time.perf_counter() - start) / steps
    kv = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
    return kv + sum(m.numel() for m in masks.values()), seconds


def fastest(loaded: Any, pipe: Any, batch: Batch, opts: argparse.Namespace) -> tuple[Any, float]:
    """(result, seconds per decode step) of the fastest of ``opts.repeat`` runs (one decode per run)."""
    best = None
    for _ in range(opts.repeat):
        result = generate(loaded, pipe, batch, RunOptions(opts.steps + 1))
        if best is None or result.decode_seconds < best.decode_seconds:
            best = result
    return best, best.decode_seconds / opts.steps


def run(args: list[str]) -> None:
    opts = parse(args)
    budget_overrides(opts.budget)  # refuse a bad value before any model loads
    if opts.prefill:
        run_prefill(opts)
        return
    opts.methods = opts.methods or "adakv,sparsemm"
    opts.budget = opts.budget or "128"
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
        f"dim {info.head_dim}), batch {opts.batch}, average budget {opts.budget}"
        f"{'' if 'budget.ratio' in budget_overrides(opts.budget) else ' tokens/head'}, "
        f"{opts.steps} decode steps, {torch.get_num_threads()} CPU threads"
    )
    print_table(title, headers, rows)


# --- --prefill: peak process memory of a padded prefill ------------------------------------------
def padded_lengths(T: int, batch: int, spread: float) -> list[int]:
    """Prompt lengths of a padded batch whose longest prompt has ``T`` tokens: ``floor(T (1 - spread i))``."""
    return [max(1, int(T * (1 - spread * i))) for i in range(batch)]


def padded_batch(loaded: Any, lengths: list[int]) -> Batch:
    """A left-padded batch of seeded random token ids with the given prompt lengths."""
    T = max(lengths)
    gen = torch.Generator().manual_seed(T)
    vocab = loaded.model.config.get_text_config().vocab_size
    ids = torch.randint(100, vocab, (len(lengths), T), generator=gen)
    mask = torch.zeros_like(ids)
    for b, length in enumerate(lengths):
        mask[b, T - length :] = 1
    return Batch(ids.masked_fill(mask == 0, 0), mask, torch.zeros_like(ids).masked_fill(mask == 0, PAD))


def reset_peak_rss() -> bool:
    """Reset the process's resident-set high-water mark to its current size (Linux: ``5`` written
    to ``/proc/self/clear_refs``), so that :func:`~kvlab.metrics.cost.process_peak_rss_bytes` then
    reports the peak of what follows. False where the kernel does not offer it."""
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
    except OSError:
        return False
    return True


def question_split(batch: Batch, question: int) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """``batch`` (left padded ``[B, T]``) as a context batch and a question block: the last
    ``question`` tokens of each sample are its question, the rest its context.

    Returns:
        ``(context, ids [B, question], valid [B, question])``: ``context`` a left-padded batch of
        each sample's first ``length - question`` tokens (:func:`~kvlab.engine.prompt_split.context_batch`).

    Raises:
        ConfigError: ``question`` < 1, or not shorter than the shortest prompt.
    """
    lengths = batch.attention_mask.sum(1)
    if question < 1 or question >= int(lengths.min()):
        raise ConfigError(
            f"--question {question}: a question-scoring method (Finch) reads the last --question tokens "
            f"of each prompt as its question, which needs 1 <= --question < the shortest prompt "
            f"({int(lengths.min())} tokens)."
        )
    ids = batch.input_ids[:, -question:]  # left padded: every row's last columns are real tokens
    return context_batch(batch, lengths - question), ids, torch.ones_like(ids, dtype=torch.bool)


def measure_prefill(
    loaded: Any, pipeline: Any, lengths: list[int], chunk: int | None = None, question: int = 64
) -> dict[str, Any]:
    """Peak memory of one prefill of a padded batch of prompts of ``lengths``, in this process.

    A pipeline that scores with the question (a progressive prefill with ``question: true``)
    prefills each prompt's context with its last ``question`` tokens as the question
    (:func:`question_split`), then those tokens on top (:func:`~kvlab.engine.generation.extend`),
    as the ``query_aware`` protocol does; any other, the whole prompt.

    Returns the lengths, ``rss_before`` (the resident set size before the prefill), ``peak`` (the
    high-water mark after it, both bytes; reset first when the kernel allows, ``reset`` says
    whether it did: otherwise the mark covers the process's whole life), the prefill's seconds
    and the cache's bytes after compression.
    """
    batch = padded_batch(loaded, lengths)
    scores_question = pipeline.prefill_mode.question
    if scores_question:
        context, ids, valid = question_split(batch, question)
    gc.collect()
    reset = reset_peak_rss()
    before = process_rss_bytes()
    start = time.perf_counter()
    options = RunOptions(prefill_chunk=chunk)
    if scores_question:
        state = prefill(loaded, pipeline, context, question + 1, options, questions=(ids, valid))
        state = extend(state, ids, valid)
    else:
        state = prefill(loaded, pipeline, batch, 1, options)
    seconds = time.perf_counter() - start
    peak = process_peak_rss_bytes()
    return {"T": max(lengths), "lengths": lengths, "rss_before": before, "peak": peak, "reset": reset,
            "seconds": seconds, "kv_bytes": state.cache.kv_bytes()}  # fmt: skip


def prefill_pipeline(method: str, budget: str | None) -> kvlab.Pipeline:
    """Preset ``method`` at ``--budget`` (:func:`budget_overrides`; the full cache takes none)."""
    if not kvlab.load_pipeline(method).compresses:
        return kvlab.load_pipeline(method)
    return kvlab.load_pipeline(method, budget_overrides(budget))


def prefill_peaks(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """:func:`measure_prefill` for each prompt length of ``spec["contexts"]``, in this process.

    ``spec``: ``model``, ``contexts`` (longest prompt per point), ``batch``, ``spread``, ``method``
    (a preset), ``budget`` (``--budget`` or None), ``question`` (tokens), ``chunk``
    (``model.prefill_chunk`` or None), ``threads``.
    """
    torch.set_num_threads(spec.get("threads", 1))
    loaded = kvlab.load_model(spec["model"])
    pipeline = prefill_pipeline(spec["method"], spec.get("budget"))
    check_prefill_chunk(pipeline, spec.get("chunk"))
    return [
        measure_prefill(
            loaded,
            pipeline,
            padded_lengths(T, spec["batch"], spec["spread"]),
            spec.get("chunk"),
            spec.get("question", 64),
        )  # fmt: skip
        for T in spec["contexts"]
    ]


def measure_in_subprocess(
    spec: dict[str, Any], rss_limit: float, timeout: float = 3600.0
) -> list[dict[str, Any]]:
    """:func:`prefill_peaks` of ``spec`` in a fresh Python process, killed past ``rss_limit`` bytes.

    Returns its points; a process killed past the limit (or ``timeout`` seconds) gives one point
    ``{"T": ..., "stopped": "rss" | "time"}`` for its first length (the others are not run).

    Raises:
        RuntimeError: the process failed otherwise (its stderr's tail in the message).
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        command = [sys.executable, "-m", "kvlab.bench.memory", json.dumps(spec)]
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        proc, start, seen = psutil.Process(child.pid), time.monotonic(), 0
        while child.poll() is None:
            try:
                seen = max(seen, proc.memory_info().rss)
            except psutil.NoSuchProcess:
                break
            if seen > rss_limit or time.monotonic() - start > timeout:
                child.kill()
                child.wait()
                stopped = "rss" if seen > rss_limit else "time"
                return [{"T": spec["contexts"][0], "stopped": stopped, "seen": seen}]
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        if child.wait() != 0:
            tail = err.read()[-3000:]
            raise RuntimeError(f"the measuring process failed (exit {child.returncode}):\n{tail}")
        return json.loads(out.read().strip().splitlines()[-1])


def run_prefill(opts: argparse.Namespace) -> None:
    """``--prefill``: one fresh process per (batch size, prompt length, method); prints the table,
    each method's peak and growth also as a ratio to the full cache's on the same prompts (when
    ``full`` is among the methods)."""
    info = kvlab.load_model(opts.model).info
    methods = (opts.methods or "snapkv").split(",")
    for method in methods:  # refuse a bad preset or budget before any measuring process starts
        prefill_pipeline(method, opts.budget)
    limit = opts.rss_limit * 2**30
    rows = []
    for batch in parse_list(opts.batches, int):
        for T in parse_list(opts.contexts, int):
            dense_mask = batch * T * T / 2**20  # one [B, T, T] bool mask, for scale
            layer_kv = batch * info.num_kv_heads * T * info.head_dim * 2 * 4 / 2**20  # one layer, fp32
            points = {}
            for method in methods:
                spec = {"model": opts.model, "contexts": [T], "batch": batch, "spread": opts.spread,
                        "method": method, "budget": opts.budget, "question": opts.question,
                        "chunk": opts.prefill_chunk, "threads": opts.threads}  # fmt: skip
                [points[method]] = measure_in_subprocess(spec, limit)
            full = points.get("full")
            full = None if full is None or "stopped" in full else full
            for method, point in points.items():
                if "stopped" in point:
                    stopped = f"stopped: RSS > {opts.rss_limit:g} GiB"
                    rows.append([context_label(T), method, batch, "", stopped, "", "", "", "", "",
                                 f"{layer_kv:.1f}", f"{dense_mask:.0f}"])  # fmt: skip
                    continue
                growth = point["peak"] - point["rss_before"]
                ratios = ["-", "-"]  # no full row to compare with
                if full is not None:
                    full_growth = full["peak"] - full["rss_before"]
                    ratios = [f"{point['peak'] / full['peak']:.2f}",
                              f"{growth / full_growth:.2f}" if full_growth > 0 else "n/a"]  # fmt: skip
                rows.append([
                    context_label(T), method, batch, ",".join(str(n) for n in point["lengths"]),
                    f"{point['peak'] / 2**20:.0f}", f"{growth / 2**20:.0f}", *ratios,
                    f"{point['seconds']:.1f}", f"{point['kv_bytes'] / 2**20:.1f}", f"{layer_kv:.1f}",
                    f"{dense_mask:.0f}",
                ])  # fmt: skip
    headers = ["context", "method", "batch", "prompt lengths", "peak RSS MiB", "prefill growth MiB",
               "peak vs full", "growth vs full", "prefill s", "cache after MiB", "one layer's dense K/V MiB",
               "one [B, T, T] bool mask MiB"]  # fmt: skip
    chunk = f"prefill_chunk {opts.prefill_chunk}" if opts.prefill_chunk else "one forward"
    budget = f"budget {opts.budget}" if opts.budget else "each preset's budget"
    title = (
        f"kvlab bench memory --prefill: {opts.model} ({info.num_layers} layers, {info.num_heads}/"
        f"{info.num_kv_heads} heads, dim {info.head_dim}, fp32), {','.join(methods)}, {budget}, {chunk}, "
        f"question-scoring methods: the last {opts.question} tokens are the question, "
        f"padded batches (sample i: T x (1 - {opts.spread:g} i) tokens), {opts.threads} CPU threads, "
        "one process per row"
    )
    print_table(title, headers, rows)


if __name__ == "__main__":  # the measuring process of --prefill: spec as JSON in, points as JSON out
    print(json.dumps(prefill_peaks(json.loads(sys.argv[1]))))
