"""Synthetic calibration artefacts: seeded stand-ins for measured statistics.

Benchmarks and tests that exercise SparseMM's head budgets on models with no calibrated
visual heads (random-weight tiny models, long random prompts) use these; they measure memory
and plumbing, never quality.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvlab.config.artefacts import Artefact


def synthetic_visual_heads(info: Any, directory: str) -> str:
    """A seeded visual-head artefact for ``info``'s shape: a few heads hold most of the score."""
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(info.num_layers, info.num_heads, generator=gen) ** 6
    shape = (info.num_layers, info.num_heads, info.num_kv_heads)
    artefact = Artefact("visual_heads", info.name, *shape, {"scores": scores})
    return str(artefact.save(Path(directory) / "visual_heads.safetensors"))
