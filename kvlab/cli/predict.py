"""``kvlab predict``: presets and overrides resolved, a sweep expanded, each run planned and run.

``kvlab predict --config snapkv.yaml [--model.compression.budget.tokens 128 ...]`` runs a method
on a dataset and writes ``<run.dir>/<run.experiment>/<run.method>/`` with ``run.json`` (the
fingerprint), ``config.yaml``, ``predictions.jsonl``, ``metrics.json`` and TensorBoard events.
Overrides that change results name the run (``snapkv@budget.tokens=128``, :mod:`kvlab.cli.sweep`);
a re-run resumes only the same run (:mod:`kvlab.runner.fingerprint`) unless ``--run.overwrite
true``. ``--trainer.devices/num_nodes/strategy`` run data-parallel (``docs/scaling.md``).

User plugins (:mod:`kvlab.config.plugins`) load before the config is used: the ``kvlab.plugins``
entry points when the command starts, a config's top-level ``imports:`` before its pipeline is
built (the key is kvlab's, recorded in the run's ``config.yaml``).

Every ``--model.*``, ``--data.*``, ``--trainer.*``, ``--run.*`` and ``--seed_everything`` option
is merged into one resolved config per run, validated in one stage into a
:class:`~kvlab.runner.plan.RunPlan` (:func:`~kvlab.runner.plan.plan_run`); :func:`run_plan` then
builds the data module, the Lightning module and the Trainer from the plan, each given what it
needs through its constructor. Bad configuration exits with status 2 and a one-paragraph message,
before any model loads and before the run directory is touched. ``--print_config`` prints the
plan's resolved config (what ``config.yaml`` records) and ``--help`` every field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning
import yaml
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger

from kvlab.cli.predict_help import predict_help
from kvlab.cli.prompt_example import describe_prompt
from kvlab.cli.sweep import cli_sweep, expand, naming_overrides
from kvlab.config.errors import ConfigError, did_you_mean
from kvlab.config.loader import apply_override, imports_by_config, resolve, split_overrides
from kvlab.config.plugins import IMPORTS_KEY, import_plugins, is_file_reference
from kvlab.metrics.reference import REFERENCE_DIR
from kvlab.runner.compare import compare_experiment
from kvlab.runner.datamodule import KVLabDataModule
from kvlab.runner.files import atomic_write_text
from kvlab.runner.fingerprint import check_run, clear_results, fingerprint_fields, kvlab_version, record_run
from kvlab.runner.guards import RunGuard, make_run_dir
from kvlab.runner.module import KVLabModule, RunFiles
from kvlab.runner.plan import RUN_DEFAULTS, RunPlan, check_answer_limits, plan_run
from kvlab.runner.progress import RunProgress, format_summary
from kvlab.runner.run_names import override_suffix
from kvlab.runner.views import write_run_summary
from kvlab.runner.writer import (
    METRICS,
    PredictionWriter,
    completed_ids,
    local_summary,
    merge_predictions,
    unreadable_lines,
)

PRINT_CONFIG = "--print_config"
HELP_FLAGS = frozenset({"--help", "-h"})
#: the flags ``kvlab predict`` takes besides the config's options
FLAGS = HELP_FLAGS | {PRINT_CONFIG}


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


def run_plan(plan: RunPlan) -> None:
    """Run one validated plan: check the run directory (another run's is refused), build the data
    module, the module and the trainer from the plan, then record the run and predict.

    Every check comes before the run directory is touched: a refused run writes nothing. Every
    process of a data-parallel run gets here (Lightning starts the others with the same command);
    only the launcher's first process clears results on ``--run.overwrite``.
    """
    if plan.seed is not False:
        seed_everything(plan.seed, workers=True)
    run_dir = plan.run.directory
    done = frozenset() if plan.run.overwrite else completed_ids(run_dir)  # read only
    datamodule = KVLabDataModule(
        **plan.data_arguments(),
        skip_ids=done,
        group_by_context=plan.groups_contexts,
        question_split=plan.question_split,
    )
    selected = datamodule.selected_samples
    limits = check_answer_limits(plan, selected)
    if limits and launch_rank() == 0:
        print(f"kvlab: note: {limits} (each record holds the limit its sample decoded under)")
    if selected and not any(s.answers for s in selected) and launch_rank() == 0:
        print(
            "kvlab: note: no sample of data.dataset has reference answers, so the run reports no task "
            "metric (a jsonl dataset reads them from the field `answers`, or the one named by "
            "data.dataset.answers_field)"
        )
    datamodule.setup("predict")  # the processor: images, prompt lengths, encodable text
    files = RunFiles(run_dir=run_dir, reference_dir=run_dir.parent / REFERENCE_DIR)
    module = KVLabModule(**plan.model_arguments(), files=files, task_metrics=datamodule.task_metrics)
    order = [s.id for s in selected]
    writer = PredictionWriter(run_dir, order=order)
    # no placeholder hp_metric: the HPARAMS trial is written from the finished run
    logger = TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version="", default_hp_metric=False)
    trainer = build_trainer(plan, [writer, RunProgress(), RunGuard(run_dir)], logger)
    fields = fingerprint_fields(plan.config(), plan.imports)
    check_run(run_dir, fields, overwrite=plan.run.overwrite)  # refuses another run's directory
    # everything is checked: from here on the run writes
    make_run_dir(run_dir)  # a file in the way or a read-only parent: one-paragraph error
    if plan.run.overwrite and launch_rank() == 0:
        clear_results(run_dir)
    record_run(run_dir, fields)
    atomic_write_text(run_dir / "config.yaml", config_text(plan))
    if launch_rank() == 0 and selected:  # what the model sees, shown once
        text, n_tokens = describe_prompt(datamodule.processor, selected[0])
        example = f"kvlab: prompt of sample '{selected[0].id}' ({n_tokens} tokens, data.chat_template = "
        example += f"{datamodule.chat_template}):\n{text}\n"
        atomic_write_text(run_dir / "prompt_example.txt", example)
        print(example, end="")
    if launch_rank() == 0:
        for problem in unreadable_lines(run_dir, order):
            print(f"kvlab: resuming {run_dir}: {problem}; the line is not counted")
        resumed = sum(1 for i in order if i in done)
        if resumed:
            print(f"kvlab: resuming {run_dir}: {resumed} samples already written are skipped")
    trainer.predict(module, datamodule=datamodule, return_predictions=False)
    if trainer.global_rank != 0:
        return
    if not (run_dir / METRICS).exists():  # nothing was left to predict: no loop ran
        records = merge_predictions(run_dir, order)
        atomic_write_text(run_dir / METRICS, json.dumps(local_summary(records), indent=2) + "\n")
    metrics = json.loads((run_dir / METRICS).read_text())
    write_run_summary(run_dir, plan.run.experiment)
    print(format_summary(metrics, run_dir))


def build_trainer(plan: RunPlan, callbacks: list[Callback], logger: TensorBoardLogger) -> Trainer:
    """The run's Trainer: the plan's options, kvlab's callbacks and logger. Lightning's own refusal
    of an option's value (a device count it cannot serve, an unknown accelerator) becomes a
    one-paragraph :class:`ConfigError` naming the trainer fields, before anything is written."""
    arguments = plan.trainer_arguments()
    try:
        return Trainer(**arguments, callbacks=callbacks, logger=logger)
    except (MisconfigurationException, TypeError, ValueError) as exc:
        options = ", ".join(f"trainer.{k} = {v!r}" for k, v in plan.trainer.items())
        raise ConfigError(
            f"the trainer options ({options}) are refused by Lightning: {' '.join(str(exc).split())} Fix "
            "the trainer fields (`kvlab predict --help` lists them)."
        ) from None


def config_text(plan: RunPlan) -> str:
    """The run's ``config.yaml``: the plan's resolved config (defaults filled), as YAML."""
    return f"# kvlab {kvlab_version()}, lightning {lightning.__version__}\n" + yaml.safe_dump(
        plan.config(), sort_keys=False
    )


def main(args: list[str]) -> None:
    """``kvlab predict``: the command line resolved into one config per run (presets, overrides, a
    sweep's points), every run validated into a :class:`~kvlab.runner.plan.RunPlan` before the
    first one starts, then each run (:func:`run_plan`); a sweep ends with ``kvlab compare``'s
    table. ``--help`` and ``--print_config`` print and exit."""
    configs, rest, overrides = split_overrides(args)
    check_flags(rest)
    if HELP_FLAGS & set(rest):
        print(predict_help())
        raise SystemExit(0)
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
    # every point of a sweep is checked before the first one runs
    given = [dotted for dotted, _ in overrides]
    plans = [plan_run(cfg, imports, build=len(runs) > 1, given=given) for cfg in runs]
    if PRINT_CONFIG in rest:
        print(config_text(plans[0]), end="")
        raise SystemExit(0)
    for plan in plans:
        run_plan(plan)
    if len(plans) > 1:
        print(compare_experiment(Path(plans[0].run.dir) / plans[0].run.experiment))


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


def check_flags(rest: Sequence[str]) -> None:
    """The arguments left after the config's options are only kvlab's flags (:data:`FLAGS`): any
    other option or word is refused here, with the closest option."""
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


def run_predict(resolved: dict[str, Any] | None, rest: list[str], imports: Sequence[str] = ()) -> None:
    """One ``kvlab predict`` run of a resolved config (None: the defaults), for callers that built
    the config themselves (``kvlab reference-table``).

    ``rest``: further ``--group.field value`` overrides and flags (``--print_config`` prints the
    plan and exits); ``imports`` (plugin modules, already imported) is recorded in the run's
    ``config.yaml``. The config is validated into a :class:`~kvlab.runner.plan.RunPlan`, then run.
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
    plan = plan_run(resolved, imports, given=[dotted for dotted, _ in overrides])
    if PRINT_CONFIG in rest:
        print(config_text(plan), end="")
        raise SystemExit(0)
    run_plan(plan)
