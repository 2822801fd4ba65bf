"""A run as one trial of TensorBoard's HPARAMS tab: its settings as columns, its results as metrics.

Each run writes a session start (its hyperparameters) and one scalar per headline result into its
``tensorboard/`` directory; the experiment writes the HPARAMS configuration
(:func:`write_experiment_config`, into ``<experiment>/compare/tensorboard/``) that orders the
columns: the method, the budget and the model first, then the fields that differ between the runs,
then the rest. The trial's name is the run's display name within its experiment
(:mod:`kvlab.runner.views.names`: ``snapkv@10%``) and the experiment's name.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboard.plugins.hparams import api_pb2, metadata
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData, SessionEndInfo, SessionStartInfo

from kvlab.config.errors import ConfigError
from kvlab.config.registry import parameter_fields
from kvlab.metrics.tasks import SCORED_SAMPLES
from kvlab.pipeline import Pipeline
from kvlab.pipeline.validation import WHERE
from kvlab.runner.leaderboard import ENTRY_STEPS, budget_point
from kvlab.runner.run_names import parse_method

#: metrics.json key -> the scalar tag the HPARAMS tab shows, its unit in the name: the headline
#: results (with the task metrics, ``task/<name>``). TensorBoard reads an HPARAMS metric only from a
#: scalar series, so each is also a one-point chart: every other number of ``metrics.json`` is in
#: the TEXT summary alone, and the KV kept is a column (:func:`kept_columns`).
METRIC_TAGS = {
    "fidelity_kl": "fidelity/kl_nats_per_token",
    "fidelity_token_match": "fidelity/token_match_share",
    "fidelity_top1": "fidelity/top1_share",
    "compression_seconds": "time/compression_s_per_sample",
}
#: the columns TensorBoard shows first, in this order (:func:`column_order`)
LEADING = ("method", "budget", "model")


def metric_values(metrics: dict[str, Any]) -> dict[str, float]:
    """``{tag: value}`` of a run's ``metrics.json``: every task metric as ``task/<name>`` (a mean
    score in [0, 1]) and the numbers of :data:`METRIC_TAGS` that the run has."""
    tasks = [name for name in metrics.get(SCORED_SAMPLES, {}) if _number(metrics.get(name))]
    out = {f"task/{name}": float(metrics[name]) for name in tasks}
    out.update({tag: float(metrics[key]) for key, tag in METRIC_TAGS.items() if _number(metrics.get(key))})
    return out


def kept_columns(records: list[dict[str, Any]]) -> dict[str, float]:
    """What a run kept, whatever its budget was written as: ``kept.ratio`` (kept / prompt tokens,
    mean over samples, layers and KV heads) and ``kept.tokens`` (kept tokens per layer and KV head,
    the same mean), read from its records' ``kept_per_layer_head``; empty without records."""
    ratios, tokens = [], []
    for record in records:
        kept = [n for layer in record.get("kept_per_layer_head") or [] for n in layer]
        if kept and record.get("prompt_tokens"):
            mean = sum(kept) / len(kept)
            tokens.append(mean)
            ratios.append(min(mean / record["prompt_tokens"], 1.0))
    if not ratios:
        return {}
    return {"kept.ratio": sum(ratios) / len(ratios), "kept.tokens": sum(tokens) / len(tokens)}


def budget_description(fields: dict[str, Any]) -> str:
    """The ``budget`` column: ``ratio 0.1``, ``128 tokens`` (per KV head) or ``full``, as written."""
    point = budget_point(fields)
    if point.kind == "ratio":
        return f"ratio {point.value:g}"
    return f"{int(point.value)} tokens" if point.kind == "tokens" else "full"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _value(value: Any) -> bool | float | str | None:
    """A column value: numbers, booleans and strings as they are, other data as JSON (None: blank)."""
    if value is None or isinstance(value, bool | str):
        return value
    if _number(value):
        return float(value)
    return json.dumps(value, sort_keys=True, default=str)


def compression_columns(node: dict[str, Any] | None) -> dict[str, Any]:
    """The columns of a ``model.compression`` node: each component's name at its YAML field and
    each of its parameters (defaults included: ``mixer=weighted_sum``, ``mixer.normalize=none``),
    the budget's fields and the schedule. A node that no longer builds (a plugin not imported)
    gives its own leaves instead."""
    try:
        pipeline = Pipeline.from_config(node or {})
    except ConfigError:  # an old run's node, or a plugin component this process does not know
        return {f"compression.{k}": v for k, v in _leaves("", node or {}).items()}
    if pipeline.keeps_full_cache:
        return {}
    out: dict[str, Any] = {}
    budget = pipeline.budget
    if pipeline.compresses:  # a pipeline that only quantizes has no budget
        for field in dataclasses.fields(budget):
            out[f"budget.{field.name}"] = getattr(budget, field.name)
        out["schedule"] = getattr(pipeline, "schedule", None)
    for part in pipeline.walk():
        field = part.field.removeprefix(f"{WHERE}.")
        if not pipeline.compresses and field.split(".")[0] not in ENTRY_STEPS:
            continue  # nothing is scored or selected: the default slots would only add blank columns
        component = part.component
        out[field] = getattr(component, "registry_name", type(component).__name__)
        if dataclasses.is_dataclass(component):
            for param in parameter_fields(type(component)):
                out[f"{field}.{param.name}"] = getattr(component, param.name, None)
    return out


def _leaves(prefix: str, value: Any) -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_leaves(f"{prefix}.{key}" if prefix else str(key), item))
        return out
    return {prefix: value}


def trial_name(shown: str, experiment: str) -> str:
    """The trial's name in HPARAMS: the run's display name (:func:`kvlab.runner.views.names.display_names`,
    what varies first), then its experiment: ``snapkv@10% (sweep)``, so runs of one name in two
    experiments stay apart (TensorBoard would average the metrics of one name's sessions)."""
    return f"{shown} ({experiment})"


def hparam_values(
    method: str, experiment: str, fields: dict[str, Any], records: list[dict[str, Any]] | None = None
) -> dict[str, bool | float | str]:
    """The HPARAMS columns of one run: ``method`` (the run name's family), ``budget``
    (:func:`budget_description`), ``model``, ``dataset``, ``protocol`` (and its parameters),
    ``max_new_tokens``, ``dtype``, :func:`kept_columns` of ``records``, then
    :func:`compression_columns` (the budget's size is the ``budget`` column), ``run`` (the
    directory's name) and ``experiment``. ``fields`` is the run's ``run.json`` fields."""
    model = fields.get("model") or {}
    data = fields.get("data") or {}
    dataset = data.get("dataset")
    protocol = model.get("protocol") or "query_aware"
    columns: dict[str, Any] = {
        "method": parse_method(method)[0],
        "budget": budget_description(fields),
        "model": model.get("model"),
        "dataset": dataset.get("name") if isinstance(dataset, dict) else dataset,
        "max_new_tokens": model.get("max_new_tokens"),
        "dtype": model.get("dtype"),
    }
    if isinstance(protocol, dict):
        columns["protocol"] = protocol.get("name")
        columns.update({f"protocol.{k}": v for k, v in protocol.items() if k != "name"})
    else:
        columns["protocol"] = protocol
    columns.update(kept_columns(records or []))
    compression = compression_columns(model.get("compression"))
    columns.update({k: v for k, v in compression.items() if k not in ("budget.ratio", "budget.tokens")})
    columns.update({"run": method, "experiment": experiment})
    values = {key: _value(value) for key, value in columns.items()}
    return {key: value for key, value in values.items() if value is not None}


def column_order(trials: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """``[(column, differs)]`` of an experiment's trials: :data:`LEADING` first, then the columns
    whose values differ between the trials, then the rest (by name). TensorBoard sorts the columns
    of an experiment by its ``differs`` flag, then by name, and shows the first five: only the
    leading columns are flagged, so they are the first TensorBoard shows (``budget``, ``method``,
    ``model``: by name), the others follow by name."""
    names = list(dict.fromkeys(key for trial in trials for key in trial))
    differs = {name: len({json.dumps(t.get(name)) for t in trials}) > 1 for name in names}
    rest = sorted((n for n in names if n not in LEADING), key=lambda n: (not differs[n], n))
    return [(n, True) for n in LEADING if n in names] + [(n, False) for n in rest]


def experiment_summary(trials: list[dict[str, Any]], metrics: list[str]) -> Summary:
    """The ``_hparams_/experiment`` summary of an experiment's trials (:func:`column_order`, each
    column's type and values) and metric tags (task scores first)."""
    infos = []
    for name, differs in column_order(trials):
        values = [t[name] for t in trials if name in t]
        info = api_pb2.HParamInfo(name=name, differs=differs)
        if all(isinstance(v, bool) for v in values):
            info.type = api_pb2.DATA_TYPE_BOOL
        elif all(_number(v) for v in values):
            info.type = api_pb2.DATA_TYPE_FLOAT64
        else:
            info.type = api_pb2.DATA_TYPE_STRING
            info.domain_discrete.extend(sorted({str(v) for v in values}))
        infos.append(info)
    tags = sorted(metrics, key=lambda tag: (not tag.startswith("task/"), tag))
    experiment = api_pb2.Experiment(
        hparam_infos=infos, metric_infos=[api_pb2.MetricInfo(name=api_pb2.MetricName(tag=t)) for t in tags]
    )
    data = HParamsPluginData(experiment=experiment, version=metadata.PLUGIN_DATA_VERSION)
    return _plugin_summary(metadata.EXPERIMENT_TAG, data)


def _plugin_summary(tag: str, data: HParamsPluginData) -> Summary:
    content = SummaryMetadata.PluginData(plugin_name=metadata.PLUGIN_NAME, content=data.SerializeToString())
    return Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=content))])


def session_start(hparams: dict[str, bool | float | str], group: str) -> Summary:
    """The ``_hparams_/session_start_info`` summary of one trial (the protobufs TensorBoard's own
    ``hparams`` summary writes, built here without TensorFlow)."""
    info = SessionStartInfo(group_name=group)
    for key, value in hparams.items():
        if isinstance(value, bool):
            info.hparams[key].bool_value = value
        elif isinstance(value, str):
            info.hparams[key].string_value = value
        else:
            info.hparams[key].number_value = float(value)
    data = HParamsPluginData(session_start_info=info, version=metadata.PLUGIN_DATA_VERSION)
    return _plugin_summary(metadata.SESSION_START_INFO_TAG, data)


def session_end() -> Summary:
    """The ``_hparams_/session_end_info`` summary of a trial that finished."""
    info = SessionEndInfo(status=api_pb2.STATUS_SUCCESS)
    data = HParamsPluginData(session_end_info=info, version=metadata.PLUGIN_DATA_VERSION)
    return _plugin_summary(metadata.SESSION_END_INFO_TAG, data)


def write_session(writer: Any, group: str, hparams: dict[str, Any], metrics: dict[str, float]) -> None:
    """One HPARAMS trial into ``writer``'s directory: the session start, each metric as a scalar at
    step 0 (TensorBoard reads HPARAMS metrics from scalars only), and the session end."""
    file_writer = writer._get_file_writer()
    file_writer.add_summary(session_start(hparams, group))
    for tag, value in metrics.items():
        writer.add_scalar(tag, value, 0)
    file_writer.add_summary(session_end())
