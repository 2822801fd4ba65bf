"""Uniform asymmetric group quantization (KIVI, per-token int8 / int4), naive: loops over Python
lists, one group at a time, written from KIVI Sec. 3.1 (``Q(X) = round((X - z) / s)``,
``z = min X``, ``s = (max X - min X) / (2^B - 1)``, ``X^ = Q(X) s + z``).

The arithmetic of one element follows the storage rules of :mod:`kvlab.compression.quantizers`:
the scale and zero point are rounded to the entries' dtype before use, each element's code and
value are computed in fp32 (``torch.float32`` scalars here, so the rounding is the same, element
by element: the comparison is bit for bit)."""

from __future__ import annotations

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
