"""Mean over samples of per-sample values: the base of the fidelity and task metrics.

Every per-sample value lives in the prediction records (``predictions.jsonl``), so one metric
class serves both paths: batches during a run and the records of a finished run (resume,
``kvlab compare``). States are sums and counts reduced by ``sum``: exact under DDP.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torchmetrics import Metric


def record_values(records: Sequence[dict[str, Any]], fields: Iterable[str]) -> dict[str, torch.Tensor]:
    """``{field: [B] float64}`` from records; NaN where a record lacks the field (or holds null)."""
    out = {}
    for name in fields:
        values = [r.get(name) for r in records]
        out[name] = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)
    return out


class SampleMeans(Metric):
    """Per field: the mean over the samples that have it (samples without it are not counted).

    Args:
        fields: names of the per-sample values (record keys).

    ``update(values)`` takes ``{field: [B]}`` tensors (NaN = missing); ``compute()`` returns
    ``{field: mean}`` for the fields seen at least once.
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, fields: Sequence[str], **kwargs: Any):
        super().__init__(**kwargs)
        self.fields = tuple(fields)
        for name in self.fields:
            self.add_state(f"{name}_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
            self.add_state(f"{name}_count", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values: dict[str, torch.Tensor]) -> None:
        for name in self.fields:
            if name not in values:
                continue
            value = values[name].to(torch.float64).flatten()
            present = ~torch.isnan(value)
            setattr(self, f"{name}_sum", getattr(self, f"{name}_sum") + value[present].sum())
            setattr(self, f"{name}_count", getattr(self, f"{name}_count") + present.sum())

    def compute(self) -> dict[str, float]:
        out = {}
        for name in self.fields:
            count = float(getattr(self, f"{name}_count"))
            if count > 0:
                out[name] = float(getattr(self, f"{name}_sum")) / count
        return out

    def update_records(self, records: Sequence[dict[str, Any]]) -> None:
        """Update from prediction records."""
        if records:
            self.update(record_values(records, self.fields))
