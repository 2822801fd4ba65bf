"""``kvlab bench kernels``: every Triton kernel's achieved bandwidth on a CUDA device, and its speedup.

For each kernel (decode attention also over KIVI-2 codes, the fused dequantizing kernel of
:mod:`kvlab.kernels.tl.packed_attention`), at each prompt length (``--contexts``, default 4k and
32k tokens) and kept fraction (``--kept``, default 10% and 50%; window scoring reads the whole
prompt, so it has one row per length), one table row:

- **bytes**: the fewest bytes the call must move through device memory (each input read once,
  each output written once; for the chunk gather, the bytes read from pinned host memory);
- **triton µs** is the eager call (Python's launch overhead included, as an unbatched decode step
  pays it); **graph µs** the same calls replayed from one CUDA graph (the kernels alone; what a
  decode loop captured in a graph pays; n/a where a call syncs with the host and cannot be
  captured);
- **GB/s** and **% of peak**: bytes over the kernels' own median time (the graph's when measured),
  against the device's
  peak memory bandwidth (:data:`kvlab.bench.common.PEAK_GBS`, from the vendors' data sheets,
  matched on the device name; ``--peak-gbs`` overrides). The chunk gather reads host memory over
  the host link, so it has no HBM percentage;
- **% of copy**: the same bandwidth against a plain copy moving the same bytes, measured in the
  same run (``torch.Tensor.copy_`` device to device of half the bytes, read + write; pinned host
  to device for the gather): what the memory system gives a transfer of this size;
- **vs reference**: the torch reference's time over the kernel's (the path ``kernels: reference``
  and machines without Triton run);
- **vs full SDPA** (decode attention only): ``scaled_dot_product_attention`` over the whole,
  uncompressed cache over the kernel's time, graph against graph when both could be captured
  (the full SDPA column shows the eager time and the graph's in brackets): what compression buys
  at decode.

Shapes default to Llama-3-8B attention (32 query heads, 8 KV heads, head dim 128), bf16, batch 4,
16 decoded tokens, a 32-token scoring window and 8-token retrieval chunks. Every time is the
median of ``triton.testing.do_bench`` (CUDA events, ``--warmup-ms`` of warm-up, ``--rep-ms`` of
timed calls, the L2 cache cleared before each call); each contender also rotates through enough
input sets to exceed twice the L2 cache, so no call reads data the previous one left there.
Targets (printed, not asserted): ragged decode attention at >= 70% of peak bandwidth at 32k
tokens, and >= 1.5x faster than the full cache with SDPA at 10% kept. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton.testing

from kvlab.bench.common import DTYPES, PEAK_GBS, context_label, device_name, parse_list
from kvlab.cache.packed import packed_decode_attention
from kvlab.compression.quantizers import KIVI
from kvlab.config.errors import ConfigError
from kvlab.kernels.compaction import compact_kv_reference
from kvlab.kernels.decode_attention import ragged_decode_attention_reference
from kvlab.kernels.dispatch import kernel_mode
from kvlab.kernels.merge import merge_scatter_reference
from kvlab.kernels.retrieval import chunk_topk_reference, gather_chunks_reference
from kvlab.kernels.tl.compaction import compact_kv_triton
from kvlab.kernels.tl.decode_attention import ragged_decode_attention_triton
from kvlab.kernels.tl.merge import merge_scatter_triton
from kvlab.kernels.tl.packed_attention import packed_decode_attention_triton
from kvlab.kernels.tl.retrieval import chunk_topk_triton, gather_chunks_triton
from kvlab.kernels.tl.window_scores import window_attention_scores_triton
from kvlab.kernels.types import segment_starts
from kvlab.kernels.window_scores import window_attention_scores_reference

HEADERS = [
    "kernel", "context", "kept", "MB moved", "triton µs", "graph µs", "GB/s", "% of peak", "% of copy",
    "reference µs", "vs reference", "full SDPA µs", "vs full SDPA",
]  # fmt: skip
MAX_SETS = 16  # input sets a contender rotates through at most


@dataclass
class Row:
    """One kernel at one (context, kept): the times in ms (None: not measured) and bytes moved."""

    kernel: str
    context: int
    kept: float | None
    bytes: int
    triton: float
    copy: float
    reference: float | None = None
    full: float | None = None
    host_link: bool = False  # the bytes cross the host link (no HBM peak applies)
    graph: float | None = None  # the Triton calls replayed from a CUDA graph: no launch overhead
    full_graph: float | None = None  # full SDPA replayed likewise

    @property
    def kernel_ms(self) -> float:
        """The kernels' own time: the graph replay's when it was measured, else the eager call's."""
        return self.graph if self.graph is not None else self.triton

    def speedup_over_full(self) -> float | None:
        """Full SDPA's time over the kernel's, graph against graph when both were measured."""
        if self.full is None:
            return None
        if self.graph is not None and self.full_graph is not None:
            return self.full_graph / self.graph
        return self.full / self.triton

    def cells(self, peak: float | None) -> list[str]:
        gbs = self.bytes / (self.kernel_ms * 1e-3) / 1e9
        copy_gbs = self.bytes / (self.copy * 1e-3) / 1e9  # the copy moved the same bytes
        of_peak = "n/a" if peak is None or self.host_link else f"{gbs / peak:.0%}"
        speedup = self.speedup_over_full()
        full = _us(self.full) if self.full_graph is None else f"{_us(self.full)} ({_us(self.full_graph)})"
        return [
            self.kernel, context_label(self.context), "-" if self.kept is None else f"{self.kept:.0%}",
            f"{self.bytes / 1e6:.1f}", f"{self.triton * 1e3:.1f}", _us(self.graph), f"{gbs:.0f}", of_peak,
            f"{gbs / copy_gbs:.0%}", _us(self.reference), _ratio(self.reference, self.triton),
            full, "n/a" if speedup is None else f"{speedup:.2f}x",
        ]  # fmt: skip


def _us(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms * 1e3:.1f}"


def _ratio(slow: float | None, fast: float) -> str:
    return "n/a" if slow is None else f"{slow / fast:.2f}x"


def peak_with_source(device: torch.device, override: float | None) -> tuple[float | None, str]:
    """``(GB/s, where the figure comes from)`` for the device's peak memory bandwidth."""
    if override is not None:
        return override, "--peak-gbs"
    name = torch.cuda.get_device_name(device)
    for key, gbs in PEAK_GBS:
        if key in name:
            return gbs, f"vendor data sheet, matched '{key}' in '{name}'"
    return None, f"unknown for '{name}' (pass --peak-gbs)"


class Timer:
    """``triton.testing.do_bench`` medians (ms) over input sets rotated past the L2 cache."""

    def __init__(self, device: torch.device, warmup_ms: int, rep_ms: int):
        self.do_bench = triton.testing.do_bench
        props = torch.cuda.get_device_properties(device)
        self.l2 = getattr(props, "L2_cache_size", 50 * 2**20) or 50 * 2**20
        self.warmup, self.rep = warmup_ms, rep_ms

    def sets(self, nbytes: int) -> int:
        """Input sets whose bytes together exceed twice the L2 cache (at most :data:`MAX_SETS`)."""
        return max(1, min(MAX_SETS, math.ceil(2 * self.l2 / max(nbytes, 1))))

    def time(self, fn: Callable[[object], object], sets: list) -> float:
        """Median ms of ``fn(inputs)``, each call on the next of ``sets``."""
        cycle = _cycle(sets)
        return self.do_bench(lambda: fn(next(cycle)), warmup=self.warmup, rep=self.rep, return_mode="median")

    def graph(self, fn: Callable[[object], object], sets: list) -> float | None:
        """Median ms per call of ``fn`` over every input set, replayed from one CUDA graph (the
        kernels alone, without Python's launch overhead); None when the calls cannot be captured
        (a host sync inside), with the reason on stderr, or without CUDA."""
        if not torch.cuda.is_available():
            return None
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for inputs in sets:  # compiled and allocated before the capture
                    fn(inputs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for inputs in sets:
                    fn(inputs)
            total = self.do_bench(graph.replay, warmup=self.warmup, rep=self.rep, return_mode="median")
        except Exception as error:  # a host sync or an uncapturable call: reported, not fatal
            print(f"(no CUDA graph: {type(error).__name__}: {str(error)[:200]})", file=sys.stderr)
            torch.cuda.synchronize()
            return None
        return total / len(sets)

    def row(self, kernel: str, T: int, kept: float | None, nbytes: int, make: Callable[[int], tuple],
            triton_fn: Callable[..., object], reference_fn: Callable[..., object],
            device: torch.device) -> Row:  # fmt: skip
        """A kernel's row: ``triton_fn(*make(seed))`` timed over enough input sets to pass the L2
        cache, ``reference_fn`` on the first set, and a plain copy of the same ``nbytes``."""
        sets = [make(i) for i in range(self.sets(nbytes))]
        triton_ms = self.time(lambda a: triton_fn(*a), sets)
        reference = self.time(lambda a: reference_fn(*a), sets[:1])
        return Row(kernel, T, kept, nbytes, triton_ms, self.copy(nbytes, device), reference)

    def copy(self, nbytes: int, device: torch.device, from_host: bool = False) -> float:
        """Median ms of a plain copy that moves ``nbytes``: a device-to-device copy of ``nbytes / 2``
        (read + write), or ``nbytes`` from pinned host memory to the device (the host link's bytes)."""
        size = max(1, nbytes if from_host else nbytes // 2)
        n = self.sets(size)
        pin = from_host and device.type == "cuda"
        sources = [torch.empty(size, dtype=torch.uint8, device="cpu" if from_host else device,
                               pin_memory=pin) for _ in range(n)]  # fmt: skip
        pairs = [(src, torch.empty(size, dtype=torch.uint8, device=device)) for src in sources]
        return self.time(lambda pair: pair[1].copy_(pair[0], non_blocking=True), pairs)


def _cycle(items: list) -> Iterator:
    while True:
        yield from items


@dataclass
class Shapes:
    B: int
    H: int
    Hkv: int
    D: int
    dtype: torch.dtype
    decoded: int
    window: int
    chunk: int
    device: torch.device

    def randn(self, *shape: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=self.device).to(self.dtype)

    def gen(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    @property
    def elt(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def kept_positions(s: Shapes, T: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """``[B, Hkv, K]`` ascending random positions below ``T`` (what a top-k selection keeps)."""
    order = torch.rand(s.B, s.Hkv, T, generator=gen, device=s.device).argsort(-1)
    return order[..., :K].sort(-1).values


def decode_inputs(s: Shapes, T: int, kept: float, seed: int) -> tuple:
    """Arguments of :func:`ragged_decode_attention_triton` over ragged heads: each keeps between
    0.5x and 1.5x the mean (``kept * T``), as a head allocator gives."""
    gen = s.gen(seed)
    mean = max(1, round(kept * T))
    lengths = (mean * (0.5 + torch.rand(s.B, s.Hkv, generator=gen, device=s.device))).round().long()
    lengths = lengths.clamp(1, T)
    N = int(lengths.sum())
    decode = [s.randn(s.B, s.Hkv, s.decoded, s.D, gen=gen) for _ in range(2)]
    prompt = [s.randn(N, s.D, gen=gen) for _ in range(2)]
    query = s.randn(s.B, s.H, 1, s.D, gen=gen)
    width = int(lengths.max())
    return (query, *prompt, segment_starts(lengths), lengths, *decode, s.decoded, s.D**-0.5, width)


def bench_decode(s: Shapes, T: int, kept: float, timer: Timer) -> Row:

    def make(seed: int) -> tuple:
        return decode_inputs(s, T, kept, seed)

    first = make(0)
    nbytes = (first[1].numel() * 2 + first[5].numel() * 2 + first[0].numel() * 2) * s.elt
    sets = [first] + [make(i) for i in range(1, timer.sets(nbytes))]
    triton_ms = timer.time(lambda a: ragged_decode_attention_triton(*a), sets)
    graph_ms = timer.graph(lambda a: ragged_decode_attention_triton(*a), sets)
    reference = timer.time(lambda a: ragged_decode_attention_reference(*a), sets[:1])
    full_bytes = s.B * s.Hkv * (T + s.decoded) * s.D * 2 * s.elt
    full_sets = [
        (sets[0][0], *(s.randn(s.B, s.Hkv, T + s.decoded, s.D, gen=s.gen(100 + i)) for _ in range(2)))
        for i in range(timer.sets(full_bytes))
    ]
    sdpa = lambda a: F.scaled_dot_product_attention(*a, enable_gqa=True)
    full, full_graph = timer.time(sdpa, full_sets), timer.graph(sdpa, full_sets)
    return Row("ragged decode attention", T, kept, nbytes, triton_ms, timer.copy(nbytes, s.device),
               reference, full, graph=graph_ms, full_graph=full_graph)  # fmt: skip


#: the packed decode row's format: KIVI's own setting (Liu et al. 2024), 2 bits, group 32, residual 128
PACKED = KIVI(bits=2, group=32, residual=128)


def bench_packed_decode(s: Shapes, T: int, kept: float, timer: Timer) -> Row:
    """Decode attention over the ragged heads of :func:`decode_inputs` stored as :data:`PACKED`
    codes: the fused dequantizing kernel; its reference is the torch path over the codes."""

    def make(seed: int) -> tuple:
        query, keys, values, starts, lengths, dk, dv, t, scaling, _ = decode_inputs(s, T, kept, seed)
        packed = PACKED.pack(keys, values, starts, lengths)
        body, residual = packed.runs()  # the widths, known to the cache: no host sync per call
        return (query, packed.keys, packed.values, packed.body_starts, packed.body_lengths,
                packed.residual_keys, packed.residual_values, packed.residual_starts,
                packed.residual_lengths, dk, dv, t, scaling, (body.width, residual.width),
                (query, packed, starts, lengths, dk, dv, t, scaling))  # fmt: skip

    first = make(0)
    packed = first[-1][1]
    nbytes = packed.nbytes() + (first[9].numel() * 2 + first[0].numel() * 2) * s.elt
    sets = [first] + [make(i) for i in range(1, timer.sets(nbytes))]
    triton_ms = timer.time(lambda a: packed_decode_attention_triton(*a[:-1]), sets)
    graph_ms = timer.graph(lambda a: packed_decode_attention_triton(*a[:-1]), sets)
    with kernel_mode("reference"):
        reference = timer.time(lambda a: packed_decode_attention(*a[-1]), sets[:1])
    return Row("packed decode attention (KIVI-2)", T, kept, nbytes, triton_ms, timer.copy(nbytes, s.device),
               reference, graph=graph_ms)  # fmt: skip


def bench_window(s: Shapes, T: int, timer: Timer) -> Row:

    def make(seed: int) -> tuple:
        gen = s.gen(seed)
        valid = torch.ones(s.B, T, dtype=torch.bool, device=s.device)
        queries = s.randn(s.B, s.H, s.window, s.D, gen=gen)
        return queries, s.randn(s.B, s.Hkv, T, s.D, gen=gen), valid, s.D**-0.5

    nbytes = (s.B * s.Hkv * T * s.D + s.B * s.H * s.window * s.D) * s.elt + s.B * T * (1 + 4 * s.H)
    return timer.row("window scores", T, None, nbytes, make, window_attention_scores_triton,
                     window_attention_scores_reference, s.device)  # fmt: skip


def bench_compaction(s: Shapes, T: int, kept: float, timer: Timer) -> Row:

    K = max(1, round(kept * T))

    def make(seed: int) -> tuple:
        gen = s.gen(seed)
        counts = torch.full((s.B, s.Hkv), K, device=s.device)
        keys, values = (s.randn(s.B, s.Hkv, T, s.D, gen=gen) for _ in range(2))
        return keys, values, kept_positions(s, T, K, gen), counts

    N = s.B * s.Hkv * K
    nbytes = 4 * N * s.D * s.elt + N * 8  # kept rows of K and V read and written, positions read
    return timer.row("compaction", T, kept, nbytes, make, compact_kv_triton, compact_kv_reference, s.device)


def bench_merge(s: Shapes, T: int, kept: float, timer: Timer) -> Row:

    rows = s.B * s.Hkv
    N, M = rows * max(1, round(kept * T)), rows * (T - max(1, round(kept * T)))

    def make(seed: int) -> tuple:
        gen = s.gen(seed)
        target = torch.randint(0, N, (M,), generator=gen, device=s.device)
        weights = torch.rand(M, generator=gen, device=s.device)
        return s.randn(N, s.D, gen=gen), s.randn(M, s.D, gen=gen), target, weights

    nbytes = (2 * N + M) * s.D * s.elt + M * (8 + 4)  # kept read + written, evicted, targets, weights
    return timer.row(
        "merge (LOOK-M)", T, kept, nbytes, make, merge_scatter_triton, merge_scatter_reference, s.device
    )


def bench_chunk_topk(s: Shapes, T: int, kept: float, timer: Timer) -> Row:

    R, NC = s.B * s.Hkv, T // s.chunk
    n_sel = max(1, round(kept * T) // s.chunk)
    r = torch.arange(R, device=s.device)
    rows = torch.stack([r // s.Hkv, r % s.Hkv], -1)  # (sample, KV head) of every row: all retrieve

    def make(seed: int) -> tuple:
        gen = s.gen(seed)
        valid = torch.ones(R, NC, dtype=torch.bool, device=s.device)
        n = torch.full((R,), n_sel, device=s.device)
        return s.randn(s.B, s.H, 1, s.D, gen=gen), s.randn(R, NC, s.D, gen=gen), rows, valid, n, s.Hkv, n_sel

    nbytes = R * NC * (s.D * s.elt + 1 + 8) + R * n_sel * 8  # index, validity, scores, chosen ids
    return timer.row(
        "chunk scores + top-k", T, kept, nbytes, make, chunk_topk_triton, chunk_topk_reference, s.device
    )


def bench_gather(s: Shapes, T: int, kept: float, timer: Timer) -> Row:

    R, NC = s.B * s.Hkv, T // s.chunk
    S = max(1, round(kept * T) // s.chunk)
    pinned = s.device.type == "cuda"  # the store as the retrieve selector keeps it on a GPU machine
    host = [torch.empty(R, NC * s.chunk, s.D, dtype=s.dtype, pin_memory=pinned) for _ in range(2)]
    for t in host:
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).to(s.dtype))

    def make(seed: int) -> tuple:
        gen = s.gen(seed)
        ids = torch.rand(R, 1, NC, generator=gen, device=s.device).argsort(-1)[..., :S].sort(-1).values
        return host[0], host[1], ids, s.chunk, s.device

    nbytes = 2 * R * S * s.chunk * s.D * s.elt  # read from host memory (and written on the device)
    sets = [make(i) for i in range(MAX_SETS)]
    triton_ms = timer.time(lambda a: gather_chunks_triton(*a), sets)
    reference = timer.time(lambda a: gather_chunks_reference(*a), sets[:1])
    return Row("chunk gather (host)", T, kept, nbytes, triton_ms, timer.copy(nbytes, s.device, True),
               reference, host_link=True)  # fmt: skip


def measure(
    shapes: Shapes,
    contexts: list[int],
    kept: list[float],
    timer: Timer,
    on_row: Callable[[Row], None] = lambda row: None,
) -> list[Row]:
    """Every kernel's row at every context and kept fraction (window scores: one per context);
    ``on_row`` sees each row as soon as it is measured."""
    benches: list[tuple[Callable[..., Row], bool]] = [
        (bench_decode, True), (bench_packed_decode, True), (bench_window, False), (bench_compaction, True),
        (bench_merge, True), (bench_chunk_topk, True), (bench_gather, True),
    ]  # fmt: skip
    rows = []
    for T in contexts:
        for bench, per_kept in benches:
            for row in [bench(shapes, T, p, timer) for p in kept] if per_kept else [bench(shapes, T, timer)]:
                on_row(row)
                rows.append(row)
    return rows


def target_lines(rows: list[Row], peak: float | None) -> list[str]:
    """The decode targets checked against the table (met / NOT met)."""
    lines = []
    longest = max(row.context for row in rows)
    for row in rows:
        if row.kernel != "ragged decode attention":
            continue
        where = f"{context_label(row.context)}, {row.kept:.0%} kept"
        if row.context == longest and peak is not None:
            share = row.bytes / (row.kernel_ms * 1e-3) / 1e9 / peak
            lines.append(f"decode at {where}: {share:.0%} of peak (>= 70%: {_verdict(share >= 0.7)})")
        speedup = row.speedup_over_full()
        if abs(row.kept - 0.1) < 1e-9 and speedup is not None:
            lines.append(f"decode at {where}: {speedup:.2f}x full SDPA (>= 1.5x: {_verdict(speedup >= 1.5)})")
    return lines


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def render(rows: list[Row], peak: float | None, fmt: str) -> str:
    table = [row.cells(peak) for row in rows]
    if fmt == "markdown":
        lines = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join("---" for _ in HEADERS) + "|"]
        return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in table])
    widths = [max([len(h), *(len(c[i]) for c in table)]) for i, h in enumerate(HEADERS)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [HEADERS, *table])


def run(args: list[str]) -> None:
    p = argparse.ArgumentParser(prog="kvlab bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="4k,32k", help="prompt lengths (comma separated, k = 1024)")
    p.add_argument("--kept", default="0.1,0.5", help="kept fractions of the prompt")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--peak-gbs", type=float, default=None, help="peak memory bandwidth (GB/s) if not known")
    p.add_argument("--warmup-ms", type=int, default=25, help="do_bench warm-up per contender (ms)")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench timed calls per contender (ms)")
    p.add_argument("--format", choices=["markdown", "text"], default="markdown")
    p.add_argument("--device", default="cuda")
    opts = p.parse_args(args)
    if not torch.cuda.is_available():
        raise ConfigError(
            "kvlab bench kernels times the Triton kernels on a CUDA device, and this machine has none "
            "(torch.cuda.is_available() is False). Run it on a GPU machine (.ci/gpu runs it there); "
            "the kernels' CPU paths are timed by `kvlab bench decode --quick` and `kvlab bench window`."
        )
    device = torch.device(opts.device)
    shapes = Shapes(
        opts.batch, opts.heads, opts.kv_heads, opts.head_dim, DTYPES[opts.dtype], 16, 32, 8, device
    )
    timer = Timer(device, opts.warmup_ms, opts.rep_ms)
    peak, source = peak_with_source(device, opts.peak_gbs)
    big = 2 << 30  # a 1 GiB copy: 2 GiB read + written
    copy_gbs = big / (timer.copy(big, device) * 1e-3) / 1e9
    print(
        f"kvlab bench kernels on {device_name(device)}, {opts.dtype}: B={opts.batch}, H={opts.heads}, "
        f"Hkv={opts.kv_heads}, D={opts.head_dim}, 16 decoded tokens, window 32, chunks of 8; medians of "
        f"triton.testing.do_bench ({opts.warmup_ms} ms warm-up, {opts.rep_ms} ms timed, L2 cleared, inputs "
        f"rotated past 2x the {timer.l2 / 2**20:.0f} MiB L2)\n"
    )
    print(f"Peak memory bandwidth: {'unknown' if peak is None else f'{peak:.0f} GB/s'} ({source}); a 1 GiB "
          f"device-to-device copy measured {copy_gbs:.0f} GB/s (read + write).\n", flush=True)  # fmt: skip
    stream = opts.format == "markdown"  # rows as they come: a cut-off run still shows its rows
    if stream:
        print("\n".join(render([], peak, "markdown").splitlines()[:2]), flush=True)

    def show(row: Row) -> None:
        if stream:
            print("| " + " | ".join(row.cells(peak)) + " |", flush=True)

    rows = measure(shapes, parse_list(opts.contexts, int), parse_list(opts.kept, float), timer, show)
    if not stream:
        print(render(rows, peak, opts.format))
    print("\nTargets (reported, not asserted):\n")
    print("\n".join(f"- {line}" for line in target_lines(rows, peak)))
