"""KVLabModule: the LightningModule whose ``predict_step`` is prefill -> compress -> decode."""

from __future__ import annotations

from typing import Any, Literal

import lightning as L
import torch

from kvlab.attention import enable_kvlab_attention
from kvlab.compression.pipeline import Pipeline
from kvlab.errors import ConfigError
from kvlab.generation import GenerationResult, generate
from kvlab.inspect import log_batch
from kvlab.kernels.dispatch import set_mode as set_kernel_mode
from kvlab.models.base import LoadedModel
from kvlab.tasks import score_output

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVLabModule(L.LightningModule):
    """Runs one compression method on a model.

    Args:
        model: built-in model name (``kvlab list``), local directory or Hub id.
        compression: the pipeline (see ``docs/architecture.md``); empty means the full cache.
        max_new_tokens: greedy decode limit per sample.
        dtype: model dtype.
        record_scores: keep per-layer scores for TensorBoard histograms (costs memory).
        kernels: ``auto`` (Triton on CUDA, torch elsewhere), ``reference`` (torch everywhere,
            for debugging) or ``triton``; sets :mod:`kvlab.kernels.dispatch` for the run.
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        compression: dict[str, Any] | None = None,
        max_new_tokens: int = 32,
        dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        record_scores: bool = False,
        kernels: Literal["auto", "reference", "triton"] = "auto",
    ):
        super().__init__()
        from kvlab.models import validate_model_name

        if max_new_tokens < 1:
            raise ConfigError(f"model.max_new_tokens must be >= 1, got {max_new_tokens}.")
        validate_model_name(model)
        self.model_name = model
        self.pipeline = Pipeline.from_config(compression)
        self.max_new_tokens = max_new_tokens
        self.dtype_name = dtype
        self.record_scores = record_scores
        set_kernel_mode(kernels)
        self.loaded: LoadedModel | None = None
        self.save_hyperparameters()

    def configure_model(self) -> None:
        """Load the model (once) and route its language-model attention through kvlab."""
        if self.loaded is not None:
            return
        from kvlab.models import load_model

        self.loaded = load_model(self.model_name, self.dtype_name)
        enable_kvlab_attention(self.loaded.model, self.loaded.info.vision_language)
        self.language_model = self.loaded.model  # registered so Lightning moves it to the device

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[dict[str, Any]]:
        """One batch -> one prediction record per sample (written by the prediction writer)."""
        result = generate(
            self.loaded,
            self.pipeline,
            batch,
            max_new_tokens=self.max_new_tokens,
            record_scores=self.record_scores,
        )
        if self.logger is not None:
            log_batch(self.logger.experiment, result, batch, step=batch_idx)
        return self.records(result, batch)

    def records(self, result: GenerationResult, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """Per-sample JSON-ready records of a batch's :class:`GenerationResult`."""
        records = []
        B = len(batch["ids"])
        for b, sample in enumerate(batch["samples"]):
            text = self.loaded.processor.decode(result.tokens[b])
            record = {
                "id": sample.id,
                "output": text,
                "output_tokens": len(result.tokens[b]),
                "prompt_tokens": int(result.prompt_lengths[b]),
                "kept_per_layer_head": result.kept[:, b].tolist(),
                "kv_bytes_full": int(result.kv_bytes_full[b]),
                "kv_bytes_kept": int(result.kv_bytes_kept[b]),
                "kv_ratio": float(result.kv_bytes_kept[b]) / max(int(result.kv_bytes_full[b]), 1),
                "batch_size": B,
                "prefill_seconds": result.prefill_seconds / B,
                "compression_seconds": result.compression_seconds / B,
                "decode_seconds": result.decode_seconds / B,
                "answers": sample.answers,
                "meta": sample.meta,
            }
            record.update(score_output(text, sample))
            records.append(record)
        return records
