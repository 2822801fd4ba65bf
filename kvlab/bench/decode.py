"""``kvlab bench decode``: decode attention over a compressed cache, alone or inside a model.

**Kernel table** (default). Per context length and budget (fraction of the prompt kept per KV
head, ragged: each head keeps between 0.5x and 1.5x the budget) it times one decode step's
attention:

- ``triton``: :func:`kvlab.kernels.tl.decode_attention.ragged_decode_attention_triton` (CUDA only),
- ``reference``: the torch path (:func:`kvlab.kernels.decode_attention.ragged_decode_attention_reference`:
  strided views of the flat buffer, one CPU flash call per run of equal-length heads and one over
  the decode region, with the segment runs computed once, as the cache keeps them),
- ``sdpa full``: ``scaled_dot_product_attention`` over the uncompressed cache (the baseline a
  compression method must beat),
- ``sdpa padded``: SDPA over the same kept tokens padded to the longest head with a mask (what
  a masked, kvpress-style layout costs),

and reports the Triton kernel's achieved bandwidth (K/V bytes read / time) as a fraction of the
device's peak. Defaults: Llama-3-8B attention shapes (32 query heads, 8 KV heads, head dim 128),
bf16 on CUDA; ``--quick`` runs small shapes in fp32 on CPU in seconds.

**Packed-entries table** (``--formats int8,int4,kivi2,turbo3``). Per context and budget (ragged
heads, as above), one decode step's attention over the kept entries in 16 bits (bf16 unless
``--dtype``) and over the same entries stored as each format's codes (:mod:`kvlab.cache.packed`,
``docs/methods/quantization.md``): the torch path (the reference above; over codes
:func:`kvlab.cache.packed.packed_decode_attention`, dequantizing a chunk of heads at a time) and,
on CUDA, the Triton kernels (the ragged kernel; over codes the fused kernel of
:mod:`kvlab.kernels.tl.packed_attention`, over ``turbo3``'s in the rotated basis), each with its
ratio to the 16-bit entries on the same path, measured in the same run; ``KV MiB``: the kept
prompt entries' bytes (codes, scales and zero points or norms and sketches, residual). Defaults:
4k and 32k contexts, 10% kept.

**Model table** (``--model NAME``). Whole decode steps of a model (batch 1, a seeded random
prompt per context, the same teacher-forced tokens everywhere), in one run:

- ``transformers DynamicCache + sdpa``: transformers' own cache and attention over the whole
  prompt, the baseline every ratio is taken against;
- ``DynamicCache, last p kept``: the same cache cropped to each budget's kept count (uniform
  eviction on transformers' own cache: what a framework that evicts inside ``DynamicCache`` gets);
- ``kvlab full`` and each ``--methods`` preset at each budget (kvlab's prefill, compression
  inside, then :func:`kvlab.engine.generation.decode`; AdaKV gives ragged heads);
- with ``--quantize '{name: kivi, bits: 2}'``, each preset at each budget again with its kept
  entries stored as codes (``model.compression.quantize``, ``docs/methods/quantization.md``):
  the same kept counts in fewer ``KV MiB``, decode dequantizing chunk by chunk.

**Pruned-keys table** (``--channels 0.5``): the kept entries with every key channel and with each
share of them (ThinK's layout, ``model.compression.channels``), against the full cache; its own
module, :mod:`kvlab.bench.channels`.

**Retrieval-index table** (``--indexes mean_key,key_bounds``). Per context and budget, one decoder
layer's decode step (random keys, values and queries; Llama-3-8B attention shapes by default, fp32
on CPU) over the whole prompt (``kvlab full``) and through the ``retrieve`` selector with each
retrieval index (:mod:`kvlab.compression.retrieval_index`: the mean key, Quest's per-channel key
bounds) at the same budget: pages of ``--page`` tokens (16, Quest's), the last ``--page`` prompt
tokens resident, ``(budget - page) // page`` pages fetched per KV head and step (Quest's top-k).
The torch path on CPU (and the Triton kernels on CUDA) of the whole step: the pages ranked, the
chosen ones gathered, one softmax over them, the resident tokens and one decoded token. Timed in
interleaved rounds (warm-up excluded; ``--stat``), as ms per step and as ratios to ``kvlab full``
and to the mean-key index measured in the same run; ``index KiB``: the device index of the layer
(every KV head), ``fetched MiB/step``: K/V gathered per step.

Every contender is prefilled once; its cache is then cropped back (transformers) or restored
from a checkpoint (kvlab) before each timed run. A warm-up round is excluded, and the rounds
interleave the contenders, so a load change on a shared machine hits them alike; the table
gives each one's fastest round (``--stat min``, the default: on a shared machine the least
disturbed run) or its median (``--stat median``), as ms per step and as ratios to transformers'
``DynamicCache`` (``vs DynamicCache``) and to ``kvlab full`` (``vs kvlab full``), and ends with
the decode targets checked against the table (:func:`target_lines`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from transformers import DynamicCache

import kvlab
from kvlab.bench.channels import run_channels
from kvlab.bench.common import (
    add_threads_option,
    base_parser,
    context_label,
    device_name,
    in_mode,
    interleaved,
    ms,
    out_of_memory,
    parse_list,
    peak_bandwidth,
    print_table,
    ragged_cache,
    resolve,
    time_call,
    triton_note,
)
from kvlab.cache.layer import CompressedLayer
from kvlab.cache.packed import packed_decode_attention
from kvlab.compression.context import LayerContext
from kvlab.compression.quantizers import KIVI, PerToken, Quantizer
from kvlab.compression.retrieval import RetrieveSelector
from kvlab.compression.turboquant import TurboQuant
from kvlab.config.errors import ConfigError
from kvlab.engine.generation import decode, prefill
from kvlab.kernels.decode_attention import SegmentRuns, ragged_decode_attention_reference
from kvlab.kernels.dispatch import triton_available
from kvlab.models.base import Batch

HEADERS = [
    "context", "budget", "kept/head", "triton", "reference", "sdpa full", "sdpa padded",
    "triton GB/s", "% of peak", "speedup vs sdpa full",
]  # fmt: skip


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
    runs = SegmentRuns.of(starts, lengths)  # the cache computes them once per compression, not per step
    reference_fn = functools.partial(ragged_decode_attention_reference, runs=runs)
    reference = time_call(reference_fn, args, device, repeat=opts.repeat)
    slot = torch.arange(width + C, device=device)
    visible = (slot < lengths[..., None]) | (slot >= width)  # [B, Hkv, width + C]
    mask = visible.repeat_interleave(H // Hkv, 1)[:, :, None, :]  # [B, H, 1, width + C]
    padded_kv = (padded(keys, starts, lengths, dk, width), padded(values, starts, lengths, dv, width))
    sdpa_padded = time_call(sdpa, (query, *padded_kv, mask), device, repeat=opts.repeat)
    triton_s = bandwidth = None
    if device.type == "cuda" and triton_available():
        from kvlab.kernels.tl.decode_attention import ragged_decode_attention_triton  # triton: optional, CUDA

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


def run_kernels(opts: argparse.Namespace) -> None:
    """The kernel table: one decode step's attention on random ragged caches."""
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


# --- packed entries: decode attention over codes against the same entries in 16 bits ------------
#: ``--formats`` names: the quantizer each stores the kept entries with
FORMATS: dict[str, Callable[[], Quantizer]] = {
    "int8": lambda: PerToken(bits=8, group=32),
    "int4": lambda: PerToken(bits=4, group=32),
    "int2": lambda: PerToken(bits=2, group=32),
    "kivi2": lambda: KIVI(bits=2, group=32, residual=128),
    "kivi4": lambda: KIVI(bits=4, group=32, residual=128),
    "turbo3": lambda: TurboQuant(bits=3),
    "turbo3mse": lambda: TurboQuant(bits=3, keys="mse"),
}
PACKED_HEADERS = [
    "context", "budget", "kept/head", "entries", "KV MiB", "torch", "torch vs 16-bit", "triton",
    "triton vs 16-bit",
]  # fmt: skip


def packed_rows(query, T, budget, formats, opts, device, dtype, gen) -> list[list[object]]:
    """One (context, budget) cell: the entries in ``dtype`` and each format's codes of the same
    entries, timed through the torch path and (CUDA) the Triton kernels in interleaved rounds,
    ratios to the ``dtype`` entries on the same path."""
    B, Hkv, D, C = opts.batch, opts.kv_heads, opts.head_dim, opts.decoded
    keys, values, starts, lengths, dk, dv = ragged_cache(B, Hkv, D, T, budget, C, dtype, device, gen)
    kept = int(lengths.sum()) // (B * Hkv)
    runs = SegmentRuns.of(starts, lengths)  # the cache computes them once per compression
    args = (query, keys, values, starts, lengths, dk, dv, C, D**-0.5, int(lengths.max()))
    label = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    calls = {(label, "torch"): functools.partial(ragged_decode_attention_reference, *args, runs=runs)}
    cuda = device.type == "cuda" and triton_available()
    if cuda:
        from kvlab.kernels.tl.decode_attention import ragged_decode_attention_triton  # triton: optional, CUDA

        calls[(label, "triton")] = functools.partial(ragged_decode_attention_triton, *args)
    sizes = {label: 2 * keys.nbytes}
    for name in formats:
        packed = FORMATS[name]().pack(keys, values, starts, lengths)
        packed.runs()  # computed once per compression, as the cache keeps them
        sizes[name] = packed.nbytes()
        call = (query, packed, starts, lengths, dk, dv, C, D**-0.5)
        calls[(name, "torch")] = in_mode("reference", packed_decode_attention, *call)
        if cuda:
            calls[(name, "triton")] = in_mode("triton", packed_decode_attention, *call)
    seconds = interleaved(calls, device, opts.repeat)

    def ratio(name: str, path: str) -> str:
        found = seconds.get((name, path))
        return "n/a" if found is None else f"{found / seconds[(label, path)]:.2f}"

    return [
        [context_label(T), f"{budget:.0%}", kept, name, f"{sizes[name] / 2**20:.2f}",
         ms(seconds[(name, "torch")]), ratio(name, "torch"), ms(seconds.get((name, "triton"))),
         ratio(name, "triton")]
        for name in [label, *formats]
    ]  # fmt: skip


def run_packed(opts: argparse.Namespace) -> None:
    """The packed-entries table (``--formats``): per context and budget, decode attention over the
    kept entries in 16 bits and as each format's codes, in one run."""
    device, dtype = resolve(opts)
    dtype = dtype if opts.dtype else torch.bfloat16  # the baseline is 16-bit unless asked otherwise
    formats = [f for f in opts.formats.split(",") if f]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ConfigError(f"--formats: unknown {', '.join(unknown)}; known: {', '.join(FORMATS)}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for T in parse_list(opts.contexts, int):
        query = torch.randn(opts.batch, opts.heads, 1, opts.head_dim, generator=gen).to(dtype).to(device)
        for budget in parse_list(opts.budgets, float):
            rows += packed_rows(query, T, budget, formats, opts, device, dtype, gen)
    title = (
        f"kvlab bench decode --formats on {device_name(device)}, {dtype}: B={opts.batch}, H={opts.heads}, "
        f"Hkv={opts.kv_heads}, D={opts.head_dim}, {opts.decoded} decoded tokens; times in ms (median of "
        f"{opts.repeat} interleaved rounds); int8 / int4: per_token, group 32; kivi2: KIVI 2 bits, group 32, "
        "residual 128; turbo3: TurboQuant 3 bits (keys 2 + the 1-bit sketch), no residual"
    )
    print_table(title, PACKED_HEADERS, rows)
    triton_note(device.type == "cuda" and triton_available())


# --- the model scenario: whole decode steps of a model, kvlab's cache vs transformers' own -------
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
MODEL_HEADERS = [
    "context", "cache", "kept/head", "KV MiB", "decode ms/step", "vs DynamicCache", "vs kvlab full",
]  # fmt: skip
STATS: dict[str, Callable[[list[float]], float]] = {"min": min, "median": statistics.median}


@dataclass
class Contender:
    """One row of the model table: ``decode()`` runs one timed decode of the bench's steps (seconds)."""

    label: str
    kept: str
    kv_bytes: int
    decode: Callable[[], float]
    times: list[float] = field(default_factory=list)


def _transformers_contenders(
    loaded: Any, batch: Batch, tokens: torch.Tensor, budgets: list[float], clock: Callable[[], float]
) -> list[Contender]:
    """transformers' ``DynamicCache`` + sdpa over the whole prompt (the baseline), and the same cache
    cropped to each budget's kept count (its most recent entries: uniform eviction on transformers'
    own cache)."""
    model, T = loaded.model, batch.input_ids.shape[1]
    with sdpa_attention(model), torch.no_grad():
        full = DynamicCache(config=model.config)
        model(input_ids=batch.input_ids, cache=full, use_cache=True, logits_to_keep=1)
    caches = [("transformers DynamicCache + sdpa", T, full)]
    for budget in budgets:
        kept = kept_count(budget, T)
        cropped = DynamicCache(config=model.config)
        for i, layer in enumerate(full.layers):
            cropped.update(layer.keys[:, :, -kept:].clone(), layer.values[:, :, -kept:].clone(), i)
        caches.append((f"DynamicCache, last {budget:.0%} kept", kept, cropped))
    out = []
    for label, kept, cache in caches:
        kv = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        run = functools.partial(_transformers_decode, model, cache, kept, tokens, T, clock)
        out.append(Contender(label, str(kept), kv, run))
    return out


def _transformers_decode(
    model: Any, cache: Any, kept: int, tokens: torch.Tensor, first: int, clock: Callable[[], float]
) -> float:
    """Seconds (by ``clock``) of ``tokens.shape[1] - 1`` decode steps on ``cache`` (cropped back to
    ``kept`` first)."""
    extra = cache.get_seq_length() - kept  # what the previous run appended
    if extra:
        cache.crop(-extra)
    with sdpa_attention(model), torch.no_grad():
        start = clock()
        for step in range(tokens.shape[1] - 1):
            position = torch.full((tokens.shape[0], 1), first + step)
            model(
                input_ids=tokens[:, step : step + 1],
                position_ids=position,
                cache=cache,
                use_cache=True,
            )
        return clock() - start


def _kvlab_contender(
    loaded: Any,
    batch: Batch,
    tokens: torch.Tensor,
    method: str,
    budget: float | None,
    clock: Callable[[], float],
    quantize: dict[str, Any] | None = None,
) -> Contender:
    """kvlab's prefill (compression inside) once; each timed run restores the compressed cache and
    decodes teacher-forced ``tokens`` through :func:`kvlab.engine.generation.decode`. ``quantize``:
    a ``model.compression.quantize`` node, the kept entries stored as codes."""
    T = batch.input_ids.shape[1]
    overrides: dict[str, Any] = {} if budget is None else {"budget.tokens": kept_count(budget, T)}
    if quantize is not None:
        overrides["quantize"] = quantize
    pipeline = kvlab.load_pipeline(method, overrides)
    state = prefill(loaded, pipeline, batch, decode_capacity=tokens.shape[1])
    checkpoint = state.cache.checkpoint()

    def run() -> float:
        state.cache.restore(checkpoint)
        start = clock()
        decode(state, teacher_tokens=tokens)
        return clock() - start

    kept = state.cache.kept_tokens().float()
    spread = f"{kept.mean():.0f}" + (
        "" if kept.min() == kept.max() else f" ({kept.min():.0f}..{kept.max():.0f})"
    )
    label = f"kvlab {method}" + ("" if budget is None else f" {budget:.0%}")
    if quantize is not None:
        label += " " + ", ".join(f"{key}={value}" for key, value in quantize.items())
    return Contender(label, spread, state.cache.kv_bytes(), run)


def kept_count(budget: float, T: int) -> int:
    """Tokens per head a ratio ``budget`` keeps of a ``T``-token prompt (``floor``, as ratio budgets do)."""
    return max(1, int(budget * T))


@contextlib.contextmanager
def sdpa_attention(model: Any) -> Iterator[None]:
    """The model's attention set to transformers' sdpa within the block (kvlab's afterwards)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def run_model(opts: argparse.Namespace) -> None:
    """The model table: per context, every contender's decode step, timed in interleaved rounds."""
    loaded = kvlab.load_model(opts.model)
    budgets, methods = parse_list(opts.budgets, float), [m for m in opts.methods.split(",") if m]
    quantize = yaml.safe_load(opts.quantize) if opts.quantize else None
    steps = opts.steps
    rows, verdicts = [], []
    for T in parse_list(opts.contexts, int):
        batch = random_prompt(loaded, T)
        gen = torch.Generator().manual_seed(T + 1)
        vocab = loaded.model.config.get_text_config().vocab_size
        tokens = torch.randint(100, vocab, (1, steps + 1), generator=gen)  # the same fed tokens everywhere
        clock = CLOCKS[opts.clock]
        contenders = _transformers_contenders(loaded, batch, tokens, budgets, clock)
        contenders.append(_kvlab_contender(loaded, batch, tokens, "full", None, clock))
        for method in methods:
            contenders += [_kvlab_contender(loaded, batch, tokens, method, b, clock) for b in budgets]
            if quantize is not None:
                contenders += [
                    _kvlab_contender(loaded, batch, tokens, method, b, clock, quantize) for b in budgets
                ]
        for round_ in range(opts.repeat + 1):  # round 0 warms up; rounds interleave the contenders
            for contender in contenders:
                seconds = contender.decode() / steps
                if round_:
                    contender.times.append(seconds)
        stat = STATS[opts.stat]
        seconds = {c.label: stat(c.times) for c in contenders}
        base, kvlab_full = seconds[contenders[0].label], seconds["kvlab full"]
        for c in contenders:
            time_ = seconds[c.label]
            rows.append([context_label(T), c.label, c.kept, f"{c.kv_bytes / 2**20:.1f}", ms(time_),
                         f"{time_ / base:.2f}", f"{time_ / kvlab_full:.2f}"])  # fmt: skip
        verdicts += target_lines(context_label(T), seconds, base, budgets, check_kept=T >= 4096)
        del contenders
    title = (
        f"kvlab bench decode --model {opts.model} on {device_name(torch.device('cpu'))}: {steps} decode "
        f"steps after the prompt, batch 1, {opts.clock} ms per step ({opts.stat} of {opts.repeat} "
        "interleaved rounds, warm-up excluded)"
    )
    print_table(title, MODEL_HEADERS, rows)
    print("\nTargets (kvlab full <= 1.02x DynamicCache; 10% kept <= 0.6x at 4k tokens and more; AdaKV "
          "faster than kvlab full below 50%):\n")  # fmt: skip
    print("\n".join(f"- {line}" for line in verdicts))


def target_lines(
    context: str, seconds: dict[str, float], base: float, budgets: list[float], check_kept: bool
) -> list[str]:
    """The decode targets checked on one context's times (``seconds`` per contender label, ``base``
    transformers' full ``DynamicCache``): kvlab full within 2% of it, every method at 10% kept
    within 0.6x of it (``check_kept``: the target is stated at 4k tokens), AdaKV (ragged) faster
    than kvlab full at every budget below 50%."""

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    full = seconds["kvlab full"] / base
    lines = [f"{context}: kvlab full {full:.2f}x DynamicCache (<= 1.02x: {verdict(full <= 1.02)})"]
    for label, value in seconds.items():
        ratio = value / base
        if check_kept and label.startswith("kvlab ") and label.endswith(" 10%"):
            lines.append(f"{context}: {label} {ratio:.2f}x DynamicCache (<= 0.6x: {verdict(ratio <= 0.6)})")
        elif check_kept and label == "DynamicCache, last 10% kept":
            lines.append(f"{context}: {label} {ratio:.2f}x DynamicCache (the reference framework's eviction)")
    for budget in budgets:
        label = f"kvlab adakv {budget:.0%}"
        if budget < 0.5 and label in seconds:
            ratio = seconds[label] / seconds["kvlab full"]
            lines.append(f"{context}: {label} {ratio:.2f}x kvlab full (< 1: {verdict(ratio < 1)})")
    return lines


# --- retrieval indexes: one layer's decode step through each index at the same budget ------------
INDEX_HEADERS = [
    "context", "budget", "contender", "pages/head", "index KiB", "fetched MiB/step", "decode ms/step",
    "vs kvlab full", "vs mean_key",
]  # fmt: skip


def retrieving_layer(ctx: LayerContext, index: str | None, tokens: int, page: int) -> CompressedLayer:
    """``ctx``'s layer compressed by ``retrieve`` with retrieval index ``index`` at ``tokens`` per KV
    head (the last ``page`` tokens resident), or kept whole (``index`` None), plus one decoded token."""
    B, Hkv, T, D = ctx.keys.shape
    scores = torch.zeros(B, Hkv, T, device=ctx.keys.device)
    scores[..., T - page :] = float("inf")  # the resident window: Quest's current page
    selector = RetrieveSelector(chunk=page, local="protected", index={"name": index or "mean_key"})
    counts = torch.full((B, Hkv), T if index is None else tokens, dtype=torch.long, device=ctx.keys.device)
    layer = CompressedLayer(decode_capacity=4)
    layer.update(ctx.keys, ctx.values)
    layer.compress(selector.select(scores, counts, ctx))
    gen = torch.Generator().manual_seed(T + 2)
    layer.update(*(torch.randn(B, Hkv, 1, D, generator=gen).to(ctx.keys) for _ in range(2)))
    return layer


def clocked(
    fn: Callable[..., object], args: tuple[object, ...], device: torch.device, clock: Callable[[], float]
) -> float:
    """Seconds of one call of ``fn(*args)`` by ``clock`` (CUDA-synchronised on GPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = clock()
    fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock() - start


def run_indexes(opts: argparse.Namespace) -> None:
    """The retrieval-index table: per context and budget, a layer's decode step over the full cache
    and through each retrieval index, timed in interleaved rounds."""
    device, dtype = resolve(opts)
    indexes = [name for name in opts.indexes.split(",") if name]
    stat, clock = STATS[opts.stat], CLOCKS[opts.clock]
    rows = []
    for T in parse_list(opts.contexts, int):
        gen = torch.Generator().manual_seed(T)
        B, H, Hkv, D = opts.batch, opts.heads, opts.kv_heads, opts.head_dim
        keys, values = (torch.randn(B, Hkv, T, D, generator=gen).to(device, dtype) for _ in range(2))
        query = torch.randn(B, H, 1, D, generator=gen).to(device, dtype)
        valid = torch.ones(B, T, dtype=torch.bool, device=device)
        ctx = LayerContext(0, 1, query, keys, values, valid, torch.zeros_like(valid, dtype=torch.long),
                           D**-0.5, query_start=T - 1)  # fmt: skip
        for budget in parse_list(opts.budgets, float):
            tokens = kept_count(budget, T)
            layers = {"kvlab full": retrieving_layer(ctx, None, tokens, opts.page)}
            layers.update(
                {f"retrieve {name}": retrieving_layer(ctx, name, tokens, opts.page) for name in indexes}
            )
            times: dict[str, list[float]] = {name: [] for name in layers}
            for round_ in range(opts.repeat + 1):  # round 0 warms up; rounds interleave the contenders
                for name, layer in layers.items():
                    seconds = clocked(layer.decode_attention, (query, ctx.scaling), device, clock)
                    if round_:
                        times[name].append(seconds)
            seconds = {name: stat(values) for name, values in times.items()}
            full, mean_key = seconds["kvlab full"], seconds.get("retrieve mean_key")
            for name, layer in layers.items():
                store = layer.offloaded
                pages = "all" if store is None else str(int(store.n_sel.max()))
                index_kib = (
                    "-"
                    if store is None
                    else f"{store.index.numel() * store.index.element_size() / 2**10:.0f}"
                )
                moved = 0.0 if store is None else float(store.moved.sum()) / max(store.steps, 1)
                vs_mean = f"{seconds[name] / mean_key:.2f}" if mean_key and store is not None else "-"
                rows.append([context_label(T), f"{budget:.0%}", name, pages, index_kib,
                             f"{moved / 2**20:.2f}", ms(seconds[name]), f"{seconds[name] / full:.2f}",
                             vs_mean])  # fmt: skip
            del layers
    title = (
        f"kvlab bench decode --indexes on {device_name(device)}, {str(dtype).replace('torch.', '')}: one "
        f"layer, B={opts.batch}, H={opts.heads}, Hkv={opts.kv_heads}, D={opts.head_dim}, pages of "
        f"{opts.page} tokens, {opts.threads} threads; {opts.clock} ms per step ({opts.stat} of {opts.repeat} "
        "interleaved rounds, warm-up excluded)"
    )
    print_table(title, INDEX_HEADERS, rows)


def random_prompt(loaded: Any, T: int) -> Batch:
    """A batch of one seeded random prompt of ``T`` token ids (time does not depend on the words)."""
    gen = torch.Generator().manual_seed(T)
    ids = torch.randint(100, loaded.model.config.get_text_config().vocab_size, (1, T), generator=gen)
    return Batch(ids, torch.ones_like(ids), torch.zeros_like(ids))


def run(args: list[str]) -> None:
    p = base_parser("kvlab bench decode", __doc__, None, repeat=None)
    p.add_argument("--budgets", default=None, help="kept fraction of the prompt per KV head")
    p.add_argument(
        "--decoded", type=int, default=16, help="kernel table: tokens already decoded (decode region)"
    )
    p.add_argument("--peak-gbs", type=float, default=None, help="peak memory bandwidth (GB/s) if not known")
    p.add_argument(
        "--model", default=None, help="time whole decode steps of this model instead (e.g. smollm2-135m)"
    )
    p.add_argument("--methods", default="snapkv,adakv", help="--model: presets timed at every budget")
    p.add_argument("--steps", type=int, default=16, help="--model: decode steps timed per run")
    p.add_argument(
        "--quantize",
        default=None,
        help="--model: also time every preset and budget with this quantizer (a YAML node, e.g. "
        "'{name: kivi, bits: 2}')",
    )
    p.add_argument(
        "--formats",
        default=None,
        help="the packed-entries table instead: decode attention over the kept entries as these "
        f"codes ({', '.join(FORMATS)}) against the same entries in 16 bits",
    )
    p.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="--model, --indexes: wall time, or the process's CPU time (steadier on a loaded machine; use "
        "--threads 1)",
    )
    p.add_argument(
        "--stat",
        choices=list(STATS),
        default="min",
        help="--model, --indexes: each contender's fastest round (default: the least disturbed one on a "
        "shared machine) or its median",
    )
    p.add_argument(
        "--indexes",
        default=None,
        help="the retrieval-index table instead: one layer's decode step through the retrieve selector "
        "with each of these retrieval indexes (e.g. mean_key,key_bounds) against the full cache",
    )
    p.add_argument("--page", type=int, default=16, help="--indexes: tokens per page (chunk)")
    p.add_argument(
        "--channels",
        default=None,
        help="the pruned-keys table instead (kvlab.bench.channels): decode attention over the kept "
        "entries with these shares of the key channels (e.g. 0.5, ThinK's) against every channel and "
        "the full cache",
    )
    add_threads_option(p, default=2)
    opts = p.parse_args(args)
    torch.set_num_threads(opts.threads)
    if opts.indexes:
        opts.contexts, opts.budgets = opts.contexts or "32k", opts.budgets or "0.10"
        opts.repeat = opts.repeat or 10
        run_indexes(opts)
    elif opts.channels:
        opts.contexts, opts.budgets = opts.contexts or "4k,32k", opts.budgets or "0.10"
        opts.repeat = opts.repeat or 10
        run_channels(opts)
    elif opts.formats:
        opts.contexts, opts.budgets = opts.contexts or "4k,32k", opts.budgets or "0.10"
        opts.repeat = opts.repeat or 10
        run_packed(opts)
    elif opts.model is None:
        opts.contexts, opts.budgets = opts.contexts or "4k,32k,128k", opts.budgets or "0.05,0.10,0.25"
        opts.repeat = opts.repeat or 20
        run_kernels(opts)
    else:
        opts.contexts, opts.budgets = opts.contexts or "1k,4k", opts.budgets or "0.5,0.25,0.1"
        opts.repeat = opts.repeat or 5
        run_model(opts)
