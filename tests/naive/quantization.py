"""Uniform asymmetric group quantization (KIVI, per-token int8 / int4), naive: loops over Python
lists, one group at a time, written from KIVI Sec. 3.1 (``Q(X) = round((X - z) / s)``,
``z = min X``, ``s = (max X - min X) / (2^B - 1)``, ``X^ = Q(X) s + z``).

The arithmetic of one element follows the storage rules of :mod:`kvlab.compression.quantizers`:
the scale and zero point are rounded to the entries' dtype before use, each element's code and
value are computed in fp32 (``torch.float32`` scalars here, so the rounding is the same, element
by element: the comparison is bit for bit).

TurboQuant (Zandieh et al. 2025, Algorithms 1-2), naive: the stored rows dequantized from their
bytes bit by bit, with the rotation and the QJL projection applied as sums over Python floats."""

from __future__ import annotations

import math

import torch


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def naive_group_round_trip(
    rows: list[list[float]], bits: int, group: int, along: str, dtype: torch.dtype
) -> tuple[list[list[int]], list[list[float]]]:
    """Codes and dequantized values of ``rows [M][D]``: groups of ``group`` consecutive rows per
    channel (``along == "tokens"``) or of ``group`` consecutive channels per row (``"channels"``)."""
    M, D = len(rows), len(rows[0])
    if along == "tokens":
        groups = [[(r, c) for r in range(g, g + group)] for g in range(0, M, group) for c in range(D)]
    else:
        groups = [[(r, c) for c in range(g, g + group)] for r in range(M) for g in range(0, D, group)]
    codes = [[0] * D for _ in range(M)]
    out = [[0.0] * D for _ in range(M)]
    top = (1 << bits) - 1
    for cells in groups:
        values = [_f32(rows[r][c]) for r, c in cells]
        low, high = min(values), max(values)
        scale = ((high - low) / top).to(dtype).float()
        zero = low.to(dtype).float()
        for (r, c), x in zip(cells, values, strict=True):
            q = ((x - zero) / scale).round().clamp(0, top) if scale > 0 else _f32(0.0)
            codes[r][c] = int(q)
            out[r][c] = float((q * scale + zero).to(dtype))
    return codes, out


def naive_pack(codes: list[list[int]], bits: int) -> list[list[int]]:
    """Bytes of each row: ``8 / bits`` consecutive codes per byte, the first in the low bits."""
    per = 8 // bits
    return [
        [sum(row[i + j] << (j * bits) for j in range(per)) for i in range(0, len(row), per)] for row in codes
    ]


def naive_unpack(row: list[int], bits: int, dim: int) -> list[int]:
    """The ``dim`` codes of one row from its bytes, bit by bit: ``8 / bits`` codes per byte, the
    first in the low bits, for ``bits`` dividing 8 (code ``d`` at bits ``d bits .. d bits + bits - 1``
    of the row); ``bits`` bit planes of ``dim`` bits otherwise (bit ``j`` of code ``d`` at bit
    ``j dim + d``)."""

    def bit(p: int) -> int:
        return (row[p // 8] >> (p % 8)) & 1

    if 8 % bits == 0:
        return [sum(bit(d * bits + j) << j for j in range(bits)) for d in range(dim)]
    return [sum(bit(j * dim + d) << j for j in range(bits)) for d in range(dim)]


def naive_turbo_dequantize(
    codes: list[list[int]] | None,
    mse_bits: int,
    codebook: list[float],
    rotation: list[list[float]],
    norms: list[float],
    signs: list[list[int]] | None = None,
    gamma: list[float] | None = None,
    projection: list[list[float]] | None = None,
) -> list[list[float]]:
    """TurboQuant's dequantization of stored rows, in Python floats, from Zandieh et al. 2025:
    ``x~ = Π^T c[idx]`` (Algorithm 1, DeQuant_mse), plus with a sketch
    ``sqrt(π/2) / d · γ · S^T qjl`` (Algorithm 2, DeQuant_prod), times the row's norm.

    ``codes`` / ``signs``: each row's packed bytes (indices of ``mse_bits``, signs 1 bit, 1 for
    ``+1``); ``rotation`` ``Π`` and ``projection`` ``S`` as ``[d][d]`` lists."""
    dim = len(rotation)
    out = []
    for m, norm in enumerate(norms):
        unit = [0.0] * dim
        if mse_bits:
            c = [codebook[i] for i in naive_unpack(codes[m], mse_bits, dim)]
            unit = [sum(rotation[j][d] * c[j] for j in range(dim)) for d in range(dim)]
        if signs is not None:
            qjl = [2 * s - 1 for s in naive_unpack(signs[m], 1, dim)]
            scale = math.sqrt(math.pi / 2) / dim * gamma[m]
            sketch = [sum(projection[j][d] * qjl[j] for j in range(dim)) for d in range(dim)]
            unit = [u + scale * s for u, s in zip(unit, sketch, strict=True)]
        out.append([norm * u for u in unit])
    return out
