"""The keywords transformers passes to an attention function: which kvlab implements, which carry
nothing for it, and the check that refuses any other (:func:`attention_options`)."""

from __future__ import annotations

from typing import Any

import torch

from kvlab.cache.options import PLAIN, AttentionOptions
from kvlab.config.errors import ConfigError

# Keywords transformers 5.x passes to attention functions that kvlab implements.
HANDLED_KWARGS = frozenset({"scaling", "dropout", "is_causal", "sliding_window", "softcap", "s_aux"})

# Keywords that reach attention functions but carry nothing kvlab's attention must act on.
IGNORED_KWARGS = {
    # RoPE is applied before the attention function; kvlab masks with its own padding mask and
    # the cache's positions, never with these.
    "position_ids": "positions are already in the post-RoPE query/key",
    # kvlab's cache always stores (it is the reason kvlab exists); the flag changes nothing here.
    "use_cache": "kvlab always caches",
    # kvlab returns no attention weights (like transformers' sdpa); decode policies get theirs
    # through the session.
    "output_attentions": "no weights are returned, as with sdpa",
    # The cache index of the new tokens; kvlab's cache keeps its own logical length.
    "cache_position": "the cache keeps its own logical length",
    # Mixture-of-experts models (GPT-OSS, Mixtral) pass their router flag down every layer's kwargs.
    "output_router_logits": "a mixture-of-experts output flag, nothing for attention",
}
KNOWN_KWARGS = HANDLED_KWARGS | frozenset(IGNORED_KWARGS)  # checked at every call: precomputed


def attention_options(module: torch.nn.Module, kwargs: dict[str, Any]) -> AttentionOptions:
    """Validate the keywords transformers passed and collect the layer's :class:`AttentionOptions`.

    Runs for every layer at every decode step: the accepted case costs a set test and three
    lookups, and a plain layer gets the shared :data:`~kvlab.cache.options.PLAIN` (the model's
    name is read only for an error).

    Raises:
        ConfigError: a keyword kvlab neither implements nor may ignore, a non-zero ``dropout``
            or ``is_causal=False`` (naming the model and the argument).
    """
    if not KNOWN_KWARGS.issuperset(kwargs) or kwargs.get("dropout") or kwargs.get("is_causal") is False:
        _refuse(module, kwargs)
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if window is None and softcap is None and sinks is None:
        return PLAIN
    return AttentionOptions(
        sliding_window=int(window) if window is not None else None,
        softcap=float(softcap) if softcap is not None else None,
        sinks=sinks,
    )


def _refuse(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Raise the :class:`ConfigError` for keywords :func:`attention_options` does not accept."""
    unknown = sorted(key for key in kwargs if key not in KNOWN_KWARGS)
    name = getattr(getattr(module, "config", None), "name_or_path", "")
    owner = f"model {name!r} ({type(module).__name__})" if name else type(module).__name__
    if unknown:
        raise ConfigError(
            f"{owner}: attention argument(s) {unknown} are not implemented by kvlab attention (it "
            f"implements {sorted(HANDLED_KWARGS)} and ignores {sorted(IGNORED_KWARGS)}); this model cannot "
            "run under kvlab."
        )
    if kwargs.get("dropout"):
        raise ConfigError(
            f"{owner}: attention argument dropout={kwargs['dropout']} (training) is not supported."
        )
    raise ConfigError(f"{owner}: attention argument is_causal=False (bidirectional) is not supported.")
