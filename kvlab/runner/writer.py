"""Incremental prediction writing and the end-of-run summary.

``predictions.jsonl`` gets one line per sample as soon as its batch is done (flushed and
fsynced), so a crashed run keeps everything finished so far and a re-run of the same config
skips those samples. ``metrics.json`` holds the :class:`~kvlab.metrics.run.RunMetrics`
aggregates over every line of the file: the writer feeds the records of a resumed run to the
metrics first (rank 0 only), then each batch's records as they are written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import BasePredictionWriter

from kvlab.metrics.run import RunMetrics, summarize

__all__ = ["METRICS", "PREDICTIONS", "PredictionWriter", "read_predictions", "summarize"]

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


class PredictionWriter(BasePredictionWriter):
    """Appends each batch's records to ``<run_dir>/predictions.jsonl``; writes ``metrics.json`` at the end."""

    def __init__(self, run_dir: str | Path):
        super().__init__(write_interval="batch")
        self.run_dir = Path(run_dir)
        self.metrics = RunMetrics()
        self.summary: dict[str, Any] = {}

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

    def on_predict_start(self, trainer, pl_module):
        self.metrics.reset()
        if trainer.global_rank == 0:
            self.metrics.update(read_predictions(self.run_dir))

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ):
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            for record in prediction:
                f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.metrics.update(prediction)

    def on_predict_end(self, trainer, pl_module):
        self.summary = self.metrics.compute()
        if trainer.global_rank != 0:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / METRICS).write_text(json.dumps(self.summary, indent=2) + "\n")
        if pl_module.logger is not None:
            for key, value in self.summary.items():
                if isinstance(value, int | float):
                    pl_module.logger.experiment.add_scalar(f"summary/{key}", value, 0)
            pl_module.logger.experiment.flush()
