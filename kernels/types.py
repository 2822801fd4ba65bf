"""What the torch references and the Triton launchers of the kernels share: the flat layout's
result type and offsets, the merge's weighting, the packed codes the fused decode kernels read. A
launcher (``kvlab.kernels.tl``) imports these from here, never from its dispatcher's module, so the
two never import each other."""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import torch

#: ``(prompt_keys [N, D], prompt_values [N, D], starts [B, Hkv], lengths [B, Hkv])``: the kept
#: entries of every (sample, KV head) in (sample, head, position) order (``compact_kv``)
Compacted = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

#: how a merge normalises the sum of a kept entry and the evicted entries merged into it
#: (``merge_scatter``): by the summed weights, or by the number of entries
Normalize = Literal["weights", "count"]


def segment_starts(counts: torch.Tensor) -> torch.Tensor:
    """Offsets ``[B, Hkv]`` of each (sample, head) segment in the flat buffer (exclusive cumsum)."""
    flat = counts.flatten()
    return (flat.cumsum(0) - flat).view(counts.shape)


@runtime_checkable
class UniformCodes(Protocol):
    """Uniform asymmetric codes of ``[M, D]`` rows, as the fused packed decode kernel reads them
    (:class:`kvlab.compression.quantizers.GroupCodes`): ``x^ = q s + z``.

    Attributes:
        packed: ``[M, D * bits / 8]`` uint8, ``8 / bits`` consecutive channels' codes per byte, the
            first in the low bits.
        scale / zero: ``[M / group, D]`` (``along == "tokens"``: ``group`` consecutive rows share one
            per channel) or ``[M, D / group]`` (``"channels"``: ``group`` consecutive channels of a
            row share one), in the entries' dtype.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group: int
    along: Literal["tokens", "channels"]


@runtime_checkable
class RotatedCodebookCodes(Protocol):
    """TurboQuant codes of ``[M, D]`` rows, as the fused packed decode kernel reads them
    (:class:`kvlab.compression.turboquant.RotatedCodes`, Zandieh et al. 2025, Algorithms 1-2):
    ``x^ = ||x|| (Π^T c[idx] + γ sqrt(π/2) / D  S^T sign)``, the second term with a sketch only.

    Attributes:
        packed: ``[M, D * mse_bits / 8]`` uint8 codebook indices (``8 / b`` per byte, the first in the
            low bits, for ``b`` in {1, 2, 4}; ``b`` bit planes of ``D / 8`` bytes otherwise), or None
            when ``mse_bits`` is 0.
        norm: ``[M]`` ``||x||`` in the entries' dtype.
        signs / gamma: ``[M, D / 8]`` uint8 the signs of ``S r`` (8 per byte, the first in the low
            bit) and ``[M]`` ``γ = ||r||``, or None (no QJL sketch).
        rotation / projection: ``Π`` and ``S`` ``[D, D]`` fp32 (``projection`` None without sketch).
        codebook: ``[2^mse_bits]`` fp32 centroids (``[1]`` zeros when ``mse_bits`` is 0).
    """

    packed: torch.Tensor | None
    norm: torch.Tensor
    signs: torch.Tensor | None
    gamma: torch.Tensor | None
    rotation: torch.Tensor
    projection: torch.Tensor | None
    codebook: torch.Tensor
    mse_bits: int
    dim: int

    def rotated_terms(
        self, rows: torch.Tensor | slice
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """Rows before any rotation back: ``(c[idx], sign(S r) as +-1 or None, the sketch's scale
        or None, ||x||)``, fp32 (the torch path's rotated-basis attention reads these)."""
        ...
