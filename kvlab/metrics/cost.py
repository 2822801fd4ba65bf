"""Cost of a run: KV memory kept, compression time relative to prefill, decode speed, peak memory.

From the per-sample records (batch timings are split evenly over the batch's samples):

- ``kv_ratio``: mean over samples of kept / full prompt KV bytes;
- ``kv_bytes_full`` / ``kv_bytes_kept``: totals over samples;
- ``prompt_tokens``, ``output_tokens``, ``prefill_seconds``, ``compression_seconds``,
  ``decode_seconds``: means over samples (prefill excludes the compression inside it);
- ``compression_over_prefill``: total compression seconds / total prefill seconds;
- ``decode_tokens_per_second``: total generated tokens / total decode seconds;
- ``budget_overshoot_samples`` / ``budget_overshoot_max``: samples whose protected window did
  not fit their asked budget (a short prompt under a ratio budget) and so kept more than asked,
  and the largest excess in tokens per head (``budget.max_window_share`` shrinks the window
  instead; see ``docs/architecture.md``);
- ``kv_bytes_allocated_peak``: the most bytes one batch's ``CompressedCache`` allocated (kept
  prompt K/V, reserved decode region, offsets);
- ``peak_memory_bytes``: ``torch.cuda.max_memory_allocated`` over the run's batches on CUDA;
  null elsewhere, with ``peak_memory_note`` saying the process peak is not available.
"""

from __future__ import annotations

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
MEAN_FIELDS = SUM_FIELDS[3:] + SUM_FIELDS[:1]
NO_PEAK_NOTE = (
    "process peak memory is not available on this device (CUDA only); "
    "kv_bytes_allocated_peak is the largest KV cache kvlab allocated for one batch"
)


class CostMetrics(Metric):
    """Memory and time of a run (see the module docstring). ``update(values)`` takes ``{field: [B]}``."""

    full_state_update = False

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.add_state("samples", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        for name in SUM_FIELDS:
            self.add_state(name, torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        for name in MAX_FIELDS:  # -1: never reported
            self.add_state(name, torch.tensor(-1.0, dtype=torch.float64), dist_reduce_fx="max")
        self.add_state("overshoot_samples", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("overshoot_max", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="max")

    def update(self, values: dict[str, torch.Tensor]) -> None:
        self.samples += values["kv_ratio"].numel()
        for name in SUM_FIELDS:
            setattr(self, name, getattr(self, name) + values[name].to(torch.float64).nansum())
        overshoot = values.get(OVERSHOOT)
        if overshoot is not None:
            overshoot = overshoot.to(torch.float64).nan_to_num(0.0)
            self.overshoot_samples += (overshoot > 0).sum()
            self.overshoot_max = torch.maximum(self.overshoot_max, overshoot.max())
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
        out["budget_overshoot_samples"] = int(self.overshoot_samples)
        out["budget_overshoot_max"] = int(self.overshoot_max)
        return out

    def update_records(self, records: list[dict[str, Any]]) -> None:
        """Update from prediction records."""
        if records:
            self.update(record_values(records, (*SUM_FIELDS, *MAX_FIELDS, OVERSHOOT)))
