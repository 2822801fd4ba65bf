"""Scorers that read the model's reconstruction of the prompt (KVzip, Kim et al. 2025).

The ``reconstruct`` prefill mode (:mod:`kvlab.compression.prefill_modes`, run by
:mod:`kvlab.engine.reconstruction`) prefills the prompt whole, then has the model repeat it one
chunk per forward. At every such step each layer hands a :class:`ReconstructionStep` (the step's
queries and keys, the prompt entries its softmax runs over, the chunk's entries it scores) to
every :class:`ReconstructionScorer` of the pipeline, which keeps per layer, in the run's state,
the largest value any step gave each entry (:meth:`ReconstructionScorer.observe`). When every
chunk has been reconstructed the layer is compressed and :meth:`ReconstructionScorer.score` returns
those maxima: a scorer of this kind is the function of one step, :meth:`step_scores`.

- ``reconstruction_attention`` (KVzip, Sec. 3.2, Eq. 2): ``s_t = max_{i, h in group(t)} a^h_{i,t}``,
  the largest softmax attention any reconstruction query ``i`` of any query head of the entry's
  KV head pays to entry ``t``.
- ``reconstruction_attention_plus`` (KVzip+, the reference framework's
  ``kvzip_plus_normalization``): ``s_t = max_{i, h} a^h_{i,t} ||W_O^h v_t|| / ||x_i||``, each
  row divided by the norm of its query's attention input ``x_i`` (the layer's normed hidden
  state) and each column multiplied by the norm of what the entry writes through the head's
  output projection.

Shapes: B batch, H query heads, Hkv KV heads, G = H / Hkv, q the step's block, S the prompt
entries its softmax runs over, T the padded prompt, D head dim, E hidden size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvlab.cache.state import RunState
from kvlab.compression.context import LayerContext, appended_attention
from kvlab.compression.importance import IMPORTANCE, ImportanceScorer
from kvlab.config import papers
from kvlab.config.capabilities import Capabilities
from kvlab.config.errors import ConfigError
from kvlab.kernels.window_scores import REFERENCE_BLOCK_ELEMENTS
from kvlab.models.facts import LayerFacts


@dataclass(frozen=True)
class ReconstructionStep:
    """One layer at one reconstruction step: the block ``[request, opening, chunk]`` after its attention.

    Attributes:
        layer_idx: the decoder layer.
        queries: post-RoPE queries of the block ``[B, H, q, D]``, left padded.
        block_keys: their post-RoPE keys ``[B, Hkv, q, D]`` (in the softmax, causally; never scored).
        block_valid: ``[B, q]`` bool, False on padding (and for a sample with no chunk left).
        keys / values: the prompt entries the softmax runs over ``[B, Hkv, S, D]`` (every prompt
            entry under ``scope: cache``, the sinks and the chunk's under ``scope: chunk``).
        entry_valid: ``[B, S]`` bool, the real ones.
        columns: ``[B, S]`` long, each entry's column in the padded prompt (any column on padding).
        scored: ``[B, S]`` bool, the chunk's entries: the ones this step scores.
        seq_len: ``T``, the padded prompt's length.
        scaling: the layer's softmax scale.
        hidden_states: the block's attention input ``[B, q, E]`` (the layer's normed hidden
            states), None unless a scorer declares the model fact ``hidden_states``.
        facts: the declared model facts of the layer (its projections for KVzip+).
        block_elements: the most attention probabilities a scorer holds at once (``B x H x rows x
            (S + q)``).
    """

    layer_idx: int
    queries: torch.Tensor
    block_keys: torch.Tensor
    block_valid: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    entry_valid: torch.Tensor
    columns: torch.Tensor
    scored: torch.Tensor
    seq_len: int
    scaling: float
    hidden_states: torch.Tensor | None = None
    facts: LayerFacts = field(default_factory=LayerFacts)
    block_elements: int = REFERENCE_BLOCK_ELEMENTS

    def attention_rows(self) -> Iterator[tuple[slice, torch.Tensor]]:
        """The block's softmax attention over the entries, a block of rows at a time (made as it is
        read): ``(rows, probs [B, H, r, S] fp32)``.

        Row ``i`` attends to every valid entry and, causally, to the block's valid keys ``j <= i``
        (:func:`~kvlab.compression.context.appended_attention`); padding rows are zero. Each block
        of rows holds at most :attr:`block_elements` logits.
        """
        B, H, q, _ = self.queries.shape
        S = self.keys.shape[2]
        rows = max(1, min(q, self.block_elements // max(1, B * H * (S + q))))
        keys = self.keys.float()  # cast once for every block of rows
        for first in range(0, q, rows):
            part = slice(first, min(q, first + rows))
            probs = appended_attention(
                self.queries[:, :, part], first, keys, self.entry_valid, self.block_keys, self.block_valid,
                self.scaling,
            )  # fmt: skip
            yield part, probs


class ReconstructionScorer(ImportanceScorer):
    """Base class of the scorers reading the reconstruction: override :meth:`step_scores`.

    The kind's capabilities: ``reads_reconstruction`` (only the ``reconstruct`` prefill mode
    runs them, and it needs one) and ``chunked_prefill`` (nothing is read of the prompt's queries:
    ``model.prefill_chunk`` may chunk the prompt's own prefill). A scorer needing more (KVzip+
    reads model facts) declares its own.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(chunked_prefill=True, reads_reconstruction=True)

    def step_scores(self, step: ReconstructionStep) -> torch.Tensor:
        """``[B, Hkv, S]`` fp32: what ``step`` gives each entry it attends to (only the scored
        entries' values are kept)."""
        raise NotImplementedError

    def observe(self, step: ReconstructionStep, run: RunState) -> None:
        """Fold ``step`` into the layer's scores: each scored entry keeps the largest value a step gave it."""
        held = run.owned(self, dict)
        values = self.step_scores(step).float()
        B, Hkv, _ = values.shape
        scores = held.get(step.layer_idx)
        if scores is None:
            scores = values.new_zeros(B, Hkv, step.seq_len)
            held[step.layer_idx] = scores
        scored = step.scored & step.entry_valid
        columns = step.columns.masked_fill(~scored, step.seq_len)[:, None, :].expand(-1, Hkv, -1)
        spare = torch.cat([scores, scores.new_zeros(B, Hkv, 1)], dim=2)  # a column for the unscored
        spare.scatter_reduce_(2, columns, values.masked_fill(~scored[:, None, :], 0.0), "amax")
        scores.copy_(spare[..., : step.seq_len])

    def score(self, ctx: LayerContext) -> torch.Tensor:
        held = ctx.run.owned(self, dict).get(ctx.layer_idx)
        if held is None:
            raise ConfigError(
                f"{self.registry_name} scores from the model's reconstruction of the prompt, which only "
                "`model.compression.prefill: {name: reconstruct}` runs (KVzip's preset: --config kvzip)."
            )
        return held.to(ctx.keys.device)


@IMPORTANCE.register("reconstruction_attention")
@dataclass
class ReconstructionAttention(ReconstructionScorer):
    """KVzip (Kim et al. 2025, Sec. 3.2): the most attention the entry receives while the model
    repeats the prompt, ``s_t = max_{i, h in group(t)} softmax_t(q^h_i [K_S; K_{block, <= i}]^T
    scaling)``, over the reconstruction's queries ``i`` and the query heads ``h`` of the entry's KV head."""

    paper: ClassVar[str | None] = papers.KVZIP

    def step_scores(self, step: ReconstructionStep) -> torch.Tensor:
        B, H, _, _ = step.queries.shape
        Hkv, S = step.keys.shape[1], step.keys.shape[2]
        best = step.keys.new_zeros(B, H, S, dtype=torch.float32)
        for _, probs in step.attention_rows():
            best = torch.maximum(best, probs.amax(2))
        return best.view(B, Hkv, H // Hkv, S).amax(2)


@IMPORTANCE.register("reconstruction_attention_plus")
@dataclass
class ReconstructionAttentionPlus(ReconstructionScorer):
    """KVzip+ (kvpress' ``kvzip_plus_normalization``): KVzip's attention, each row divided by the
    norm of its query's attention input ``||x_i||`` and each entry's column multiplied by
    ``||W_O^h v_t||`` (the L2 norm of what the entry writes through query head ``h``'s block of the
    output projection), before the max over rows and the group. Reads the model facts
    ``hidden_states`` (the block's, during the reconstruction) and ``projections``."""

    paper: ClassVar[str | None] = papers.KVZIP
    capabilities: ClassVar[Capabilities] = Capabilities(
        chunked_prefill=False, reads_reconstruction=True, model_facts=("hidden_states", "projections")
    )

    def step_scores(self, step: ReconstructionStep) -> torch.Tensor:
        B, H, _, D = step.queries.shape
        Hkv, S = step.keys.shape[1], step.keys.shape[2]
        G = H // Hkv
        out_proj = step.facts.projections.o  # [E, H*D]
        per_head = out_proj.float().view(out_proj.shape[0], H, D).to(step.keys.device)
        values = step.values.float()
        written = torch.stack(
            [torch.linalg.vector_norm(values[:, h // G] @ per_head[:, h].T, dim=-1) for h in range(H)], dim=1
        )  # [B, H, S]
        inputs = step.hidden_states.float().to(step.keys.device).norm(dim=-1).clamp_min(1e-12)  # [B, q]
        best = values.new_zeros(B, H, S)
        for rows, probs in step.attention_rows():
            weighted = probs / inputs[:, None, rows, None] * written[:, :, None, :]
            best = torch.maximum(best, weighted.amax(2))
        return best.view(B, Hkv, G, S).amax(2)
