"""``synthetic_counting`` (count from 1 to N and stop at N) and its metric ``counts_to_answer``."""

from __future__ import annotations

import random
from itertools import combinations

import pytest

from kvlab.config.errors import ConfigError
from kvlab.data import DATASETS, Sample, build_dataset
from kvlab.data.counting import SyntheticCounting
from kvlab.metrics.tasks import SAMPLE_CHECKS, TASK_METRICS, score_output


def test_generation_is_deterministic_and_seeded_per_sample():
    def fields(dataset):
        return [(s.id, s.prompt, s.answers, s.max_new_tokens, s.meta) for s in dataset.samples()]

    samples = SyntheticCounting(num_samples=12, seed=3).samples()
    first = fields(SyntheticCounting(num_samples=12, seed=3))
    assert first == fields(SyntheticCounting(num_samples=12, seed=3))
    for i, sample in enumerate(samples):
        n = random.Random(f"3:{i}").randint(15, 30)  # sample i's own generator
        assert sample.prompt == f"Count from 1 to {n}. Stop at {n}."
        assert sample.answers == [str(n)] and sample.meta == {"task": "synthetic_counting", "count": n}
        assert sample.max_new_tokens == 8 * n + 16
    # a prefix of a longer set is the same samples; another seed gives other counts
    assert fields(SyntheticCounting(num_samples=5, seed=3)) == first[:5]
    other = [s.answers for s in SyntheticCounting(num_samples=12, seed=4).samples()]
    assert other != [s.answers for s in samples]
    assert "synthetic_counting" in DATASETS.names()
    built = build_dataset({"name": "synthetic_counting", "num_samples": 3, "min_count": 4, "max_count": 4})
    assert [s.answers for s in built.samples()] == [["4"]] * 3
    assert built.metrics == ("counts_to_answer", "contains_answer")


@pytest.mark.parametrize(
    "output, score",
    [
        ("1, 2, 3, 4, 5", 1.0),
        ("1. 1\n2. 2\n3. 3\n4. 4\n5. 5\n\nThe answer is 5.", 1.0),  # a line "k. k" per number
        ("1. 1. 1. 2. 2. 3. 4. 5.", 1.0),  # repeats between the numbers counted
        ("1. 1. 5.\n2. 2. 5.\n3. 3. 5.\n4. 4. 5.\n5. 5. 5.", 1.0),  # the target echoed on every line
        ("5.", 0.0),  # names N without counting
        ("Count from 1 to 5.", 0.0),  # 1 then 5: 2, 3, 4 missing
        ("1, 2, 3, 4, 5, 6, 7", 0.0),  # ran past N
        ("1, 2, 3, 4", 0.0),  # stopped before N
        ("1, 2, 4, 5", 0.0),  # skipped 3
        ("", 0.0),
    ],
)
def test_counts_to_answer(output, score):
    sample = Sample("c", "Count from 1 to 5. Stop at 5.", answers=["5"])
    assert score_output(output, sample, ["counts_to_answer"]) == {"counts_to_answer": score}


def test_counts_to_answer_against_a_brute_force_reading():
    """Random outputs of numbers: the score is 1 exactly when 1..N is a subsequence and N is last."""
    rng = random.Random(0)
    metric = TASK_METRICS["counts_to_answer"]
    for _ in range(500):
        n = rng.randint(1, 6)
        numbers = [rng.randint(1, 7) for _ in range(rng.randint(0, 10))]
        output = " ".join(f"{x}." for x in numbers)
        subsequence = any(  # brute force: some increasing choice of indices reads 1, 2, ..., n
            [numbers[i] for i in pick] == list(range(1, n + 1)) for pick in _increasing_picks(len(numbers), n)
        )
        expected = float(subsequence and numbers[-1] == n)
        assert metric(output, Sample("r", "?", answers=[str(n)])) == expected, (output, n)


def _increasing_picks(length: int, k: int):
    return combinations(range(length), k)


def test_refusals():
    with pytest.raises(ConfigError, match="min_count"):
        SyntheticCounting(min_count=10, max_count=5)
    with pytest.raises(ConfigError, match="num_samples"):
        SyntheticCounting(num_samples=0)
    assert SAMPLE_CHECKS["counts_to_answer"](Sample("x", "?", answers=["five"])) is not None
    assert SAMPLE_CHECKS["counts_to_answer"](Sample("x", "?", answers=["5"])) is None
