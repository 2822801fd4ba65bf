"""KVLabModule: the LightningModule whose ``predict_step`` is prefill -> compress -> decode."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch

from kvlab.api import Output, batch_outputs, load_model, load_pipeline
from kvlab.config.errors import ConfigError
from kvlab.engine.generation import RunOptions
from kvlab.engine.prefill_plan import check_prefill_chunk, chunked_vlm_message
from kvlab.engine.protocols import Protocol, build_protocol
from kvlab.engine.verify import verify_engine
from kvlab.kernels.dispatch import check_mode, kernel_mode
from kvlab.metrics.cost import process_peak_rss_bytes, process_rss_bytes
from kvlab.metrics.reference import ReferenceStore
from kvlab.metrics.tasks import DEFAULT_TASK_METRICS, score_output
from kvlab.models import MODELS, validate_model_dtype, validate_model_name
from kvlab.models.base import Batch, LoadedModel
from kvlab.models.fingerprint import model_fingerprint, reproduce_record
from kvlab.models.placement import validate_device_map
from kvlab.pipeline.report import LayerReport, budget_overshoot
from kvlab.runner.fidelity_run import FidelityEvaluator
from kvlab.runner.files import atomic_write_text
from kvlab.runner.positions import RECORD_FIELD as POSITIONS_FIELD
from kvlab.runner.positions import position_rows
from kvlab.runner.views import Inspector, modality_record, run_label


@dataclass(frozen=True)
class RunFiles:
    """Where a module's run writes: ``run_dir`` (``reproduce.json``) and ``reference_dir`` (the
    full-cache references that ``model.fidelity`` caches per sample, shared by an experiment's runs)."""

    run_dir: Path
    reference_dir: Path


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: what a re-run needs to reproduce a run, written into the run directory (``docs/evaluation.md``)
REPRODUCE = "reproduce.json"


class KVLabModule(L.LightningModule):
    """Runs one compression method on a model.

    Args:
        model: built-in model name (``kvlab list``), local directory or Hub id.
        compression: the pipeline (see ``docs/architecture.md``); empty means the full cache.
        max_new_tokens: greedy decode limit per sample.
        dtype: model dtype.
        record_scores: keep per-layer scores of every batch (the first ``inspect_samples``
            batches always keep them for the TensorBoard histograms).
        record_positions: write each sample's kept prompt positions per layer and KV head to
            ``positions.jsonl`` beside the predictions (:mod:`kvlab.runner.positions`; compared
            across runs by ``kvlab compare``), under every protocol: the context's and the question
            part's apart under ``query_agnostic`` / ``multi_question``, and ``decode_time``'s
            evictions during generation. Not part of the run's fingerprint: it changes no result,
            and samples finished before it was turned on have no row.
        fidelity: compare every sample with the full-cache model (greedy agreement,
            teacher-forced KL and top-1; ``docs/evaluation.md``). The full-cache reference is
            cached per sample in ``files.reference_dir`` (``<run.dir>/<run.experiment>/reference``).
        inspect_samples: batches (from the first) whose first sample gets the detailed
            TensorBoard views (heatmap, score histograms, kept image patches).
        inspect_layers: layers whose score histograms and kept image patches are drawn (negative:
            from the end); default ``[0, -1]``; ``all``: every layer.
        kernels: ``auto`` (Triton on CUDA, torch elsewhere), ``reference`` (torch everywhere,
            for debugging) or ``triton``: every prediction step runs inside
            :func:`kvlab.kernels.dispatch.kernel_mode` of it (no process-wide setting).
        device_map: spread the model over several devices (accelerate): ``auto``, ``balanced``,
            ``balanced_low_0``, ``sequential`` or a module name -> device mapping; each layer's
            cache lives on its layer's device. Lightning then does not move the model (it is
            not registered as a submodule) and the run must be one process (``trainer.devices:
            1``); see ``docs/scaling.md``.
        verify: ``first_batch`` (default): before any prediction, the first sample runs through
            transformers' own attention and through kvlab's engine with nothing evicted
            (:func:`kvlab.engine.verify.verify_engine`); a mismatch refuses the run. ``off`` skips it.
        protocol: what is compressed and when (``docs/protocols.md``): ``query_aware`` (default:
            the whole prompt in one prefill), ``query_agnostic`` (the context alone, then the
            question prefilled uncompressed), ``multi_question`` (one compressed context per
            ``context_id`` answers each of its questions) or ``decode_time`` (also compress during
            generation: ``{name: decode_time, interval: 512, target_size: 1024}`` or ``ratio``).
            A name or a node; checked against the pipeline here, before the model loads.
        prefill_chunk: None (default): the prompt in one forward. N: prefill it in chunks of N
            tokens, each attending to the dense K/V of the chunks before it; every layer is
            compressed after the last chunk (``docs/scaling.md``). Refused here, before the
            model loads, for methods whose scorers need every prompt query (H2O, LOOK-M), and
            for vision-language models when the model is loaded.

    Keyword-only, wired by the run's driver (:mod:`kvlab.cli.predict`), never config fields:

    Args:
        files: where the run writes (``reproduce.json``, the fidelity references); None (a module
            built without a run directory) writes nothing and keeps references in memory.
        task_metrics: the task metrics each sample is scored with (the dataset's, checked against
            the registry by the data module).
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        compression: dict[str, Any] | None = None,
        max_new_tokens: int = 32,
        dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        record_scores: bool = False,
        record_positions: bool = False,
        fidelity: bool = True,
        inspect_samples: int = 4,
        inspect_layers: list[int] | Literal["all"] | None = None,
        kernels: Literal["auto", "reference", "triton"] = "auto",
        device_map: str | dict[str, str | int] | None = None,
        verify: Literal["first_batch", "off"] = "first_batch",
        protocol: str | dict[str, Any] = "query_aware",
        prefill_chunk: int | None = None,
        *,
        files: RunFiles | None = None,
        task_metrics: tuple[str, ...] = DEFAULT_TASK_METRICS,
    ):
        super().__init__()
        if max_new_tokens < 1:
            raise ConfigError(f"model.max_new_tokens must be >= 1, got {max_new_tokens}.")
        if inspect_samples < 0:
            raise ConfigError(
                f"model.inspect_samples must be >= 0 (0 = no detailed views), got {inspect_samples}."
            )
        validate_model_name(model)
        validate_model_dtype(model, dtype)
        if verify not in ("first_batch", "off"):
            raise ConfigError(
                f"model.verify must be 'first_batch' (check kvlab's engine against transformers on the first "
                f"sample) or 'off', got {verify!r}."
            )
        self.verify = verify
        #: seconds the first-batch check took (None until it ran); added to the first record
        self.verify_seconds: float | None = None
        self.verify_reported = False  # whether a record carries verify_seconds yet
        self.model_name = model
        self.pipeline = load_pipeline(compression)
        self.pipeline.bind_model(model)  # a calibration artefact of another model fails here, before loading
        self.protocol: Protocol = build_protocol(protocol)
        self.protocol.check(self.pipeline)
        check_prefill_chunk(self.pipeline, prefill_chunk)
        #: every batch's options (``record_scores`` also holds for the inspected batches)
        self.options = RunOptions(
            max_new_tokens, fidelity, record_scores, None, prefill_chunk, record_positions
        )
        self.dtype_name = dtype
        self.inspect_samples = inspect_samples
        if isinstance(inspect_layers, str) and inspect_layers != "all":
            raise ConfigError(f"model.inspect_layers must be a list of layers or 'all': {inspect_layers!r}")
        #: the layers the detailed views draw (None: every layer)
        layers = (0, -1) if inspect_layers is None else inspect_layers
        self.inspect_layers = None if layers == "all" else tuple(layers)
        self.files = files
        self.task_metrics = task_metrics
        self.inspector: Inspector | None = None
        self.kernels = check_mode(kernels)  # the mode of this run's prediction steps (kernel_mode)
        validate_device_map(device_map)
        self.device_map = device_map
        self.loaded: LoadedModel | None = None
        #: the loaded model's fingerprint (reproduce.json), computed when first written
        self.fingerprint: dict[str, Any] | None = None
        self.save_hyperparameters(ignore=["files", "task_metrics"])

    def configure_model(self) -> None:
        """Load the model (once) and route its language-model attention through kvlab."""
        if self.loaded is not None:
            return
        if self.device_map is not None and getattr(self._trainer, "world_size", 1) > 1:
            raise ConfigError(
                f"model.device_map ({self.device_map!r}) spreads one model over several devices, which needs "
                f"a single process, but the trainer runs {self._trainer.world_size} (data-parallel). Set "
                "`--trainer.devices 1` (the device map then uses every visible accelerator), or drop "
                "model.device_map to run one model copy per device."
            )
        # attention routed through kvlab
        self.loaded = load_model(self.model_name, self.dtype_name, device_map=self.device_map)
        if self.options.prefill_chunk is not None and self.loaded.info.vision_language:
            raise ConfigError(chunked_vlm_message(self.model_name, self.options.prefill_chunk))
        if self.device_map is None:
            self.language_model = self.loaded.model  # registered so Lightning moves it to the device
        # with a device_map the model stays unregistered: Lightning's move of the module to its root
        # device (strategy.model_to_device) would otherwise pull every layer onto that one device

    def on_predict_start(self) -> None:
        """The TensorBoard inspector and, on rank 0 of a run with files (:attr:`files`),
        ``reproduce.json``."""
        if self.logger is not None:
            method = self.files.run_dir.name if self.files is not None else None
            label = run_label(method, self.pipeline)  # figure titles: method and budget
            experiment = self.logger.experiment
            self.inspector = Inspector(experiment, self.inspect_samples, self.inspect_layers, label)
        if self.files is not None and self.global_rank == 0:
            record = self.reproduce_record()
            atomic_write_text(self.files.run_dir / REPRODUCE, json.dumps(record, indent=2) + "\n")

    def reproduce_record(self) -> dict[str, Any]:
        """:func:`kvlab.models.fingerprint.reproduce_record` of this run (the model's fingerprint is
        computed once, :attr:`fingerprint`)."""
        if self.fingerprint is None:
            self.fingerprint = model_fingerprint(self.loaded.model)
        seed = os.environ.get("PL_GLOBAL_SEED")  # set by seed_everything (the CLI's seed_everything)
        builtin = MODELS.get(self.model_name) if self.model_name in MODELS else None
        return reproduce_record(
            model=self.model_name,
            fingerprint=self.fingerprint,
            model_seed=builtin.seed if builtin is not None else None,
            seed=int(seed) if seed is not None else None,
            dtype=self.dtype_name,
            device=self._compute_device(),
        )

    def _compute_device(self) -> torch.device:
        """Where the model computes: its first parameter's device (with a device_map, the first layer's)."""
        param = next(self.loaded.model.parameters(), None)
        return param.device if param is not None else self.device

    def _cuda_devices(self) -> list[torch.device]:
        """The CUDA devices holding the model's parameters (several under a device_map)."""
        devices = {p.device for p in self.loaded.model.parameters() if p.device.type == "cuda"}
        return sorted(devices, key=lambda d: d.index or 0)

    def on_predict_end(self) -> None:
        if self.inspector is not None:
            self.inspector.finish()

    def predict_step(self, batch: Batch, batch_idx: int) -> list[dict[str, Any]]:
        """One batch -> one prediction record per sample (written by the prediction writer), with
        the kernels of this run's ``model.kernels`` (the mode is the step's, not the process's)."""
        with kernel_mode(self.kernels):
            return self.predict_batch(batch, batch_idx)

    def predict_batch(self, batch: Batch, batch_idx: int) -> list[dict[str, Any]]:
        """:meth:`predict_step`'s work: verify (first batch), run the protocol, build the records."""
        if self.verify == "first_batch" and self.verify_seconds is None:
            self.verify_engine(batch)
        cuda_devices = self._cuda_devices()
        rss_before = None
        for device in cuda_devices:
            torch.cuda.reset_peak_memory_stats(device)
        if not cuda_devices:
            rss_before = process_rss_bytes()
        detailed = self.inspector is not None and self.inspector.detailed(batch_idx)
        options = replace(self.options, record_scores=True) if detailed else self.options
        run = self.protocol.run(self.loaded, self.pipeline, batch, options)
        result = run.result
        if cuda_devices:  # summed over the devices a device_map spreads the model over
            peak, kind = sum(torch.cuda.max_memory_allocated(d) for d in cuda_devices), "cuda_allocated"
        else:  # a high-water mark over the process's life: rss_before says where the batch started
            peak, kind = process_peak_rss_bytes(), "process_rss_high_water"
        rows = position_rows(run, batch, self.protocol.registry_name) if options.record_positions else None
        report = self.pipeline.report(result.reports, result.kv_bytes_kept)  # the components' fields
        outputs = batch_outputs(self.loaded, batch, result, report.samples, self.options.max_new_tokens)
        records = self.records(outputs, result.reports, batch, rows)
        for record, extra in zip(records, run.extras, strict=True):
            record["protocol"] = self.protocol.registry_name
            record.update(extra)
        if self.verify_seconds is not None and not self.verify_reported:
            records[0]["verify_seconds"] = self.verify_seconds
            self.verify_reported = True
        for record in records:
            record["kv_bytes_allocated"] = result.kv_bytes_allocated
            if peak is not None:
                record["peak_memory_bytes"] = int(peak)
                record["peak_memory_kind"] = kind
            if rss_before is not None:
                record["peak_memory_rss_before_bytes"] = rss_before
        if options.return_logits:  # model.fidelity
            store = ReferenceStore(self.files.reference_dir if self.files is not None else None)
            evaluator = FidelityEvaluator(self.loaded, store, self.options, self.dtype_name, self.protocol)
            values = evaluator.evaluate(self.pipeline, batch, result)
            for record, fidelity in zip(records, values, strict=True):
                record.update(fidelity)
        if self.inspector is not None:
            self.inspector.log_batch(result, batch, batch_idx, self.loaded.processor, report.scalars)
        return records

    def verify_engine(self, batch: Batch) -> None:
        """``model.verify: first_batch``: compare the batch's first sample under kvlab's engine (full
        cache) with transformers' own forward (:func:`kvlab.engine.verify.verify_engine`).

        Raises:
            ConfigError: kvlab does not reproduce the model (before any prediction is returned).
        """
        result = verify_engine(self.loaded, batch)
        self.verify_seconds = result.seconds_native + result.seconds_kvlab
        if not result.ok:
            raise ConfigError(
                f"model.verify: kvlab's engine does not reproduce model {self.model_name!r} "
                f"({self.dtype_name}) on the first sample with nothing evicted: {result.describe()}. No "
                "prediction was written. Run with `--model.verify off` to predict anyway at your own risk "
                "(every result of this model may be wrong), or report the model family to kvlab."
            )
        print(
            "kvlab: engine verified on the first sample (max |logit difference| "
            f"{result.max_logit_diff:.3g}, "
            f"greedy tokens match; {self.verify_seconds:.2f} s)"
        )

    def records(
        self,
        outputs: list[Output],
        reports: list[LayerReport],
        batch: Batch,
        positions: list[dict[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        """Per-sample JSON-ready records of a batch: each sample's :class:`~kvlab.api.Output`
        (:meth:`~kvlab.api.Output.record`, then the components' :attr:`~kvlab.api.Output.reported`
        fields) with its id, answers, budget overshoot, task scores and kept modalities;
        ``positions``: each sample's ``positions.jsonl`` row (``model.record_positions``), handed
        to the writer."""
        records = []
        overshoot = budget_overshoot(reports)  # [B] or None (full cache)
        for b, (sample, output) in enumerate(zip(batch.samples, outputs, strict=True)):
            record = {"id": sample.id, **output.record(), "answers": sample.answers, "meta": sample.meta}
            if overshoot is not None:
                record["budget_overshoot"] = int(overshoot[b])
            record.update(score_output(output.text, sample, self.task_metrics))
            record.update(output.reported)
            record.update(modality_record(reports, batch.modality, b))  # for the end-of-run figure
            if positions is not None:  # the writer moves it to positions.jsonl
                record[POSITIONS_FIELD] = positions[b]
            records.append(record)
        return records
