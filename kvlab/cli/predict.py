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

Bad configuration exits with status 2 and a one-paragraph message, before any model loads.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger

from kvlab.cli.prompt_example import describe_prompt
from kvlab.cli.sweep import cli_sweep, expand, has_option, naming_overrides, pop_run_args
from kvlab.config.loader import check_fields, resolve, split_overrides
from kvlab.config.plugins import IMPORTS_KEY, import_plugins
from kvlab.metrics.reference import REFERENCE_DIR
from kvlab.metrics.tasks import DEFAULT_TASK_METRICS, check_task_samples, validate_task_metrics
from kvlab.runner.compare import compare_experiment
from kvlab.runner.datamodule import KVLabDataModule
from kvlab.runner.files import atomic_write_text
from kvlab.runner.fingerprint import check_run, clear_results, fingerprint_fields, record_run
from kvlab.runner.guards import RunGuard, make_run_dir
from kvlab.runner.module import KVLabModule
from kvlab.runner.progress import RunProgress, format_summary
from kvlab.runner.run_names import override_suffix
from kvlab.runner.views import write_run_summary
from kvlab.runner.writer import METRICS, PredictionWriter, local_summary, merge_predictions


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
        return Path(run["dir"]) / run["experiment"] / run["method"]

    def before_predict(self) -> None:
        """Check the fingerprint (refuse another run's directory), record the run, set up writing.

        Every process of a data-parallel run gets here; only the launcher's first process clears
        results on ``--run.overwrite``. Nothing in the directory changes before the check passes.
        """
        # the dataset's metric names (strings in the data layer) name registered metrics
        names = validate_task_metrics(
            getattr(self.datamodule.source, "metrics", None) or DEFAULT_TASK_METRICS
        )
        check_task_samples(names, self.datamodule.selected_samples)
        run_dir = self.run_dir()
        config = self.config["predict"]
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
        writer = PredictionWriter(run_dir, order=[s.id for s in self.datamodule.selected_samples])
        self.trainer.callbacks.extend([writer, RunProgress(), RunGuard(run_dir)])
        # no placeholder hp_metric: the HPARAMS trial is written from the finished run (after_predict)
        self.trainer.logger = TensorBoardLogger(
            save_dir=str(run_dir), name="tensorboard", version="", default_hp_metric=False
        )
        if launch_rank() == 0 and self.datamodule.selected_samples:  # what the model sees, shown once
            self.datamodule.setup("predict")
            sample = self.datamodule.selected_samples[0]
            text, n_tokens = describe_prompt(self.datamodule.processor, sample)
            example = f"kvlab: prompt of sample '{sample.id}' ({n_tokens} tokens, data.chat_template = "
            example += f"{self.datamodule.chat_template}):\n{text}\n"
            atomic_write_text(run_dir / "prompt_example.txt", example)
            print(example, end="")
        done = writer.completed_ids()
        self.datamodule.skip_ids = done
        if done and launch_rank() == 0:
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
    """``kvlab predict``: resolve presets and kvlab-merged overrides, expand a sweep, then hand each
    run to LightningCLI (:func:`run_predict`); a sweep ends with ``kvlab compare``'s table."""
    configs, rest, overrides = split_overrides(args)
    if not (configs or overrides):
        run_predict(None, rest)
        return
    resolved = resolve(configs, overrides)
    imports = resolved.pop(IMPORTS_KEY, [])
    import_plugins(imports)  # before any component is built (relative paths are already absolute)
    if configs:
        resolved.setdefault("run", {}).setdefault("method", Path(configs[-1]).stem)
    # overrides that change results name the run, unless --run.method names it explicitly
    swept = {dotted for dotted, _ in cli_sweep(overrides)}
    fixed = [(d, v) for d, v in overrides if d not in swept] + naming_overrides(rest)
    named = "" if has_option(rest, "--run.method") else override_suffix(fixed)
    points = expand(resolved, overrides)
    if len(points) == 1 and not named:
        run_predict(points[0][1], rest, imports)
        return
    rest, run_args = pop_run_args(rest)
    if "overwrite" in run_args:
        run_args["overwrite"] = yaml.safe_load(run_args["overwrite"])
    run = {"dir": "runs", "experiment": "default", "method": "method", **resolved.get("run", {}), **run_args}
    for suffix, cfg in points:
        name = ",".join(part for part in (named, suffix) if part)
        run_predict({**cfg, "run": {**run, "method": f"{run['method']}@{name}"}}, rest, imports)
    if len(points) == 1:
        return
    print(compare_experiment(Path(run["dir"]) / run["experiment"]))


def run_predict(resolved: dict[str, Any] | None, rest: list[str], imports: Sequence[str] = ()) -> None:
    """One ``kvlab predict`` run of a resolved config (None: LightningCLI's own arguments only).

    The resolved config reaches LightningCLI as a temporary file, deleted when the run ends;
    ``imports`` (plugin modules, already imported) is recorded in the run's ``config.yaml``.
    """
    if resolved is not None and IMPORTS_KEY in resolved:  # a caller that did not import them first
        resolved = dict(resolved)
        imports = list(dict.fromkeys([*imports, *resolved.pop(IMPORTS_KEY)]))
        import_plugins(imports)
    config_file = None
    if resolved is not None:
        check_fields(resolved, {"model": KVLabModule, "data": KVLabDataModule})  # unknown field, wrong type
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="kvlab-", delete=False) as tmp:
            yaml.safe_dump(resolved, tmp, sort_keys=False)
        config_file = tmp.name
        rest = ["--config", config_file, *rest]
    # kvlab rewrites the arguments it received (resolved config file): not a user mistake.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    try:
        KVLabCLI(
            KVLabModule,
            KVLabDataModule,
            args=["predict", *rest],
            save_config_callback=None,
            trainer_defaults={
                "logger": False,
                "enable_checkpointing": False,
                "enable_model_summary": False,
                "devices": 1,
            },
            seed_everything_default=0,
            imports=imports,
        )
    finally:
        if config_file is not None:
            os.unlink(config_file)
