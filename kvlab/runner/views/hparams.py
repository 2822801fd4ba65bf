"""A run as one trial of TensorBoard's HPARAMS tab: its settings as columns, its results as metrics.

Each run writes a session start (its hyperparameters, no experiment summary) and one scalar per
result into ``tensorboard/summary/``. With no experiment summary anywhere, TensorBoard builds the
table from every session it finds under ``--logdir``: the columns are the union of the runs'
fields (a field a run lacks is blank; the fields that differ come first, and the first five of
them are shown) and the metrics are the scalar tags of the sessions' directories, so an
experiment's runs compare side by side. The trial's name is :func:`trial_name` (the session's
group name: two runs of one name in two experiments stay apart).
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
from kvlab.runner.run_names import parse_method

#: metrics.json key -> the scalar tag the HPARAMS tab shows, its unit in the name. TensorBoard
#: sorts metrics by tag and shows the first five: the KV kept, the three fidelity measures and the
#: first task metric (``task/<name>``); the times and ``usage/`` follow. Every other number of
#: ``metrics.json`` is in the TEXT summary.
METRIC_TAGS = {
    "kv_ratio": "cost/kv_kept_over_full",
    "fidelity_kl": "fidelity/kl_nats_per_token",
    "fidelity_token_match": "fidelity/token_match_share",
    "fidelity_top1": "fidelity/top1_share",
    "prefill_seconds": "time/prefill_s_per_sample",
    "compression_seconds": "time/compression_s_per_sample",
    "decode_seconds": "time/decode_s_per_sample",
    "decode_tokens_per_second": "time/decode_tokens_per_s",
    "peak_memory_bytes": "usage/peak_memory_bytes",
    "kv_bytes_kept": "usage/kv_bytes_kept_total",
    "budget_overshoot_samples": "usage/over_budget_samples",
}


def metric_values(metrics: dict[str, Any]) -> dict[str, float]:
    """``{tag: value}`` of a run's ``metrics.json``: every task metric as ``task/<name>`` (a mean
    score in [0, 1]) and the numbers of :data:`METRIC_TAGS` that the run has."""
    tasks = [name for name in metrics.get(SCORED_SAMPLES, {}) if _number(metrics.get(name))]
    out = {f"task/{name}": float(metrics[name]) for name in tasks}
    out.update({tag: float(metrics[key]) for key, tag in METRIC_TAGS.items() if _number(metrics.get(key))})
    return out


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
    if not pipeline.compresses:
        return {}
    out: dict[str, Any] = {}
    budget = pipeline.budget
    for field in dataclasses.fields(budget):
        out[f"budget.{field.name}"] = getattr(budget, field.name)
    out["schedule"] = getattr(pipeline, "schedule", None)
    for part in pipeline.walk():
        field = part.field.removeprefix(f"{WHERE}.")
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


def trial_name(method: str, experiment: str) -> str:
    """The trial's name in HPARAMS: the run's family and swept values, then its experiment
    (``snapkv@budget.tokens=64`` in ``sweep`` -> ``snapkv@64 (sweep)``; a budget's ``tokens`` or
    ``ratio`` alone is written as its value, any other point as ``field=value`` with the field's
    last part: ``snapkv@window=64``, so runs of one experiment never share a trial). TensorBoard
    cuts a trial name at about 15 characters, so what tells runs apart comes first; the columns
    say what the values are (the run's full name is the ``run`` column)."""
    family, point = parse_method(method)
    (key, value), *more = point.items() if point else ((None, ""),)
    if not more and (key == "budget.tokens" or (key == "budget.ratio" and "." in value)):
        values = value  # the common sweep: the value alone (a ratio has a point, a count has none)
    else:  # two runs whose values are equal but fields differ must not share a trial (TensorBoard
        # would average their metrics into one row): the field's last part names each value
        values = ",".join(f"{key.rsplit('.', 1)[-1]}={value}" for key, value in point.items())
    return f"{family}@{values} ({experiment})" if values else f"{family} ({experiment})"


def hparam_values(method: str, experiment: str, fields: dict[str, Any]) -> dict[str, bool | float | str]:
    """The HPARAMS columns of one run: ``run``, ``experiment``, ``preset`` (the run name's family),
    ``model``, ``protocol`` (and its parameters), ``dataset``, ``max_new_tokens``, ``dtype``, then
    :func:`compression_columns`. ``fields`` is the run's ``run.json`` fields."""
    model = fields.get("model") or {}
    data = fields.get("data") or {}
    dataset = data.get("dataset")
    protocol = model.get("protocol") or "query_aware"
    columns: dict[str, Any] = {
        "run": method,
        "experiment": experiment,
        "preset": parse_method(method)[0],
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
    columns.update(compression_columns(model.get("compression")))
    values = {key: _value(value) for key, value in columns.items()}
    return {key: value for key, value in values.items() if value is not None}


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
    """One HPARAMS trial into ``writer``'s directory: the session start (no experiment summary, so
    TensorBoard takes the union of every session's columns), each metric as a scalar at step 0,
    and the session end."""
    file_writer = writer._get_file_writer()
    file_writer.add_summary(session_start(hparams, group))
    for tag, value in metrics.items():
        writer.add_scalar(tag, value, 0)
    file_writer.add_summary(session_end())
