"""Quantized prompt entries in the ragged cache: packed codes, their scales, a full-precision residual.

A quantizer (:mod:`kvlab.compression.quantizers`, ``model.compression.quantize``) turns a layer's
kept prompt entries into a :class:`PackedPrompt` right after compaction
(:meth:`kvlab.cache.layer.CompressedLayer.compress`); the flat ``prompt_keys / prompt_values``
buffers are then released, so what the layer holds is what :meth:`PackedPrompt.nbytes` counts.

Layout of one layer (``D`` head dim, ``b`` bits, every segment split the same way)::

    segment (b, h) of n kept entries = body (the oldest n_q entries, quantized)
                                     + residual (the newest n - n_q entries, full precision)
    body codes      keys / values: PackedCodes over Nb = sum n_q rows (codes + scales + zeros)
    body_starts / body_lengths          [B, Hkv]   rows of each segment's body in the codes
    residual_keys / residual_values     [Nr, D]    full precision, Nr = sum (n - n_q)
    residual_starts / residual_lengths  [B, Hkv]

``n_q = group * floor(max(n - residual, 0) / group)`` (:func:`body_lengths`): each body is whole
groups of ``group`` rows, so a group of tokens never straddles two segments (KIVI's per-channel
key groups, Liu et al. 2024, Sec. 3.2), and at least ``residual`` newest entries stay in full
precision (KIVI's residual ``R``, Sec. 3.3).

Decode attention (:func:`packed_decode_attention`) attends the body one bounded chunk of segments
at a time, dequantized into the cache's dtype (never the whole body at once, never in fp32 beyond
one chunk), the residual through strided views of its buffers, and the decode region, merging the
parts by their log-sum-exp. Calls the in-place path cannot take (attention variants, tensors off
the CPU) attend :meth:`PackedPrompt.dense`, the entries dequantized back into the layer's flat
order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvlab.kernels.decode_attention import (
    SegmentRuns,
    _decode_mask,
    _flash,
    _segments_view,
    ragged_decode_attention,
    reads_in_place,
    variants,
)
from kvlab.kernels.types import segment_starts

#: segments dequantized at once by the in-place decode path (bounds its transient buffer)
CHUNK_SEGMENTS = 16


class PackedCodes(Protocol):
    """Quantized rows ``[M, D]`` of one buffer (keys or values): codes and their parameters."""

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows [m]`` (long, row indices into the ``M`` quantized rows) dequantized, ``[m, D]``
        in the dtype of the entries that were quantized."""
        ...

    def nbytes(self) -> int:
        """Bytes held: packed codes plus every scale, zero point, norm and sketch."""
        ...

    def row_bytes(self) -> float:
        """Bytes one row costs: its codes and its share of the per-row or per-group parameters
        (what a batch row is charged, :meth:`PackedPrompt.sample_bytes`)."""
        ...


class EntryQuantizer(Protocol):
    """What the cache asks of a quantizer (:class:`kvlab.compression.quantizers.Quantizer`)."""

    def pack(
        self, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor
    ) -> PackedPrompt:
        """The flat kept entries ``keys / values [N, D]`` (segments ``starts / lengths [B, Hkv]``)
        as a :class:`PackedPrompt`."""
        ...


def body_lengths(lengths: torch.Tensor, group: int, residual: int) -> torch.Tensor:
    """``[B, Hkv]`` long: quantized entries of each segment,
    ``group * floor(max(n - residual, 0) / group)``."""
    return torch.div((lengths - residual).clamp(min=0), group, rounding_mode="floor") * group


def segment_rows(starts: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[sum counts]`` long: rows ``starts + offsets + j`` for ``j < counts`` of every segment, in order."""
    counts = counts.flatten()
    first = (starts + offsets).flatten()
    within = torch.arange(int(counts.sum()), device=counts.device) - torch.repeat_interleave(
        segment_starts(counts), counts
    )
    return torch.repeat_interleave(first, counts) + within


@dataclass
class PackedPrompt:
    """One layer's quantized prompt region (see the module docstring for the layout)."""

    keys: PackedCodes
    values: PackedCodes
    body_starts: torch.Tensor
    body_lengths: torch.Tensor
    residual_keys: torch.Tensor
    residual_values: torch.Tensor
    residual_starts: torch.Tensor
    residual_lengths: torch.Tensor
    _runs: tuple[SegmentRuns, SegmentRuns] | None = field(default=None, repr=False)

    @classmethod
    def split(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        starts: torch.Tensor,
        lengths: torch.Tensor,
        group: int,
        residual: int,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The body rows ``[Nb, D]`` of ``keys`` and ``values`` (to quantize) and the remaining
        :class:`PackedPrompt` fields but the codes (residual buffers, offsets), by name."""
        body = body_lengths(lengths, group, residual)
        rest = lengths - body
        body_rows = segment_rows(starts, torch.zeros_like(starts), body)
        residual_rows = segment_rows(starts, body, rest)
        layout = {
            "body_starts": segment_starts(body),
            "body_lengths": body,
            "residual_keys": keys[residual_rows],
            "residual_values": values[residual_rows],
            "residual_starts": segment_starts(rest),
            "residual_lengths": rest,
        }
        return keys[body_rows], values[body_rows], layout

    def nbytes(self) -> int:
        """Bytes held: both bodies' codes and parameters, the residual buffers and the offsets."""
        tensors = (
            self.residual_keys, self.residual_values, self.body_starts, self.body_lengths,
            self.residual_starts, self.residual_lengths,
        )  # fmt: skip
        return self.keys.nbytes() + self.values.nbytes() + sum(t.numel() * t.element_size() for t in tensors)

    def sample_bytes(self) -> torch.Tensor:
        """``[B]`` long: each batch row's bytes, its body rows at :meth:`PackedCodes.row_bytes` (keys
        and values) and its residual entries at full precision; parameters shared by the layer (a
        rotation) are in :meth:`nbytes` only."""
        body = self.body_lengths.sum(-1).double() * (self.keys.row_bytes() + self.values.row_bytes())
        entry = 2 * self.residual_keys.shape[1] * self.residual_keys.element_size()
        return body.round().long() + self.residual_lengths.sum(-1) * entry

    def runs(self) -> tuple[SegmentRuns, SegmentRuns]:
        """The body's and the residual's :class:`SegmentRuns` (one host sync, computed once)."""
        if self._runs is None:
            self._runs = (
                SegmentRuns.of(self.body_starts, self.body_lengths),
                SegmentRuns.of(self.residual_starts, self.residual_lengths),
            )
        return self._runs

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[N, D]`` dequantized in the layer's flat order (segment by segment, body
        then residual): what the layer held before quantization, up to the quantization error."""
        lengths = self.body_lengths + self.residual_lengths
        starts = segment_starts(lengths)
        body_rows = segment_rows(starts, torch.zeros_like(starts), self.body_lengths)
        residual_rows = segment_rows(starts, self.body_lengths, self.residual_lengths)
        codes = torch.arange(body_rows.shape[0], device=body_rows.device)
        out = []
        for packed, residual in ((self.keys, self.residual_keys), (self.values, self.residual_values)):
            flat = residual.new_empty(int(lengths.sum()), residual.shape[1])
            flat[body_rows] = packed.dequantize_rows(codes).to(residual.dtype)
            flat[residual_rows] = residual
            out.append(flat)
        return out[0], out[1]


def _merge(
    out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmax-attention results over disjoint entries merged by their log-sum-exps (fp32):
    ``lse = log(e^lse + e^part_lse)``, ``out = out e^(lse_old - lse) + part e^(part_lse - lse)``;
    a part with no entry has ``-inf`` and weight 0."""
    merged = torch.logaddexp(lse, part_lse)
    safe = torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)
    out = out * (lse - safe).exp().unsqueeze(-1) + part.float() * (part_lse - safe).exp().unsqueeze(-1)
    return out, merged


def packed_decode_attention(
    query: torch.Tensor,
    packed: PackedPrompt,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    decode_keys: torch.Tensor,
    decode_values: torch.Tensor,
    decode_length: int,
    scaling: float,
    max_prompt_length: int | None = None,
    chunk: int = CHUNK_SEGMENTS,
    **options: Any,
) -> torch.Tensor:
    """Attention of ``query [B, H, q, D]`` over a quantized layer -> ``[B, H, q, D]`` (query dtype).

    Arguments as :func:`kvlab.kernels.decode_attention.ragged_decode_attention`, the flat prompt
    buffers replaced by ``packed`` (``starts / lengths``: the layer's logical segments; ``options``:
    the keyword arguments of ``ragged_decode_attention``). A plain call on CPU (no attention
    variant) attends each body run in chunks of at most ``chunk`` segments
    dequantized into the cache dtype, the residual runs in place and the decode entries, merged by
    log-sum-exp (:func:`_merge`); any other call attends :meth:`PackedPrompt.dense` through
    ``ragged_decode_attention``.
    """
    asked = variants(*(options.get(k) for k in ("sliding_window", "softcap", "sinks", "decode_valid")))
    if asked or not reads_in_place(query):
        keys, values = packed.dense()
        return ragged_decode_attention(
            query, keys, values, starts, lengths, decode_keys, decode_values, decode_length, scaling,
            max_prompt_length, **options,
        )  # fmt: skip
    B, H, q, D = query.shape
    Hkv = starts.shape[1]
    n, r = B * Hkv, (H // Hkv) * q
    grouped = query.reshape(n, 1, r, D)
    out = query.new_zeros(n, 1, r, D, dtype=torch.float32)
    lse = query.new_full((n, 1, r), float("-inf"), dtype=torch.float32)
    body_runs, residual_runs = packed.runs()
    device = query.device
    for run in body_runs.runs:
        if not run.length:
            continue
        for first in range(0, run.count, chunk):
            count = min(chunk, run.count - first)
            base = run.row + (first + torch.arange(count, device=device)) * run.stride
            rows = (base[:, None] + torch.arange(run.length, device=device)).flatten()
            keys = packed.keys.dequantize_rows(rows).to(query.dtype).view(count, 1, run.length, D)
            values = packed.values.dequantize_rows(rows).to(query.dtype).view(count, 1, run.length, D)
            segments = slice(run.first + first, run.first + first + count)
            part, part_lse = _flash(grouped[segments], keys, values, scaling)
            out[segments], lse[segments] = _merge(out[segments], lse[segments], part, part_lse.float())
    for run in residual_runs.runs:
        if run.length:
            keys, values = run.view(packed.residual_keys, True), run.view(packed.residual_values, True)
            part, part_lse = _flash(grouped[run.segments], keys, values, scaling)
            out[run.segments], lse[run.segments] = _merge(
                out[run.segments], lse[run.segments], part, part_lse.float()
            )
    if decode_length:
        dk, dv = _segments_view(decode_keys, decode_length), _segments_view(decode_values, decode_length)
        mask = _decode_mask(q, r, decode_length, query) if q > 1 else None
        part, part_lse = _flash(grouped, dk, dv, scaling, mask)
        out, lse = _merge(out, lse, part, part_lse.float())
    return out.to(query.dtype).reshape(B, H, q, D)
