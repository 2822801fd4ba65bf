"""TurboQuant (Zandieh et al. 2025, "TurboQuant: Online Vector Quantization with Near-optimal
Distortion Rate", arXiv 2504.19874): the ``turboquant`` quantizer.

Each entry is stored as its norm and the codes of its unit vector after a seeded random rotation:
every coordinate coded by the Lloyd-Max quantizer of a rotated unit vector's coordinate marginal
(``TurboQuant_mse``, Algorithm 1); keys may spend one of their ``bits`` on the QJL sign sketch of
the residual, which makes inner products unbiased (``TurboQuant_prod``, Algorithm 2). The other
quantizers and the packing of codes: :mod:`kvlab.compression.quantizers`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch

from kvlab.compression.quantizers import QUANTIZERS, Quantizer, check_bits, pack_codes, unpack_codes
from kvlab.config import papers


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

    def rotated_terms(
        self, rows: torch.Tensor | slice
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """Rows ``rows`` before any rotation back: ``(c[idx] [m, D], sign(S r) [m, D] as +-1 or
        None, the sketch's scale ``γ sqrt(π/2) / D`` [m] or None, ||x|| [m])``, all fp32, so that
        ``x^ = ||x|| (c[idx] Π + scale sign S)`` (rows as row vectors). Attention can then rotate
        the query once instead of every row (:meth:`dequantize_rows` is this, multiplied out)."""
        if self.packed is None:
            unit = torch.zeros(self.norm[rows].shape[0], self.dim, device=self.norm.device)
        else:
            unit = self.codebook[unpack_codes(self.packed[rows], self.mse_bits, self.dim).long()]
        signs = scale = None
        if self.signs is not None:
            signs = unpack_codes(self.signs[rows], 1, self.dim).float() * 2 - 1
            scale = self.gamma[rows].float() * math.sqrt(math.pi / 2) / self.dim
        return unit, signs, scale, self.norm[rows].float()

    def dequantize_rows(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """Rows ``rows`` (``[m]`` long indices or a slice) as ``[m, D]`` in the entries' dtype."""
        unit, signs, scale, norm = self.rotated_terms(rows)
        unit = unit @ self.rotation
        if signs is not None:
            unit = unit + scale[:, None] * (signs @ self.projection)
        return (unit * norm[:, None]).to(self.norm.dtype)

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
        check_bits(self.bits, (1, 2, 3, 4), "turboquant")
        if self.residual < 0:
            raise ValueError("turboquant: residual must be >= 0")

    def quantize_keys(self, keys: torch.Tensor) -> RotatedCodes:
        return turbo_quantize(keys, self.bits, self.seed, sketch=self.keys == "prod")

    def quantize_values(self, values: torch.Tensor) -> RotatedCodes:
        return turbo_quantize(values, self.bits, self.seed, sketch=False)
