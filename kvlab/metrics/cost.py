"""Cost of a run: KV memory kept, compression time relative to prefill, decode speed, peak memory.

From the per-sample records (batch timings are split evenly over the batch's samples):

- ``kv_ratio``: mean over samples of kept / full prompt KV bytes;
- ``kv_bytes_full`` / ``kv_bytes_kept``: totals over samples;
- ``prompt_tokens``, ``output_tokens``, ``prefill_seconds``, ``compression_seconds``,
  ``decode_seconds``: means over samples (prefill excludes the compression inside it);
- ``compression_over_prefill``: total compression seconds / total prefill seconds;
- ``decode_tokens_per_second``: total generated tokens / total decode seconds;
- ``budget_overshoot_samples`` / ``budget_overshoot_max``: samples that kept more than asked at
  some layer, and the largest excess in tokens per head: a protected window that does not fit
  the asked budget (a short prompt under a ratio budget; ``budget.max_window_share`` shrinks the
  window instead), or a component keeping beyond its layer budget (``text_prior`` with
  ``overflow: keep_all_text``); see ``docs/architecture.md``;
- ``kv_bytes_device`` / ``kv_bytes_offloaded`` / ``kv_ratio_device`` / ``retrieval_bytes_per_step``
  (only for pipelines that retrieve, e.g. ``hybridkv``, ``retrieval``): totals over samples of the
  accelerator-resident prompt KV (kept entries + chunk index + one step's fetch buffer) and of
  the K/V held in host memory, device over full bytes, and the mean K/V bytes fetched from the
  host per decode step (the ``retrieve`` selector's record fields, ``RetrieveSelector.report``);
- ``kv_bytes_allocated_peak``: the most bytes one batch's ``CompressedCache`` allocated (kept
  prompt K/V, reserved decode region, offsets);
- ``peak_memory_bytes``: the most memory over the run's batches, of the kind
  ``peak_memory_kind`` names: ``"cuda_allocated"`` (``torch.cuda.max_memory_allocated``, reset
  before each batch) on CUDA, ``"process_rss_high_water"`` elsewhere (the process's peak
  resident set size, ``getrusage(RUSAGE_SELF).ru_maxrss``: a high-water mark over the process's
  whole life, model loading included, so each record also holds
  ``peak_memory_rss_before_bytes``, the resident set size when its batch started);
  ``"mixed"`` when the records mix kinds (a run resumed on another device). Null, with
  ``peak_memory_note``, only when no record has a figure (records written by older kvlab, or a
  platform without ``resource``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torchmetrics import Metric

from kvlab.metrics.means import record_values

SUM_FIELDS = (
    "kv_ratio",
    "kv_bytes_full",
    "kv_bytes_kept",
    "prompt_tokens",
    "output_tokens",
    "prefill_seconds",
    "compression_seconds",
    "decode_seconds",
)
MAX_FIELDS = ("kv_bytes_allocated", "peak_memory_bytes")
OVERSHOOT = "budget_overshoot"  # per record: tokens per head kept beyond the asked budget
#: per record, only for pipelines that retrieve (summed over the records that have them)
OFFLOAD_FIELDS = ("kv_bytes_device", "kv_bytes_offloaded", "retrieval_bytes_per_step")
MEAN_FIELDS = SUM_FIELDS[3:] + SUM_FIELDS[:1]
#: ``peak_memory_kind`` of a record: CUDA allocator peak, or the process's resident-set high-water mark
PEAK_KINDS = ("cuda_allocated", "process_rss_high_water")
NO_PEAK_NOTE = (
    "peak memory is not available: no record has a peak_memory_bytes figure (written by an older "
    "kvlab, or no CUDA and no resource module); kv_bytes_allocated_peak is the largest KV cache "
    "kvlab allocated for one batch"
)


def process_peak_rss_bytes() -> int | None:
    """The process's peak resident set size so far (``ru_maxrss``; a lifetime high-water mark).

    ``ru_maxrss`` is in KiB on Linux and in bytes on macOS; None where ``resource`` is missing
    (Windows). The kernel updates the mark lazily, so it can trail the current resident set
    size by a few pages: the larger of the two is returned.
    """
    try:
        import resource  # optional: this standard module is missing on Windows
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = int(peak) if sys.platform == "darwin" else int(peak) * 1024
    return max(peak, process_rss_bytes() or 0)


def process_rss_bytes() -> int | None:
    """The process's resident set size now (psutil, which accelerate installs; else ``/proc``)."""
    try:
        import psutil  # optional dependency (accelerate installs it); /proc/self/statm otherwise
    except ImportError:
        try:
            with open("/proc/self/statm") as file:
                return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return None
    return int(psutil.Process().memory_info().rss)


class CostMetrics(Metric):
    """Memory and time of a run (see the module docstring). ``update(values)`` takes ``{field: [B]}``
    (``peak_<kind>``: 1 for the records whose ``peak_memory_kind`` is that kind of :data:`PEAK_KINDS`)."""

    full_state_update = False

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.add_state("samples", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        for name in SUM_FIELDS:
            self.add_state(name, torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        for name in MAX_FIELDS:  # -1: never reported
            self.add_state(name, torch.tensor(-1.0, dtype=torch.float64), dist_reduce_fx="max")
        self.add_state("overshoot_samples", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        for name in (*OFFLOAD_FIELDS, "offload_full", "offload_samples"):
            self.add_state(name, torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("overshoot_max", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="max")
        for kind in PEAK_KINDS:  # records whose peak figure is of that kind
            self.add_state(f"peak_{kind}", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values: dict[str, torch.Tensor]) -> None:
        self.samples += values["kv_ratio"].numel()
        for name in SUM_FIELDS:
            setattr(self, name, getattr(self, name) + values[name].to(torch.float64).nansum())
        overshoot = values.get(OVERSHOOT)
        if overshoot is not None:
            overshoot = overshoot.to(torch.float64).nan_to_num(0.0)
            self.overshoot_samples += (overshoot > 0).sum()
            self.overshoot_max = torch.maximum(self.overshoot_max, overshoot.max())
        device = values.get(OFFLOAD_FIELDS[0])
        if device is not None:
            present = ~torch.isnan(device.to(torch.float64))
            for name in OFFLOAD_FIELDS:
                setattr(self, name, getattr(self, name) + values[name].to(torch.float64)[present].nansum())
            self.offload_full += values["kv_bytes_full"].to(torch.float64)[present].nansum()
            self.offload_samples += present.sum()
        for kind in PEAK_KINDS:
            count = values.get(f"peak_{kind}")
            if count is not None:
                setattr(self, f"peak_{kind}", getattr(self, f"peak_{kind}") + count.nansum())
        for name in MAX_FIELDS:
            value = values.get(name)
            if value is not None and (~torch.isnan(value)).any():
                setattr(
                    self,
                    name,
                    torch.maximum(getattr(self, name), value.to(torch.float64).nan_to_num(-1).max()),
                )

    def compute(self) -> dict[str, Any]:
        n = float(self.samples)
        if n == 0:
            return {}
        out: dict[str, Any] = {"samples": int(n)}  # reduced over ranks like every state
        out.update({name: float(getattr(self, name)) / n for name in MEAN_FIELDS})
        out["kv_bytes_full"] = int(self.kv_bytes_full)
        out["kv_bytes_kept"] = int(self.kv_bytes_kept)
        decode, prefill = float(self.decode_seconds), float(self.prefill_seconds)
        out["decode_tokens_per_second"] = float(self.output_tokens) / decode if decode > 0 else 0.0
        out["compression_over_prefill"] = float(self.compression_seconds) / max(prefill, 1e-9)
        allocated = float(self.kv_bytes_allocated)
        out["kv_bytes_allocated_peak"] = int(allocated) if allocated >= 0 else None
        peak = float(self.peak_memory_bytes)
        out["peak_memory_bytes"] = int(peak) if peak >= 0 else None
        if peak < 0:
            out["peak_memory_note"] = NO_PEAK_NOTE
        else:
            kinds = [kind for kind in PEAK_KINDS if float(getattr(self, f"peak_{kind}")) > 0]
            # records from before peak_memory_kind existed measured on CUDA only
            out["peak_memory_kind"] = "mixed" if len(kinds) > 1 else (kinds or ["cuda_allocated"])[0]
        out["budget_overshoot_samples"] = int(self.overshoot_samples)
        out["budget_overshoot_max"] = int(self.overshoot_max)
        if float(self.offload_samples) > 0:
            out["kv_bytes_device"] = int(self.kv_bytes_device)
            out["kv_bytes_offloaded"] = int(self.kv_bytes_offloaded)
            out["kv_ratio_device"] = float(self.kv_bytes_device) / max(float(self.offload_full), 1.0)
            samples = float(self.offload_samples)
            out["retrieval_bytes_per_step"] = float(self.retrieval_bytes_per_step) / samples
        return out

    def update_records(self, records: list[dict[str, Any]]) -> None:
        """Update from prediction records."""
        if records:
            values = record_values(records, (*SUM_FIELDS, *MAX_FIELDS, OVERSHOOT, *OFFLOAD_FIELDS))
            for kind in PEAK_KINDS:
                values[f"peak_{kind}"] = torch.tensor(
                    [float(r.get("peak_memory_kind") == kind) for r in records], dtype=torch.float64
                )
            self.update(values)
