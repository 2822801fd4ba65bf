"""What the torch references and the Triton launchers of the kernels share: the flat layout's
result type and offsets, the merge's weighting. A launcher (``kvlab.kernels.tl``) imports these
from here, never from its dispatcher's module, so the two never import each other."""

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
