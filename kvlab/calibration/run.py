"""Running a calibration: a model over a calibration set, one statistic recorded, one artefact written.

A calibration config (a YAML file or the name of a shipped one, ``kvlab/calibration/configs/``:
``visual_heads``, ``redundancy``, ...) has the fields::

    model: smollm2-qwen2-vl                 # built-in name, local directory or Hub id
    calibration: {name: visual_heads}       # a registered statistic and its parameters
    data: {dataset: {name: synthetic_image_qa, num_samples: 32}}
    dtype: float32
    output: auto                            # or a path (auto: see kvlab.config.artefacts.cache_path)

:func:`read_settings` reads and checks one, :func:`calibrate` runs it; everything is validated
before the model loads. The command line (``kvlab calibrate``) is :mod:`kvlab.cli.calibrate`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvlab import models  # module attribute: load_model stays replaceable (tests)
from kvlab.calibration.statistics import (
    CALIBRATIONS,
    CalibrationBatch,
    Recorder,
    needle_sentence,
    needle_targets,
    region_targets,
)
from kvlab.config.artefacts import Artefact, cache_path
from kvlab.config.errors import ConfigError, did_you_mean
from kvlab.config.loader import find_config
from kvlab.config.yaml_text import load_yaml_file
from kvlab.data import build_dataset
from kvlab.engine.generation import RunOptions, generate
from kvlab.engine.registration import enable_kvlab_attention
from kvlab.models.base import Batch
from kvlab.pipeline import Pipeline

CONFIGS = Path(__file__).parent / "configs"
FIELDS = ("model", "calibration", "data", "dtype", "output")


def read_settings(config: str) -> dict[str, Any]:
    """The calibration config ``config`` (a YAML path or a shipped name) as a plain dict, its fields
    checked."""
    path = find_config(config, shipped=CONFIGS, kind="calibration config")
    settings = load_yaml_file(path) or {}
    if not isinstance(settings, dict):
        raise ConfigError(f"calibration config '{config}' must be a mapping with fields {', '.join(FIELDS)}.")
    for key in settings:
        if key not in FIELDS:
            raise ConfigError(
                f"calibration config has no field '{key}'.{did_you_mean(key, FIELDS)} "
                f"Fields: {', '.join(FIELDS)}."
            )
    return settings


def calibrate(settings: dict[str, Any]) -> Path:
    """Run the calibration described by ``settings``; returns the artefact path."""
    model_name = settings.get("model")
    models.validate_model_name(model_name)
    statistic = CALIBRATIONS.build(settings.get("calibration"), "calibration")
    dataset_node = (settings.get("data") or {}).get("dataset")
    if dataset_node is None:
        raise ConfigError(
            "calibration config needs data.dataset, e.g. {name: synthetic_image_qa, num_samples: 32}."
        )
    samples = build_dataset(
        dataset_node, "data.dataset", tokenizer=model_name, processors=models.PROCESSORS
    ).samples()
    if (statistic.needs_answers or statistic.needs_needle) and any(not s.answers for s in samples):
        raise ConfigError(
            f"calibration '{statistic.registry_name}' teacher-forces reference answers, but some samples of "
            "data.dataset have none. Use a dataset with answers (e.g. synthetic_image_qa)."
        )
    output = settings.get("output", "auto")
    path = cache_path(model_name, statistic.registry_name) if output in (None, "auto") else Path(output)

    loaded = models.load_model(model_name, settings.get("dtype", "float32"))
    if statistic.needs_targets and not loaded.tokens_per_image:
        raise ConfigError(
            f"calibration '{statistic.registry_name}' needs image tokens, but model '{model_name}' takes no "
            "images. Use a vision-language model (e.g. smollm2-qwen2-vl)."
        )
    enable_kvlab_attention(loaded.model, loaded.info.vision_language)
    info = loaded.info
    statistic.start(info.num_layers, info.num_heads, info.num_kv_heads)
    recorder = Recorder(statistic, Pipeline.from_config(None))
    start = time.perf_counter()
    for sample in samples:
        batch = loaded.processor.collate([sample])
        answer = 0
        prompt_ids = batch.input_ids[0]
        if statistic.needs_answers or statistic.needs_needle:
            batch, answer = with_answer(loaded, batch, sample.answers[0])
        targets = None
        if statistic.needs_needle:  # the needle's prompt tokens; the answer's tokens are no target
            needle = needle_sentence(sample.prompt, sample.answers[0])
            needle_ids = loaded.processor.tokenizer(needle, add_special_tokens=False)["input_ids"]
            forced = torch.zeros(answer, dtype=torch.bool)
            targets = torch.cat([needle_targets(prompt_ids, needle_ids), forced])[None]
        elif statistic.needs_targets:
            targets = region_targets(batch.modality[0], sample.meta, loaded.tokens_per_image)[None]
        recorder.batch = CalibrationBatch(answer_tokens=torch.tensor([answer]), targets=targets)
        generate(loaded, recorder, batch, RunOptions(max_new_tokens=1))
    artefact = Artefact(
        kind=statistic.registry_name,
        model=model_name,
        num_layers=info.num_layers,
        num_heads=info.num_heads,
        num_kv_heads=info.num_kv_heads,
        tensors=statistic.result(),
        settings={**settings, "samples": len(samples), "seconds": round(time.perf_counter() - start, 2)},
    )
    return artefact.save(path)


def with_answer(loaded: Any, batch: Batch, answer: str) -> tuple[Batch, int]:
    """Append the tokens of ``answer`` to a one-sample batch (teacher forcing); returns (batch, count)."""
    ids = loaded.processor.tokenizer(answer, add_special_tokens=False)["input_ids"]
    extra = torch.tensor([ids], dtype=torch.long)
    n = extra.shape[1]
    T = batch.input_ids.shape[1]
    inputs = {}
    for key, value in batch.model_inputs.items():
        if torch.is_tensor(value) and value.dim() == 2 and value.shape == (1, T):
            value = torch.cat([value, torch.zeros(1, n, dtype=value.dtype)], dim=1)  # token-type ids: text
        inputs[key] = value
    out = replace(
        batch,
        input_ids=torch.cat([batch.input_ids, extra], dim=1),
        attention_mask=torch.cat([batch.attention_mask, torch.ones_like(extra)], dim=1),
        modality=torch.cat([batch.modality, torch.zeros_like(extra)], dim=1),
        model_inputs=inputs,
    )
    return out, n
