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
- ``turboquant`` (Zandieh et al. 2025): a seeded random rotation, then each coordinate coded by
  the Lloyd-Max quantizer of a rotated unit vector's coordinate marginal (``TurboQuant_mse``,
  Algorithm 1); keys spend one of their ``bits`` on the QJL sign sketch of the residual, which
  makes inner products unbiased (``TurboQuant_prod``, Algorithm 2).

Uniform codes are ``q = clamp(round((x - z) / s), 0, 2^b - 1)``, ``x^ = q s + z`` with
``z = min``, ``s = (max - min) / (2^b - 1)`` over the group, computed in fp32 from the scale and
zero point as stored (the entries' dtype). Codes are packed ``8 / b`` per byte for ``b`` in
{1, 2, 4, 8} (two int4 or four int2 per byte), as bit planes for other widths.
"""

from __future__ import annotations

import math
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


def _check_bits(bits: int, allowed: tuple[int, ...], name: str) -> None:
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
        _check_bits(self.bits, (1, 2, 4, 8), "kivi")
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
        _check_bits(self.bits, (2, 4, 8), "per_token")
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


# --- TurboQuant --------------------------------------------------------------------------------------
def lloyd_max_codebook(bits: int, dim: int, points: int = 16385, iterations: int = 500) -> torch.Tensor:
    """``[2^bits]`` fp64 ascending: the Lloyd-Max scalar quantizer (minimum MSE) of one coordinate of
    a uniformly random unit vector in ``R^dim``, density ``∝ (1 - x^2)^((dim - 3) / 2)`` on ``[-1, 1]``
    (TurboQuant Lemma 1; close to ``N(0, 1 / dim)`` for large ``dim``). Lloyd's iterations on a
    fine grid: thresholds at midpoints, centroids the conditional means (Sec. 3.1, Eq. 4)."""
    x = torch.linspace(-1, 1, points, dtype=torch.float64)[1:-1]
    density = (1 - x * x).pow((dim - 3) / 2)
    density = density / density.sum()
    sigma = 1 / math.sqrt(dim)
    levels = 1 << bits
    centroids = (
        torch.linspace(-2.5 * sigma, 2.5 * sigma, levels, dtype=torch.float64)
        if levels > 1
        else x.new_zeros(1)
    )
    zero = torch.zeros(1, dtype=torch.float64)
    mass_below = torch.cat([zero, torch.cumsum(density, 0)])  # cell sums as differences of prefix sums
    moment_below = torch.cat([zero, torch.cumsum(density * x, 0)])
    for _ in range(iterations):
        cuts = torch.searchsorted(x, (centroids[1:] + centroids[:-1]) / 2)
        edges = torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), x.shape[0])])
        mass = mass_below[edges[1:]] - mass_below[edges[:-1]]
        moment = moment_below[edges[1:]] - moment_below[edges[:-1]]
        updated = torch.where(mass > 0, moment / mass.clamp(min=1e-300), centroids)
        if torch.equal(updated, centroids):  # converged
            break
        centroids = updated
    return (centroids - centroids.flip(0)) / 2  # the density is symmetric: so is its quantizer


def seeded_rotation(dim: int, seed: int) -> torch.Tensor:
    """``[dim, dim]`` fp32 random orthogonal matrix (QR of a seeded Gaussian, signs fixed so it is
    Haar-distributed), the rotation ``Π`` of TurboQuant Algorithm 1."""
    generator = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def seeded_gaussian(dim: int, seed: int) -> torch.Tensor:
    """``[dim, dim]`` fp32 i.i.d. ``N(0, 1)``: the QJL projection ``S`` of TurboQuant Algorithm 2."""
    return torch.randn(dim, dim, generator=torch.Generator().manual_seed(seed)).float()


@dataclass
class RotatedCodes:
    """TurboQuant codes of ``[M, D]`` rows.

    ``x^ = ||x|| Π^T c[idx]`` (Algorithm 1 on the unit vector ``x / ||x||``), plus with ``sketch``
    the QJL term ``||x|| γ sqrt(π/2) / D  S^T sign(S r)`` of the unit residual ``r`` (``γ = ||r||``,
    Algorithm 2), which makes ``<y, x^>`` an unbiased estimate of ``<y, x>`` (Theorem 2).

    Attributes:
        packed: ``[M, D * mse_bits / 8]`` uint8 codebook indices (absent when ``mse_bits`` is 0).
        norm: ``[M]`` ``||x||`` in the entries' dtype.
        signs / gamma: ``[M, D / 8]`` uint8 packed signs of ``S r`` and ``[M]`` ``γ`` (keys only).
        rotation / projection / codebook: ``Π``, ``S`` (``[D, D]`` fp32) and the codebook (fp32),
            derived from the seed and held once per buffer.
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

    def _mse_unit(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """``[m, D]`` fp32 dequantized unit vectors ``Π^T c[idx]`` (zero without MSE bits)."""
        if self.packed is None:
            return torch.zeros(self.norm[rows].shape[0], self.dim, device=self.norm.device)
        idx = unpack_codes(self.packed[rows], self.mse_bits, self.dim).long()
        return self.codebook[idx] @ self.rotation

    def dequantize_rows(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """Rows ``rows`` (``[m]`` long indices or a slice) as ``[m, D]`` in the entries' dtype."""
        unit = self._mse_unit(rows)
        if self.signs is not None:
            signs = unpack_codes(self.signs[rows], 1, self.dim).float() * 2 - 1
            scale = self.gamma[rows].float() * math.sqrt(math.pi / 2) / self.dim
            unit = unit + scale[:, None] * (signs @ self.projection)
        return (unit * self.norm[rows].float()[:, None]).to(self.norm.dtype)

    def take(self, rows: torch.Tensor) -> RotatedCodes:
        """Rows ``rows [m]`` (the layer's ``Π``, ``S`` and codebook shared)."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows]

        return replace(self, packed=pick(self.packed), norm=self.norm[rows], signs=pick(self.signs),
                       gamma=pick(self.gamma))  # fmt: skip

    def cat(self, other: RotatedCodes) -> RotatedCodes:
        """These rows then ``other`` 's (codes of the same seed and bits)."""

        def join(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
            return None if a is None else torch.cat([a, b])

        return replace(self, packed=join(self.packed, other.packed), norm=torch.cat([self.norm, other.norm]),
                       signs=join(self.signs, other.signs), gamma=join(self.gamma, other.gamma))  # fmt: skip

    def nbytes(self) -> int:
        held = (self.packed, self.norm, self.signs, self.gamma, self.rotation, self.projection, self.codebook)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def row_bytes(self) -> float:
        """Bytes per row: its codes, norm, and sign sketch with ``γ`` (``Π``, ``S`` and the codebook
        are the layer's, counted by :meth:`nbytes` only)."""
        sketch = self.dim / 8 + self.norm.element_size() if self.signs is not None else 0
        return self.dim * self.mse_bits / 8 + self.norm.element_size() + sketch


def turbo_quantize(x: torch.Tensor, bits: int, seed: int, sketch: bool) -> RotatedCodes:
    """TurboQuant codes of ``x [M, D]`` at ``bits`` per coordinate: ``TurboQuant_prod`` (``bits - 1``
    MSE bits + the 1-bit QJL sketch) with ``sketch``, ``TurboQuant_mse`` otherwise."""
    M, D = x.shape
    device = x.device
    mse_bits = bits - 1 if sketch else bits
    rotation = seeded_rotation(D, seed).to(device)
    codebook = (
        lloyd_max_codebook(mse_bits, D).float().to(device) if mse_bits else torch.zeros(1, device=device)
    )
    xf = x.float()
    norm = xf.norm(dim=1)
    unit = xf / torch.where(norm > 0, norm, 1.0)[:, None]
    packed = None
    approx = torch.zeros_like(unit)
    if mse_bits:
        rotated = unit @ rotation.T
        idx = torch.bucketize(rotated, (codebook[1:] + codebook[:-1]) / 2)
        packed = pack_codes(idx, mse_bits)
        approx = codebook[idx] @ rotation
    signs = gamma = projection = None
    if sketch:
        projection = seeded_gaussian(D, seed + 1).to(device)
        residual = unit - approx
        gamma = residual.norm(dim=1).to(x.dtype)
        signs = pack_codes((residual @ projection.T >= 0).to(torch.uint8), 1)
    return RotatedCodes(packed, norm.to(x.dtype), signs, gamma, rotation, projection, codebook, mse_bits, D)


@QUANTIZERS.register("turboquant")
@dataclass
class TurboQuant(Quantizer):
    """TurboQuant: seeded rotation, Lloyd-Max codes per coordinate, QJL sketch on keys.

    ``bits`` per coordinate; values use all for MSE (``TurboQuant_mse``, Algorithm 1). ``keys:
    prod`` (the paper's choice for inner products, Algorithm 2) spends one of them on the 1-bit sign
    sketch of the residual, making each ``<q, k>`` unbiased; ``keys: mse`` codes keys as values
    are. Unbiased is not lower-error: the sketch's variance, about ``π / (2 D)`` of ``||q||^2 ||r||^2``,
    goes through the softmax, and at head dim 64 (SmolLM2-135M) ``mse`` keys at 3 bits perturb the
    attention less than ``prod`` keys at 4 (``docs/methods/quantization.md``). The newest
    ``residual`` tokens stay full precision."""

    paper: ClassVar[str] = papers.TURBOQUANT
    bits: int = 3
    residual: int = 0
    seed: int = 0
    keys: Literal["prod", "mse"] = "prod"

    def __post_init__(self) -> None:
        _check_bits(self.bits, (1, 2, 3, 4), "turboquant")
        if self.residual < 0:
            raise ValueError("turboquant: residual must be >= 0")

    def quantize_keys(self, keys: torch.Tensor) -> RotatedCodes:
        return turbo_quantize(keys, self.bits, self.seed, sketch=self.keys == "prod")

    def quantize_values(self, values: torch.Tensor) -> RotatedCodes:
        return turbo_quantize(values, self.bits, self.seed, sketch=False)
