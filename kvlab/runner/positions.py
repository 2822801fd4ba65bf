"""Kept prompt positions per sample, layer and KV head: the side file of ``model.record_positions``.

With ``model.record_positions: true`` a run writes, next to ``predictions.jsonl``, one JSON line
per sample in ``positions.jsonl`` (``positions.rank<k>.jsonl`` per data-parallel rank, merged by
rank 0 at the end, exactly as the predictions): which positions of the sample's own prompt
(0-based, padding removed) each layer and KV head kept after prefill compression. Format
(version 1, ``docs/evaluation.md``)::

    {"id": "s0", "prompt_tokens": T, "layers": L, "kv_heads": H, "encoding": "packbits-zlib-base64",
     "bits": "<base64 of zlib of numpy.packbits(mask, axis=-1, bitorder='little')>"}

``mask`` is ``[L, H, T]`` bool (True = kept), packed row by row along T (each row padded to a
whole byte with zero bits). :func:`read_positions` also reads rows written by another framework
in the plain form ``{"id": ..., "prompt_tokens": T, "positions": [[[p, ...] per head] per layer]}``.

Each line is written (flushed and fsynced) before the sample's predictions line, so a crash
never leaves a prediction without its positions; a sample re-run after a crash writes its row
again and readers keep the first row of an id (as :func:`~kvlab.runner.writer.read_predictions`).
Layers are in layer order; a layer without a selection (not compressed) counts as keeping
every valid token. Positions are those kept by prefill compression (a decode policy's later
evictions are not recorded); LOOK-M's merged entries count as the kept positions they replace.
"""

from __future__ import annotations

import base64
import json
import os
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvlab.runner.files import atomic_write_text, read_jsonl

__all__ = [
    "POSITIONS",
    "RECORD_FIELD",
    "KeptPositions",
    "append_rows",
    "encode_row",
    "jaccard",
    "kept_masks",
    "mean_jaccard",
    "merge_positions",
    "read_positions",
]

POSITIONS = "positions.jsonl"
#: the record key under which ``KVLabModule`` hands a sample's encoded row to the writer
RECORD_FIELD = "_kept_positions"
ENCODING = "packbits-zlib-base64"
SHARD = re.compile(r"positions\.rank(\d+)\.jsonl")
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)


def shard_name(rank: int) -> str:
    """The positions shard of a data-parallel rank: ``positions.rank<k>.jsonl``."""
    return f"positions.rank{rank}.jsonl"


def shard_paths(run_dir: str | Path) -> list[Path]:
    """The run's positions shards, by rank."""
    paths = [p for p in Path(run_dir).glob("positions.rank*.jsonl") if SHARD.fullmatch(p.name)]
    return sorted(paths, key=lambda p: int(SHARD.fullmatch(p.name).group(1)))  # type: ignore[union-attr]


@dataclass
class KeptPositions:
    """One sample's kept positions, stored packed.

    Attributes:
        packed: ``[L, H, ceil(T / 8)]`` uint8, :func:`numpy.packbits` of the ``[L, H, T]`` kept mask
            along T (little bit order).
        prompt_tokens: T, the sample's prompt length (padding excluded).
    """

    packed: np.ndarray
    prompt_tokens: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(L, H, T)``."""
        return (*self.packed.shape[:2], self.prompt_tokens)

    def mask(self) -> np.ndarray:
        """``[L, H, T]`` bool, True where the (layer, head) kept the position."""
        return np.unpackbits(self.packed, axis=-1, count=self.prompt_tokens, bitorder="little").astype(bool)

    def positions(self, layer: int, head: int) -> list[int]:
        """The kept positions of one layer and KV head, ascending."""
        row = np.unpackbits(self.packed[layer, head], count=self.prompt_tokens, bitorder="little")
        return np.flatnonzero(row).tolist()


def kept_masks(
    reports: Sequence[Any], attention_mask: torch.Tensor, prompt_lengths: torch.Tensor
) -> list[np.ndarray]:
    """Per sample, ``[L, Hkv, T_b]`` bool: the positions of its own prompt each layer and head kept.

    Args:
        reports: the batch's layer reports (:class:`~kvlab.pipeline.report.LayerReport`),
            each with a ``selection`` in padded batch coordinates.
        attention_mask: ``[B, T]`` (0 on padding) of the batch the compression ran on.
        prompt_lengths: ``[B]`` valid tokens the engine compressed (``GenerationResult``); they
            must equal the mask's, or the positions would be mapped wrongly (refused).
    """
    valid = attention_mask.bool().cpu()
    B, T = valid.shape
    lengths = valid.sum(-1)
    if not torch.equal(lengths, prompt_lengths.cpu().to(lengths.dtype)):
        raise RuntimeError(
            f"model.record_positions: the engine compressed prompts of {prompt_lengths.tolist()} tokens "
            f"but the batch's attention mask holds {lengths.tolist()}; the kept positions cannot be "
            "mapped back to the prompts. Turn record_positions off for this protocol."
        )
    layers = []
    for report in sorted(reports, key=lambda r: r.layer_idx):
        if report.selection is None:
            heads = report.kept.shape[1]
            layers.append(valid[:, None, :].expand(B, heads, T))
        else:
            layers.append(report.selection.kept_mask(T).cpu())
    stacked = torch.stack(layers, dim=1)  # [B, L, Hkv, T]
    return [stacked[b][..., valid[b]].numpy() for b in range(B)]


def encode_row(sample_id: str, mask: np.ndarray) -> dict[str, Any]:
    """One ``positions.jsonl`` row of a ``[L, H, T]`` bool mask (format in the module docstring)."""
    L, H, T = mask.shape
    packed = np.packbits(mask.astype(bool), axis=-1, bitorder="little")
    bits = base64.b64encode(zlib.compress(packed.tobytes(), 6)).decode("ascii")
    return {
        "id": str(sample_id),
        "prompt_tokens": T,
        "layers": L,
        "kv_heads": H,
        "encoding": ENCODING,
        "bits": bits,
    }


def decode_row(row: dict[str, Any]) -> KeptPositions:
    """A row (kvlab's packed encoding or the plain ``positions`` lists) as :class:`KeptPositions`."""
    T = int(row["prompt_tokens"])
    if "positions" in row:
        lists = row["positions"]
        mask = np.zeros((len(lists), len(lists[0]) if lists else 0, T), dtype=bool)
        for layer, heads in enumerate(lists):
            for head, kept in enumerate(heads):
                mask[layer, head, np.asarray(kept, dtype=np.int64)] = True
        return KeptPositions(np.packbits(mask, axis=-1, bitorder="little"), T)
    if row.get("encoding") != ENCODING:
        raise ValueError(f"positions row '{row.get('id')}': unknown encoding {row.get('encoding')!r}")
    raw = np.frombuffer(zlib.decompress(base64.b64decode(row["bits"])), dtype=np.uint8)
    return KeptPositions(raw.reshape(int(row["layers"]), int(row["kv_heads"]), (T + 7) // 8).copy(), T)


def append_rows(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Append rows to a positions file, flushed and fsynced."""
    rows = list(rows)
    if not rows:
        return
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    seen: set[str] = set()
    rows = []
    for path in [run_dir / POSITIONS, *shard_paths(run_dir)]:
        for row in read_jsonl(path):
            if str(row.get("id")) not in seen:
                seen.add(str(row.get("id")))
                rows.append(row)
    return rows


def read_positions(run_dir: str | Path) -> dict[str, KeptPositions]:
    """Every recorded sample of a run (``positions.jsonl`` then unmerged shards; first row of an id
    wins, a line cut short by a crash is ignored): ``{sample id: KeptPositions}``. Empty when the
    run recorded none."""
    return {str(row["id"]): decode_row(row) for row in _rows(Path(run_dir))}


def merge_positions(run_dir: str | Path, order: Sequence[str] = ()) -> None:
    """Merge ``positions.jsonl`` and the shards into ``positions.jsonl`` in dataset order (atomic),
    then delete the shards; a run that recorded nothing is left alone."""
    run_dir = Path(run_dir)
    if not shard_paths(run_dir):
        return
    position = {str(i): n for n, i in enumerate(order)}
    rows = sorted(_rows(run_dir), key=lambda r: position.get(str(r.get("id")), len(position)))
    atomic_write_text(run_dir / POSITIONS, "".join(json.dumps(r) + "\n" for r in rows))
    for shard in shard_paths(run_dir):
        shard.unlink()


def jaccard(a: KeptPositions, b: KeptPositions) -> np.ndarray:
    """``[L, H]`` Jaccard index ``|A ∩ B| / |A ∪ B|`` of the kept sets (1 where both are empty)."""
    both = _POPCOUNT[a.packed & b.packed].sum(-1)
    either = _POPCOUNT[a.packed | b.packed].sum(-1)
    return np.where(either > 0, both / np.maximum(either, 1), 1.0)


def mean_jaccard(a: dict[str, KeptPositions], b: dict[str, KeptPositions]) -> tuple[float | None, int, int]:
    """Mean Jaccard over every (sample, layer, head) the two runs share: ``(mean, samples, skipped)``.

    Samples are matched by id; a shared sample whose ``(L, H, T)`` differ between the runs (another
    model or prompt format) is skipped and counted. ``mean`` is None when nothing is shared.
    """
    total, rows, samples, skipped = 0.0, 0, 0, 0
    for sample_id in a.keys() & b.keys():
        if a[sample_id].shape != b[sample_id].shape:
            skipped += 1
            continue
        values = jaccard(a[sample_id], b[sample_id])
        total += float(values.sum())
        rows += values.size
        samples += 1
    return (total / rows if rows else None), samples, skipped
