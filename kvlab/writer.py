"""Incremental prediction writing and the end-of-run summary.

``predictions.jsonl`` gets one line per sample as soon as its batch is done (flushed and
fsynced), so a crashed run keeps everything finished so far and a re-run of the same config
skips those samples. ``metrics.json`` summarises every line of the file (resumed ones too).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from statistics import mean
from typing import Any

from lightning.pytorch.callbacks import BasePredictionWriter

PREDICTIONS = "predictions.jsonl"
METRICS = "metrics.json"


def read_predictions(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of a run's predictions file (a truncated last line from a crash is ignored)."""
    path = Path(run_dir) / PREDICTIONS
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over records: task scores (when answers exist), KV ratio and bytes, timings, throughput."""
    if not records:
        return {"samples": 0}
    summary: dict[str, Any] = {"samples": len(records)}
    for key in ("exact_match", "contains_answer"):
        values = [r[key] for r in records if key in r]
        if values:
            summary[key] = mean(values)
    for key in (
        "kv_ratio",
        "prompt_tokens",
        "output_tokens",
        "prefill_seconds",
        "compression_seconds",
        "decode_seconds",
    ):
        summary[key] = mean(r[key] for r in records)
    summary["kv_bytes_full"] = sum(r["kv_bytes_full"] for r in records)
    summary["kv_bytes_kept"] = sum(r["kv_bytes_kept"] for r in records)
    decode_time = sum(r["decode_seconds"] for r in records)
    summary["decode_tokens_per_second"] = (
        sum(r["output_tokens"] for r in records) / decode_time if decode_time else 0.0
    )
    summary["compression_over_prefill"] = summary["compression_seconds"] / max(
        summary["prefill_seconds"], 1e-9
    )
    return summary


class PredictionWriter(BasePredictionWriter):
    """Appends each batch's records to ``<run_dir>/predictions.jsonl``; writes ``metrics.json`` at the end."""

    def __init__(self, run_dir: str | Path):
        super().__init__(write_interval="batch")
        self.run_dir = Path(run_dir)

    @property
    def path(self) -> Path:
        return self.run_dir / PREDICTIONS

    def completed_ids(self) -> set[str]:
        """Ids already in the predictions file (skipped when the run is resumed)."""
        return {str(r["id"]) for r in read_predictions(self.run_dir)}

    def drop_partial_line(self) -> None:
        """Remove a last line cut short by a crash, so new records start on a fresh line."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            self.path.write_bytes(data[: data.rfind(b"\n") + 1])

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ):
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            for record in prediction:
                f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def on_predict_end(self, trainer, pl_module):
        summary = summarize(read_predictions(self.run_dir))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / METRICS).write_text(json.dumps(summary, indent=2) + "\n")
        if pl_module.logger is not None:
            for key, value in summary.items():
                if isinstance(value, int | float):
                    pl_module.logger.experiment.add_scalar(f"summary/{key}", value, 0)
            pl_module.logger.experiment.flush()
