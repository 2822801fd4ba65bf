"""``kvlab predict``: presets and overrides resolved, a sweep expanded, each run handed to LightningCLI.

``kvlab predict --config snapkv.yaml [--model.compression.budget.tokens 128 ...]`` runs a method
on a dataset (LightningCLI: ``--print_config``, dotted overrides, ``--help``) and writes
``<run.dir>/<run.experiment>/<run.method>/`` with ``run.json`` (the fingerprint),
``config.yaml``, ``predictions.jsonl``, ``metrics.json`` and TensorBoard events. Overrides that
change results name the run (``snapkv@budget.tokens=128``, :mod:`kvlab.cli.sweep`); a re-run
resumes only the same run (:mod:`kvlab.runner.fingerprint`) unless ``--run.overwrite true``.
``--trainer.devices/num_nodes/strategy`` run data-parallel (``docs/scaling.md``).

User plugins (:mod:`kvlab.config.plugins`) load before the config is used: the ``kvlab.plugins``
entry points when the command starts, a config's top-level ``imports:`` before its pipeline is
built (the key is kvlab's, removed before LightningCLI sees the config, and written back into the
run's ``config.yaml``).

Every ``--model.*``, ``--data.*``, ``--trainer.*``, ``--run.*`` and ``--seed_everything`` option
is merged by kvlab into one resolved config per run; only LightningCLI's flags (``--print_config``,
``--help``) reach it directly. Each run's config is validated in one stage
(:func:`check_run_config`, then the samples against the model's tokenizer in
:meth:`KVLabCLI.before_predict`) before anything is written: bad configuration exits with status
2 and a one-paragraph message, before any model loads and before the run directory is touched.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
import warnings
from argparse import ArgumentError
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger

from kvlab.cli.prompt_example import describe_prompt
from kvlab.cli.sweep import cli_sweep, expand, naming_overrides
from kvlab.config.errors import ConfigError, did_you_mean
from kvlab.config.loader import apply_override, check_fields, imports_by_config, resolve, split_overrides
from kvlab.config.names import run_directory
from kvlab.config.plugins import IMPORTS_KEY, import_plugins, is_file_reference
from kvlab.config.values import check_numbers
from kvlab.metrics.reference import REFERENCE_DIR
from kvlab.metrics.tasks import DEFAULT_TASK_METRICS, check_task_samples, validate_task_metrics
from kvlab.runner.compare import compare_experiment
from kvlab.runner.datamodule import KVLabDataModule
from kvlab.runner.files import atomic_write_text
from kvlab.runner.fingerprint import check_run, clear_results, fingerprint_fields, plain, record_run
from kvlab.runner.guards import RunGuard, make_run_dir
from kvlab.runner.module import KVLabModule
from kvlab.runner.progress import RunProgress, format_summary
from kvlab.runner.run_names import override_suffix
from kvlab.runner.views import write_run_summary
from kvlab.runner.writer import METRICS, PredictionWriter, local_summary, merge_predictions

#: the ``run`` group: where a run writes (``<dir>/<experiment>/<method>/``) and whether it starts afresh
RUN_DEFAULTS: dict[str, Any] = {
    "dir": "runs",
    "experiment": "default",
    "method": "method",
    "overwrite": False,
}
#: the top-level fields of a run config
TOP_LEVEL = frozenset({"model", "data", "trainer", "run", "seed_everything"})
#: LightningCLI's own flags, passed through to it
FLAGS = frozenset({"--print_config", "--help", "-h"})
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


def launch_rank() -> int:
    """This process's global rank as its launcher set it (0 before a launcher started any process).

    ``RANK`` (torchrun), ``SLURM_PROCID`` under a multi-task SLURM step, else Lightning's own
    launch: ``NODE_RANK`` and ``LOCAL_RANK`` (0 and 0 only on the first process of the first node).
    """
    env = os.environ
    if "RANK" in env:
        return int(env["RANK"])
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"])
    return int(env.get("NODE_RANK", "0")) or int(env.get("LOCAL_RANK", "0"))


class KVLabCLI(LightningCLI):
    """LightningCLI with a ``run`` group (output directory) and resumable prediction writing.

    ``imports`` (the config's plugin modules, already imported) is not a LightningCLI argument;
    it is only written into the run's ``config.yaml``.
    """

    def __init__(self, *args: Any, imports: Sequence[str] = (), **kwargs: Any) -> None:
        self.imports = list(imports)
        super().__init__(*args, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {"predict": {"model", "dataloaders", "datamodule"}}

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.model", "data.model")
        parser.add_argument("--run.dir", type=str, default="runs", help="root of run directories")
        parser.add_argument("--run.experiment", type=str, default="default", help="experiment name")
        parser.add_argument("--run.method", type=str, default="method", help="method name (the preset's)")
        parser.add_argument(
            "--run.overwrite",
            type=bool,
            default=False,
            help="delete the run directory's predictions, metrics and TensorBoard events before running "
            "(needed to reuse the directory of a run with a different fingerprint)",
        )

    def run_dir(self) -> Path:
        run = self.config["predict"]["run"]
        return run_directory(run["dir"], run["experiment"], run["method"])

    def before_predict(self) -> None:
        """Validate what is left (the samples against the model's processor), then check the
        fingerprint (refuse another run's directory), record the run and set up writing.

        Every check comes before the run directory is touched: a refused run writes nothing.
        Every process of a data-parallel run gets here; only the launcher's first process clears
        results on ``--run.overwrite``.
        """
        config = self.config["predict"]
        check_numbers(plain(config))  # what LightningCLI parsed, defaults included
        # the dataset's metric names (strings in the data layer) name registered metrics
        names = validate_task_metrics(
            getattr(self.datamodule.source, "metrics", None) or DEFAULT_TASK_METRICS
        )
        selected = self.datamodule.selected_samples
        check_task_samples(names, selected)
        if selected and not any(s.answers for s in selected) and launch_rank() == 0:
            print(
                "kvlab: note: no sample of data.dataset has reference answers, so the run reports no task "
                "metric (a jsonl dataset reads them from the field `answers`, or the one named by "
                "data.dataset.answers_field)"
            )
        self.datamodule.setup("predict")  # the processor: images, prompt lengths, encodable text
        run_dir = self.run_dir()
        fields = fingerprint_fields(config, self.imports)
        overwrite = bool(config["run"].get("overwrite", False))
        check_run(run_dir, fields, overwrite=overwrite)
        make_run_dir(run_dir)  # a file in the way or a read-only parent: one-paragraph error
        if overwrite and launch_rank() == 0:
            clear_results(run_dir)
        record_run(run_dir, fields)
        text = self._parser("predict").dump(config, skip_validation=True)
        if self.imports:
            text += yaml.safe_dump({IMPORTS_KEY: self.imports}, sort_keys=False)
        atomic_write_text(run_dir / "config.yaml", text)
        self.model.reference_dir = str(run_dir.parent / REFERENCE_DIR)
        self.model.run_dir = str(run_dir)
        order = [s.id for s in self.datamodule.selected_samples]
        writer = PredictionWriter(run_dir, order=order)
        self.trainer.callbacks.extend([writer, RunProgress(), RunGuard(run_dir)])
        # no placeholder hp_metric: the HPARAMS trial is written from the finished run (after_predict)
        self.trainer.logger = TensorBoardLogger(
            save_dir=str(run_dir), name="tensorboard", version="", default_hp_metric=False
        )
        if launch_rank() == 0 and self.datamodule.selected_samples:  # what the model sees, shown once
            sample = self.datamodule.selected_samples[0]
            text, n_tokens = describe_prompt(self.datamodule.processor, sample)
            example = f"kvlab: prompt of sample '{sample.id}' ({n_tokens} tokens, data.chat_template = "
            example += f"{self.datamodule.chat_template}):\n{text}\n"
            atomic_write_text(run_dir / "prompt_example.txt", example)
            print(example, end="")
        done = writer.completed_ids()
        self.datamodule.skip_ids = done
        if launch_rank() == 0:
            for problem in writer.unreadable_lines():
                print(f"kvlab: resuming {run_dir}: {problem}; the line is not counted")
            if done:
                print(f"kvlab: resuming {run_dir}: {len(done)} samples already written are skipped")

    def after_predict(self) -> None:
        if self.trainer.global_rank != 0:
            return
        if not (self.run_dir() / METRICS).exists():  # nothing was left to predict: no loop ran
            records = merge_predictions(self.run_dir(), [s.id for s in self.datamodule.selected_samples])
            atomic_write_text(self.run_dir() / METRICS, json.dumps(local_summary(records), indent=2) + "\n")
        metrics = json.loads((self.run_dir() / METRICS).read_text())
        write_run_summary(self.run_dir(), self.config["predict"]["run"]["experiment"])
        print(format_summary(metrics, self.run_dir()))


def main(args: list[str]) -> None:
    """``kvlab predict``: the command line resolved into one config per run (presets, overrides, a
    sweep's points), every run validated (:func:`check_run_config`) before the first one starts,
    then each handed to LightningCLI (:func:`run_predict`); a sweep ends with ``kvlab compare``'s
    table."""
    configs, rest, overrides = split_overrides(args)
    resolved = resolve(configs, overrides)
    imports = resolved.pop(IMPORTS_KEY, [])
    announce_plugins(configs, imports)
    import_plugins(imports)  # before any component is built (relative paths are already absolute)
    if configs:
        resolved.setdefault("run", {}).setdefault("method", Path(configs[0]).stem)
    # overrides that change results name the run, unless --run.method names it explicitly
    swept = {dotted for dotted, _ in cli_sweep(overrides)}
    explicit = any(dotted == "run.method" for dotted, _ in overrides)
    named = "" if explicit else override_suffix(naming_overrides(overrides, swept))
    points = expand(resolved, overrides)
    runs = []
    for suffix, cfg in points:
        name = ",".join(part for part in (named, suffix) if part)
        if name:
            run = {**RUN_DEFAULTS, **cfg.get("run", {})}
            cfg = {**cfg, "run": {**run, "method": f"{run['method']}@{name}"}}
        runs.append(cfg)
    for cfg in runs:  # every point of a sweep is checked before the first one runs
        check_run_config(cfg, instantiate=len(runs) > 1)
    for cfg in runs:
        run_predict(cfg, rest, imports)
    if len(runs) > 1:
        experiment = {**RUN_DEFAULTS, **runs[0].get("run", {})}
        print(compare_experiment(Path(experiment["dir"]) / experiment["experiment"]))


def announce_plugins(configs: Sequence[str], imports: Sequence[str]) -> None:
    """Say, once, each plugin file or module the run imports and the config that asked for it
    (a preset's ``imports:`` runs code: the user sees what, before it runs)."""
    if not imports:
        return
    origin: dict[str, str] = {}
    for entry, config in imports_by_config(configs):
        origin.setdefault(entry, config)
    for entry in imports:
        kind = "file" if is_file_reference(entry) else "module"
        print(f"kvlab: imports plugin {kind} {entry} (listed by {origin.get(entry, 'the command line')})")


def check_run_config(cfg: dict[str, Any], instantiate: bool = False) -> None:
    """Validate one run's resolved config, before anything of it is written: numbers, the fields of
    every group, the trainer options kvlab allows, the run's names and directory. ``instantiate``
    (the points of a sweep): also build the module and the data module, so each point's pipeline
    and dataset are checked before the first point runs (LightningCLI builds them again)."""
    check_numbers(cfg)
    unknown = sorted(set(cfg) - TOP_LEVEL)
    if unknown:
        raise ConfigError(
            f"unknown top-level field `{unknown[0]}`.{did_you_mean(unknown[0], TOP_LEVEL)} A run config "
            f"holds {', '.join(sorted(TOP_LEVEL))}. Fix or remove it."
        )
    check_fields(cfg, {"model": KVLabModule, "data": KVLabDataModule})  # unknown field, wrong type
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
    run_directory(run["dir"], run["experiment"], run["method"])
    if instantiate:
        model = cfg.get("model") or {}
        KVLabModule(**model)
        KVLabDataModule(**{**(cfg.get("data") or {}), "model": model.get("model", "smollm2-135m")})


def check_trainer(node: Any) -> None:
    """The ``trainer`` options a run may set: Lightning's ``Trainer`` arguments, minus those that write
    outside the run directory or import classes by name (kvlab owns the logger and the callbacks).
    ``class_path`` is allowed only for Lightning's own classes."""
    if node is None:
        return
    if not isinstance(node, dict):
        raise ConfigError(f"`trainer` must be a mapping of Trainer options, got {node!r}. Fix the config.")
    known = [name for name in inspect.signature(Trainer.__init__).parameters if name != "self"]
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


def check_flags(rest: Sequence[str]) -> None:
    """The arguments left for LightningCLI are only its flags (:data:`FLAGS`): any other option or
    word is refused here, with the closest option, instead of LightningCLI's usage text."""
    for arg in rest:
        flag = arg.partition("=")[0]
        if flag in FLAGS:
            continue
        if flag == "--ckpt_path":
            raise ConfigError(
                "--ckpt_path is not accepted: kvlab predict loads the model named by model.model (a "
                "built-in, a local Hugging Face directory or a Hub id) and never loads a Lightning "
                "checkpoint (which would unpickle it). Point --model.model at the model's directory instead."
            )
        if flag.startswith("-"):
            raise ConfigError(
                f"unknown option {flag}.{did_you_mean(flag, [*FLAGS, '--config'])} `kvlab predict` takes "
                "--config FILE, --model.<field>, --data.<field>, --trainer.<field>, --run.<field>, "
                "--seed_everything N and --print_config; options are matched exactly (never by prefix)."
            )
        raise ConfigError(
            f"unexpected argument {arg!r}: every value follows its option. To run a preset or a file, write "
            f"`--config {arg}`."
        )


def class_paths(node: Any) -> list[str]:
    """Every ``class_path`` value inside ``node``."""
    if isinstance(node, dict):
        found = [str(node["class_path"])] if "class_path" in node else []
        return found + [p for value in node.values() for p in class_paths(value)]
    if isinstance(node, list):
        return [p for value in node for p in class_paths(value)]
    return []


def run_predict(resolved: dict[str, Any] | None, rest: list[str], imports: Sequence[str] = ()) -> None:
    """One ``kvlab predict`` run of a resolved config (None: the defaults).

    The config is validated (:func:`check_run_config`), then reaches LightningCLI as a temporary
    file, deleted when the run ends; ``imports`` (plugin modules, already imported) is recorded in
    the run's ``config.yaml``. Options are matched exactly, and LightningCLI's own parse errors
    become one-paragraph :class:`ConfigError` messages.
    """
    resolved = dict(resolved or {})
    configs, rest, overrides = split_overrides(rest)
    if configs:
        raise ConfigError("run_predict takes a resolved config: pass --config files to `kvlab predict`.")
    for dotted, text in overrides:
        resolved = apply_override(resolved, dotted, text)
    check_flags(rest)
    if IMPORTS_KEY in resolved:  # a caller that did not import them first
        imports = list(dict.fromkeys([*imports, *resolved.pop(IMPORTS_KEY)]))
        import_plugins(imports)
    check_run_config(resolved)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="kvlab-", delete=False) as tmp:
        yaml.safe_dump(resolved, tmp, sort_keys=False)
    config_file = tmp.name
    # kvlab rewrites the arguments it received (resolved config file): not a user mistake.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    try:
        KVLabCLI(
            KVLabModule,
            KVLabDataModule,
            args=["predict", "--config", config_file, *rest],
            save_config_callback=None,
            trainer_defaults={
                "logger": False,
                "enable_checkpointing": False,
                "enable_model_summary": False,
                "devices": 1,
            },
            seed_everything_default=0,
            parser_kwargs={"allow_abbrev": False, "exit_on_error": False},
            imports=imports,
        )
    except ArgumentError as exc:
        message = " ".join(str(exc).split())
        raise ConfigError(
            f"the command line: {message}. Options are matched exactly; `kvlab predict --help` lists them."
        ) from None
    finally:
        os.unlink(config_file)
