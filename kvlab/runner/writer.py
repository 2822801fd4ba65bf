"""Incremental prediction writing, the merge of data-parallel shards and the end-of-run summary.

One process: ``predictions.jsonl`` gets one line per sample as soon as its batch is done
(flushed and fsynced), so a crashed run keeps everything finished so far and a re-run of the
same config skips those samples. ``metrics.json`` holds the :class:`~kvlab.metrics.run.RunMetrics`
aggregates over every record: the writer feeds the records of a resumed run to the metrics
first, then each batch's records as they are written.

Data-parallel (``world_size > 1``): each rank appends to its own shard
``predictions.rank<k>.jsonl`` (no two processes write one file). At the end every rank waits
at a barrier, then rank 0 merges the previous ``predictions.jsonl`` and every shard into
``predictions.jsonl`` in dataset order (written atomically, shards deleted afterwards) and
computes ``metrics.json`` from the merged records: the metrics are sums and maxima over
records, so this is their reduction over the ranks, and it holds even when a rank had nothing
left to do on a resumed run. A run killed before the merge leaves its shards; a re-run reads
them (:func:`read_predictions`) and skips their samples. ``metrics.json`` is written atomically.

Kept positions (``model.record_positions``): a record carrying
:data:`~kvlab.runner.positions.RECORD_FIELD` has it moved to ``positions.jsonl`` (the rank's
``positions.rank<k>.jsonl``), written before the predictions line and merged the same way
(:mod:`kvlab.runner.positions`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import BasePredictionWriter
from torchmetrics import Metric

from kvlab.metrics.run import RunMetrics, summarize
from kvlab.runner import positions
from kvlab.runner.files import atomic_write_text, read_jsonl

__all__ = [
    "METRICS",
    "PREDICTIONS",
    "PredictionWriter",
    "merge_predictions",
    "read_predictions",
    "unreadable_lines",
    "shard_paths",
    "summarize",
]

PREDICTIONS = "predictions.jsonl"
METRICS = "metrics.json"
SHARD = re.compile(r"predictions\.rank(\d+)\.jsonl")


def shard_name(rank: int) -> str:
    """The predictions shard of a data-parallel rank: ``predictions.rank<k>.jsonl``."""
    return f"predictions.rank{rank}.jsonl"


def shard_paths(run_dir: str | Path) -> list[Path]:
    """The run's predictions shards, by rank."""
    paths = [p for p in Path(run_dir).glob("predictions.rank*.jsonl") if SHARD.fullmatch(p.name)]
    return sorted(paths, key=lambda p: int(SHARD.fullmatch(p.name).group(1)))  # type: ignore[union-attr]


def read_predictions(run_dir: str | Path, ids: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """All records of a run: ``predictions.jsonl`` then the shards of an unmerged data-parallel run,
    each sample once (the first record of an id wins; a truncated last line is ignored, and so is a
    line that is not a JSON object with an ``id``). ``ids``: keep only the records of these samples
    (the run's selection: a line of another sample is never counted, :func:`unreadable_lines`)."""
    run_dir = Path(run_dir)
    keep = None if ids is None else {str(i) for i in ids}
    seen: set[str] = set()
    records = []
    for path in [run_dir / PREDICTIONS, *shard_paths(run_dir)]:
        for record in read_jsonl(path):
            if not isinstance(record, dict) or "id" not in record:
                continue
            sample_id = str(record["id"])
            if sample_id not in seen and (keep is None or sample_id in keep):
                seen.add(sample_id)
                records.append(record)
    return records


def completed_ids(run_dir: str | Path) -> frozenset[str]:
    """Ids of the samples already written in ``predictions.jsonl`` or a shard (a resumed run skips
    them; an id outside the run's selection is never among its pending samples anyway)."""
    return frozenset(str(r["id"]) for r in read_predictions(run_dir))


def unreadable_lines(run_dir: str | Path, ids: Sequence[str]) -> list[str]:
    """What a resume cannot count, one phrase per line with its file and line number: a line that is
    not JSON (except a last line cut short by a crash, which is dropped), not a JSON object with an
    ``id``, or whose id is not among ``ids`` (the run's selected samples)."""
    run_dir = Path(run_dir)
    known = {str(i) for i in ids}
    problems = []
    for path in [run_dir / PREDICTIONS, *shard_paths(run_dir)]:
        if not path.is_file():
            continue
        data = path.read_bytes()
        lines = data.decode("utf-8", errors="replace").split("\n")
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path.name} line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):  # no newline after it: a line cut short by a crash
                    continue
                problems.append(f"{where} is not valid JSON")
                continue
            if not isinstance(record, dict) or "id" not in record:
                problems.append(f"{where} is not a JSON object with an 'id'")
            elif str(record["id"]) not in known:
                problems.append(
                    f"{where} has id {str(record['id'])!r}, which is not among this run's samples"
                )
    return problems


def merge_predictions(run_dir: str | Path, order: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Merge ``predictions.jsonl`` and the shards into ``predictions.jsonl`` in dataset order.

    ``order`` is the dataset's ids; records of other ids follow in the order they were read (kept
    in the file, not returned). The merged file replaces the old one atomically, then the shards
    are deleted (a crash in between leaves duplicates that :func:`read_predictions` reads once).
    Returns the records of the samples in ``order`` (all records when it is empty).
    """
    run_dir = Path(run_dir)
    position = {str(i): n for n, i in enumerate(order)}
    records = read_predictions(run_dir)
    records = sorted(records, key=lambda r: position.get(str(r.get("id")), len(position)))
    atomic_write_text(run_dir / PREDICTIONS, "".join(json.dumps(r) + "\n" for r in records))
    for shard in shard_paths(run_dir):
        shard.unlink()
    return [r for r in records if not position or str(r.get("id")) in position]


def local_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``metrics.json`` dict of ``records`` computed in this process alone (no reduction over
    ranks: rank 0 calls it on the merged records, which already hold every rank's samples)."""
    metrics = RunMetrics()
    for module in metrics.modules():
        if isinstance(module, Metric):
            module.sync_on_compute = False
            module._to_sync = False
    metrics.update(records)
    return metrics.compute()


def drop_partial_line(path: Path) -> None:
    """Remove a last line cut short by a crash, so new records start on a fresh line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as file:
            file.truncate(data.rfind(b"\n") + 1)


class PredictionWriter(BasePredictionWriter):
    """Appends each batch's records to the run's predictions file (one process) or to the rank's
    shard (data-parallel); merges the shards and writes ``metrics.json`` at the end.

    Args:
        run_dir: the run directory.
        order: the dataset's sample ids, in dataset order (the order of the merged file).
    """

    def __init__(self, run_dir: str | Path, order: Sequence[str] = ()):
        super().__init__(write_interval="batch")
        self.run_dir = Path(run_dir)
        self.order = [str(i) for i in order]
        self.metrics = RunMetrics()
        self.summary: dict[str, Any] = {}
        self.path = self.run_dir / PREDICTIONS
        self.positions_path = self.run_dir / positions.POSITIONS

    def drop_partial_line(self) -> None:
        """Remove a last line cut short by a crash from this process's predictions file."""
        drop_partial_line(self.path)

    def on_predict_start(self, trainer, pl_module):
        self.metrics.reset()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if trainer.world_size > 1:
            self.path = self.run_dir / shard_name(trainer.global_rank)
            self.positions_path = self.run_dir / positions.shard_name(trainer.global_rank)
        self.drop_partial_line()
        drop_partial_line(self.positions_path)
        if trainer.world_size == 1:
            self.metrics.update(read_predictions(self.run_dir, self.order or None))

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ):
        # positions first: a crash in between re-runs the sample, and readers keep an id's first row
        positions.append_rows(self.positions_path, [r.pop(positions.RECORD_FIELD) for r in prediction
                                                    if positions.RECORD_FIELD in r])  # fmt: skip
        with self.path.open("a") as f:
            for record in prediction:
                f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.metrics.update(prediction)

    def on_predict_end(self, trainer, pl_module):
        if trainer.world_size > 1:
            trainer.strategy.barrier("kvlab-shards-written")
            if trainer.global_rank == 0:
                self.summary = local_summary(merge_predictions(self.run_dir, self.order))
                positions.merge_positions(self.run_dir, self.order)
        else:
            self.summary = self.metrics.compute()
            if shard_paths(self.run_dir):  # finishing a data-parallel run in one process
                merge_predictions(self.run_dir, self.order)
            positions.merge_positions(self.run_dir, self.order)  # a no-op without shards
        if trainer.global_rank == 0:
            atomic_write_text(self.run_dir / METRICS, json.dumps(self.summary, indent=2) + "\n")
        if trainer.world_size > 1:
            trainer.strategy.barrier("kvlab-metrics-written")
