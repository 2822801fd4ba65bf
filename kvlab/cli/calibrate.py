"""``kvlab calibrate``: run a model over a calibration set and write a calibration artefact.

    kvlab calibrate --config visual_heads [--model NAME] [--output PATH] [--num_samples N]

``--config`` takes a YAML file or the name of a shipped calibration config; its fields are
described in :mod:`kvlab.calibration.run`. The options override the config's ``model``,
``output`` and ``data.dataset.num_samples``. Everything is validated before the model loads.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvlab.calibration.run import calibrate, read_settings
from kvlab.config.artefacts import Artefact


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvlab calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="calibration YAML or shipped name")
    parser.add_argument("--model", help="override the config's model")
    parser.add_argument("--output", help="artefact path (default: the config's output)")
    parser.add_argument("--num_samples", type=int, help="override data.dataset.num_samples")
    return parser.parse_args(argv)


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The calibration config named by ``--config`` with the command-line overrides applied."""
    settings = read_settings(args.config)
    if args.model:
        settings["model"] = args.model
    if args.output:
        settings["output"] = args.output
    if args.num_samples is not None:
        settings.setdefault("data", {}).setdefault("dataset", {})["num_samples"] = args.num_samples
    return settings


def main(argv: list[str]) -> None:
    """Entry point of ``kvlab calibrate``."""
    path = calibrate(settings_of(parse_args(argv)))
    artefact = Artefact.load(path)
    shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in artefact.tensors.items())
    print(f"kvlab: wrote {artefact.kind} artefact for {artefact.model} ({shapes}) to {path}")
