"""A finished run's summary in TensorBoard, read from the run's own files: TEXT, the end-of-run
figures and the HPARAMS trial; and the experiment's HPARAMS configuration.

Everything lands in the run's one ``tensorboard/`` directory (one TensorBoard run per kvlab run),
each part in event files of its own suffix, so that rewriting a part replaces it whole:

- ``*.summary`` (:func:`write_run_summary`): TEXT ``results/metrics`` (the results table),
  ``run/config`` (the method and the budget first, then the resolved ``config.yaml``),
  ``run/prompt``, and the end-of-run figures drawn from every record of ``predictions.jsonl`` (a
  resumed run's figures cover the samples of every part): ``budget/kept_layer_head_mean`` (not
  for a uniform allocation: its value is in the results table), ``modality/kept_fraction_per_layer``
  (only where prompts hold images or video) and, for routed pipelines, ``route/metric_per_layer``;
- ``*.trial`` (:func:`write_trial`): the run as an HPARAMS trial named by what varies within its
  experiment (:mod:`kvlab.runner.views.names`; over the runs finished so far, then rewritten by
  ``kvlab compare``);
- ``<experiment>/compare/tensorboard/*.experiment`` (:func:`write_experiment_config`, by
  ``kvlab compare``): the columns' order (method, budget, model first) and the metrics, over the
  experiment's runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.utils.tensorboard import SummaryWriter

from kvlab.runner.progress import SECTIONS, format_value
from kvlab.runner.views.figures import fitted_range, heatmap_figure, modality_figure, render, route_figure
from kvlab.runner.views.hparams import (
    budget_description,
    experiment_summary,
    hparam_values,
    metric_values,
    trial_name,
    write_session,
)
from kvlab.runner.views.inspector import route_table
from kvlab.runner.views.labels import titled
from kvlab.runner.views.names import display_names
from kvlab.runner.writer import read_predictions

TENSORBOARD = "tensorboard"
#: where the experiment's HPARAMS configuration is written, beside ``kvlab compare``'s views
EXPERIMENT_DIR = Path("compare") / "tensorboard"
SUMMARY, TRIAL, EXPERIMENT = ".summary", ".trial", ".experiment"  # event file suffixes
#: units the TEXT table writes after a value (bytes get theirs from ``format_value``; shares,
#: ratios and scores in [0, 1] have none); the same units as the HPARAMS tags' names
UNITS = {
    "fidelity_kl": "nats/token",
    "prefill_seconds": "s per sample",
    "compression_seconds": "s per sample",
    "decode_seconds": "s per sample",
    "decode_tokens_per_second": "tokens/s",
    "kept.tokens": "tokens per layer and KV head",
}


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _fields(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads(_read(run_dir / "run.json") or "{}").get("fields") or {}
    except (ValueError, AttributeError):
        return {}


def code_block(text: str) -> str:
    """``text`` as a fenced Markdown block (TensorBoard's TEXT tab renders Markdown)."""
    return "```\n" + text.rstrip("\n") + "\n```"


def with_unit(key: str, value: Any) -> str:
    """A metric's value for the TEXT table: :func:`~kvlab.runner.progress.format_value` and the
    key's unit from :data:`UNITS` (``0.1748 nats/token``)."""
    text = format_value(key, value)
    return f"{text} {UNITS[key]}" if key in UNITS and isinstance(value, int | float) else text


def metrics_table(metrics: dict[str, Any], extra: list[tuple[str, str, str]] = ()) -> str:
    """``metrics.json`` as a Markdown table ``| section | metric | value |``, values with units
    (bytes in KiB/MiB/GiB, :data:`UNITS`), the sections of the end-of-run summary first, then
    ``extra`` rows (what the run kept), then every other number."""
    rows, seen = [], set()
    task = tuple(metrics.get("task_samples", {}))
    for title, keys in SECTIONS:
        for key in dict.fromkeys([*keys, *(task if title == "task" else ())]):
            if key in metrics:
                rows.append((title, key, with_unit(key, metrics[key])))
                seen.add(key)
    rows.extend(extra)
    for key, value in metrics.items():
        if key not in seen and isinstance(value, int | float | str) and not isinstance(value, bool):
            rows.append(("other", key, with_unit(key, value)))
    lines = ["| section | metric | value |", "|---|---|---|"]
    return "\n".join(lines + [f"| {s} | `{k}` | {v} |" for s, k, v in rows]) + "\n"


def config_text(config: str, fields: dict[str, Any], method: str, run: str) -> str:
    """The TEXT ``run/config``: the method, the budget, the model and the run's directory name on
    one line, the ``model.compression`` node, then the whole resolved ``config.yaml``."""
    model = fields.get("model") or {}
    budget = (model.get("compression") or {}).get("budget")
    window = budget.get("window") if isinstance(budget, dict) else None
    head = f"**method** `{method}` · **budget** {budget_description(fields)}"
    head += f", window {window}" if window is not None else ""
    head += f" · **model** `{model.get('model')}`" if model.get("model") else ""
    head += f" · **run** `{run}`" if run != method else ""
    try:
        node = ((yaml.safe_load(config) or {}).get("model") or {}).get("compression")
    except (yaml.YAMLError, AttributeError):
        node = None
    parts = [head]
    if node:
        parts += ["model.compression:", code_block(yaml.safe_dump(node, sort_keys=False))]
    return "\n\n".join([*parts, "the resolved config.yaml:", code_block(config)])


def kept_share_mean(records: list[dict[str, Any]]) -> torch.Tensor | None:
    """``[L, Hkv]`` kept / prompt tokens averaged over every record (None without records)."""
    shares = [
        torch.tensor(r["kept_per_layer_head"], dtype=torch.float32) / max(int(r["prompt_tokens"]), 1)
        for r in records
        if r.get("kept_per_layer_head") and r.get("prompt_tokens")
    ]
    shapes = {tuple(s.shape) for s in shares}
    if not shares or len(shapes) != 1 or 0 in next(iter(shapes)):
        return None
    return torch.stack(shares).mean(0).clamp(0, 1)


def modality_fractions(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """``{modality: [L]}`` kept entries / (tokens x KV heads) per layer over every record that
    holds :func:`~kvlab.runner.views.inspector.modality_record`'s numbers (empty for text-only runs)."""
    kept: dict[str, list[float]] = {}
    present: dict[str, float] = {}
    for record in records:
        heads = record.get("kv_heads")
        for name, counts in (record.get("modality_kept") or {}).items():
            total = kept.setdefault(name, [0.0] * len(counts))
            if len(total) != len(counts) or not heads:
                continue
            kept[name] = [a + b for a, b in zip(total, counts, strict=True)]
            present[name] = present.get(name, 0.0) + record["modality_tokens"][name] * heads
    return {name: [k / present[name] for k in values] for name, values in kept.items() if present.get(name)}


def route_means(records: list[dict[str, Any]]) -> dict[int, float]:
    """``{layer: mean route metric}`` over the records that evaluated it (routed pipelines)."""
    sums: dict[int, list[float]] = {}
    for record in records:
        for layer, value in enumerate(record.get("route_metric") or []):
            if value is not None:
                total = sums.setdefault(layer, [0.0, 0.0])
                total[0] += value
                total[1] += 1
    return {layer: total / count for layer, (total, count) in sorted(sums.items())}


def _writer(directory: Path, suffix: str) -> SummaryWriter:
    """A writer of a fresh event file ending in ``suffix``; that suffix's earlier files deleted
    (our own output, rewritten whole)."""
    for old in directory.glob(f"events.out.tfevents.*{suffix}"):
        old.unlink(missing_ok=True)
    return SummaryWriter(str(directory), filename_suffix=suffix)


def write_run_summary(run_dir: str | Path, experiment: str) -> Path:
    """Write the run's TEXT, end-of-run figures (module docstring) and HPARAMS trial (named over the
    experiment's runs so far) into ``<run_dir>/tensorboard/``; nothing outside the run directory
    (``kvlab compare`` renames every trial and writes the experiment's column order). Returns the
    directory."""
    run_dir = Path(run_dir)
    out = run_dir / TENSORBOARD
    shutil.rmtree(out / "summary", ignore_errors=True)  # the second TensorBoard run of earlier versions
    out.mkdir(parents=True, exist_ok=True)
    metrics = json.loads(_read(run_dir / "metrics.json") or "{}")
    fields = _fields(run_dir)
    records = read_predictions(run_dir)
    hparams = hparam_values(run_dir.name, experiment, fields, records)
    extra = [("kept", k, with_unit(k, hparams[k])) for k in ("kept.ratio", "kept.tokens") if k in hparams]
    share = kept_share_mean(records)
    uniform = share is not None and fitted_range(share)[2]
    if uniform:
        value = f"uniform: {float(share.flatten()[0]):.4g} in every layer and KV head"
        extra.append(("kept", "kept / prompt tokens per layer and KV head", value))
    label = f"{hparams.get('method', run_dir.name)} · {hparams.get('budget', '')}"
    writer = _writer(out, SUMMARY)
    try:
        writer.add_text("results/metrics", metrics_table(metrics, extra), 0)
        config = _read(run_dir / "config.yaml")
        if config is not None:
            text = config_text(config, fields, str(hparams.get("method")), run_dir.name)
            writer.add_text("run/config", text, 0)
        prompt = _read(run_dir / "prompt_example.txt")
        if prompt is not None:
            writer.add_text("run/prompt", code_block(prompt), 0)
        every = f"all {len(records)} samples"
        if share is not None and not uniform:
            figure = heatmap_figure(share, titled(label, f"mean of {every}"))
            writer.add_image("budget/kept_layer_head_mean", render(figure), 0, dataformats="HWC")
        fractions = modality_fractions(records)
        if fractions:
            figure = modality_figure(fractions, titled(label, every))
            writer.add_image("modality/kept_fraction_per_layer", render(figure), 0, dataformats="HWC")
        means = route_means(records)
        if means:
            figure = route_figure(means, titled(label, every))
            writer.add_image("route/metric_per_layer", render(figure), 0, dataformats="HWC")
            writer.add_text("route/metric_per_layer", route_table(means), 0)
    finally:
        writer.close()
    names = display_names([(p.name, _fields(p)) for p in experiment_runs(run_dir.parent)])
    write_trial(run_dir, experiment, names.get(run_dir.name, run_dir.name))
    return out


def experiment_runs(root: Path) -> list[Path]:
    """The run directories of an experiment that kvlab predict wrote (a ``run.json``), by name."""
    return sorted(p for p in root.iterdir() if (p / "run.json").is_file()) if root.is_dir() else []


def write_trial(run_dir: Path, experiment: str, shown: str) -> dict[str, Any]:
    """The run's HPARAMS trial (named ``shown`` within ``experiment``) into ``tensorboard/``, rewritten
    whole; returns its columns and metrics (``{"hparams": ..., "metrics": ...}``)."""
    metrics = metric_values(json.loads(_read(run_dir / "metrics.json") or "{}"))
    hparams = hparam_values(run_dir.name, experiment, _fields(run_dir), read_predictions(run_dir))
    writer = _writer(run_dir / TENSORBOARD, TRIAL)
    try:
        write_session(writer, trial_name(shown, experiment), hparams, metrics)
    finally:
        writer.close()
    return {"hparams": hparams, "metrics": metrics}


def write_experiment_summaries(root: str | Path, experiment: str | None = None) -> None:
    """The HPARAMS trials of an experiment's runs, named by what varies between them
    (:func:`~kvlab.runner.views.names.display_names`), and the experiment's HPARAMS configuration
    (:func:`~kvlab.runner.views.hparams.experiment_summary`) in ``compare/tensorboard/``
    (``kvlab compare``). Runs without a ``tensorboard/`` directory (hand-made, or written by
    another tool) get no trial."""
    root = Path(root)
    experiment = experiment or root.name
    runs = [p for p in experiment_runs(root) if (p / TENSORBOARD).is_dir()]
    if not runs:
        return
    names = display_names([(p.name, _fields(p)) for p in experiment_runs(root)])
    write_experiment_config(root, [write_trial(path, experiment, names[path.name]) for path in runs])


def write_experiment_config(root: Path, trials: list[dict[str, Any]]) -> None:
    """The experiment's HPARAMS configuration into ``<root>/compare/tensorboard/`` (rewritten whole)."""
    out = root / EXPERIMENT_DIR
    out.mkdir(parents=True, exist_ok=True)
    metrics = sorted({tag for trial in trials for tag in trial["metrics"]})
    writer = _writer(out, EXPERIMENT)
    try:
        writer._get_file_writer().add_summary(experiment_summary([t["hparams"] for t in trials], metrics))
    finally:
        writer.close()
