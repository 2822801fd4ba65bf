"""DMS's eviction rule: every entry scoring below a fixed threshold is evicted (the ``threshold`` selector).

Łańcucki et al. 2025 ("Inference-Time Hyper-Scaling with KV Cache Compression", DMS, arXiv
2506.05345) train each head to decide, per token, whether its entry is evicted once it leaves a
sliding window; kvpress 0.5.5's ``DMSPress`` runs the same rule at inference with any scorer in
place of the trained decision: an entry past the window is evicted when its score is below a
threshold. What a head keeps then depends on the prompt, not on a budget.
``docs/methods/dms.md`` lists the choices. Shapes: B batch, Hkv KV heads, T padded prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.cache.selection import Selection
from kvlab.compression.context import LayerContext
from kvlab.compression.selectors import SELECTORS, Selector, topk_indices
from kvlab.config import papers


@SELECTORS.register("threshold")
@dataclass
class ThresholdSelector(Selector):
    """Keep every entry whose final score is at least ``threshold``, at most the head's count.

    Per (sample, KV head), with ``s_t`` the final (mixed) score (``+inf`` on the protected window
    and sinks, ``-inf`` on padding) and ``c`` the head's count from the allocators::

        kept = the top min(c, |{t : s_t >= threshold}|) entries by s_t

    so an entry below the threshold is never kept, the protected ones always are, and the budget
    is a cap: a head keeps fewer entries than its count whenever fewer score at least the
    threshold (kept counts differ between heads, samples and layers; the cache is ragged). DMS has
    no budget: its preset's budget is the whole prompt (``ratio: 1.0``), so the threshold alone
    decides; a smaller budget keeps the best ``c`` of the entries above the threshold. The
    threshold is in the final score's units: with one scorer and the default mixer, the scorer's.
    """

    paper: ClassVar[str | None] = papers.DMS
    keeps_counts: ClassVar[bool] = False

    threshold: float = 0.0

    def select(self, scores: torch.Tensor, counts: torch.Tensor, ctx: LayerContext) -> Selection:
        above = (scores >= self.threshold).sum(-1)  # [B, Hkv]; -inf padding never, +inf protected always
        kept = torch.minimum(counts, above)
        return Selection(indices=topk_indices(scores, kept), counts=kept)
