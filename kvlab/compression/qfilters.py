"""Q-Filters (Godey et al. 2025): each key projected on its head's calibrated query direction.

The method, the sign convention and where kvlab stands against the paper and the reference code
(kvpress' ``QFilterPress``) are written out in ``docs/methods/qfilters.md``; the directions come
from ``kvlab calibrate --config qfilters`` (:mod:`kvlab.calibration.qfilters`, docs/calibration.md).
Shapes: B batch, Hkv KV heads, T padded prompt length, D head dim, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.compression.context import LayerContext
from kvlab.compression.importance import IMPORTANCE, ImportanceScorer
from kvlab.config import papers
from kvlab.config.artefacts import UsesArtefact
from kvlab.config.capabilities import Capabilities


@IMPORTANCE.register("qfilters")
@dataclass
class QFiltersScorer(ImportanceScorer, UsesArtefact):
    """Q-Filters: ``s_t = <k_t, u_h>``, the key's projection on its KV head's Q-Filter.

    Godey et al. 2025, the method's observations: the queries and keys of a head share one dominant direction
    ``u_h`` (Observation 1, ``E<Q, u_h> > 0``), and the queries are near-isotropic around it
    (Observation 2), so the attention logit a key can expect is ``E_Q <Q, K_t> ~ kappa_h <K_t, u_h>``
    with ``kappa_h > 0`` (Theorem 1): the keys with the largest projection on ``u_h`` are the ones
    the next queries attend to most, and the ones kept. ``u_h`` is estimated offline (the
    Q-Filters): the first right singular vector of a matrix of the head's (rotated) queries over
    a calibration set, its sign fixed so that the mean projection of the queries is positive.

    The filters are the ``filters [L, Hkv, D]`` of a ``qfilters`` calibration artefact
    (``kvlab calibrate --config qfilters``; ``artefact: auto`` finds the model's, shipped for
    ``smollm2-135m`` and the tiny test models). kvpress' ``QFilterPress`` scores
    ``-(f . k)`` with filters ``f`` downloaded from the authors' hub collection: the same
    ranking as this scorer exactly when ``f = -u_h`` (the hub stores the opposite sign of the
    paper's ``u_h``); kvlab follows the paper's Theorem 1, and ``docs/methods/qfilters.md``
    records the measurement on ``smollm2-135m`` that the paper's sign is the one that finds the
    attended keys.

    Reads the keys only (``chunked_prefill``): keys ``[B, Hkv, T, D]`` -> scores ``[B, Hkv, T]`` fp32.
    """

    paper: ClassVar[str | None] = papers.QFILTERS

    artefact: str = "auto"

    artefact_kind = "qfilters"
    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=True)  # keys only

    def score(self, ctx: LayerContext) -> torch.Tensor:
        filters = self.artefact_for(ctx).tensors["filters"][ctx.layer_idx]  # [Hkv, D]
        filters = filters.to(device=ctx.keys.device, dtype=torch.float32)
        return torch.einsum("bhtd,hd->bht", ctx.keys_fp32(), filters)
