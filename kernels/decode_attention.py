"""Decode attention over the ragged :class:`~kvlab.cache.layer.CompressedLayer` layout.

``ragged_decode_attention`` is the entry point the attention function calls; it dispatches
(:mod:`kvlab.kernels.dispatch`) to the split-K Triton kernel in
:mod:`kvlab.kernels.tl.decode_attention` on CUDA tensors and to
:func:`ragged_decode_attention_reference` elsewhere. Both take the same arguments.

The torch path reads the cache where it lies, with no per-step gather or dtype copy of the kept
entries. The flat buffer ``[N, D]`` is cut into :class:`SegmentRuns`: consecutive (sample,
head) segments of equal length whose starts are evenly spaced are one strided
``[count, length, D]`` view (equal-length heads, as uniform allocators give, are one run: the
whole buffer viewed as ``[B * Hkv, L, D]``; a ragged layer is one run per distinct-length head).
On CPU each run is one call of torch's CPU flash attention (the kernel behind
``scaled_dot_product_attention``: the cache's own dtype is read; logits, softmax and
accumulation are fp32, and for a 16-bit cache the unnormalised probabilities are rounded to its
dtype before the product with the values, as sdpa does), the decode entries one more, and the
parts are merged by their log-sum-exp (three small ops, see :func:`_flash_attention`). fp32
results therefore change only by summation order; the number of tensor ops per layer stays
about what transformers' own sdpa path takes. Tensors on
other devices without the kernel (``kernels: reference`` on CUDA) take
:func:`padded_decode_attention`.

Attention variants (a sliding window over the entries' original positions, logit soft-capping,
per-head sink logits) and padding entries in the decode region (``decode_valid``, left by a
padded block of questions) are implemented by :func:`padded_decode_attention`, which gathers
every head padded to the longest and attends in fp32 with masks: exact, slower. The dispatcher
sends every call that asks for one to the torch path, on CUDA too, so such a layer is never run
by a kernel that would ignore it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.config.errors import ConfigError
from kvlab.kernels.dispatch import CALLS, get_mode, launch_device, use_triton

FULL_PRECISION = (torch.float32, torch.float64)  # a matmul of these gives full-precision logits


@dataclass(frozen=True)
class SegmentRun:
    """Segments ``first .. first + count - 1`` (flat index ``b * Hkv + h``) of one ``length``,
    starting at rows ``row, row + stride, ...`` of the flat buffer: one strided view."""

    first: int
    count: int
    length: int
    row: int
    stride: int

    @property
    def segments(self) -> slice:
        return slice(self.first, self.first + self.count)

    def view(self, flat: torch.Tensor, heads: bool = False) -> torch.Tensor:
        """``[count, length, D]`` view of ``flat [N, D]`` (no copy); ``[count, 1, length, D]`` with
        ``heads`` (the layout the flash kernel reads: one head per segment), in one op either way."""
        rows, cols = flat.stride()
        offset, step, D = flat.storage_offset() + self.row * rows, self.stride * rows, flat.shape[1]
        if heads:
            return flat.as_strided((self.count, 1, self.length, D), (step, rows, rows, cols), offset)
        return flat.as_strided((self.count, self.length, D), (step, rows, cols), offset)


@dataclass(frozen=True)
class SegmentRuns:
    """The (sample, head) segments of a flat buffer as strided runs (see the module docstring).

    ``width`` is the longest segment; ``dense`` is True when one run covers every segment, so
    the attention needs no padding at all.
    """

    runs: tuple[SegmentRun, ...]
    segments: int
    width: int

    @classmethod
    def of(cls, starts: torch.Tensor, lengths: torch.Tensor) -> SegmentRuns:
        """Runs of ``starts / lengths [B, Hkv]`` (one host sync; the cache keeps the result)."""
        start, length = starts.flatten().tolist(), lengths.flatten().tolist()
        runs, i = [], 0
        while i < len(start):
            j, stride = i + 1, max(length[i], 1)
            if j < len(start) and length[j] == length[i] and start[j] > start[i]:
                stride = start[j] - start[i]
                while j < len(start) and length[j] == length[i] and start[j] - start[j - 1] == stride:
                    j += 1
            runs.append(SegmentRun(i, j - i, length[i], start[i], stride))
            i = j
        return cls(tuple(runs), len(start), max(length, default=0))

    @property
    def dense(self) -> bool:
        return len(self.runs) == 1 and self.runs[0].length == self.width


@dataclass(frozen=True)
class RunViews:
    """:class:`SegmentRuns` bound to the flat buffers they cut: each run's keys and values as the
    ``[count, 1, length, D]`` view the flash kernel reads (None for a run of empty segments).

    Views of the buffers, not copies: in-place writes to the buffers show through. The cache keeps
    them for the buffers and segments they were made from
    (:meth:`kvlab.cache.layer.CompressedLayer.run_views`), so a decode step makes no view of the
    prompt entries.
    """

    runs: SegmentRuns
    keys: tuple[torch.Tensor | None, ...]
    values: tuple[torch.Tensor | None, ...]

    @classmethod
    def of(cls, runs: SegmentRuns, prompt_keys: torch.Tensor, prompt_values: torch.Tensor) -> RunViews:
        """The views of ``prompt_keys / prompt_values [N, D]`` cut by ``runs`` (no host sync)."""
        keys = tuple(run.view(prompt_keys, True) if run.length else None for run in runs.runs)
        values = tuple(run.view(prompt_values, True) if run.length else None for run in runs.runs)
        return cls(runs, keys, values)


def grouped_logits(
    query: torch.Tensor,
    prompt_keys: torch.Tensor,
    runs: SegmentRuns,
    decode_keys: torch.Tensor,
    width: int | None = None,
) -> torch.Tensor:
    """Unscaled logits of ``query [n, r, D]`` over every segment and the decode entries.

    ``n = B * Hkv`` segments, ``r`` query rows per segment, ``decode_keys [n, t, D]``. Returns
    ``[n, r, width + t]`` in the query dtype: segment ``i``'s prompt entries in slots
    ``0 .. length - 1``, ``-inf`` up to ``width`` (default: the longest segment), then the decode
    entries. One matmul per run, over views of the flat buffer.
    """
    width = runs.width if width is None else width
    decode = torch.matmul(query, decode_keys.transpose(-1, -2))
    if runs.dense and width == runs.width:
        return torch.cat([torch.matmul(query, runs.runs[0].view(prompt_keys).transpose(-1, -2)), decode], -1)
    n, r, _ = query.shape
    logits = query.new_full((n, r, width + decode_keys.shape[1]), float("-inf"))
    for run in runs.runs:
        if run.length:
            keys = run.view(prompt_keys).transpose(-1, -2)
            logits[run.segments, :, : run.length] = torch.matmul(query[run.segments], keys)
    logits[..., width:] = decode
    return logits


def _flash(query, keys, values, scaling, mask=None):
    """torch's CPU flash attention (what ``scaled_dot_product_attention`` runs on CPU), which also
    returns the log-sum-exp: ``[n, 1, r, D]`` in the inputs' dtype and ``[n, 1, r]`` (fp32, fp64
    for fp64). 16-bit inputs are read as they are; logits, softmax and accumulation are fp32 (the
    probabilities are rounded to the inputs' dtype for the product with the values)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    return flash(query, keys, values, 0.0, False, attn_mask=mask, scale=scaling)


def _decode_mask(q: int, rows: int, decode_length: int, like: torch.Tensor) -> torch.Tensor:
    """``[r, t]`` additive mask (``like`` 's dtype): row ``r`` (query ``r % q`` of a block of ``q``)
    sees the decode slots up to its own."""
    own = decode_length - q + torch.arange(rows, device=like.device) % q
    hidden = torch.arange(decode_length, device=like.device)[None, :] > own[:, None]
    return like.new_zeros(rows, decode_length).masked_fill_(hidden, float("-inf"))


def _flash_attention(
    query: torch.Tensor,
    views: RunViews,
    decode_keys: torch.Tensor,
    decode_values: torch.Tensor,
    scaling: float,
    q: int,
) -> torch.Tensor:
    """``[n, 1, r, D]``: one flash call per run and one over the decode entries, merged by log-sum-exp.

    ``query [n, 1, r, D]`` (each segment one "batch" entry with one head), ``views`` the prompt
    entries' runs as views, ``decode_keys / decode_values [n, 1, t, D]``. With ``lse_p`` / ``lse_d``
    the log-sum-exps of the prompt and decode parts, the result is
    ``lerp(out_d, out_p, sigmoid(lse_p - lse_d))`` (:func:`merge_by_lse`, in fp32 for 16-bit
    inputs): three small ops, exact up to rounding. A head with no prompt entry has
    ``lse_p = -inf`` (share 0).
    Every op is counted: on a busy CPU each costs more than its arithmetic (docs/kernels.md).
    """
    n, _, rows, D = query.shape
    runs = views.runs.runs
    if len(runs) == 1 and runs[0].length:  # equal-length heads: one call over the buffer
        out, lse = _flash(query, views.keys[0], views.values[0], scaling)
    else:
        outs, lses = [], []
        for run, keys, values in zip(runs, views.keys, views.values, strict=True):
            if run.length:
                part, part_lse = _flash(query[run.segments], keys, values, scaling)
            else:
                part = query.new_zeros(run.count, 1, rows, D)
                part_lse = query.new_full((run.count, 1, rows), float("-inf"), dtype=_lse_dtype(query))
            outs.append(part)
            lses.append(part_lse)
        out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs), torch.cat(lses))
    t = decode_keys.shape[2]
    if t == 0:
        return out
    mask = _decode_mask(q, rows, t, query) if q > 1 else None
    decode, decode_lse = _flash(query, decode_keys, decode_values, scaling, mask)
    merged = merge_by_lse(out, lse, decode, decode_lse, with_lse=False)[0]
    return merged if merged.dtype == query.dtype else merged.to(query.dtype)


def merge_by_lse(
    out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor, with_lse: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Two softmax attentions of the same queries over disjoint entries, merged by log-sum-exp.

    ``out / part [..., r, D]`` with ``lse / part_lse [..., r]``: ``out`` 's share of the softmax
    mass is ``sigmoid(lse - part_lse)``, so the merge is ``lerp(part, out, sigmoid(lse - part_lse))``
    (three small ops, exact up to rounding) and the merged log-sum-exp ``logaddexp(lse, part_lse)``
    (skipped without ``with_lse``). ``part`` must attend at least one entry (finite ``part_lse``);
    ``out`` may attend none (``lse = -inf``: share 0). fp32 / fp64 results are written into
    ``part`` (the caller's fresh output), 16-bit ones computed in fp32 and returned in fp32.
    """
    share = torch.sub(lse, part_lse).sigmoid_().unsqueeze_(-1)  # [..., r, 1]
    if part.dtype in FULL_PRECISION and out.dtype == part.dtype:
        merged = part.lerp_(out, share)
    else:
        merged = torch.lerp(part.float(), out.float(), share)
    return merged, torch.logaddexp(lse, part_lse) if with_lse else None


def _segments_view(decode: torch.Tensor, length: int) -> torch.Tensor:
    """``[B * Hkv, 1, length, D]`` view of the first ``length`` entries of ``decode [B, Hkv, C, D]``
    (one op when the (sample, head) dims merge, as in the cache's own buffers)."""
    B, Hkv, _, D = decode.shape
    s0, s1, s2, s3 = decode.stride()
    if s0 == Hkv * s1 or B == 1:
        return decode.as_strided((B * Hkv, 1, length, D), (s1, s1, s2, s3), decode.storage_offset())
    return decode[:, :, :length].flatten(0, 1)[:, None]


def _lse_dtype(query: torch.Tensor) -> torch.dtype:
    return torch.float64 if query.dtype == torch.float64 else torch.float32


def run_variants_on_reference(kernel: str, what: str, used: list[str]) -> None:
    """A call whose attention uses variants ``used`` (sliding window, soft-capping, sinks, a decode
    mask) that the Triton ``kernel`` does not implement: it runs the torch reference (counted in
    :data:`CALLS`), or is refused when ``model.kernels`` asked for the kernel itself."""
    if get_mode() == "triton":
        raise ConfigError(
            f"model.kernels is 'triton', but this layer's attention uses {', '.join(used)}, which the "
            f"{what} does not implement. Use `model.kernels: auto` (such layers then run the torch "
            "reference) or `reference`."
        )
    CALLS[(kernel, "reference")] += 1


def padded_decode_attention(
    query: torch.Tensor,
    prompt_keys: torch.Tensor,
    prompt_values: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    decode_keys: torch.Tensor,
    decode_values: torch.Tensor,
    decode_length: int,
    scaling: float,
    max_prompt_length: int | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    prompt_positions: torch.Tensor | None = None,
    decode_positions: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
    decode_valid: torch.Tensor | None = None,
    prompt_query: torch.Tensor | None = None,
) -> torch.Tensor:
    """The masked path: every head's segment gathered, padded to the longest, attended in fp32.

    Arguments and result as :func:`ragged_decode_attention_reference`. Implements the attention
    variants; copies the kept entries (in fp32) at every call. ``prompt_query``: ``[B, H, q, Dk]``
    the queries the prompt entries are attended with when the prompt keys hold ``Dk`` channels
    (a channel-pruned layer, :mod:`kvlab.cache.pruned`); None: ``query`` itself.
    """
    B, H, q, D = query.shape
    Hkv = starts.shape[1]
    G = H // Hkv
    qf = query.float().reshape(B, Hkv, G * q, D)
    qp = qf if prompt_query is None else prompt_query.float().reshape(B, Hkv, G * q, -1)

    if max_prompt_length is None:
        max_prompt_length = int(lengths.max()) if lengths.numel() else 0
    width = max_prompt_length
    offsets = torch.arange(width, device=query.device)
    present = offsets < lengths[..., None]  # [B, Hkv, width]
    rows = (starts[..., None] + offsets).clamp(max=max(prompt_keys.shape[0] - 1, 0))
    pk = prompt_keys[rows].float()  # [B, Hkv, width, D]
    pv = prompt_values[rows].float()
    prompt_logits = torch.einsum("bkqd,bktd->bkqt", qp, pk) * scaling
    if softcap is not None:
        prompt_logits = torch.tanh(prompt_logits / softcap) * softcap
    present = present[:, :, None, :]  # [B, Hkv, 1 or G*q, width]
    if sliding_window is not None:
        first = (query_positions - sliding_window + 1).repeat(1, G)  # [B, G*q] oldest visible position
        present = present & (prompt_positions[rows][:, :, None, :] >= first[:, None, :, None])
    prompt_logits = prompt_logits.masked_fill(~present, float("-inf"))

    dk = decode_keys[:, :, :decode_length].float()  # [B, Hkv, t, D]
    dv = decode_values[:, :, :decode_length].float()
    decode_logits = torch.einsum("bkqd,bktd->bkqt", qf, dk) * scaling  # [B, Hkv, G*q, t]
    if softcap is not None:
        decode_logits = torch.tanh(decode_logits / softcap) * softcap
    query_step = torch.arange(q, device=query.device).repeat(G)  # row r is query r % q
    slot = torch.arange(decode_length, device=query.device)[None, :]
    own = decode_length - q + query_step[:, None]  # [G*q, 1] each row's own decode slot
    visible = (slot <= own)[None, None]
    if decode_valid is not None:
        visible = visible & (decode_valid[:, None, None, :decode_length] | (slot == own)[None, None])
    if sliding_window is not None:
        first = (query_positions - sliding_window + 1).repeat(1, G)
        visible = visible & (decode_positions[:, :, None, :decode_length] >= first[:, None, :, None])
    decode_logits = decode_logits.masked_fill(~visible, float("-inf"))

    logits = [prompt_logits, decode_logits]
    if sinks is not None:  # row r of KV head k belongs to query head k * G + r // q
        sink = sinks.float().view(1, Hkv, G, 1).expand(B, -1, -1, q).reshape(B, Hkv, G * q, 1)
        logits.append(sink)
    probs = torch.softmax(torch.cat(logits, dim=-1), dim=-1)
    out = probs[..., :width] @ pv + probs[..., width : width + decode_length] @ dv  # [B, Hkv, G*q, D]
    return out.view(B, H, q, D).to(query.dtype)


def variants(
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    decode_valid: torch.Tensor | None,
) -> list[str]:
    """The attention variants a call asks for (names), which only :func:`padded_decode_attention`
    implements; empty for a plain call."""
    asked = (("sliding_window", sliding_window), ("softcap", softcap), ("sinks", sinks),
             ("padded decode entries", decode_valid))  # fmt: skip
    return [name for name, value in asked if value is not None]


def reads_in_place(query: torch.Tensor) -> bool:
    """Whether the torch path attends to a cache of ``query`` 's device without copying it (CPU:
    torch's CPU flash attention reads every float dtype as it is)."""
    return query.device.type == "cpu" and query.dtype.is_floating_point


def ragged_decode_attention_reference(
    query: torch.Tensor,
    prompt_keys: torch.Tensor,
    prompt_values: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    decode_keys: torch.Tensor,
    decode_values: torch.Tensor,
    decode_length: int,
    scaling: float,
    max_prompt_length: int | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    prompt_positions: torch.Tensor | None = None,
    decode_positions: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
    decode_valid: torch.Tensor | None = None,
    runs: SegmentRuns | RunViews | None = None,
) -> torch.Tensor:
    """Attention of new queries over each (sample, KV head)'s kept prompt tokens plus decoded tokens.

    Args:
        query: ``[B, H, q, D]`` post-RoPE queries of the ``q`` newest tokens (already appended to
            the decode region, so query ``i`` sees decode entries ``< decode_length - q + i + 1``).
        prompt_keys / prompt_values: ``[N, D]`` flat kept prompt entries.
        starts / lengths: ``[B, Hkv]`` segment offsets and sizes in the flat buffers.
        decode_keys / decode_values: ``[B, Hkv, C, D]`` decode region (first ``decode_length`` used).
        scaling: softmax scale.
        max_prompt_length: ``lengths.max()`` if the caller knows it (saves a device sync per call).
        sliding_window: query at original position ``p`` sees only entries at positions
            ``(p - sliding_window, p]``; needs ``prompt_positions`` ``[N]``, ``decode_positions``
            ``[B, Hkv, C]`` (original positions of the entries) and ``query_positions``
            ``[B, q]`` (each sample's own positions of the new tokens).
        softcap: logits become ``tanh(logits / softcap) * softcap`` before masking.
        sinks: ``[H]`` one extra logit per query head in the softmax denominator (no value row).
        decode_valid: ``[B, C]`` bool, False on padding entries of the decode region (hidden from
            every query but their own, so a padding query's output stays finite), or None.
        runs: the :class:`SegmentRuns` of ``starts / lengths`` if the caller keeps them, or their
            :class:`RunViews` of ``prompt_keys / prompt_values`` (the cache keeps these); computed
            here otherwise (one host sync).

    Returns:
        ``[B, H, q, D]`` in the query dtype. GQA: query head ``h`` reads KV head ``h // (H // Hkv)``.
        Plain calls on CPU read the buffers in place (module docstring); a variant or
        ``decode_valid``, and tensors on other devices, take :func:`padded_decode_attention`
        (gathered, fp32 throughout).
    """
    if variants(sliding_window, softcap, sinks, decode_valid) or not reads_in_place(query):
        return padded_decode_attention(
            query, prompt_keys, prompt_values, starts, lengths, decode_keys, decode_values,
            decode_length, scaling, max_prompt_length, sliding_window=sliding_window, softcap=softcap,
            sinks=sinks, prompt_positions=prompt_positions, decode_positions=decode_positions,
            query_positions=query_positions, decode_valid=decode_valid,
        )  # fmt: skip
    if not isinstance(runs, RunViews):
        runs = SegmentRuns.of(starts, lengths) if runs is None else runs
        runs = RunViews.of(runs, prompt_keys, prompt_values)
    return in_place_decode_attention(query, runs, decode_keys, decode_values, decode_length, scaling)


def in_place_decode_attention(
    query: torch.Tensor,
    views: RunViews,
    decode_keys: torch.Tensor,
    decode_values: torch.Tensor,
    decode_length: int,
    scaling: float,
) -> torch.Tensor:
    """The plain in-place CPU path of :func:`ragged_decode_attention_reference` (module docstring):
    ``query [B, H, q, D]`` over the prompt entries' ``views`` and the first ``decode_length``
    entries of ``decode_keys / decode_values [B, Hkv, C, D]`` -> ``[B, H, q, D]``.

    No check is made: the caller has established a plain call (no variant, no padding entry) on
    CPU floating tensors (:func:`reads_in_place`). The cache calls it directly at every decode
    step; each Python call and tensor op here counts against a decode step (docs/kernels.md).
    """
    B, H, q, D = query.shape
    n = views.runs.segments
    grouped = query.reshape(n, 1, (H * B // n) * q, D)  # [n, 1, r, D]: one head per segment
    dk = _segments_view(decode_keys, decode_length)  # [n, 1, t, D] views
    dv = _segments_view(decode_values, decode_length)
    return _flash_attention(grouped, views, dk, dv, scaling, q).reshape(B, H, q, D)


def ragged_decode_attention(
    query: torch.Tensor,
    prompt_keys: torch.Tensor,
    prompt_values: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    decode_keys: torch.Tensor,
    decode_values: torch.Tensor,
    decode_length: int,
    scaling: float,
    max_prompt_length: int | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    prompt_positions: torch.Tensor | None = None,
    decode_positions: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
    decode_valid: torch.Tensor | None = None,
    runs: SegmentRuns | RunViews | None = None,
) -> torch.Tensor:
    """Dispatcher: the Triton kernel on CUDA tensors, the torch path elsewhere (same arguments).

    A call with a sliding window, soft-capping, sinks or padding entries in the decode region
    always runs the torch path (the kernel implements none of them). ``runs`` (the segment runs
    the cache keeps, or their views) is used by the torch path only; a plain call on CPU with
    :class:`RunViews` goes straight to :func:`in_place_decode_attention`.
    """
    args = (query, prompt_keys, prompt_values, starts, lengths, decode_keys, decode_values)
    used = variants(sliding_window, softcap, sinks, decode_valid)
    if used:
        run_variants_on_reference("ragged_decode_attention", "Triton decode kernel", used)
    elif use_triton("ragged_decode_attention", query, prompt_keys, decode_keys):
        # triton is optional: the launcher (which imports it) loads on this path only
        from kvlab.kernels.tl.decode_attention import ragged_decode_attention_triton

        with launch_device(query):
            return ragged_decode_attention_triton(*args, decode_length, scaling, max_prompt_length)
    elif isinstance(runs, RunViews) and reads_in_place(query):  # the decode step's path on CPU
        return in_place_decode_attention(query, runs, decode_keys, decode_values, decode_length, scaling)
    return ragged_decode_attention_reference(
        *args, decode_length, scaling, max_prompt_length, sliding_window=sliding_window, softcap=softcap,
        sinks=sinks, prompt_positions=prompt_positions, decode_positions=decode_positions,
        query_positions=query_positions, decode_valid=decode_valid, runs=runs,
    )  # fmt: skip
