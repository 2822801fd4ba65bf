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

Folding (KIVI's streaming residual, Sec. 3.3 and Algorithm 1): a quantizer with a
``fold_every`` (KIVI: its ``group``) takes the decoded tokens into the codes once that many are
pending in the layer's decode region (:meth:`kvlab.cache.layer.CompressedLayer.update`).
:func:`fold` appends them to each segment's full-precision stream (residual, then the decoded
tokens), quantizes the stream's oldest whole groups beyond ``residual`` and appends their codes to
the segment's body: the result is exactly :meth:`EntryQuantizer.pack` of the segment's entries
and the folded tokens together, as if they had all been quantized offline.

Decode attention (:func:`packed_decode_attention`): where the kernel mode picks Triton (CUDA
tensors under ``auto``), the codes go to the fused kernel of
:mod:`kvlab.kernels.tl.packed_attention`: uniform codes (KIVI, ``per_token``) dequantized tile by
tile in registers, TurboQuant codes attended in the rotated basis (the query rotated once, each
tile's indices looked up in the codebook, the values' sum rotated back once,
:mod:`kvlab.kernels.tl.rotated_attention`); no dequantized entry is written to memory. The torch
path (CPU) attends the body one bounded chunk of segments at a time, dequantized into the cache's
dtype (never the whole body at once, never in fp32 beyond one chunk), the residual through strided
views of its buffers, and the decode region, merging the parts by their log-sum-exp. Calls
neither can take (attention variants; a torch path off the CPU, ``kernels: reference`` on CUDA)
attend :meth:`PackedPrompt.dense`, the entries dequantized back into the layer's flat order.
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
    merge_by_lse,
    ragged_decode_attention,
    reads_in_place,
    variants,
)
from kvlab.kernels.dispatch import launch_device, use_triton
from kvlab.kernels.types import RotatedCodebookCodes, UniformCodes, segment_starts

#: segments dequantized at once by the in-place decode path (bounds its transient buffer)
CHUNK_SEGMENTS = 16


class PackedCodes(Protocol):
    """Quantized rows ``[M, D]`` of one buffer (keys or values): codes and their parameters."""

    def dequantize_rows(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """Rows ``rows`` (``[m]`` long row indices into the ``M`` quantized rows, or a slice of
        them) dequantized, ``[m, D]`` in the dtype of the entries that were quantized."""
        ...

    def nbytes(self) -> int:
        """Bytes held: packed codes plus every scale, zero point, norm and sketch."""
        ...

    def row_bytes(self) -> float:
        """Bytes one row costs: its codes and its share of the per-row or per-group parameters
        (what a batch row is charged, :meth:`PackedPrompt.sample_bytes`)."""
        ...

    def take(self, rows: torch.Tensor) -> PackedCodes:
        """The codes of rows ``rows [m]`` (long; whole groups, in order, where rows share
        parameters), as codes of ``m`` rows."""
        ...

    def cat(self, other: PackedCodes) -> PackedCodes:
        """These rows, then ``other`` 's (codes of the same kind and parameters)."""
        ...


class EntryQuantizer(Protocol):
    """What the cache asks of a quantizer (:class:`kvlab.compression.quantizers.Quantizer`)."""

    residual: int

    @property
    def row_group(self) -> int:
        """Rows that share parameters along tokens: every body is whole groups of it."""
        ...

    @property
    def fold_every(self) -> int | None:
        """Decoded tokens pending before the layer folds them into the codes (None: never)."""
        ...

    def pack(
        self, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor
    ) -> PackedPrompt:
        """The flat kept entries ``keys / values [N, D]`` (segments ``starts / lengths [B, Hkv]``)
        as a :class:`PackedPrompt`."""
        ...

    def quantize_keys(self, keys: torch.Tensor) -> PackedCodes:
        """Codes of body key rows ``[M, D]``."""
        ...

    def quantize_values(self, values: torch.Tensor) -> PackedCodes:
        """Codes of body value rows ``[M, D]``."""
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


def merged_order(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``[sum first + sum second]`` long: the rows of ``cat(A, B)`` segment by segment, each
    segment's rows of ``A`` then its rows of ``B``; ``A`` (``B``) holds segments of ``first``
    (``second``) ``[B, Hkv]`` rows back to back, in segment order."""
    total = first + second
    starts, zero = segment_starts(total), torch.zeros_like(total)
    order = torch.empty(int(total.sum()), dtype=torch.long, device=total.device)
    n_first = int(first.sum())
    order[segment_rows(starts, zero, first)] = torch.arange(n_first, device=total.device)
    order[segment_rows(starts, first, second)] = n_first + torch.arange(
        order.shape[0] - n_first, device=total.device
    )
    return order


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

    def sample_bytes(self, folded: int = 0) -> torch.Tensor:
        """``[B]`` long: each batch row's bytes of its prompt entries, those in the body at
        :meth:`PackedCodes.row_bytes` (keys and values), those in the residual at full precision.

        ``folded``: decoded entries :func:`fold` appended to every segment (its newest ones), which
        are not prompt entries and are not charged. Parameters shared by the layer (a rotation) are
        in :meth:`nbytes` only."""
        prompt = self.body_lengths + self.residual_lengths - folded
        coded = torch.minimum(self.body_lengths, prompt)
        body = coded.sum(-1).double() * (self.keys.row_bytes() + self.values.row_bytes())
        entry = 2 * self.residual_keys.shape[1] * self.residual_keys.element_size()
        return body.round().long() + (prompt - coded).sum(-1) * entry

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


def fold(
    quantizer: EntryQuantizer, packed: PackedPrompt, keys: torch.Tensor, values: torch.Tensor
) -> PackedPrompt:
    """``packed`` with ``t`` more entries per segment, ``keys / values [n, t, D]`` (segment
    ``i = b * Hkv + h``, oldest first): what ``quantizer.pack`` gives for each segment's entries
    followed by these.

    Each segment's full-precision stream (its residual, then the new entries) loses its oldest
    rows to the body until at most ``residual`` plus less than a group of them remain
    (:func:`body_lengths` of the new length); those rows are quantized together and their codes
    appended to the segment's body, whose earlier codes are not touched. Costs one copy of the
    codes and of the residual (the segments move).
    """
    n, t, D = keys.shape
    added = torch.full_like(packed.residual_lengths, t)
    stream_order = merged_order(packed.residual_lengths, added)
    stream_keys = torch.cat([packed.residual_keys, keys.reshape(n * t, D)])[stream_order]
    stream_values = torch.cat([packed.residual_values, values.reshape(n * t, D)])[stream_order]
    stream = packed.residual_lengths + added
    body = body_lengths(packed.body_lengths + stream, quantizer.row_group, quantizer.residual)
    moved = body - packed.body_lengths  # whole groups, from the front of each stream
    starts, zero = segment_starts(stream), torch.zeros_like(stream)
    kept_rows = segment_rows(starts, moved, stream - moved)
    codes = packed.keys, packed.values
    if int(moved.sum()):
        rows = segment_rows(starts, zero, moved)
        order = merged_order(packed.body_lengths, moved)
        new = quantizer.quantize_keys(stream_keys[rows]), quantizer.quantize_values(stream_values[rows])
        codes = tuple(old.cat(part).take(order) for old, part in zip(codes, new, strict=True))
    return PackedPrompt(
        codes[0], codes[1], segment_starts(body), body, stream_keys[kept_rows], stream_values[kept_rows],
        segment_starts(stream - moved), stream - moved,
    )  # fmt: skip


def _attends_rotated(keys: PackedCodes, values: PackedCodes) -> bool:
    """Whether a body run can be attended in the rotated basis: keys and values both TurboQuant
    codes, values without a QJL sketch (its ``S^T sign`` term does not rotate back as one matrix)."""
    return (
        isinstance(keys, RotatedCodebookCodes)
        and isinstance(values, RotatedCodebookCodes)
        and values.signs is None
    )


def _rotated_attention(
    query: torch.Tensor,
    keys: RotatedCodebookCodes,
    values: RotatedCodebookCodes,
    rows: torch.Tensor | slice,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query [n, 1, r, D]`` over ``n`` segments of TurboQuant rows ``rows`` (``n * L``
    rows, segment by segment) in the rotated basis, as the fused kernel does on a GPU: with rows
    ``k^ = ||k|| (c Π + s sign S)``, ``q . k^ = ||k|| ((q Π^T) . c + s (q S^T) . sign)``, and the
    weighted sum of ``v^ = ||v|| c_v Π_v`` is ``(sum_i p_i ||v_i|| c_v,i) Π_v``: the query is rotated
    once and the output once, where dequantizing rotates each of the ``n * L`` rows (a ``D x D``
    product per row and step). fp32 throughout.

    Returns:
        ``out [n, 1, r, D]`` fp32 and its log-sum-exp ``[n, 1, r]``.
    """
    n, _, r, D = query.shape
    q = query.float()
    k_unit, signs, sketch_scale, k_norm = keys.rotated_terms(rows)
    length = k_unit.shape[0] // n
    scores = (q @ keys.rotation.T) @ k_unit.view(n, length, D).transpose(1, 2)[:, None]  # [n, 1, r, L]
    if signs is not None:
        sketched = (q @ keys.projection.T) @ signs.view(n, length, D).transpose(1, 2)[:, None]
        scores = scores + sketched * sketch_scale.view(n, 1, 1, length)
    scores = scores * (k_norm.view(n, 1, 1, length) * scaling)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse[..., None])
    v_unit, _, _, v_norm = values.rotated_terms(rows)
    summed = (weights * v_norm.view(n, 1, 1, length)) @ v_unit.view(n, 1, length, D)
    return summed @ values.rotation, lse


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
    the keyword arguments of ``ragged_decode_attention``). A plain call over uniform codes (KIVI,
    ``per_token``) or TurboQuant codes that the kernel mode sends to Triton
    (:func:`~kvlab.kernels.dispatch.use_triton`: CUDA tensors under ``auto``) runs the fused kernel
    :func:`kvlab.kernels.tl.packed_attention.packed_decode_attention_triton`, which reads the codes
    without writing a dequantized entry. Otherwise a plain call on CPU (no attention
    variant) attends each body run in chunks of at most ``chunk`` segments (uniform codes
    dequantized into the cache dtype; TurboQuant codes in their rotated basis, fp32,
    :func:`_rotated_attention`), the residual runs in place and the decode entries, merged by log-sum-exp
    (:func:`~kvlab.kernels.decode_attention.merge_by_lse`); any other call attends
    :meth:`PackedPrompt.dense` through ``ragged_decode_attention``.
    """
    asked = variants(*(options.get(k) for k in ("sliding_window", "softcap", "sinks", "decode_valid")))
    fusable = all(isinstance(codes, UniformCodes) for codes in (packed.keys, packed.values)) or all(
        isinstance(codes, RotatedCodebookCodes) for codes in (packed.keys, packed.values)
    )
    if (
        not asked
        and fusable
        and use_triton("packed_decode_attention", query, packed.residual_keys, decode_keys)
    ):
        # triton is optional: the launcher (which imports it) loads on this path only
        from kvlab.kernels.tl.packed_attention import packed_decode_attention_triton

        body_runs, residual_runs = packed.runs()
        with launch_device(query):
            return packed_decode_attention_triton(
                query, packed.keys, packed.values, packed.body_starts, packed.body_lengths,
                packed.residual_keys, packed.residual_values, packed.residual_starts,
                packed.residual_lengths, decode_keys, decode_values, decode_length, scaling,
                widths=(body_runs.width, residual_runs.width),
            )  # fmt: skip
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
    rotated = _attends_rotated(packed.keys, packed.values)
    for run in body_runs.runs:
        if not run.length:
            continue
        for first in range(0, run.count, chunk):
            count = min(chunk, run.count - first)
            if run.stride == run.length:  # segments back to back (a body always is): a slice
                rows = slice(run.row + first * run.stride, run.row + (first + count) * run.stride)
            else:
                base = run.row + (first + torch.arange(count, device=device)) * run.stride
                rows = (base[:, None] + torch.arange(run.length, device=device)).flatten()
            segments = slice(run.first + first, run.first + first + count)
            if rotated:
                part, part_lse = _rotated_attention(
                    grouped[segments], packed.keys, packed.values, rows, scaling
                )
            else:
                keys = packed.keys.dequantize_rows(rows).to(query.dtype).view(count, 1, run.length, D)
                values = packed.values.dequantize_rows(rows).to(query.dtype).view(count, 1, run.length, D)
                part, part_lse = _flash(grouped[segments], keys, values, scaling)
            out[segments], lse[segments] = merge_by_lse(out[segments], lse[segments], part, part_lse.float())
    for run in residual_runs.runs:
        if run.length:
            keys, values = run.view(packed.residual_keys, True), run.view(packed.residual_values, True)
            part, part_lse = _flash(grouped[run.segments], keys, values, scaling)
            out[run.segments], lse[run.segments] = merge_by_lse(
                out[run.segments], lse[run.segments], part, part_lse.float()
            )
    if decode_length:
        dk, dv = _segments_view(decode_keys, decode_length), _segments_view(decode_values, decode_length)
        mask = _decode_mask(q, r, decode_length, query) if q > 1 else None
        part, part_lse = _flash(grouped, dk, dv, scaling, mask)
        out, lse = merge_by_lse(out, lse, part, part_lse.float())
    return out.to(query.dtype).reshape(B, H, q, D)
