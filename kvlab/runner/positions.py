from __future__ import annotations

import base64
import json
import os
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvlab.engine.protocols import ProtocolResult
from kvlab.models.base import Batch
from kvlab.runner.files import atomic_write_text, read_jsonl

__all__ = [
    "POSITIONS",
    "RECORD_FIELD",
    "DecodeEviction",
    "KeptPositions",
    "Overlap",
    "PackedMask",
    "append_rows",
    "encode_row",
    "jaccard",
    "kept_masks",
    "mean_jaccard",
    "merge_positions",
    "position_rows",
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
class PackedMask:
    """A ``[L, H, n]`` bool mask over positions ``0 .. n - 1``, stored packed.

    Attributes:
        packed: ``[L, H, ceil(n / 8)]`` uint8, :func:`numpy.packbits` of the mask along its last
            axis (little bit order).
        tokens: n.
    """

    packed: np.ndarray
    tokens: int

    @classmethod
    def of(cls, mask: np.ndarray) -> PackedMask:
        """The packed form of a ``[L, H, n]`` bool mask."""
        return cls(np.packbits(mask.astype(bool), axis=-1, bitorder="little"), mask.shape[-1])

    def mask(self) -> np.ndarray:
        """``[L, H, n]`` bool."""
        return np.unpackbits(self.packed, axis=-1, count=self.tokens, bitorder="little").astype(bool)

    def prefix(self, n: int) -> np.ndarray:
        """``[L, H, ceil(n / 8)]`` uint8: the packed mask of positions ``0 .. n - 1`` (``n <= tokens``)."""
        packed = self.packed[..., : (n + 7) // 8].copy()
        if n % 8:
            packed[..., -1] &= (1 << (n % 8)) - 1
        return packed


@dataclass
class DecodeEviction:
    """What one ``decode_time`` compression removed: ``removed`` ``[L, H, T + step]`` after ``step``
    generated tokens."""

    step: int
    removed: PackedMask


@dataclass
class KeptPositions:
    """One sample's kept positions, stored packed (the row format is in the module docstring).

    Attributes:
        packed: ``[L, H, ceil(Tc / 8)]`` uint8, :func:`numpy.packbits` of the ``[L, H, Tc]`` kept
            mask of the prompt's first ``Tc`` positions along Tc (little bit order).
        prompt_tokens: T, the sample's prompt length (padding excluded).
        context_tokens: Tc, the positions the prefill compressed: the whole prompt (None is read
            as T) or, under ``query_agnostic`` / ``multi_question``, the context; the question part
            ``[Tc, T)`` was held whole.
        protocol: the run's ``model.protocol`` (None in the first version's rows).
        context_id: ``multi_question``: the sample's context.
        context_shared_by: ``multi_question``: the ids of every sample answered from the same
            compressed context (their rows hold the same mask).
        evictions: ``decode_time``: what each compression before the sample's last token removed
            (empty under a decode policy that evicts: one eviction per step is not listed).
        final: ``decode_time`` or a decode policy that evicts: ``[L, H, T + final_step]``, the
            positions held at the last token.
        final_step: generated tokens in the cache when the last token was chosen.
    """

    packed: np.ndarray
    prompt_tokens: int
    context_tokens: int | None = None
    protocol: str | None = None
    context_id: str | None = None
    context_shared_by: list[str] | None = None
    evictions: list[DecodeEviction] = field(default_factory=list)
    final: PackedMask | None = None
    final_step: int | None = None

    def __post_init__(self) -> None:
        if self.context_tokens is None:
            self.context_tokens = self.prompt_tokens

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(L, H, T)``."""
        return (*self.packed.shape[:2], self.prompt_tokens)

    @property
    def context(self) -> PackedMask:
        """The kept mask of the compressed part, ``[L, H, Tc]``."""
        return PackedMask(self.packed, int(self.context_tokens))

    def context_mask(self) -> np.ndarray:
        """``[L, H, Tc]`` bool, True where the (layer, head) kept the position of the compressed part."""
        return self.context.mask()

    def mask(self) -> np.ndarray:
        """``[L, H, T]`` bool, what each (layer, head) held of the prompt when decoding started: the
        kept positions of the compressed part and the whole question part after it."""
        L, H, T = self.shape
        mask = np.ones((L, H, T), dtype=bool)
        mask[..., : self.context_tokens] = self.context_mask()
        return mask

    def positions(self, layer: int, head: int) -> list[int]:
        """The prompt positions one layer and KV head held when decoding started, ascending."""
        return np.flatnonzero(self.mask()[layer, head]).tolist()

    def at_end(self) -> PackedMask:
        """The prompt's kept mask at the end of generation, ``[L, H, Tc]``: the positions held at
        the sample's last token after ``decode_time``'s compressions or a decode policy's
        evictions, else the prefill's (nothing was evicted after it)."""
        if self.final is None:
            return self.context
        n = int(self.context_tokens)
        return PackedMask(self.final.prefix(n), n)


def kept_masks(
    reports: Sequence[Any], attention_mask: torch.Tensor, prompt_lengths: torch.Tensor
) -> list[np.ndarray]:
    """Per sample, ``[L, Hkv, T_b]`` bool: the positions of its own prompt each layer and head kept.

    Args:
        reports: the batch's layer reports (:class:`~kvlab.pipeline.report.LayerReport`),
            each with a ``selection`` in padded batch coordinates.
        attention_mask: ``[B, T]`` (0 on padding) of the batch the compression ran on.
        prompt_lengths: ``[B]`` valid tokens of the prompts (``GenerationResult``); they must equal
            the mask's, or the positions would be mapped wrongly (refused).
    """
    valid = attention_mask.bool().cpu()
    B, T = valid.shape
    lengths = valid.sum(-1)
    if not torch.equal(lengths, prompt_lengths.cpu().to(lengths.dtype)):
        raise RuntimeError(
            f"model.record_positions: the run holds prompts of {prompt_lengths.tolist()} tokens "
            f"but the batch's attention mask holds {lengths.tolist()}; the kept positions cannot be "
            "mapped back to the prompts. Turn model.record_positions off for this run."
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


def _bits(mask: np.ndarray) -> str:
    """``base64(zlib(packbits(mask)))`` of a ``[L, H, n]`` bool mask."""
    packed = np.packbits(mask.astype(bool), axis=-1, bitorder="little")
    return base64.b64encode(zlib.compress(packed.tobytes(), 6)).decode("ascii")


def _unbits(bits: str, layers: int, heads: int, tokens: int) -> PackedMask:
    raw = np.frombuffer(zlib.decompress(base64.b64decode(bits)), dtype=np.uint8)
    return PackedMask(raw.reshape(layers, heads, (tokens + 7) // 8).copy(), tokens)


def encode_row(
    sample_id: str,
    mask: np.ndarray,
    *,
    prompt_tokens: int | None = None,
    protocol: str | None = None,
    context_id: str | None = None,
    context_shared_by: Sequence[str] | None = None,
    evictions: Sequence[tuple[int, np.ndarray]] = (),
    final: tuple[int, np.ndarray] | None = None,
) -> dict[str, Any]:
    """One ``positions.jsonl`` row (format in the module docstring).

    Args:
        mask: ``[L, H, Tc]`` bool, the kept positions of the part the prefill compressed.
        prompt_tokens: T (default Tc: the whole prompt was compressed); positions ``[Tc, T)`` are
            the question part, prefilled uncompressed.
        context_id, context_shared_by: ``multi_question``'s shared context.
        evictions: ``decode_time``: ``(step, removed [L, H, T + step])`` per compression.
        final: ``decode_time``: ``(step, held [L, H, T + step])`` at the sample's last token.
    """
    L, H, Tc = mask.shape
    T = Tc if prompt_tokens is None else int(prompt_tokens)
    row: dict[str, Any] = {"id": str(sample_id)}
    if protocol is not None:
        row["protocol"] = protocol
    row.update(prompt_tokens=T, context_tokens=Tc, layers=L, kv_heads=H, encoding=ENCODING, bits=_bits(mask))
    if Tc < T:
        row["question_positions"] = [Tc, T]
    if context_shared_by is not None:
        row["context_id"] = None if context_id is None else str(context_id)
        row["context_shared_by"] = [str(i) for i in context_shared_by]
    if evictions or final is not None:
        row["decode_evictions"] = [
            {"step": int(step), "tokens": removed.shape[-1], "bits": _bits(removed)}
            for step, removed in evictions
        ]
    if final is not None:
        step, held = final
        row["decode_final"] = {"step": int(step), "tokens": held.shape[-1], "bits": _bits(held)}
    return row


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
    L, H = int(row["layers"]), int(row["kv_heads"])
    Tc = int(row.get("context_tokens", T))
    evictions = [
        DecodeEviction(int(e["step"]), _unbits(e["bits"], L, H, int(e["tokens"])))
        for e in row.get("decode_evictions", [])
    ]
    final = row.get("decode_final")
    return KeptPositions(
        _unbits(row["bits"], L, H, Tc).packed,
        T,
        Tc,
        protocol=row.get("protocol"),
        context_id=row.get("context_id"),
        context_shared_by=row.get("context_shared_by"),
        evictions=evictions,
        final=None if final is None else _unbits(final["bits"], L, H, int(final["tokens"])),
        final_step=None if final is None else int(final["step"]),
    )


def position_rows(run: ProtocolResult, batch: Batch, protocol: str) -> list[dict[str, Any]]:
    """The ``positions.jsonl`` rows of a batch's samples under any protocol.

    ``run``: the protocol's result (its layer reports in ``batch``'s padded prompt coordinates,
    ``context_tokens`` / ``context_groups`` / ``decode_positions`` as the protocol sets them);
    ``protocol``: its name, written into every row.
    """
    result = run.result
    masks = kept_masks(result.reports, batch.attention_mask, result.prompt_lengths)
    samples = batch.samples
    shared: dict[int, list[str]] = {}
    for members in run.context_groups or []:
        for m in members:
            shared[m] = [samples[i].id for i in members]
    rows = []
    for b, sample in enumerate(samples):
        T = masks[b].shape[-1]
        Tc = T if run.context_tokens is None else int(run.context_tokens[b])
        evictions, final = (), None
        if run.decode_positions is not None:
            record = run.decode_positions[b]
            evictions = [(e.step, e.removed.numpy()) for e in record.evictions]
            final = (record.final_step, record.final.numpy())
        rows.append(
            encode_row(
                sample.id,
                masks[b][..., :Tc],
                prompt_tokens=T,
                protocol=protocol,
                context_id=sample.context_id,
                context_shared_by=shared.get(b),
                evictions=evictions,
                final=final,
            )
        )
    return rows


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


def jaccard(a: KeptPositions, b: KeptPositions, end: bool = False) -> np.ndarray:
    """``[L, H]`` Jaccard index ``|A ∩ B| / |A ∪ B|`` of the kept sets (1 where both are empty), over
    the prompt positions both samples compressed: the first ``min(Tc_a, Tc_b)`` (the context, when
    one run compressed the context alone). ``end``: the kept sets at the end of generation
    (:meth:`KeptPositions.at_end`; they differ from the prefill's under ``decode_time``)."""
    n = min(int(a.context_tokens), int(b.context_tokens))
    pa = (a.at_end() if end else a.context).prefix(n)
    pb = (b.at_end() if end else b.context).prefix(n)
    both = _POPCOUNT[pa & pb].sum(-1)
    either = _POPCOUNT[pa | pb].sum(-1)
    return np.where(either > 0, both / np.maximum(either, 1), 1.0)


@dataclass
class Overlap:
    """Two runs' kept positions side by side (:func:`mean_jaccard`).

    Attributes:
        mean: mean Jaccard index over every (sample, layer, head) compared, after the prefill;
            None when nothing was comparable.
        mean_end: the same at the end of generation (differs where a run is ``decode_time``).
        samples: samples compared.
        skipped: shared samples whose prompt length, layers or KV heads differ between the runs.
        reason: why nothing was comparable (None when something was).
    """

    mean: float | None
    mean_end: float | None
    samples: int
    skipped: int
    reason: str | None = None


def mean_jaccard(a: dict[str, KeptPositions], b: dict[str, KeptPositions]) -> Overlap:
    """Mean Jaccard over every (sample, layer, head) the two runs share, whatever their protocols.

    Samples are matched by id and compared over the prompt positions both compressed
    (:func:`jaccard`); a shared sample whose ``(L, H, T)`` differ between the runs (another model
    or prompt format) is skipped and counted.
    """
    total, total_end, rows, samples, skipped = 0.0, 0.0, 0, 0, 0
    shared = a.keys() & b.keys()
    for sample_id in shared:
        if a[sample_id].shape != b[sample_id].shape:
            skipped += 1
            continue
        values = jaccard(a[sample_id], b[sample_id])
        total += float(values.sum())
        total_end += float(jaccard(a[sample_id], b[sample_id], end=True).sum())
        rows += values.size
        samples += 1
    if rows:
        return Overlap(total / rows, total_end / rows, samples, skipped)
    if not shared:
        reason = "nothing comparable: no sample id in common"
    elif samples:
        reason = "nothing comparable: the shared samples have no layer or head"
    else:
        reason = (
            f"nothing comparable: the {skipped} shared samples differ in prompt tokens, layers or KV heads "
            "(another model or prompt format)"
        )
    return Overlap(None, None, samples, skipped, reason)
