"""Head statistics on needle-in-a-haystack prompts: which heads read the needle while the answer
is copied out of it (``needs_needle``: the reference answer teacher-forced after the prompt, the
needle's prompt tokens as targets; :func:`~kvlab.calibration.statistics.needle_targets`).

- ``duo_attention_heads``: DuoAttention's retrieval-head scores (Xiao et al. 2024), estimated
  without the paper's gate optimisation: each query head's attention mass from the answer tokens
  on the needle (``docs/calibration.md`` says what this replaces and what it costs).

The consumers are the head allocators of :mod:`kvlab.compression.duo_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.calibration.reading import ImageAttention
from kvlab.calibration.statistics import CALIBRATIONS


@CALIBRATIONS.register("duo_attention_heads")
@dataclass
class NeedleAttention(ImageAttention):
    """``scores [L, H]`` fp32: for every teacher-forced answer token and query head, the attention
    mass on the needle's prompt tokens, mean over the answer's tokens, then over samples (the
    ``target`` mass of :class:`~kvlab.calibration.reading.ImageAttention`, with the needle as the
    target). A streaming head (sinks and recent tokens only) cannot put mass there; a head that
    copies the answer out of the needle puts most of its mass there."""

    needs_targets = False
    needs_needle = True

    def result(self) -> dict[str, torch.Tensor]:
        return {"scores": super().result()["target"]}
