"""A finished run's summary in TensorBoard: TEXT (config, prompt, results table) and an HPARAMS trial.

:func:`write_run_summary` reads the run directory's own files (``run.json``, ``metrics.json``,
``config.yaml``, ``prompt_example.txt``) and rewrites ``tensorboard/summary/`` whole, so a resumed
run replaces its summary instead of adding a second one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from kvlab.runner.progress import SECTIONS, format_value
from kvlab.runner.views.hparams import hparam_values, metric_values, trial_name, write_session

SUMMARY_DIR = Path("tensorboard") / "summary"
#: units the TEXT table writes after a value (bytes get theirs from ``format_value``; shares,
#: ratios and scores in [0, 1] have none); the same units as the HPARAMS tags' names
UNITS = {
    "fidelity_kl": "nats/token",
    "prefill_seconds": "s per sample",
    "compression_seconds": "s per sample",
    "decode_seconds": "s per sample",
    "decode_tokens_per_second": "tokens/s",
}


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def code_block(text: str) -> str:
    """``text`` as a fenced Markdown block (TensorBoard's TEXT tab renders Markdown)."""
    return "```\n" + text.rstrip("\n") + "\n```"


def with_unit(key: str, value: Any) -> str:
    """A metric's value for the TEXT table: :func:`~kvlab.runner.progress.format_value` and the
    key's unit from :data:`UNITS` (``0.1748 nats/token``)."""
    text = format_value(key, value)
    return f"{text} {UNITS[key]}" if key in UNITS and isinstance(value, int | float) else text


def metrics_table(metrics: dict[str, Any]) -> str:
    """``metrics.json`` as a Markdown table ``| section | metric | value |``, values with units
    (bytes in KiB/MiB/GiB, :data:`UNITS`), the sections of the end-of-run summary first, then every
    other number."""
    rows, seen = [], set()
    task = tuple(metrics.get("task_samples", {}))
    for title, keys in SECTIONS:
        for key in dict.fromkeys([*keys, *(task if title == "task" else ())]):
            if key in metrics:
                rows.append((title, key, with_unit(key, metrics[key])))
                seen.add(key)
    for key, value in metrics.items():
        if key not in seen and isinstance(value, int | float | str) and not isinstance(value, bool):
            rows.append(("other", key, with_unit(key, value)))
    lines = ["| section | metric | value |", "|---|---|---|"]
    return "\n".join(lines + [f"| {s} | `{k}` | {v} |" for s, k, v in rows]) + "\n"


def write_run_summary(run_dir: str | Path, experiment: str) -> Path:
    """Write the run's TEXT summary and HPARAMS trial into ``<run_dir>/tensorboard/summary/``.

    TEXT (step 0): ``results/metrics`` (the results table, :func:`metrics_table`; its group sorts
    first), ``run/config`` (the resolved ``config.yaml``), ``run/prompt`` (the first sample's
    prompt as the model saw it).
    HPARAMS: :func:`kvlab.runner.views.hparams.hparam_values` as columns and
    :func:`~kvlab.runner.views.hparams.metric_values` as metrics. Returns the directory.
    """
    run_dir = Path(run_dir)
    out = run_dir / SUMMARY_DIR
    shutil.rmtree(out, ignore_errors=True)  # our own output, rewritten whole
    metrics = json.loads(_read(run_dir / "metrics.json") or "{}")
    try:
        fields = json.loads(_read(run_dir / "run.json") or "{}").get("fields") or {}
    except ValueError:
        fields = {}
    writer = SummaryWriter(str(out))
    try:
        writer.add_text("results/metrics", metrics_table(metrics), 0)
        config = _read(run_dir / "config.yaml")
        if config is not None:
            writer.add_text("run/config", code_block(config), 0)
        prompt = _read(run_dir / "prompt_example.txt")
        if prompt is not None:
            writer.add_text("run/prompt", code_block(prompt), 0)
        hparams = hparam_values(run_dir.name, experiment, fields)
        write_session(writer, trial_name(run_dir.name, experiment), hparams, metric_values(metrics))
    finally:
        writer.close()
    return out
