"""Budgets: how many prompt tokens each (sample, KV head) keeps, and which are protected.

YAML forms (all under ``model.compression.budget``)::

    budget: 128                               # tokens per head (int)
    budget: 0.2                               # fraction of each prompt kept (float in [0, 1])
    budget: {tokens: 128, window: 32, sinks: 0}
    budget: {ratio: 0.2, window: 32}
    budget: {ratio: 0.2, window: 0.1}         # window as a fraction of each prompt (LOOK-M's alpha1)

The budget counts every kept prompt token of a head, protected ones included ("budget
includes the window", as SnapKV, MixKV and kvpress count it). Protected tokens are the last
``window`` and the first ``sinks`` valid tokens of each sample; they are always kept. A window
written as a float in [0, 1) is a fraction of each prompt: ``floor(window * prompt length)``
tokens (LOOK-M's recent ratio alpha1; ``int(T * ratio)`` as its code). A ratio
budget is ``floor(ratio * prompt length)`` per sample (kvpress' ``int(T * (1 - cr))``). A
sample whose budget is at least its prompt length is not compressed at all (except by a selector
whose counts are caps: DMS's ``threshold`` still evicts what scores below it).

``budget.window`` is the one source of the recent window: it is protected here, observed by
the scorers that look at the last queries (SnapKV's window attention, DAVID's NCAR) and kept
by the H2O decode policy. Those components may restate it, but a different value is a
:class:`ConfigError` (see ``docs/architecture.md``, "One source per setting").

A short prompt can get a ratio budget below its protected tokens (20% of a 136-token prompt
is 27 tokens; the window is 32). ``max_window_share`` says what happens then:

- ``null`` (default): the whole window is kept, so the sample keeps more than asked; the
  excess is recorded per sample (``budget_overshoot`` in the predictions) and counted in the
  run summary;
- a share ``s`` in (0, 1]: the recent window of such a sample shrinks to
  ``floor(s * asked budget)`` tokens (DAVID's suggestion is 0.5), observed and protected alike,
  so the budget holds; sinks are never shrunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvlab.compression.context import sample_positions
from kvlab.config.errors import ConfigError
from kvlab.config.registry import to_plain, validate_params

WHERE = "model.compression.budget"


@dataclass(frozen=True)
class Budget:
    """A parsed budget: exactly one of ``tokens`` (per head) or ``ratio`` (of the prompt)."""

    tokens: int | None = None
    ratio: float | None = None
    window: int | float = 32
    sinks: int = 0
    max_window_share: float | None = None

    @classmethod
    def from_config(cls, node: Any) -> Budget:
        """Parse and validate the YAML node (int, float or mapping); :class:`ConfigError` on bad input."""
        node = to_plain(node)
        if isinstance(node, bool):
            raise ConfigError(f"{WHERE} must be a token count, a ratio or a mapping, got {node!r}.")
        if isinstance(node, int):
            node = {"tokens": node}
        elif isinstance(node, float):
            node = {"ratio": node}
        elif node is None or not isinstance(node, dict):
            raise ConfigError(
                f"{WHERE} must be a token count (e.g. 128), a ratio (e.g. 0.2) or a mapping such as "
                f"{{tokens: 128, window: 32}}, got {node!r}."
            )
        values = validate_params(cls, node, WHERE)
        budget = cls(**values)
        budget.check()
        return budget

    def check(self) -> None:
        """Validate field ranges (raises :class:`ConfigError`)."""
        if (self.tokens is None) == (self.ratio is None):
            raise ConfigError(
                f"{WHERE} needs exactly one of 'tokens' (per-head token count) or 'ratio' (fraction of the "
                f"prompt kept), got tokens={self.tokens}, ratio={self.ratio}."
            )
        if self.window < 0 or self.sinks < 0:
            raise ConfigError(f"{WHERE}.window and .sinks must be >= 0, got {self.window} and {self.sinks}.")
        if isinstance(self.window, float) and self.window >= 1.0:
            raise ConfigError(
                f"{WHERE}.window = {self.window}: a float window is a fraction of the prompt and must be in "
                "[0, 1); write an integer (e.g. 32) for a number of tokens."
            )
        if self.max_window_share is not None and not 0.0 < self.max_window_share <= 1.0:
            raise ConfigError(
                f"{WHERE}.max_window_share = {self.max_window_share}: it is the largest share of a sample's "
                "budget the recent window may take, in (0, 1] (0.5 keeps the window to half the budget); "
                "write null to keep the whole window and record the overshoot."
            )
        if self.ratio is not None and not 0.0 <= self.ratio <= 1.0:
            raise ConfigError(
                f"{WHERE}.ratio must be in [0, 1] (the fraction of prompt tokens kept), got {self.ratio}. "
                "For an absolute budget write `tokens: N` instead."
            )
        if self.tokens is not None and self.tokens < self.protected:
            raise ConfigError(
                f"{WHERE}.tokens = {self.tokens} is below the protected tokens (window {self.window} + sinks "
                f"{self.sinks} = {self.protected}), which are always kept. Raise the budget to at least "
                f"{self.protected} or shrink the window."
            )

    @property
    def window_is_ratio(self) -> bool:
        """True when ``window`` is a fraction of each prompt rather than a token count."""
        return isinstance(self.window, float)

    @property
    def protected(self) -> int:
        """Protected tokens known from the config alone (the sinks only, for a ratio window)."""
        if self.window_is_ratio:
            return self.sinks
        window = int(self.window)
        if self.max_window_share is not None and self.tokens is not None:
            window = min(window, int(self.tokens * self.max_window_share))
        return window + self.sinks

    def asked(self, lengths: torch.Tensor) -> torch.Tensor:
        """The per-head budget the config asks for each sample, ``[B]`` long (before protection)."""
        if self.tokens is not None:
            return torch.full_like(lengths, self.tokens)
        return torch.floor(lengths.double() * self.ratio).long()

    def window_counts(self, lengths: torch.Tensor) -> torch.Tensor:
        """Recent-window tokens of each sample, ``[B]`` long: ``window`` (a ratio window floored per
        sample), shrunk to ``floor(max_window_share * asked)`` when that share is set."""
        if self.window_is_ratio:
            window = torch.floor(lengths.double() * self.window).long()
        else:
            window = torch.full_like(lengths, int(self.window))
        if self.max_window_share is not None:
            share = torch.floor(self.asked(lengths).double() * self.max_window_share).long()
            window = torch.minimum(window, share)
        return window

    def per_sample(self, lengths: torch.Tensor) -> torch.Tensor:
        """Per-head budget of each sample, ``[B]`` long, from prompt lengths ``[B]``: the asked
        budget, raised to the protected tokens where they do not fit (see :meth:`overshoot`)."""
        return torch.maximum(self.asked(lengths), self.protected_counts(lengths))

    def overshoot(self, lengths: torch.Tensor) -> torch.Tensor:
        """Tokens per head each sample keeps beyond its asked budget because its protected
        tokens do not fit, ``[B]`` long (0 when the budget holds or the prompt is not compressed)."""
        asked = self.asked(lengths)
        return torch.where(asked >= lengths, 0, self.per_sample(lengths) - asked)

    def protected_counts(self, lengths: torch.Tensor) -> torch.Tensor:
        """Protected tokens per sample, ``[B]`` (never more than the prompt)."""
        return torch.clamp(self.window_counts(lengths) + self.sinks, max=lengths)

    def protected_mask(self, valid: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` bool: the last ``window`` and first ``sinks`` valid tokens of each sample."""
        pos = sample_positions(valid)
        lengths = valid.sum(-1, keepdim=True)
        recent = pos >= lengths - self.window_counts(lengths[:, 0])[:, None]
        sink = pos < self.sinks
        return valid & (recent | sink)


@dataclass(frozen=True)
class TargetBudget(Budget):
    """A per-sample token target ``targets [B]`` in place of ``tokens`` / ``ratio`` (decode-time
    compression, a progressive prefill's steps); the window, sinks and window share are the
    configured budget's."""

    targets: torch.Tensor | None = None

    def asked(self, lengths: torch.Tensor) -> torch.Tensor:
        return self.targets.to(lengths.device)
