"""Fidelity of a compressed run to the uncompressed (full-cache) model on the same prompt.

Per sample, with ``y`` the full model's greedy tokens (eos excluded) and ``c`` the compressed
model's:

- ``fidelity_exact``: 1 if ``c == y`` else 0;
- ``fidelity_token_match``: ``#{i: c_i == y_i} / max(|c|, |y|)`` (1 when both are empty);
- ``fidelity_rouge_l``: ROUGE-L F1 of ``c`` vs ``y`` over token ids;
- teacher forcing: the compressed model is fed ``y`` (after its compressed prefill) and its
  next-token distribution ``q_i`` at each of the ``n = min(|y| + 1, max_new_tokens)`` positions
  the full model decided (the ``|y|`` tokens and the eos, if it stopped on one) is compared
  with the full model's ``p_i``:
  ``fidelity_kl`` = mean_i KL(p_i || q_i) in nats and ``fidelity_top1`` = mean_i
  [argmax q_i == argmax p_i]; ``fidelity_positions`` = n.

The full distribution is stored as its top ``K`` = :data:`REFERENCE_TOPK` log-probabilities
(the whole vocabulary when it is smaller); the rest of the vocabulary is one "other" bucket, so
KL is that of the two distributions over ``K + 1`` outcomes: exact when ``K`` covers the
vocabulary, otherwise a lower bound short of the true KL by ``p_other * KL(p|other || q|other)``.

Run aggregates are token-weighted for the teacher-forced values (sum over all positions of all
samples / total positions) and sample means for the greedy ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchmetrics import Metric

from kvlab.metrics.means import SampleMeans, record_values
from kvlab.metrics.text import position_match, rouge_l

REFERENCE_TOPK = 1024
GREEDY_FIELDS = ("fidelity_exact", "fidelity_token_match", "fidelity_rouge_l")
TEACHER_FIELDS = ("fidelity_kl", "fidelity_top1", "fidelity_positions")


@dataclass
class Reference:
    """The full model's output for one sample.

    Attributes:
        tokens: greedy tokens (eos excluded).
        logprobs: ``[n, K]`` float32 top-K log-probabilities per decided position, descending.
        ids: ``[n, K]`` long, their token ids (``ids[:, 0]`` is the full model's choice).
    """

    tokens: list[int]
    logprobs: torch.Tensor
    ids: torch.Tensor

    @property
    def positions(self) -> int:
        return int(self.logprobs.shape[0])

    @classmethod
    def from_logits(
        cls, tokens: list[int], step_logits: torch.Tensor, topk: int = REFERENCE_TOPK
    ) -> Reference:
        """From a full run's greedy ``tokens`` and its ``[S, V]`` step logits."""
        n = min(len(tokens) + 1, step_logits.shape[0])
        logprobs = torch.log_softmax(step_logits[:n].float(), dim=-1)
        values, ids = logprobs.topk(min(topk, logprobs.shape[-1]), dim=-1)
        return cls(list(tokens), values.contiguous(), ids.contiguous())


def teacher_tokens(refs: list[Reference], pad_id: int) -> torch.Tensor:
    """``[B, S]`` tokens to feed for teacher forcing (``S`` = most positions; rows padded)."""
    steps = max(ref.positions for ref in refs)
    out = torch.full((len(refs), steps), pad_id, dtype=torch.long)
    for b, ref in enumerate(refs):
        row = ref.tokens[:steps]
        out[b, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def teacher_forced_sums(ref: Reference, logits: torch.Tensor) -> tuple[float, float]:
    """``(sum_i KL(p_i || q_i), sum_i [top-1 agrees])`` over the reference's positions.

    ``logits``: the compressed model's ``[>= n, V]`` logits when fed ``ref.tokens``.
    """
    n = ref.positions
    q_all = torch.log_softmax(logits[:n].double(), dim=-1)  # [n, V]; float64: KL is a small difference
    log_p = ref.logprobs.double()
    log_q = q_all.gather(-1, ref.ids)  # [n, K]
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    if ref.ids.shape[-1] < q_all.shape[-1]:  # the rest of the vocabulary is one "other" outcome
        p_other = (1 - log_p.exp().sum(-1)).clamp(min=0)
        q_other = (1 - log_q.exp().sum(-1)).clamp(min=1e-300)
        kl = kl + torch.where(p_other > 0, p_other * (p_other.clamp(min=1e-300).log() - q_other.log()), 0.0)
    top1 = q_all.argmax(-1) == ref.ids[:, 0]
    return float(kl.clamp(min=0).sum()), float(top1.sum())


def fidelity_values(
    ref: Reference, tokens: list[int], forced_logits: torch.Tensor | None
) -> dict[str, float]:
    """The per-sample fidelity fields (module docstring) of one compressed output."""
    out = {
        "fidelity_exact": float(list(tokens) == ref.tokens),
        "fidelity_token_match": position_match(tokens, ref.tokens),
        "fidelity_rouge_l": rouge_l(tokens, ref.tokens),
    }
    if forced_logits is not None:
        kl_sum, top1_sum = teacher_forced_sums(ref, forced_logits)
        out.update(
            fidelity_kl=kl_sum / ref.positions,
            fidelity_top1=top1_sum / ref.positions,
            fidelity_positions=ref.positions,
        )
    return out


class GreedyAgreement(SampleMeans):
    """Sample means of ``fidelity_exact``, ``fidelity_token_match`` and ``fidelity_rouge_l``."""

    def __init__(self, **kwargs: Any):
        super().__init__(GREEDY_FIELDS, **kwargs)


class TeacherForcedAgreement(Metric):
    """Token-weighted ``fidelity_kl`` and ``fidelity_top1`` over all teacher-forced positions.

    ``update(kl_sum [B], top1_sum [B], positions [B])``: per-sample sums over positions.
    """

    full_state_update = False

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        for name in ("kl_sum", "top1_sum", "positions"):
            self.add_state(name, torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, kl_sum: torch.Tensor, top1_sum: torch.Tensor, positions: torch.Tensor) -> None:
        self.kl_sum += kl_sum.to(torch.float64).sum()
        self.top1_sum += top1_sum.to(torch.float64).sum()
        self.positions += positions.to(torch.float64).sum()

    def compute(self) -> dict[str, float]:
        n = float(self.positions)
        if n == 0:
            return {}
        return {"fidelity_kl": float(self.kl_sum) / n, "fidelity_top1": float(self.top1_sum) / n}

    def update_records(self, records: list[dict[str, Any]]) -> None:
        """Update from prediction records (their per-sample means times their positions)."""
        values = record_values(records, TEACHER_FIELDS)
        present = ~torch.isnan(values["fidelity_positions"])
        if present.any():
            n = values["fidelity_positions"][present]
            self.update(values["fidelity_kl"][present] * n, values["fidelity_top1"][present] * n, n)
