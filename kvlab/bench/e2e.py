"""``kvlab bench e2e``: whole generations of an 8B-class model, kvlab against transformers' own cache.

A model with Llama-3.1-8B's shape (32 layers, 32 query / 8 KV heads, head dim 128, hidden 4096,
MLP 14336, RoPE theta 500000) and seeded random weights in bfloat16, built on the device without
a checkpoint (:func:`build_model`: speed does not depend on the weights' values). Per prompt
length (default 8k, 32k and the longest that fits, ``max``) and batch (1 and 8), each row
prefills a seeded random prompt and decodes ``--tokens`` teacher-forced tokens (the same for
every row, so every row runs exactly as many steps), all in one process:

- ``transformers full (sdpa)``: transformers' ``DynamicCache`` and sdpa attention, the baseline
  every ratio is taken against;
- ``kvlab full``, ``kvlab snapkv 10%``, ``kvlab adakv 10%``, ``kvlab mixkv_snapkv 10%``: the
  shipped presets' compression config with a ratio budget (``budget.ratio``), through kvlab's
  prefill (compression inside) and decode;
- with ``--kvpress-python PATH`` (a Python with kvpress installed, in an environment of its own),
  the reference framework's rows, measured by :mod:`kvlab.bench.kvpress_rows` in a subprocess on
  the same shape, seed and prompts (without it the rows are absent and the table says so).

Columns: time to first token (the prefill forward, compression included, to the first token's
logits), decode tokens per second over the decode steps (batch x steps / seconds), peak device
memory of the row (CUDA: ``max_memory_allocated`` from just before the prefill, weights
included; on CPU not measured), bytes of KV the cache keeps after the prefill (kept prompt
entries; transformers: the whole prompt), and each ratio to transformers' full cache. A row that
runs out of memory prints ``OOM``.

``--quick``: a scaled-down shape (2 layers, 4/2 heads, head dim 16) with short prompts and a
few decode tokens, then SmolLM2-135M (``smollm2-135m``, fp32) on CPU: seconds, for a smoke test
of the plumbing; the figures mean little.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvlab
from kvlab.bench.common import add_threads_option, context_label, device_name, out_of_memory, parse_list
from kvlab.engine.generation import decode, prefill
from kvlab.engine.registration import enable_kvlab_attention
from kvlab.models.base import Batch, LoadedModel
from kvlab.models.info import model_info

#: kvlab's rows: (preset, budget ratio or None for the full cache)
METHODS: list[tuple[str, float | None]] = [
    ("full", None),
    ("snapkv", 0.1),
    ("adakv", 0.1),
    ("mixkv_snapkv", 0.1),
]
HEADERS = [
    "model", "context", "batch", "cache", "TTFT s", "decode tok/s", "peak GiB", "KV kept MiB",
    "TTFT vs full", "tok/s vs full", "peak vs full", "KV vs full",
]  # fmt: skip
BASELINE = "transformers full (sdpa)"


@dataclass(frozen=True)
class Shape:
    """A Llama-architecture decoder's shape (what :func:`build_model` builds)."""

    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    rope_theta: float = 500000.0
    max_positions: int = 131072

    def config(self) -> LlamaConfig:
        return LlamaConfig(
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, head_dim=self.head_dim, hidden_size=self.hidden,
            intermediate_size=self.intermediate, vocab_size=self.vocab, rope_theta=self.rope_theta,
            max_position_embeddings=self.max_positions, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip


#: Llama-3.1-8B's shape (its RoPE scaling left out: speed does not depend on it)
LLAMA_8B = Shape("llama-3.1-8b shape", 32, 32, 8, 128, 4096, 14336, 128256)
#: ``--quick``: the same architecture scaled down
QUICK = Shape("quick shape", 2, 4, 2, 16, 64, 128, 512, max_positions=8192)


@dataclass
class Row:
    """One measured row (seconds, bytes; None where not measured, ``oom`` where it did not fit)."""

    model: str
    context: int
    batch: int
    cache: str
    ttft: float | None = None
    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    kv_bytes: int | None = None
    oom: bool = False


def build_model(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` of ``shape`` with seeded random weights, built directly on ``device``
    in ``dtype`` (no checkpoint, no fp32 copy)."""
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(shape.config())
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def as_loaded(model: torch.nn.Module, name: str) -> LoadedModel:
    """``model`` runnable by kvlab's prefill and decode (no tokenizer: the prompts are token ids)."""

    @dataclass
    class Ids:  # the one processor field decode reads
        eos_token_ids: tuple[int, ...] = (2,)

    enable_kvlab_attention(model, vision_language=False)
    dtype = next(model.parameters()).dtype
    return LoadedModel(model, Ids(), model_info(model.config, name), dtype=dtype)  # type: ignore[arg-type]


def prompts(vocab: int, batch: int, T: int, tokens: int, device: torch.device) -> tuple[Batch, torch.Tensor]:
    """A seeded random prompt batch ``[batch, T]`` and the teacher-forced tokens ``[batch, tokens]``."""
    gen = torch.Generator().manual_seed(T * 31 + batch)
    ids = torch.randint(3, vocab, (batch, T), generator=gen)
    fed = torch.randint(3, vocab, (batch, tokens), generator=gen)
    return Batch(ids.to(device), torch.ones_like(ids).to(device), torch.zeros_like(ids).to(device)), fed.to(
        device
    )


class Clock:
    """Wall seconds with the device synchronised, and the device's peak memory since :meth:`reset`."""

    def __init__(self, device: torch.device):
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None


@contextlib.contextmanager
def sdpa_attention(model: torch.nn.Module) -> Iterator[None]:
    """The model's attention set to transformers' sdpa within the block (kvlab's afterwards)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
def transformers_row(loaded: LoadedModel, batch: Batch, fed: torch.Tensor, clock: Clock) -> Row:
    """transformers' ``DynamicCache`` + sdpa: prefill, then ``fed.shape[1] - 1`` decode steps."""
    model, (B, T) = loaded.model, batch.input_ids.shape
    row = Row("", T, B, BASELINE)
    with sdpa_attention(model):
        clock.reset()
        start = clock.now()
        cache = DynamicCache(config=model.config)
        out = model(input_ids=batch.input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        out.logits[:, -1].argmax(-1)
        row.ttft = clock.now() - start
        row.kv_bytes = sum(
            t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
        )
        del out
        start = clock.now()
        for step in range(fed.shape[1] - 1):
            positions = torch.full((B, 1), T + step, device=fed.device)
            model(input_ids=fed[:, step : step + 1], position_ids=positions, cache=cache, use_cache=True)
        row.tokens_per_s = B * (fed.shape[1] - 1) / (clock.now() - start)
        row.peak_bytes = clock.peak()
    return row


@torch.no_grad()
def kvlab_row(
    loaded: LoadedModel, batch: Batch, fed: torch.Tensor, method: str, ratio: float | None, clock: Clock
) -> Row:
    """kvlab's prefill (the preset's compression inside), then its decode of the same fed tokens."""
    B, T = batch.input_ids.shape
    overrides = {} if ratio is None else {"budget": {"ratio": ratio, "window": 32}}
    pipeline = kvlab.load_pipeline(method, overrides)
    row = Row("", T, B, f"kvlab {method}" + ("" if ratio is None else f" {ratio:.0%}"))
    clock.reset()
    start = clock.now()
    state = prefill(loaded, pipeline, batch, decode_capacity=fed.shape[1])
    state.logits.argmax(-1)
    row.ttft = clock.now() - start
    row.kv_bytes = state.cache.prompt_kv_bytes()
    start = clock.now()
    decode(state, teacher_tokens=fed)
    row.tokens_per_s = B * (fed.shape[1] - 1) / (clock.now() - start)
    row.peak_bytes = clock.peak()
    return row


def guarded(measure: Callable[[], Row], template: Row) -> Row:
    """``measure()``, or ``template`` marked OOM when it does not fit."""
    try:
        return measure()
    except out_of_memory():
        template.oom = True
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return template


def longest_context(shape: Shape, batch: int, device: torch.device, dtype: torch.dtype) -> int:
    """The longest prompt (a multiple of 8k, at most the shape's positions) whose full ``DynamicCache``
    takes at most half of the device memory left after the weights: the baseline's prefill
    activations and kvlab's compression need the rest. On CPU: 32k."""
    if device.type != "cuda":
        return 32768
    free, _ = torch.cuda.mem_get_info(device)
    per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * torch.finfo(dtype).bits // 8 * batch
    return max(8192, min(shape.max_positions, (free // 2 // per_token) // 8192 * 8192))


def measure_model(
    loaded: LoadedModel,
    label: str,
    contexts: list[int | str],
    batches: list[int],
    tokens: int,
    clock: Clock,
    shape: Shape | None = None,
) -> list[Row]:
    """Every row at every (context, batch), after one untimed round on a short prompt (one-time
    costs: kernels, allocator); ``"max"`` in ``contexts``: :func:`longest_context` of ``shape``
    (the one ``loaded`` was built from)."""
    rows, config = [], loaded.model.config
    batch, fed = prompts(config.vocab_size, 1, 64, 2, clock.device)  # warm-up, untimed: first calls
    transformers_row(loaded, batch, fed, clock)
    for method, ratio in METHODS:
        kvlab_row(loaded, batch, fed, method, ratio, clock)
    for B in batches:
        for context in contexts:
            T = longest_context(shape, B, clock.device, loaded.dtype) if context == "max" else int(context)
            batch, fed = prompts(config.vocab_size, B, T, tokens, clock.device)
            baseline = functools.partial(transformers_row, loaded, batch, fed, clock)
            measured = [guarded(baseline, Row(label, T, B, BASELINE))]
            for method, ratio in METHODS:
                name = f"kvlab {method}" + ("" if ratio is None else f" {ratio:.0%}")
                row = functools.partial(kvlab_row, loaded, batch, fed, method, ratio, clock)
                measured.append(guarded(row, Row(label, T, B, name)))
            for row in measured:
                row.model = label
            rows += measured
    return rows


def kvpress_rows(
    python: str, shape: Shape, cells: list[tuple[int, int]], tokens: int, device: str, dtype: torch.dtype
) -> list[Row]:
    """The reference framework's rows at each ``(context, batch)`` of ``cells``, measured by
    :mod:`kvlab.bench.kvpress_rows` under ``python`` (an environment with kvpress; kvlab is not
    imported there), which prints one JSON row per line."""
    script = Path(__file__).with_name("kvpress_rows.py")
    spec = {
        "shape": asdict(shape), "cells": cells, "tokens": tokens, "device": device,
        "dtype": str(dtype).removeprefix("torch."),
    }  # fmt: skip
    done = subprocess.run(
        [python, str(script), json.dumps(spec)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"kvlab bench e2e: the kvpress rows failed under {python}:\n{done.stderr[-2000:]}")
    return [Row(**json.loads(line)) for line in done.stdout.splitlines() if line.startswith("{")]


def render(rows: list[Row]) -> list[list[str]]:
    """The table's cells: each row with its ratios to the baseline of its (model, context, batch)."""
    base = {(r.model, r.context, r.batch): r for r in rows if r.cache == BASELINE and not r.oom}

    def cell(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
        return "n/a" if value is None else f"{value / scale:.{digits}f}"

    def ratio(value: float | None, reference: float | None) -> str:
        return "n/a" if value is None or not reference else f"{value / reference:.2f}"

    out = []
    for r in rows:
        head = [r.model, context_label(r.context), str(r.batch), r.cache]
        if r.oom:
            out.append(head + ["OOM"] * (len(HEADERS) - len(head)))
            continue
        b = base.get((r.model, r.context, r.batch), Row("", 0, 0, ""))
        out.append(head + [
            cell(r.ttft, digits=3), cell(r.tokens_per_s, digits=1), cell(r.peak_bytes, 2**30),
            cell(r.kv_bytes, 2**20, 1), ratio(r.ttft, b.ttft), ratio(r.tokens_per_s, b.tokens_per_s),
            ratio(r.peak_bytes, b.peak_bytes), ratio(r.kv_bytes, b.kv_bytes),
        ])  # fmt: skip
    return out


def run(args: list[str]) -> None:
    p = argparse.ArgumentParser(prog="kvlab bench e2e", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--contexts", default="8k,32k,max", help="prompt lengths (k = 1024; max: the longest that fits)"
    )
    p.add_argument("--batches", default="1,8", help="batch sizes")
    p.add_argument("--tokens", type=int, default=256, help="decode tokens per row")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--kvpress-python", default=None, help="a Python with kvpress installed: add its rows")
    p.add_argument("--quick", action="store_true", help="a scaled-down shape, then SmolLM2-135M on CPU")
    add_threads_option(p, default=2)
    opts = p.parse_args(args)
    torch.set_num_threads(opts.threads)
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape, dtype = (QUICK, torch.float32) if opts.quick else (LLAMA_8B, torch.bfloat16)
    if opts.quick:
        opts.contexts, opts.batches, opts.tokens = "256,1k", "1,2", 8
    contexts: list[int | str] = [c if c == "max" else parse_list(c, int)[0] for c in opts.contexts.split(",")]
    batches, clock = parse_list(opts.batches, int), Clock(device)
    loaded = as_loaded(build_model(shape, dtype, device), shape.name)
    rows = measure_model(loaded, shape.name, contexts, batches, opts.tokens, clock, shape)
    del loaded
    if opts.quick:  # the trained small model on CPU, where the reference framework was compared
        smol = kvlab.load_model("smollm2-135m")
        rows += measure_model(smol, "smollm2-135m (fp32, CPU)", [256], [1], 4, Clock(torch.device("cpu")))
    note = "kvpress rows: not measured (no --kvpress-python given)"
    if opts.kvpress_python:
        cells = sorted({(r.context, r.batch) for r in rows if r.model == shape.name})
        rows += kvpress_rows(opts.kvpress_python, shape, cells, opts.tokens, str(device), dtype)
        note = f"kvpress rows: measured under {opts.kvpress_python}"
    print(
        f"\nkvlab bench e2e on {device_name(device)}: {shape.name} ({shape.layers} layers, {shape.heads}/"
        f"{shape.kv_heads} heads, head dim {shape.head_dim}, hidden {shape.hidden}, {dtype}), random seeded "
        f"weights; {opts.tokens} decode tokens; ratios to {BASELINE} of the same model, context and batch; "
        f"{note}\n"
    )
    print("| " + " | ".join(HEADERS) + " |")
    print("|" + "|".join("---" for _ in HEADERS) + "|")
    for cells in render(rows):
        print("| " + " | ".join(cells) + " |")
    if device.type != "cuda":
        print("\nPeak memory is measured on CUDA only (n/a on CPU).")
    sys.stdout.flush()
