"""The fingerprint of a run: everything that changes its results, recorded in ``<run_dir>/run.json``.

A re-run into an existing run directory resumes only when its fingerprint equals the recorded
one; otherwise :func:`check_run` refuses, naming the differing fields. What is in it:

- ``kvlab_version``;
- ``model``: every ``KVLabModule`` argument (the model name, a local directory made absolute,
  ``dtype``, the whole ``compression`` node, ``max_new_tokens``, ``fidelity``, the ``protocol``
  as its canonical node ``{name: ..., <every parameter>}``, and any argument added later) except
  those that only change what is shown or how it is computed (:data:`MODEL_EXCLUDED`:
  TensorBoard views, the kernel implementation, device placement). A run recorded before
  ``model.protocol`` existed ran ``query_aware`` and resumes as such;
- ``data``: every ``KVLabDataModule`` argument (the whole ``dataset`` node, ``limit``,
  ``long_prompts``, ``chat_template``: everything that changes which samples run or how they
  are built) except :data:`DATA_EXCLUDED`: ``batch_size`` and ``num_workers`` (a padded batch
  gives what each sample gives alone, by design). A run's metrics cover exactly its selection,
  so a re-run with another ``limit`` is another run (refused in the same directory);
- ``seed_everything``, ``trainer.precision`` and the plugin ``imports``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from kvlab.config.errors import ConfigError
from kvlab.engine.protocols import protocol_node
from kvlab.runner.files import atomic_write_text

RUN_JSON = "run.json"
MODEL_EXCLUDED = frozenset(
    # verify: the first-batch engine check refuses a run or lets it go; it never changes a result;
    # record_positions: a side file of what was kept (samples finished before it was on have no row)
    {
        "record_scores",
        "record_positions",
        "inspect_samples",
        "inspect_layers",
        "kernels",
        "device_map",
        "max_memory",
        "verify",
    }
)
DATA_EXCLUDED = frozenset({"batch_size", "num_workers", "model"})  # data.model is model.model
# what `--run.overwrite true` removes (run.json and config.yaml are rewritten by the run itself)
RESULTS = (
    "predictions.jsonl",
    "predictions.rank*.jsonl",
    "metrics.json",
    "tensorboard",
    "positions.jsonl",  # model.record_positions
    "positions.rank*.jsonl",
)


def kvlab_version() -> str:
    """The installed kvlab version (``unknown`` when kvlab runs from an uninstalled tree)."""
    try:
        return version("kvlab")
    except PackageNotFoundError:
        return "unknown"


def plain(value: Any) -> Any:
    """``value`` as JSON-ready data (a deep copy; values JSON cannot hold become their text)."""
    return json.loads(json.dumps(value, default=str))


def resolved_model(name: str) -> str:
    """A local model directory as an absolute path; a built-in name or Hub id as given."""
    path = Path(str(name)).expanduser()
    return str(path.resolve()) if path.exists() else str(name)


def fingerprint_fields(config: Any, imports: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of a predict config (a run plan's :meth:`~kvlab.runner.plan.RunPlan.config`) that
    change the results."""
    config = plain(config)
    model = {k: v for k, v in (config.get("model") or {}).items() if k not in MODEL_EXCLUDED}
    if "model" in model:
        model["model"] = resolved_model(model["model"])
    if "protocol" in model:
        model["protocol"] = protocol_node(model["protocol"])
    data = {k: v for k, v in (config.get("data") or {}).items() if k not in DATA_EXCLUDED}
    return {
        "kvlab_version": kvlab_version(),
        "model": model,
        "data": data,
        "seed_everything": config.get("seed_everything"),
        "trainer": {"precision": (config.get("trainer") or {}).get("precision")},
        "imports": list(imports),
    }


def fingerprint(fields: dict[str, Any]) -> str:
    """A short hash of the fields (sha256 of their canonical JSON, 16 hex digits)."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists and scalars are leaves; an empty mapping too)."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``dotted.path: old -> new`` for each field that differs (``<absent>`` where one side lacks it)."""
    a, b = flatten(old), flatten(new)
    text = lambda d, k: json.dumps(d[k]) if k in d else "<absent>"  # noqa: E731
    return [
        f"{k}: {text(a, k)} -> {text(b, k)}"
        for k in sorted(set(a) | set(b))
        if a.get(k, ...) != b.get(k, ...)
    ]


def clear_results(run_dir: Path) -> None:
    """Remove a run's predictions (merged and shards), metrics and TensorBoard events."""
    for pattern in RESULTS:
        for path in run_dir.glob(pattern):
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def check_run(run_dir: str | Path, fields: dict[str, Any], overwrite: bool = False) -> None:
    """Refuse a run whose fingerprint differs from the one recorded in ``run_dir`` (nothing is written).

    ``overwrite``, or a directory with no ``run.json`` and no results: accepted. Results without a
    ``run.json`` (written by an older kvlab, or copied in) are refused: nothing says which run they
    belong to. Raises :class:`~kvlab.config.errors.ConfigError` naming each differing field, old -> new.
    """
    path = Path(run_dir) / RUN_JSON
    if overwrite:
        return
    if not path.exists():
        results = [p.name for pattern in RESULTS[:3] for p in sorted(Path(run_dir).glob(pattern))]
        if results:
            raise ConfigError(
                f"{run_dir} holds results ({', '.join(results)}) but no {RUN_JSON}, so kvlab cannot tell "
                "whether they come from this run's configuration (they were written by an older kvlab or "
                "copied in). Pass `--run.overwrite true` to start the run afresh, or name this run "
                "differently (`--run.method NAME` or `--run.experiment NAME`)."
            )
        return
    try:
        recorded = json.loads(path.read_text())["fields"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{path} cannot be read ({exc}), so kvlab cannot tell whether this is the same run; pass "
            "`--run.overwrite true` to start the run afresh, or choose another `--run.method`."
        ) from None
    model = recorded.get("model") if isinstance(recorded, dict) else None
    if isinstance(model, dict) and "protocol" not in model:  # recorded before model.protocol existed
        model["protocol"] = protocol_node(None)
    diff = differences(recorded, fields)
    if diff:
        raise ConfigError(
            f"{run_dir} holds a different run, so its results cannot be resumed or mixed with this one's: "
            f"{'; '.join(diff)}. Either name this run differently (`--run.method NAME` or "
            "`--run.experiment NAME`), or pass `--run.overwrite true` to delete that run's predictions, "
            "metrics and TensorBoard events and start afresh."
        )


def record_run(run_dir: str | Path, fields: dict[str, Any]) -> Path:
    """Write ``<run_dir>/run.json`` (fields and their hash) atomically; return its path."""
    record = {
        "fingerprint": fingerprint(fields),
        "kvlab_version": fields.get("kvlab_version"),
        "fields": fields,
    }
    return atomic_write_text(Path(run_dir) / RUN_JSON, json.dumps(record, indent=2) + "\n")
