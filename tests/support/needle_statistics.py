"""Calibration statistics that score heads by a needle span (DuoAttention's attention mass, HeadKV's
retrieval-reasoning score) checked against their loop references on a hand-made layer context."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from naive.context import make_ctx, sample_lists

from kvlab.calibration.statistics import CALIBRATIONS, CalibrationBatch

#: ``naive(q, k, scaling, answer_tokens, needle) -> per-head scores`` of one sample (lists, fp64)
NaiveHeadScore = Callable[..., Sequence[float]]


def check_needle_statistic(
    name: str, naive: NaiveHeadScore, seed: int, spans: Sequence[tuple[int, int]]
) -> None:
    """Statistic ``name`` observed on two samples (19 and 14 tokens, 4 query / 2 KV heads, the last
    3 and 2 tokens the teacher-forced answer) whose needle of sample ``b`` is ``T - spans[b][0]`` to
    ``T - spans[b][1]``: its ``scores`` of the layer equal the mean of ``naive`` over the samples."""
    ctx = make_ctx([19, 14], seed=seed, num_layers=1)
    T = ctx.seq_len
    targets = torch.zeros(2, T, dtype=torch.bool)
    for b, (start, stop) in enumerate(spans):
        targets[b, T - start : T - stop] = True
    answers = torch.tensor([3, 2])
    statistic = CALIBRATIONS.build({"name": name}, "calibration")
    statistic.start(1, 4, 2)
    statistic.observe(ctx, CalibrationBatch(answer_tokens=answers, targets=targets))
    want = torch.zeros(4, dtype=torch.float64)
    for b in range(2):
        _, off, q, k, _ = sample_lists(ctx, b)
        needle = [t - off for t in range(T) if targets[b, t]]
        want += torch.tensor(naive(q, k, ctx.scaling, int(answers[b]), needle), dtype=torch.float64)
    torch.testing.assert_close(statistic.result()["scores"][0].double(), want / 2, atol=1e-5, rtol=0)
