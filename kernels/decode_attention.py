"""Decode attention over the ragged :class:`~kvlab.engine.cache.CompressedLayer` layout.

``ragged_decode_attention`` is the entry point the attention function calls; it dispatches
(:mod:`kvlab.kernels.dispatch`) to the split-K Triton kernel in
:mod:`kvlab.kernels.tl.decode_attention` on CUDA tensors and to
:func:`ragged_decode_attention_reference` elsewhere. Both take the same arguments.

Attention variants (a sliding window over the entries' original positions, logit soft-capping,
per-head sink logits) and padding entries in the decode region (``decode_valid``, left by a
padded block of questions) are implemented by the reference only: the dispatcher sends every
call that asks for one to the reference, on CUDA too, so such a layer is never run by a kernel
that would ignore it.
"""

from __future__ import annotations

import torch

from kvlab.config.errors import ConfigError
from kvlab.kernels.dispatch import CALLS, get_mode, use_triton


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

    Returns:
        ``[B, H, q, D]`` in the query dtype; logits, softmax and the weighted sum run in fp32.
        GQA: query head ``h`` reads KV head ``h // (H // Hkv)``.
    """
    B, H, q, D = query.shape
    Hkv = starts.shape[1]
    G = H // Hkv
    qf = query.float().reshape(B, Hkv, G * q, D)

    if max_prompt_length is None:
        max_prompt_length = int(lengths.max()) if lengths.numel() else 0
    width = max_prompt_length
    offsets = torch.arange(width, device=query.device)
    present = offsets < lengths[..., None]  # [B, Hkv, width]
    rows = (starts[..., None] + offsets).clamp(max=max(prompt_keys.shape[0] - 1, 0))
    pk = prompt_keys[rows].float()  # [B, Hkv, width, D]
    pv = prompt_values[rows].float()
    prompt_logits = torch.einsum("bkqd,bktd->bkqt", qf, pk) * scaling
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
) -> torch.Tensor:
    """Dispatcher: the Triton kernel on CUDA tensors, the reference elsewhere (same arguments).

    A call with a sliding window, soft-capping, sinks or padding entries in the decode region
    always runs the reference (the kernel implements none of them).
    """
    args = (query, prompt_keys, prompt_values, starts, lengths, decode_keys, decode_values)
    features = (("sliding_window", sliding_window), ("softcap", softcap), ("sinks", sinks),
                ("padded decode entries", decode_valid))  # fmt: skip
    used = [name for name, value in features if value is not None]
    if used:
        if get_mode() == "triton":  # asked for the kernel, which implements none of them: refuse
            raise ConfigError(
                f"model.kernels is 'triton', but this layer's attention uses {', '.join(used)}, which the "
                "Triton decode kernel does not implement. Use `model.kernels: auto` (such layers then run "
                "the torch reference) or `reference`."
            )
        CALLS[("ragged_decode_attention", "reference")] += 1
        return ragged_decode_attention_reference(
            *args,
            decode_length,
            scaling,
            max_prompt_length,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=sinks,
            prompt_positions=prompt_positions,
            decode_positions=decode_positions,
            query_positions=query_positions,
            decode_valid=decode_valid,
        )
    if use_triton("ragged_decode_attention", query, prompt_keys, decode_keys):
        from kvlab.kernels.tl.decode_attention import ragged_decode_attention_triton as impl
    else:
        impl = ragged_decode_attention_reference
    return impl(*args, decode_length, scaling, max_prompt_length)
