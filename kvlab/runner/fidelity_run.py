"""Fidelity of one batch: the full-cache reference (cached per sample) and the teacher-forced run.

The runs are orchestration (protocols, pipelines), so they live with the runner;
:mod:`kvlab.metrics.fidelity` computes the values from their tokens and logits.

For a batch already generated with the method's pipeline (``result``, with step logits):

1. each sample's :class:`~kvlab.metrics.fidelity.Reference` is loaded from the
   :class:`~kvlab.metrics.reference.ReferenceStore`; if any is missing, the full cache runs on
   the whole batch once and the missing ones are stored (a method that keeps the full cache,
   nothing evicted, quantized or pruned, is its own reference);
2. if every sample's greedy output equals its reference, the method's own step logits are
   the teacher-forced logits (same inputs at every decided position); otherwise the method
   runs again on the batch through its protocol, fed the references' tokens
   (``teacher_tokens=...``);
3. :func:`~kvlab.metrics.fidelity.fidelity_values` per sample.

Definitions and the caching rules: ``docs/evaluation.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.engine.generation import GenerationResult, RunOptions
from kvlab.engine.protocols import Protocol, build_protocol
from kvlab.metrics.fidelity import Reference, fidelity_values, teacher_tokens
from kvlab.metrics.reference import ReferenceStore, reference_key
from kvlab.models.base import Batch, LoadedModel
from kvlab.pipeline import Pipeline


@dataclass
class FidelityEvaluator:
    """Fidelity of batches of one model (see the module docstring).

    Args:
        loaded: the model.
        store: where references are cached (``ReferenceStore(None)``: not cached).
        options: the run's options (its ``max_new_tokens``, part of the reference key, and its
            ``prefill_chunk`` hold for every extra run, which returns logits).
        dtype: the model dtype name (part of the reference key).
        protocol: how the method's teacher-forced run compresses (``model.protocol``,
            :mod:`kvlab.engine.protocols`; default ``query_aware``). The references stay the full
            cache on the whole prompt, which every protocol gives when nothing is evicted; each
            sample decodes up to its own ``max_new_tokens`` when it has one.
    """

    loaded: LoadedModel
    store: ReferenceStore
    options: RunOptions
    dtype: str
    protocol: Protocol = field(default_factory=lambda: build_protocol("query_aware"))

    def references(self, batch: Batch, own: GenerationResult | None = None) -> list[Reference]:
        """One full-cache :class:`Reference` per sample (loaded, or computed and stored).

        ``own``: the batch's result with a pipeline that keeps the full cache
        (:attr:`~kvlab.pipeline.Pipeline.keeps_full_cache`; used as the reference).
        """
        valid = batch.attention_mask.bool()
        name = self.loaded.info.name
        keys = [
            reference_key(name, self.dtype, self.options.max_new_tokens, sample, batch.input_ids[b][valid[b]])
            for b, sample in enumerate(batch.samples)
        ]
        refs = [self.store.load(key) for key in keys]
        if all(ref is not None for ref in refs):
            return refs  # type: ignore[return-value]
        full = own or self.run(Pipeline.from_config(None), batch)
        for b, key in enumerate(keys):
            if refs[b] is None:
                refs[b] = Reference.from_logits(full.tokens[b], full.step_logits[b])
                self.store.save(key, refs[b])
        return refs  # type: ignore[return-value]

    def evaluate(self, pipeline: Pipeline, batch: Batch, result: GenerationResult) -> list[dict[str, float]]:
        """Per-sample fidelity fields of ``result`` (``pipeline``'s run, with ``return_logits=True``)."""
        refs = self.references(batch, result if pipeline.keeps_full_cache else None)
        if all(tokens == ref.tokens for tokens, ref in zip(result.tokens, refs, strict=True)):
            forced = result.step_logits
        else:
            pad = self.loaded.processor.eos_token_ids[0]
            forced = self.run(pipeline, batch, teacher_tokens(refs, pad)).step_logits
        return [fidelity_values(ref, result.tokens[b], forced[b]) for b, ref in enumerate(refs)]

    def run(self, pipeline: Pipeline, batch: Batch, teacher: torch.Tensor | None = None) -> GenerationResult:
        """``pipeline`` on ``batch`` with step logits (teacher-forced by ``teacher`` ``[B, S]``):
        through :attr:`protocol`, or ``query_aware`` (prefill, then decode) for a pipeline that
        keeps the full cache."""
        protocol = build_protocol("query_aware") if pipeline.keeps_full_cache else self.protocol
        options = RunOptions(self.options.max_new_tokens, True, False, teacher, self.options.prefill_chunk)
        return protocol.run(self.loaded, pipeline, batch, options).result
