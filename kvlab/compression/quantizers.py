"""Quantizers: the kept prompt entries stored as low-bit codes (``model.compression.quantize``).

The step runs after selection, on whatever the selector kept (merged entries included): the
layer compacts the kept entries, then :meth:`Quantizer.pack` splits every (sample, head) segment
into a quantized body and a full-precision residual of its newest entries and returns a
:class:`~kvlab.cache.packed.PackedPrompt` (codes, scales / zero points or norms, residual), which
is all the layer keeps of its prompt (layout and decode attention: :mod:`kvlab.cache.packed`).

- ``kivi`` (Liu et al. 2024, Sec. 3): asymmetric uniform ``bits``-bit codes; keys per channel
  (a scale and zero point per channel for every ``group`` consecutive tokens of a segment),
  values per token (a scale and zero point per ``group`` channels of a token); the newest
  ``residual`` tokens (at least, see :func:`~kvlab.cache.packed.body_lengths`) full precision,
  and decoded tokens folded into the codes every ``group`` steps (``fold_every``,
  :func:`~kvlab.cache.packed.fold`).
- ``per_token``: keys and values both per token, groups of ``group`` channels, ``bits`` in
  {2, 4, 8} (the int8 / int4 / int2 baselines of KV quantization).
- ``turboquant`` (Zandieh et al. 2025): rotated Lloyd-Max codes, in :mod:`kvlab.compression.turboquant`.

Uniform codes are ``q = clamp(round((x - z) / s), 0, 2^b - 1)``, ``x^ = q s + z`` with
``z = min``, ``s = (max - min) / (2^b - 1)`` over the group, computed in fp32 from the scale and
zero point as stored (the entries' dtype). Codes are packed ``8 / b`` per byte for ``b`` in
{1, 2, 4, 8} (two int4 or four int2 per byte), as bit planes for other widths.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch

from kvlab.cache.packed import PackedCodes, PackedPrompt
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities, Component
from kvlab.config.registry import Registry


class Quantizer(Component):
    """Base class: :meth:`quantize_keys` / :meth:`quantize_values` turn body rows ``[M, D]`` into
    :class:`~kvlab.cache.packed.PackedCodes`; :meth:`pack` is the cache's entry point.

    ``row_group``: the body of each segment is a multiple of it (KIVI's per-channel key groups).
    ``residual``: newest entries of each segment kept in full precision. Capabilities: the kind's
    default (a quantizer reads only the kept entries, so it runs under every prefill schedule).
    """

    capabilities: ClassVar[Capabilities] = Capabilities()

    residual: int = 0

    @property
    def row_group(self) -> int:
        return 1

    @property
    def fold_every(self) -> int | None:
        """Decoded tokens pending before the layer folds them into the codes
        (:func:`~kvlab.cache.packed.fold`); None: decoded tokens stay in full precision."""
        return None

    def quantize_keys(self, keys: torch.Tensor) -> PackedCodes:
        raise NotImplementedError

    def quantize_values(self, values: torch.Tensor) -> PackedCodes:
        raise NotImplementedError

    def pack(
        self, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor
    ) -> PackedPrompt:
        """The flat kept entries ``keys / values [N, D]`` (segments ``starts / lengths [B, Hkv]``)
        as a :class:`~kvlab.cache.packed.PackedPrompt`."""
        body_keys, body_values, layout = PackedPrompt.split(
            keys, values, starts, lengths, self.row_group, self.residual
        )
        return PackedPrompt(self.quantize_keys(body_keys), self.quantize_values(body_values), **layout)


QUANTIZERS: Registry[Quantizer] = Registry("quantizer", "model.compression.quantize")


# --- bit packing -----------------------------------------------------------------------------------
def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes [M, D]`` (integers below ``2^bits``) -> ``[M, D * bits / 8]`` uint8.

    ``bits`` in {1, 2, 4, 8}: ``8 / bits`` consecutive codes per byte, the first in the low bits
    (two int4, four int2 per byte). Other widths: ``bits`` bit planes of ``D / 8`` bytes each.
    """
    M, D = codes.shape
    codes = codes.to(torch.uint8)
    if 8 % bits == 0:
        per = 8 // bits
        shifts = torch.arange(per, device=codes.device, dtype=torch.uint8) * bits
        return (codes.view(M, D // per, per) << shifts).sum(-1, dtype=torch.uint8)
    planes = (codes[:, None, :] >> torch.arange(bits, device=codes.device, dtype=torch.uint8)[:, None]) & 1
    return pack_codes(planes.reshape(M, bits * D), 1)


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of :func:`pack_codes`: ``[M, dim * bits / 8]`` uint8 -> ``[M, dim]`` uint8."""
    M = packed.shape[0]
    if 8 % bits == 0:
        per = 8 // bits
        shifts = torch.arange(per, device=packed.device, dtype=torch.uint8) * bits
        return ((packed[..., None] >> shifts) & ((1 << bits) - 1)).view(M, dim)
    planes = unpack_codes(packed, 1, bits * dim).view(M, bits, dim)
    weights = torch.tensor([1 << i for i in range(bits)], device=packed.device, dtype=torch.uint8)
    return (planes * weights[:, None]).sum(1, dtype=torch.uint8)


# --- asymmetric uniform group codes (KIVI, per-token) --------------------------------------------
@dataclass
class GroupCodes:
    """Uniform asymmetric codes of ``[M, D]`` rows in groups.

    Attributes:
        packed: ``[M, D * bits / 8]`` uint8 (:func:`pack_codes`).
        scale / zero: ``[M / group, D]`` (``along: tokens``: a group of ``group`` consecutive rows
            shares one per channel, KIVI's keys) or ``[M, D / group]`` (``along: channels``: a group
            of ``group`` channels of one row), in the entries' dtype.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group: int
    along: Literal["tokens", "channels"]
    dim: int

    @classmethod
    def quantize(
        cls, x: torch.Tensor, bits: int, group: int, along: Literal["tokens", "channels"]
    ) -> GroupCodes:
        """Codes of ``x [M, D]`` (``M`` a multiple of ``group`` along tokens, ``D`` along channels)."""
        M, D = x.shape
        grouped = (
            x.float().view(M // group, group, D)
            if along == "tokens"
            else x.float().view(M, D // group, group)
        )
        axis = 1 if along == "tokens" else 2
        low, high = grouped.amin(axis), grouped.amax(axis)
        scale = ((high - low) / ((1 << bits) - 1)).to(x.dtype)
        zero = low.to(x.dtype)
        codes = cls._codes(x, scale, zero, bits, group, along)
        return cls(pack_codes(codes, bits), scale, zero, bits, group, along, D)

    @staticmethod
    def _expand(param: torch.Tensor, rows: torch.Tensor, group: int, along: str) -> torch.Tensor:
        """``[m, D]`` fp32: the parameter of each element of rows ``rows``."""
        if along == "tokens":
            return param[torch.div(rows, group, rounding_mode="floor")].float()
        return param[rows].float().repeat_interleave(group, dim=1)

    @classmethod
    def _codes(cls, x, scale, zero, bits, group, along) -> torch.Tensor:
        rows = torch.arange(x.shape[0], device=x.device)
        s, z = cls._expand(scale, rows, group, along), cls._expand(zero, rows, group, along)
        q = torch.where(s > 0, (x.float() - z) / torch.where(s > 0, s, 1.0), 0.0)
        return q.round().clamp(0, (1 << bits) - 1)

    def dequantize_rows(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """Rows ``rows`` (``[m]`` long indices, or a slice of consecutive rows) as ``[m, D]`` in the
        entries' dtype: ``q s + z`` in fp32.

        Parameters are broadcast over their group, not expanded per element, when a group's rows
        are known to lie together: groups of channels always, groups of tokens for a slice of
        whole groups (the decode path's body chunks)."""
        codes = unpack_codes(self.packed[rows], self.bits, self.dim).float()
        m, D, g = codes.shape[0], self.dim, self.group
        if self.along == "channels":
            shape, params = (m, D // g, g), rows
            scale, zero = self.scale[params].float()[..., None], self.zero[params].float()[..., None]
        elif isinstance(rows, slice) and (rows.start or 0) % g == 0 and m % g == 0:
            shape, params = (m // g, g, D), slice((rows.start or 0) // g, (rows.start or 0) // g + m // g)
            scale, zero = self.scale[params].float()[:, None], self.zero[params].float()[:, None]
        else:
            index = torch.arange(self.packed.shape[0], device=codes.device)[rows]
            shape, scale, zero = (
                codes.shape,
                *(self._expand(t, index, g, self.along) for t in (self.scale, self.zero)),
            )
        return codes.view(shape).mul_(scale).add_(zero).view(m, D).to(self.scale.dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))

    def take(self, rows: torch.Tensor) -> GroupCodes:
        """Rows ``rows [m]`` (``along: tokens``: whole aligned groups of ``group`` rows, in order)."""
        params = rows
        if self.along == "tokens":
            params = torch.div(rows[:: self.group], self.group, rounding_mode="floor")
        return replace(self, packed=self.packed[rows], scale=self.scale[params], zero=self.zero[params])

    def cat(self, other: GroupCodes) -> GroupCodes:
        """These rows then ``other`` 's (the same bits, group and axis)."""
        return replace(
            self,
            packed=torch.cat([self.packed, other.packed]),
            scale=torch.cat([self.scale, other.scale]),
            zero=torch.cat([self.zero, other.zero]),
        )

    def row_bytes(self) -> float:
        """Bytes per row: its codes, and its share of its group's scale and zero point."""
        return self.dim * self.bits / 8 + 2 * self.scale.element_size() * self.dim / self.group  # either axis


def check_bits(bits: int, allowed: tuple[int, ...], name: str) -> None:
    if bits not in allowed:
        raise ValueError(f"{name}: bits must be one of {', '.join(map(str, allowed))}, got {bits}")


@QUANTIZERS.register("kivi")
@dataclass
class KIVI(Quantizer):
    """KIVI: keys per channel, values per token, asymmetric ``bits``-bit codes in groups.

    Keys: a scale and zero point per channel for every ``group`` tokens; values: per ``group``
    channels of a token; the newest ``residual`` tokens stay full precision."""

    paper: ClassVar[str] = papers.KIVI
    bits: int = 2
    group: int = 32
    residual: int = 128

    def __post_init__(self) -> None:
        check_bits(self.bits, (1, 2, 4, 8), "kivi")
        if self.group < 1 or self.residual < 0:
            raise ValueError("kivi: group must be >= 1 and residual >= 0")

    @property
    def row_group(self) -> int:
        return self.group

    @property
    def fold_every(self) -> int:
        """KIVI's streaming residual: every ``group`` decoded tokens are folded into the codes."""
        return self.group

    def quantize_keys(self, keys: torch.Tensor) -> GroupCodes:
        return GroupCodes.quantize(keys, self.bits, self.group, "tokens")

    def quantize_values(self, values: torch.Tensor) -> GroupCodes:
        return GroupCodes.quantize(values, self.bits, channel_group(self.group, values.shape[1]), "channels")


@QUANTIZERS.register("per_token")
@dataclass
class PerToken(Quantizer):
    """Keys and values per token: asymmetric int8 / int4 / int2 codes in channel groups.

    A scale and zero point per ``group`` channels of a token; the newest ``residual`` tokens stay
    full precision."""

    bits: int = 8
    group: int = 32
    residual: int = 0

    def __post_init__(self) -> None:
        check_bits(self.bits, (2, 4, 8), "per_token")
        if self.group < 1 or self.residual < 0:
            raise ValueError("per_token: group must be >= 1 and residual >= 0")

    def quantize_keys(self, keys: torch.Tensor) -> GroupCodes:
        return GroupCodes.quantize(keys, self.bits, channel_group(self.group, keys.shape[1]), "channels")

    quantize_values = quantize_keys


def channel_group(group: int, dim: int) -> int:
    """The channel group for a head of ``dim`` channels: ``group``, or the whole head when it is
    longer than the head; it must divide ``dim``."""
    group = min(group, dim)
    if dim % group:
        raise ValueError(f"a channel group of {group} does not divide the head dim {dim}")
    return group
