"""``synthetic_counting``: count from 1 to N and stop there, a task whose answer is a long output.

A reasoning-style task for decode-time compression (R-KV, the ``decode_time`` protocol): the
model writes a chain of ``N`` numbers (about 3 to 7 tokens each with SmolLM2's formats, so 45
to 210 tokens for N in 15..30) and must stop at ``N``, which only the prompt holds. Scored by
``counts_to_answer`` (the output's integers hold 1, 2, ..., N in order and the last is N: it
counted there and stopped), so a cache that keeps the recent chain but loses the prompt's ``N``
counts on past it, and an output that only names N ("19.") does not count. Each sample ``i``
draws ``N`` from its own ``random.Random(f"{seed}:{i}")``, so the same parameters always give
the same samples.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvlab.config.errors import ConfigError
from kvlab.data.datasets import DATASETS, check_metrics
from kvlab.data.sample import Sample
from kvlab.data.synthetic import check_num_samples

#: generated tokens allowed per number counted, plus a margin: SmolLM2's longest format, a line
#: "17. 17" per number, takes 7 tokens (its digits one token each); a shorter chain stops early
TOKENS_PER_NUMBER, TOKEN_MARGIN = 8, 16


@DATASETS.register("synthetic_counting")
@dataclass
class SyntheticCounting:
    """Count from 1 to N and stop at N (N uniform in [``min_count``, ``max_count``]; answer: N).

    The prompt is "Count from 1 to N. Stop at N."; each sample's ``max_new_tokens`` is
    ``8 N + 16`` (the chain in the model's longest format, and room to overshoot). ``Sample.meta``
    records ``task`` and ``count`` (N). Default metrics: ``counts_to_answer`` (the output counts
    1, 2, ..., N and its last integer is N), then ``contains_answer`` (N occurs in the output,
    which a chain that runs past N, or an output naming N alone, also satisfies).
    """

    num_samples: int = 20
    min_count: int = 15
    max_count: int = 30
    metrics: tuple[str, ...] = ("counts_to_answer", "contains_answer")
    seed: int = 0

    def __post_init__(self) -> None:
        check_num_samples(self.num_samples)
        self.metrics = check_metrics(self.metrics)
        if not 2 <= self.min_count <= self.max_count:
            raise ConfigError(
                f"min_count {self.min_count} and max_count {self.max_count}: need 2 <= min_count <= "
                "max_count. Fix data.dataset.min_count / data.dataset.max_count."
            )

    def samples(self) -> list[Sample]:
        """``num_samples`` counting prompts."""
        return [self._sample(i) for i in range(self.num_samples)]

    def _sample(self, index: int) -> Sample:
        count = random.Random(f"{self.seed}:{index}").randint(self.min_count, self.max_count)
        return Sample(
            id=f"counting-{index:04d}",
            prompt=f"Count from 1 to {count}. Stop at {count}.",
            answers=[str(count)],
            max_new_tokens=TOKENS_PER_NUMBER * count + TOKEN_MARGIN,
            meta={"task": "synthetic_counting", "count": count},
        )
