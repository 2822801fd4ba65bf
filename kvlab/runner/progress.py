"""Progress and the end-of-run summary.

:class:`RunProgress` adds ``samples/s`` and the running mean fidelity (greedy token match and
teacher-forced top-1) to Lightning's predict progress bar; :func:`format_summary` is the
one-screen summary ``kvlab predict`` prints at the end.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from kvlab.metrics.tasks import SCORED_SAMPLES

SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "fidelity to the full cache",
        ("fidelity_exact", "fidelity_token_match", "fidelity_rouge_l", "fidelity_kl", "fidelity_top1"),
    ),
    ("task", ("exact_match", "contains_answer", "token_f1", "rouge_l", "choice_accuracy")),
    (
        "memory",
        ("kv_ratio", "kv_bytes_kept", "kv_bytes_full", "kv_bytes_allocated_peak", "peak_memory_bytes"),
    ),
    (
        "time",
        (
            "prefill_seconds",
            "compression_seconds",
            "compression_over_prefill",
            "decode_seconds",
            "decode_tokens_per_second",
        ),
    ),
)


class RunProgress(Callback):
    """Shows samples/s and the running mean fidelity on the predict progress bar (if there is one)."""

    def __init__(self) -> None:
        self.start = 0.0
        self.samples = 0
        self.sums = {"token_match": 0.0, "top1": 0.0}

    def on_predict_start(self, trainer, pl_module) -> None:
        self.start, self.samples = time.perf_counter(), 0
        self.sums = dict.fromkeys(self.sums, 0.0)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        records = outputs or []
        self.samples += len(records)
        for record in records:
            self.sums["token_match"] += record.get("fidelity_token_match", 0.0)
            self.sums["top1"] += record.get("fidelity_top1", 0.0)
        postfix = {"samples/s": f"{self.samples / max(time.perf_counter() - self.start, 1e-9):.2f}"}
        if records and "fidelity_token_match" in records[0]:
            postfix.update({k: f"{v / max(self.samples, 1):.3f}" for k, v in self.sums.items()})
        show(trainer.progress_bar_callback, postfix)


def show(progress_bar: Any, postfix: dict[str, str]) -> None:
    """Put ``postfix`` on Lightning's predict bar: TQDM's postfix, or the Rich task's description."""
    bar = getattr(progress_bar, "predict_progress_bar", None)
    if bar is not None and hasattr(bar, "set_postfix"):  # TQDMProgressBar
        bar.set_postfix(postfix)
        return
    progress, task = (
        getattr(progress_bar, "progress", None),
        getattr(progress_bar, "predict_progress_bar_id", None),
    )
    if progress is not None and task is not None:  # RichProgressBar
        text = " ".join(f"{k}={v}" for k, v in postfix.items())
        progress.update(task, description=f"Predicting {text}")


#: how the summary names each ``peak_memory_kind`` beside ``peak_memory_bytes``
PEAK_KIND_LABELS = {
    "cuda_allocated": "CUDA allocated, max over batches",
    "process_rss_high_water": "process RSS high-water mark, model loading included",
    "mixed": "records of several kinds: CUDA allocated and process RSS",
}


def format_value(key: str, value: Any) -> str:
    """A metric's value for people: bytes in KiB/MiB/GiB, floats to 4 significant digits."""
    if value is None:
        return "n/a"
    if "bytes" in key and isinstance(value, int | float):
        if value >= 2**30:
            return f"{value / 2**30:.2f} GiB"
        return f"{value / 2**20:.2f} MiB" if value >= 2**20 else f"{value / 2**10:.1f} KiB"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def scored_warnings(metrics: dict[str, Any]) -> list[str]:
    """A warning per task metric that scored fewer samples than the run has (``task_samples``)."""
    samples = metrics.get("samples", 0)
    return [
        f"  warning: {name} scored {count} of {samples} samples, and its mean is over those {count}: "
        "the others have no reference answers or are of a task this metric does not score "
        f"(records without a '{name}' field in predictions.jsonl)"
        for name, count in metrics.get(SCORED_SAMPLES, {}).items()
        if count != samples
    ]


def format_summary(metrics: dict[str, Any], run_dir: str | Path) -> str:
    """The one-screen summary of a run's ``metrics.json`` (sections: fidelity, task, memory, time).

    ``peak_memory_bytes`` is followed by what it measures (``peak_memory_kind``); the note on a
    missing peak appears only when the metrics carry one (no record had a figure).
    """
    lines = [f"kvlab: {metrics.get('samples', 0)} samples -> {run_dir}"]
    for title, keys in SECTIONS:
        if title == "task":  # the benchmark suites' metrics too
            keys = tuple(dict.fromkeys([*keys, *metrics.get(SCORED_SAMPLES, {})]))
        present = [k for k in keys if k in metrics]
        if present:
            lines.append(f"  {title}:")
            for k in present:
                line = f"    {k:<28} {format_value(k, metrics[k])}"
                if k == "peak_memory_bytes" and metrics.get("peak_memory_kind"):
                    kind = metrics["peak_memory_kind"]
                    line += f" ({PEAK_KIND_LABELS.get(kind, kind)})"
                lines.append(line)
    if "peak_memory_note" in metrics:
        lines.append(f"  note: {metrics['peak_memory_note']}")
    lines.extend(scored_warnings(metrics))
    if metrics.get("budget_overshoot_samples"):
        lines.append(
            f"  warning: {metrics['budget_overshoot_samples']} samples kept more than their budget (up to "
            f"{metrics['budget_overshoot_max']} tokens per head): a prompt too short for the protected "
            "window under this ratio (set model.compression.budget.max_window_share, e.g. 0.5, to shrink "
            "the window instead), or a component that keeps beyond the budget (text_prior's "
            "overflow: keep_all_text); see `budget_overshoot` in predictions.jsonl"
        )
    lines.append(
        f"  files: config.yaml predictions.jsonl metrics.json reproduce.json tensorboard/ "
        f"(tensorboard --logdir {run_dir})"
    )
    return "\n".join(lines)
