"""Fidelity of one batch: the full-cache reference (cached per sample) and the teacher-forced run.

For a batch already generated with the method's pipeline (``result``, with step logits):

1. each sample's :class:`~kvlab.metrics.fidelity.Reference` is loaded from the
   :class:`~kvlab.metrics.reference.ReferenceStore`; if any is missing, the full cache runs on
   the whole batch once and the missing ones are stored (a method that does not compress is
   its own reference);
2. if every sample's greedy output equals its reference, the method's own step logits are
   the teacher-forced logits (same inputs at every decided position); otherwise the method
   runs again on the batch, fed the references' tokens (``generate(teacher_tokens=...)``);
3. :func:`~kvlab.metrics.fidelity.fidelity_values` per sample.

Definitions and the caching rules: ``docs/evaluation.md``.
"""

from __future__ import annotations

from typing import Any

from kvlab.compression.pipeline import Pipeline
from kvlab.generation import GenerationResult, generate
from kvlab.metrics.fidelity import Reference, fidelity_values, teacher_tokens
from kvlab.metrics.reference import ReferenceStore, reference_key
from kvlab.models.base import LoadedModel


def batch_references(
    loaded: LoadedModel,
    pipeline: Pipeline,
    batch: dict[str, Any],
    result: GenerationResult,
    store: ReferenceStore,
    max_new_tokens: int,
    dtype: str,
    **generate_kwargs: Any,
) -> list[Reference]:
    """One full-cache :class:`Reference` per sample of ``batch`` (loaded, or computed and stored)."""
    valid = batch["attention_mask"].bool()
    keys = [
        reference_key(loaded.info.name, dtype, max_new_tokens, sample, batch["input_ids"][b][valid[b]])
        for b, sample in enumerate(batch["samples"])
    ]
    refs = [store.load(key) for key in keys]
    if all(ref is not None for ref in refs):
        return refs  # type: ignore[return-value]
    full = result if not pipeline.compresses else None
    if full is None:
        full = generate(
            loaded, Pipeline.from_config(None), batch, max_new_tokens, return_logits=True, **generate_kwargs
        )
    for b, key in enumerate(keys):
        if refs[b] is None:
            refs[b] = Reference.from_logits(full.tokens[b], full.step_logits[b])
            store.save(key, refs[b])
    return refs  # type: ignore[return-value]


def batch_fidelity(
    loaded: LoadedModel,
    pipeline: Pipeline,
    batch: dict[str, Any],
    result: GenerationResult,
    store: ReferenceStore,
    max_new_tokens: int,
    dtype: str,
    **generate_kwargs: Any,
) -> list[dict[str, float]]:
    """Per-sample fidelity fields of ``result`` (generated with ``return_logits=True``).

    ``generate_kwargs`` (e.g. ``calibration``) go to every extra :func:`generate` call.
    """
    refs = batch_references(loaded, pipeline, batch, result, store, max_new_tokens, dtype, **generate_kwargs)
    if all(tokens == ref.tokens for tokens, ref in zip(result.tokens, refs, strict=True)):
        forced = result.step_logits
    else:
        pad = loaded.processor.eos_token_ids[0]
        forced = generate(
            loaded,
            pipeline,
            batch,
            max_new_tokens,
            return_logits=True,
            teacher_tokens=teacher_tokens(refs, pad),
            **generate_kwargs,
        ).step_logits
    return [fidelity_values(ref, result.tokens[b], forced[b]) for b, ref in enumerate(refs)]
