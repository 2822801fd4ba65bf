"""``kvlab calibrate``: run a model over a calibration set and write a calibration artefact.

    kvlab calibrate --config visual_heads [--model NAME] [--output PATH] [--num_samples N]

``--config`` takes a YAML file or the name of a shipped calibration config
(``kvlab/calibration/configs/``: ``visual_heads``, ``redundancy``). Fields::

    model: smollm2-qwen2-vl                 # built-in name, local directory or Hub id
    calibration: {name: visual_heads}       # a registered statistic and its parameters
    data: {dataset: {name: synthetic_image_qa, num_samples: 32}}
    dtype: float32
    output: auto                            # or a path (auto: see kvlab.calibration.cache_path)

Everything is validated before the model loads.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from kvlab.calibration import prefixkv as _prefixkv  # noqa: F401  (registers prefixkv_layer_ratios)
from kvlab.calibration import reading as _reading  # noqa: F401  (hybridkv_head_classes, image_attention)
from kvlab.calibration.artefact import Artefact, cache_path
from kvlab.calibration.statistics import CALIBRATIONS, CalibrationBatch, Recorder, region_targets
from kvlab.config.errors import ConfigError, did_you_mean
from kvlab.config.loader import find_config

CONFIGS = Path(__file__).parent / "configs"
FIELDS = ("model", "calibration", "data", "dtype", "output")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvlab calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="calibration YAML or shipped name")
    parser.add_argument("--model", help="override the config's model")
    parser.add_argument("--output", help="artefact path (default: the config's output)")
    parser.add_argument("--num_samples", type=int, help="override data.dataset.num_samples")
    return parser.parse_args(argv)


def load_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The calibration config with the command-line overrides applied (plain dict)."""
    path = find_config(args.config, shipped=CONFIGS, kind="calibration config")
    settings = yaml.safe_load(path.read_text()) or {}
    if not isinstance(settings, dict):
        raise ConfigError(
            f"calibration config '{args.config}' must be a mapping with fields {', '.join(FIELDS)}."
        )
    for key in settings:
        if key not in FIELDS:
            raise ConfigError(
                f"calibration config has no field '{key}'.{did_you_mean(key, FIELDS)} "
                f"Fields: {', '.join(FIELDS)}."
            )
    if args.model:
        settings["model"] = args.model
    if args.output:
        settings["output"] = args.output
    if args.num_samples is not None:
        settings.setdefault("data", {}).setdefault("dataset", {})["num_samples"] = args.num_samples
    return settings


def calibrate(settings: dict[str, Any]) -> Path:
    """Run the calibration described by ``settings``; returns the artefact path."""
    from kvlab.compression.pipeline import Pipeline
    from kvlab.data import build_dataset
    from kvlab.engine.generation import generate
    from kvlab.models import load_model, validate_model_name

    model_name = settings.get("model")
    validate_model_name(model_name)
    statistic = CALIBRATIONS.build(settings.get("calibration"), "calibration")
    dataset_node = (settings.get("data") or {}).get("dataset")
    if dataset_node is None:
        raise ConfigError(
            "calibration config needs data.dataset, e.g. {name: synthetic_image_qa, num_samples: 32}."
        )
    samples = build_dataset(dataset_node, "data.dataset", tokenizer=model_name).samples()
    if statistic.needs_answers and any(not s.answers for s in samples):
        raise ConfigError(
            f"calibration '{statistic.registry_name}' teacher-forces reference answers, but some samples of "
            "data.dataset have none. Use a dataset with answers (e.g. synthetic_image_qa)."
        )
    output = settings.get("output", "auto")
    path = cache_path(model_name, statistic.registry_name) if output in (None, "auto") else Path(output)

    loaded = load_model(model_name, settings.get("dtype", "float32"))
    if statistic.needs_targets and not loaded.extras.get("tokens_per_image"):
        raise ConfigError(
            f"calibration '{statistic.registry_name}' needs image tokens, but model '{model_name}' takes no "
            "images. Use a vision-language model (e.g. smollm2-qwen2-vl)."
        )
    from kvlab.engine.attention import enable_kvlab_attention

    enable_kvlab_attention(loaded.model, loaded.info.vision_language)
    info = loaded.info
    statistic.start(info.num_layers, info.num_heads, info.num_kv_heads)
    recorder = Recorder(statistic, Pipeline.from_config(None))
    start = time.perf_counter()
    for sample in samples:
        batch = loaded.processor.collate([sample])
        answer = 0
        if statistic.needs_answers:
            batch, answer = with_answer(loaded, batch, sample.answers[0])
        targets = None
        if statistic.needs_targets:
            targets = region_targets(batch["modality"][0], sample.meta, loaded.extras["tokens_per_image"])[
                None
            ]
        recorder.batch = CalibrationBatch(answer_tokens=torch.tensor([answer]), targets=targets)
        generate(loaded, recorder, batch, max_new_tokens=1)
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


def with_answer(loaded: Any, batch: dict[str, Any], answer: str) -> tuple[dict[str, Any], int]:
    """Append the tokens of ``answer`` to a one-sample batch (teacher forcing); returns (batch, count)."""
    ids = loaded.processor.tokenizer(answer, add_special_tokens=False)["input_ids"]
    extra = torch.tensor([ids], dtype=torch.long)
    n = extra.shape[1]
    out = dict(batch)
    out["input_ids"] = torch.cat([batch["input_ids"], extra], dim=1)
    out["attention_mask"] = torch.cat([batch["attention_mask"], torch.ones_like(extra)], dim=1)
    out["modality"] = torch.cat([batch["modality"], torch.zeros_like(extra)], dim=1)
    T = batch["input_ids"].shape[1]
    inputs = {}
    for key, value in batch.get("model_inputs", {}).items():
        if torch.is_tensor(value) and value.dim() == 2 and value.shape == (1, T):
            value = torch.cat([value, torch.zeros(1, n, dtype=value.dtype)], dim=1)  # token-type ids: text
        inputs[key] = value
    out["model_inputs"] = inputs
    return out, n


def main(argv: list[str]) -> None:
    """Entry point of ``kvlab calibrate``."""
    settings = load_settings(parse_args(argv))
    path = calibrate(settings)
    artefact = Artefact.load(path)
    shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in artefact.tensors.items())
    print(f"kvlab: wrote {artefact.kind} artefact for {artefact.model} ({shapes}) to {path}")
