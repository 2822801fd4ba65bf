"""Channel-pruned prompt keys in the ragged cache: ``[N, Dk]`` key rows and each head's channels.

A channel pruner (:mod:`kvlab.compression.channels`, ``model.compression.channels``) gives every
(sample, KV head) the key channels it keeps; right after compaction
(:meth:`kvlab.cache.layer.CompressedLayer.compress`) the layer keeps only those channels of its
prompt keys (:func:`prune_key_channels`), so what it holds is what
:meth:`~kvlab.cache.accounting.ByteAccounting.kv_bytes` counts. Layout of one layer (``D`` head
dim, ``Dk`` kept key channels)::

    prompt_keys     [N, Dk]         segment (b, h)'s rows hold channels key_channels[b, h] of its keys
    prompt_values   [N, D]          every channel
    key_channels    [B, Hkv, Dk]    long, ascending
    decode_keys     [B, Hkv, C, D]  decoded tokens keep every channel (ThinK prunes the prompt's keys)

Decode attention (:func:`pruned_decode_attention`): each query head takes the channels of its KV
head, ``q_sel [B, H, q, Dk]`` (:func:`query_channels`), attends the prompt rows with them and the
decode region with the whole query, at the layer's scaling (the model's ``1 / sqrt(D)``, not
``1 / sqrt(Dk)``), and the two parts are merged by their log-sum-exp. ``q_sel . k_sel`` is ``q . k``
with the pruned channels of ``k`` set to zero, so the result is exactly attention over such keys.
Where the kernel mode picks Triton (CUDA tensors under ``auto``), a plain call runs the kernel of
:mod:`kvlab.kernels.tl.pruned_attention` (prompt splits over the ``Dk``-wide keys, the decode
region through the ragged decode kernel's partials, one combine). Plain calls on CPU read the
buffers in place (torch's flash kernel over each segment run, the values in slices of ``Dk``
channels, :func:`_attend`; the decode region one more call); every other call (attention variants,
padding entries, ``kernels: reference`` on CUDA) takes
:func:`~kvlab.kernels.decode_attention.padded_decode_attention` with the selected queries for the
prompt part, which is exact and gathers the entries in fp32.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlab.kernels.decode_attention import (
    RunViews,
    _decode_mask,
    _flash,
    _segments_view,
    merge_by_lse,
    padded_decode_attention,
    reads_in_place,
    run_variants_on_reference,
    variants,
)
from kvlab.kernels.dispatch import launch_device, use_triton


def prune_key_channels(keys: torch.Tensor, lengths: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """``[N, Dk]``: the channels ``channels [B, Hkv, Dk]`` of each segment's rows of the flat keys
    ``keys [N, D]`` (segments of ``lengths [B, Hkv]`` back to back, in (sample, head) order)."""
    Dk = channels.shape[-1]
    segment = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=keys.device), lengths.flatten(), output_size=keys.shape[0]
    )
    return keys.gather(1, channels.reshape(-1, Dk)[segment]).contiguous()


def query_channels(query: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """``[B, H, q, Dk]``: each query head's channels ``channels [B, Hkv, Dk]`` of its KV head
    (query head ``h`` reads KV head ``h // (H // Hkv)``) of ``query [B, H, q, D]``."""
    B, H, q, _ = query.shape
    Hkv, Dk = channels.shape[1], channels.shape[2]
    index = channels[:, :, None, None, :].expand(B, Hkv, H // Hkv, q, Dk).reshape(B, H, q, Dk)
    return query.gather(3, index)


#: most torch flash calls one run of narrow keys takes (one per slice of the values' channels);
#: keys narrower than ``D / SLICES`` take one matmul attention instead
SLICES = 4


def _attend(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(query keys^T * scaling) values`` and its log-sum-exp for keys narrower than the
    values: ``query [n, 1, r, Dk]``, ``keys [n, 1, L, Dk]``, ``values [n, 1, L, D]`` -> ``[n, 1, r,
    D]`` in the values' dtype and ``[n, 1, r]`` (fp32; fp64 for fp64).

    Torch's CPU flash kernel needs one head size for keys and values, so the values are attended
    in ``ceil(D / Dk)`` slices of ``Dk`` channels (views; the last slice ends at ``D``, overlapping
    the one before), one flash call each: every call computes the same logits, so each returns
    its columns of the output and the same log-sum-exp, in the cache's dtype with fp32 logits as
    the unpruned path. Keys narrower than ``D / SLICES`` take one matmul attention (fp32 logits,
    the probabilities rounded to the values' dtype for the product, as the flash kernel does).
    """
    Dk, D = keys.shape[-1], values.shape[-1]
    if -(-D // Dk) <= SLICES:
        parts, lse = [], None
        for first in range(0, D, Dk):
            start = min(first, D - Dk)
            part, lse = _flash(query, keys, values[..., start : start + Dk], scaling)
            parts.append(part[..., first - start :])
        return torch.cat(parts, -1), lse
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    logits = torch.matmul(query.to(work), keys.to(work).transpose(-1, -2)).mul_(scaling)
    lse = torch.logsumexp(logits, -1)
    probs = logits.sub_(lse[..., None]).exp_()
    return torch.matmul(probs.to(values.dtype), values), lse


def pruned_decode_attention(
    query: torch.Tensor,
    prompt_keys: torch.Tensor,
    prompt_values: torch.Tensor,
    key_channels: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    decode_keys: torch.Tensor,
    decode_values: torch.Tensor,
    decode_length: int,
    scaling: float,
    max_prompt_length: int | None = None,
    runs: RunViews | None = None,
    **options: Any,
) -> torch.Tensor:
    """Attention of ``query [B, H, q, D]`` over a channel-pruned layer -> ``[B, H, q, D]`` (query dtype).

    Arguments as :func:`kvlab.kernels.decode_attention.ragged_decode_attention`, with
    ``prompt_keys [N, Dk]`` holding the channels ``key_channels [B, Hkv, Dk]`` of each segment's
    keys (``options``: its keyword arguments: sliding window, soft-capping, sinks, positions,
    ``decode_valid``). ``runs``: the layer's :class:`RunViews` of its prompt buffers (the in-place
    CPU path; computed by the caller, which keeps them).
    """
    selected = query_channels(query, key_channels)
    asked = variants(*(options.get(k) for k in ("sliding_window", "softcap", "sinks", "decode_valid")))
    if asked:
        run_variants_on_reference("pruned_decode_attention", "Triton decode kernel over pruned keys", asked)
    elif use_triton("pruned_decode_attention", query, prompt_keys, decode_keys):
        # triton is optional: the launcher (which imports it) loads on this path only
        from kvlab.kernels.tl.pruned_attention import pruned_decode_attention_triton

        with launch_device(query):
            return pruned_decode_attention_triton(
                query, selected, prompt_keys, prompt_values, starts, lengths, decode_keys, decode_values,
                decode_length, scaling, max_prompt_length,
            )  # fmt: skip
    if asked or runs is None or not reads_in_place(query):
        return padded_decode_attention(
            query, prompt_keys, prompt_values, starts, lengths, decode_keys, decode_values, decode_length,
            scaling, max_prompt_length, prompt_query=selected, **options,
        )  # fmt: skip
    B, H, q, D = query.shape
    n = runs.runs.segments
    r = (H * B // n) * q
    grouped, grouped_selected = query.reshape(n, 1, r, D), selected.reshape(n, 1, r, -1)
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    out = query.new_zeros(n, 1, r, D, dtype=work)
    lse = query.new_full((n, 1, r), float("-inf"), dtype=work)
    for run, keys, values in zip(runs.runs.runs, runs.keys, runs.values, strict=True):
        if run.length:
            part, part_lse = _attend(grouped_selected[run.segments], keys, values, scaling)
            out[run.segments], lse[run.segments] = part.to(work), part_lse
    if decode_length:
        dk, dv = _segments_view(decode_keys, decode_length), _segments_view(decode_values, decode_length)
        mask = _decode_mask(q, r, decode_length, query) if q > 1 else None
        part, part_lse = _flash(grouped, dk, dv, scaling, mask)
        out = merge_by_lse(out, lse, part.to(work), part_lse.to(work), with_lse=False)[0]
    return out.to(query.dtype).reshape(B, H, q, D)
