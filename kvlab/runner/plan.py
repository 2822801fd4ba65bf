"""The run plan: one ``kvlab predict`` run, resolved, validated once and frozen.

``kvlab predict`` (and :func:`kvlab.cli.predict.run_predict`) turns the command line into one
resolved config per run (presets, group files, overrides, a sweep's point), then
:func:`plan_run` validates it in one stage and returns a :class:`RunPlan`: every field of every
group (unknown fields with the closest name, types, finite numbers within what the engine
indexes), the trainer options a run may set, the run's names and directory. The plan fills the
defaults, so what it holds is exactly what runs, what ``config.yaml`` records and what the
fingerprint (``run.json``) hashes.

Nothing downstream validates the config again or probes another object's attributes: the driver
(:mod:`kvlab.cli.predict`) builds the Lightning module, the data module and the trainer from the
plan, and hands each what it needs through its constructor. A class's **config fields** are its
constructor's ordinary parameters; its **keyword-only** parameters (after ``*``) are what the
driver wires in (the run's files, the samples already written, the task metrics), never set by
a config (:func:`config_fields`).
"""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from lightning.pytorch import Trainer

from kvlab.config.errors import ConfigError, did_you_mean
from kvlab.config.loader import check_fields
from kvlab.config.names import run_directory
from kvlab.config.values import check_numbers
from kvlab.data.datasets import DATASETS
from kvlab.data.sample import Sample, describe_own_limits, refuse_unused_limit
from kvlab.engine.protocols import build_protocol
from kvlab.runner.datamodule import KVLabDataModule
from kvlab.runner.module import KVLabModule

#: the ``run`` group: where a run writes (``<dir>/<experiment>/<method>/``) and whether it starts afresh
RUN_DEFAULTS: dict[str, Any] = {
    "dir": "runs",
    "experiment": "default",
    "method": "method",
    "overwrite": False,
}
#: the top-level fields of a run config
TOP_LEVEL = frozenset({"model", "data", "trainer", "run", "seed_everything"})
#: the trainer options kvlab sets unless the config does (one device; no checkpoints, no summary)
TRAINER_DEFAULTS: dict[str, Any] = {
    "devices": 1,
    "enable_checkpointing": False,
    "enable_model_summary": False,
}
#: the seed when the config names none
DEFAULT_SEED = 0
#: Trainer options a run may not set, and why
TRAINER_REFUSED = {
    "default_root_dir": "kvlab writes every file of a run under <run.dir>/<run.experiment>/<run.method>/; "
    "choose that place with --run.dir.",
    "logger": "kvlab writes the run's TensorBoard events itself, in the run directory (tensorboard --logdir "
    "runs/).",
    "callbacks": "kvlab installs the run's callbacks (prediction writing, progress); a callback could write "
    "outside the run directory or import other code. Use a plugin (`imports:`) for code of your own.",
    "profiler": "a profiler writes its report outside the run directory; profile with `kvlab bench` or "
    "py-spy instead.",
    "plugins": "Lightning plugins are classes named by import path; kvlab runs only what its config "
    "declares.",
}


def config_fields(cls: type) -> dict[str, inspect.Parameter]:
    """The config fields of ``cls``: its constructor's ordinary parameters, in order (its
    keyword-only parameters are wired by the run's driver, never set by a config)."""
    return {
        name: param
        for name, param in inspect.signature(cls.__init__).parameters.items()
        if name != "self" and param.kind in (param.POSITIONAL_OR_KEYWORD, param.POSITIONAL_ONLY)
    }


def with_defaults(cls: type, node: Mapping[str, Any] | None) -> dict[str, Any]:
    """Every config field of ``cls``: ``node``'s value, else the constructor's default (deep copies)."""
    node = node or {}
    return {name: copy.deepcopy(node.get(name, param.default)) for name, param in config_fields(cls).items()}


@dataclass(frozen=True)
class RunSettings:
    """The ``run`` group: the run writes ``<dir>/<experiment>/<method>/``; ``overwrite`` clears
    that directory's results first (needed to reuse the directory of another run)."""

    dir: str = RUN_DEFAULTS["dir"]
    experiment: str = RUN_DEFAULTS["experiment"]
    method: str = RUN_DEFAULTS["method"]
    overwrite: bool = RUN_DEFAULTS["overwrite"]

    @property
    def directory(self) -> Path:
        """The run directory (its names checked, inside ``dir``: :func:`kvlab.config.names.run_directory`)."""
        return run_directory(self.dir, self.experiment, self.method)


def _frozen(value: dict[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(copy.deepcopy(value))


@dataclass(frozen=True)
class RunPlan:
    """One validated run: each group's fields with the defaults filled.

    Attributes:
        model: every ``KVLabModule`` config field (``model.*``).
        data: every ``KVLabDataModule`` config field (``data.*``; ``data.model`` is ``model.model``).
        trainer: the Trainer options of the run (:data:`TRAINER_DEFAULTS`, then the config's).
        run: where the run writes.
        seed: ``seed_everything`` (an integer, or False for no seeding).
        imports: the plugin modules and files the config imports (already imported).
        groups_contexts: whether the protocol answers several questions from one compressed
            context, so the data module must batch each ``context_id`` whole.
        question_split: what compresses each context apart from its question (``model.protocol =
            query_agnostic``, a progressive prefill with ``question: true``), so every sample must
            mark its question; None when nothing does.
        given: the dotted fields set on the command line (``model.max_new_tokens``, ...): what the
            user asked for explicitly, refused where it would not apply
            (:func:`check_answer_limits`).
    """

    model: Mapping[str, Any]
    data: Mapping[str, Any]
    trainer: Mapping[str, Any]
    run: RunSettings
    seed: int | bool = DEFAULT_SEED
    imports: tuple[str, ...] = ()
    groups_contexts: bool = field(default=False)
    question_split: str | None = None
    given: frozenset[str] = frozenset()

    def model_arguments(self) -> dict[str, Any]:
        """``KVLabModule``'s config arguments (a copy the module may keep)."""
        return copy.deepcopy(dict(self.model))

    def data_arguments(self) -> dict[str, Any]:
        """``KVLabDataModule``'s config arguments (a copy the data module may keep)."""
        return copy.deepcopy(dict(self.data))

    def trainer_arguments(self) -> dict[str, Any]:
        """The Trainer's arguments, ``class_path`` nodes built (only Lightning's own classes pass
        :func:`plan_run`)."""
        return {key: instantiate(value) for key, value in self.trainer.items()}

    def config(self) -> dict[str, Any]:
        """The resolved config as plain data: what ``config.yaml`` records and ``--print_config``
        prints (run again with ``kvlab predict --config config.yaml``, it is the same run)."""
        config = {
            "seed_everything": self.seed,
            "trainer": copy.deepcopy(dict(self.trainer)),
            "model": self.model_arguments(),
            "data": {k: v for k, v in self.data_arguments().items() if k != "model"},
            "run": {
                "dir": self.run.dir,
                "experiment": self.run.experiment,
                "method": self.run.method,
                "overwrite": self.run.overwrite,
            },
        }
        if self.imports:
            config["imports"] = list(self.imports)
        return config


def plan_run(
    resolved: Mapping[str, Any] | None,
    imports: Sequence[str] = (),
    build: bool = False,
    given: Sequence[str] = (),
) -> RunPlan:
    """Validate one run's resolved config and return its :class:`RunPlan`; nothing is loaded or
    written (``given``: the dotted fields the command line set, :attr:`RunPlan.given`). Each
    problem is one :class:`ConfigError` naming the field, the value, what is accepted and the fix.
    The pipeline and the dataset validate themselves when the driver builds the module and the
    data module, still before anything is written; ``build`` (the points of a sweep) builds them
    here too, so that every point is checked before the first one runs."""
    cfg = dict(resolved or {})
    check_numbers(cfg)
    unknown = sorted(set(cfg) - TOP_LEVEL)
    if unknown:
        raise ConfigError(
            f"unknown top-level field `{unknown[0]}`.{did_you_mean(unknown[0], TOP_LEVEL)} A run config "
            f"holds {', '.join(sorted(TOP_LEVEL))}. Fix or remove it."
        )
    check_fields(cfg, {"model": KVLabModule, "data": KVLabDataModule})  # unknown field, wrong type
    model_node, data_node = cfg.get("model") or {}, cfg.get("data") or {}
    if "model" in data_node:
        raise ConfigError(
            f"data.model ({data_node['model']!r}) is not set on its own: the data module tokenizes with the "
            "run's model, model.model. Remove data.model and set model.model."
        )
    check_trainer(cfg.get("trainer"))
    run = {**RUN_DEFAULTS, **(cfg.get("run") or {})}
    extra = sorted(set(run) - set(RUN_DEFAULTS))
    if extra:
        raise ConfigError(
            f"unknown field run.{extra[0]}.{did_you_mean(extra[0], RUN_DEFAULTS)} The fields of `run` are: "
            f"{', '.join(RUN_DEFAULTS)}. Fix or remove it."
        )
    if not isinstance(run["overwrite"], bool):
        raise ConfigError(f"run.overwrite must be true or false, got {run['overwrite']!r}.")
    settings = RunSettings(**run)
    settings.directory  # noqa: B018 (the names and the directory are checked)
    seed = cfg.get("seed_everything", DEFAULT_SEED)
    if seed is True or not isinstance(seed, int):
        raise ConfigError(
            f"seed_everything must be an integer seed (or false: no seeding), got {seed!r}. A run is "
            "resumed and compared by its seed, so kvlab does not draw one at random: write e.g. 0."
        )
    model = with_defaults(KVLabModule, model_node)
    data = {**with_defaults(KVLabDataModule, data_node), "model": model["model"]}
    if build:
        KVLabModule(**copy.deepcopy(model))  # the pipeline, the protocol, the kernels
        KVLabDataModule(**copy.deepcopy(data))  # the dataset
    return RunPlan(
        model=_frozen(model),
        data=_frozen(data),
        trainer=_frozen({**TRAINER_DEFAULTS, **(cfg.get("trainer") or {})}),
        run=settings,
        seed=seed,
        imports=tuple(imports),
        groups_contexts=build_protocol(model["protocol"]).groups_contexts,
        question_split=question_split(model),
        given=frozenset(given),
    )


def check_answer_limits(plan: RunPlan, samples: Sequence[Sample]) -> str:
    """The run's ``model.max_new_tokens`` against the samples' own limits (a benchmark's answer
    length per task wins over it: ``Sample.max_new_tokens``).

    Given on the command line (``--model.max_new_tokens``) and not applying to some sample, it is
    refused: the user asked for a limit the run would not use. Set in a config file, it is the
    default for the samples without a limit of their own (a run's ``config.yaml``, run again,
    holds it whatever the dataset), and the returned note says which samples decode under their
    own; empty when none does. Each prediction record holds the limit its sample decoded under.

    Raises:
        ConfigError: the explicit limit, the samples it would not reach, and the fix.
    """
    limit = int(plan.model["max_new_tokens"])
    if "model.max_new_tokens" in plan.given:
        dataset = DATASETS.get(plan.data["dataset"]["name"], "data.dataset")
        own_field = "max_new_tokens" in config_fields(dataset)
        fix = (
            f"Set --data.dataset.max_new_tokens {limit} (this dataset's answer limit) instead."
            if own_field
            else "Remove --model.max_new_tokens: it applies only to samples without a limit of their own."
        )
        refuse_unused_limit(samples, limit, "--model.max_new_tokens", fix)
        return ""
    found = describe_own_limits(samples, limit, len(samples))
    return f"{found}, which replaces model.max_new_tokens ({limit}) for them" if found else ""


def question_split(model: Mapping[str, Any]) -> str | None:
    """What in the run's ``model`` fields compresses each context apart from its question (the field
    and its value, for a refusal), or None: a protocol that splits prompts (``query_agnostic``,
    ``multi_question``), or a progressive prefill that scores with the question (Finch)."""
    protocol = build_protocol(model["protocol"])
    if protocol.splits_prompts:
        return f"model.protocol = {protocol.registry_name}"
    prefill = (model.get("compression") or {}).get("prefill")
    if isinstance(prefill, Mapping) and prefill.get("question"):
        return f"model.compression.prefill = {prefill.get('name')} with question: true"
    return None


def check_trainer(node: Any) -> None:
    """The ``trainer`` options a run may set: Lightning's ``Trainer`` arguments, minus those that write
    outside the run directory or import classes by name (kvlab owns the logger and the callbacks).
    ``class_path`` is allowed only for Lightning's own classes."""
    if node is None:
        return
    if not isinstance(node, dict):
        raise ConfigError(f"`trainer` must be a mapping of Trainer options, got {node!r}. Fix the config.")
    known = trainer_fields()
    for key, value in node.items():
        if key in TRAINER_REFUSED:
            raise ConfigError(f"trainer.{key} is not accepted: {TRAINER_REFUSED[key]}")
        if key not in known:
            raise ConfigError(
                f"unknown field trainer.{key}.{did_you_mean(str(key), known)} Fix or remove it (Lightning's "
                "Trainer arguments are listed by `kvlab predict --help`)."
            )
        for path in class_paths(value):
            if not path.startswith("lightning."):
                raise ConfigError(
                    f"trainer.{key}: class_path {path!r} is refused; a run may name only Lightning's own "
                    "classes (lightning.pytorch.*), so that a config cannot import other code. Use a "
                    "plugin (`imports:`, docs/plugins.md) for code of your own."
                )


def trainer_fields() -> dict[str, inspect.Parameter]:
    """Lightning's ``Trainer`` arguments a run may set (:data:`TRAINER_REFUSED` left out)."""
    params = inspect.signature(Trainer.__init__).parameters
    return {name: p for name, p in params.items() if name != "self" and name not in TRAINER_REFUSED}


def class_paths(node: Any) -> list[str]:
    """Every ``class_path`` value inside ``node``."""
    if isinstance(node, dict):
        found = [str(node["class_path"])] if "class_path" in node else []
        return found + [p for value in node.values() for p in class_paths(value)]
    if isinstance(node, list):
        return [p for value in node for p in class_paths(value)]
    return []


def instantiate(node: Any) -> Any:
    """``node`` with every ``{class_path: lightning..., init_args: {...}}`` built (after
    :func:`check_trainer`, so only Lightning's classes are named)."""
    if isinstance(node, Mapping) and "class_path" in node:
        module_name, _, name = str(node["class_path"]).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            raise ConfigError(
                f"class_path {node['class_path']!r} names no class of Lightning. Check its spelling "
                "(e.g. lightning.pytorch.strategies.DDPStrategy)."
            ) from None
        return cls(**{k: instantiate(v) for k, v in (node.get("init_args") or {}).items()})
    if isinstance(node, Mapping):
        return {k: instantiate(v) for k, v in node.items()}
    if isinstance(node, list):
        return [instantiate(v) for v in node]
    return node
