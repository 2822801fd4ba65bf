"""AttentionOptions: a layer's attention variant (sliding window, soft-capping, sinks).

transformers passes them per call to the attention function
(:func:`kvlab.engine.keywords.attention_options` collects them); prefill attention and the
cache's decode attention (:meth:`kvlab.cache.layer.CompressedLayer.decode_attention`) apply them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionOptions:
    """A layer's per-call attention variant (all None: plain causal softmax attention).

    Attributes:
        sliding_window: a query at position ``i`` sees keys at positions ``(i - window, i]``.
        softcap: logits become ``tanh(logits / softcap) * softcap`` before masking.
        sinks: ``[H]`` one extra logit per query head in the softmax denominator (no value).
    """

    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """True when no variant applies (the exact pre-existing code paths are used)."""
        return self.sliding_window is None and self.softcap is None and self.sinks is None

    def describe(self) -> str:
        """The variants in use, e.g. ``sliding_window=512, softcap=50.0``."""
        parts = [f"sliding_window={self.sliding_window}"] if self.sliding_window is not None else []
        parts += [f"softcap={self.softcap}"] if self.softcap is not None else []
        return ", ".join(parts + (["sinks (s_aux)"] if self.sinks is not None else []))


#: the options of a plain layer (no variant), shared by every call that asks for none
PLAIN = AttentionOptions()
