"""``needle_haystack``: the needle-in-a-haystack grid (depth x length) and its heatmap.

Kamradt's test (gkamradt/LLMTest_NeedleInAHaystack, ``needlehaystack/llm_needle_haystack_tester.py``
and ``providers/huggingface.py``, the provider for local models) hides one sentence (the needle)
in a haystack of essays cut to each context length, at each depth, and asks for it:

- context: the haystack's tokens cut to ``length - buffer`` (``final_context_length_buffer``,
  200: room for the system message, the question and the answer) minus the needle; the needle's
  tokens go in at ``int(n * depth / 100)``, moved back to just after the previous period token
  (depth 100: at the end); tokens are those of the ``tokenizer`` model (null: the run's model);
- prompt: the provider's system message, and the user turn ``"\\n<context>\\n{context}\\n</context>\\n"
  + "\\n\\n" + "\\n<question>\\n{question}\\n</question>\\n" + "\\n\\nDon't give information outside
  the document or repeat your findings. Just provide the most relevant sentence in the context."``
  (``Sample.question`` is everything after the context); 300 new tokens.

The haystack is Paul Graham's essays there; offline, kvlab generates filler prose unless
``haystack_path`` points at the essays (a directory of .txt files, as the repository ships them).
The reference scores with an LLM judge (1-10); kvlab scores ``needle_rouge1`` (NVIDIA kvpress's
replacement: the ``rouge`` package's ROUGE-1 F of the answer against the needle).
:func:`needle_heatmap` draws the usual figure from a run's predictions.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.config.errors import ConfigError
from kvlab.config.registry import context_field
from kvlab.data.benchmarks.common import HaystackWords, check_count
from kvlab.data.datasets import DATASETS, check_metrics
from kvlab.data.sample import Sample
from kvlab.data.tokens import (
    ProcessorSource,
    TokenCounter,
    check_tokenizer_name,
    require_tokenizer,
)

__all__ = ["NeedleHaystack", "needle_grid", "needle_heatmap"]

NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
QUESTION = "What is the best thing to do in San Francisco?"
SYSTEM = "You are a helpful AI bot that answers questions for a user. Keep your response short and direct"
CONTEXT_PROMPT = "\n<context>\n{context}\n</context>\n"
QUESTION_PROMPT = "\n<question>\n{question}\n</question>\n"
INSTRUCTION = (
    "\n\nDon't give information outside the document or repeat your findings. Just provide the most "
    "relevant sentence in the context."
)
MAX_NEW_TOKENS = 300


@DATASETS.register("needle_haystack")
@dataclass
class NeedleHaystack:
    """Needle-in-a-haystack grid: one sample per (length, depth, repeat).

    ``lengths``: context lengths in tokens of the ``tokenizer`` model (null: the run's model),
    ``depths``: needle depths in percent of the context (0 = start, 100 = end); ``repeats``:
    samples per cell (each a different stretch of the generated haystack). ``needle``,
    ``question``, ``buffer`` (tokens kept free of haystack), ``haystack_path``: as in the
    reference. ``Sample.meta`` records ``length``, ``depth`` and ``prompt_tokens``.
    """

    lengths: list[int] = field(default_factory=lambda: [1000, 2000, 4000])
    depths: list[float] = field(default_factory=lambda: [0.0, 25.0, 50.0, 75.0, 100.0])
    repeats: int = 1
    needle: str = NEEDLE
    question: str = QUESTION
    buffer: int = 200
    haystack_path: str | None = None
    tokenizer: str | None = None
    processors: ProcessorSource | None = context_field()  # loads the tokenizer's processor (kvlab's)
    seed: int = 0
    metrics: tuple[str, ...] = ("needle_rouge1",)

    def __post_init__(self) -> None:
        if (
            isinstance(self.lengths, int | str)
            or not self.lengths
            or any(isinstance(n, bool) or not isinstance(n, int) for n in self.lengths)
        ):
            raise ConfigError(
                f"data.dataset.lengths must be a non-empty list of token counts, got {self.lengths!r}."
            )
        check_count(self.buffer, "buffer", least=0)
        if any(n <= self.buffer + 16 for n in self.lengths):
            raise ConfigError(
                f"data.dataset.lengths must each exceed buffer + 16 = {self.buffer + 16} tokens (the buffer "
                f"is kept free for the system message, question and answer), got {self.lengths}."
            )
        if (
            isinstance(self.depths, int | float | str)
            or not self.depths
            or any(
                isinstance(d, bool) or not isinstance(d, int | float) or not 0 <= d <= 100
                for d in self.depths
            )
        ):
            raise ConfigError(
                "data.dataset.depths must be a non-empty list of percentages in [0, 100], got "
                f"{self.depths!r}."
            )
        self.lengths, self.depths = list(self.lengths), [float(d) for d in self.depths]
        check_count(self.repeats, "repeats")
        check_count(self.seed, "seed", least=0)
        for name in ("needle", "question"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ConfigError(f"data.dataset.{name} must be a non-empty string.")
        check_tokenizer_name(self.tokenizer, self.processors)
        self.metrics = check_metrics(self.metrics)
        self._haystack = HaystackWords(self.haystack_path, self.seed)

    def samples(self) -> list[Sample]:
        """Every (length, depth, repeat) cell, lengths outermost."""
        counter = require_tokenizer(self.tokenizer, self.processors, "needle_haystack", "lengths")
        needle_ids = counter.ids(self.needle)
        periods = set(counter.ids("."))
        question = (
            CONTEXT_PROMPT.partition("{context}")[2] + "\n\n" + QUESTION_PROMPT.format(question=self.question)
        )
        question += INSTRUCTION
        head = CONTEXT_PROMPT.partition("{context}")[0]
        out = []
        for repeat in range(self.repeats):
            haystack = self._haystack_ids(counter, max(self.lengths), repeat)
            for length in self.lengths:
                budget = length - self.buffer
                context_ids = haystack[:length]
                if len(context_ids) + len(needle_ids) > budget:
                    context_ids = context_ids[: budget - len(needle_ids)]
                for depth in self.depths:
                    text = counter.decode(self._insert(context_ids, needle_ids, depth, periods))
                    sample = Sample(
                        id=f"needle-{length}-{depth:g}-{repeat}",
                        prompt=head + text + question,
                        question=question,
                        system=SYSTEM,
                        answers=[self.needle.strip()],
                        max_new_tokens=MAX_NEW_TOKENS,
                        meta={"suite": "needle_haystack", "task": "needle", "length": length, "depth": depth},
                    )
                    sample.meta["prompt_tokens"] = counter.count_prompt(sample)
                    out.append(sample)
        return out

    def _haystack_ids(self, counter: TokenCounter, tokens: int, repeat: int) -> list[int]:
        """At least ``tokens`` haystack tokens; repeat ``r`` starts ``r`` x 1000 words in."""
        words = 2 * tokens
        while True:
            ids = counter.ids(" ".join(self._haystack.take(repeat * 1000 + words)[repeat * 1000 :]))
            if len(ids) >= tokens:
                return ids
            words *= 2

    @staticmethod
    def _insert(context: list[int], needle: list[int], depth: float, periods: set[int]) -> list[int]:
        """The reference's ``insert_needle``: after the last period token before the depth."""
        if depth == 100:
            return context + needle
        point = int(len(context) * (depth / 100))
        while point > 0 and context[point - 1] not in periods:
            point -= 1
        return context[:point] + needle + context[point:]


def _rows(predictions: str | Path | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(predictions, str | Path):
        path = Path(predictions)
        if path.is_dir():
            path = path / "predictions.jsonl"
        if not path.is_file():
            raise ConfigError(
                f"needle_heatmap: no predictions file at {path}. Point it at a run's predictions.jsonl."
            )
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return list(predictions)


def needle_grid(
    predictions: str | Path | Iterable[dict[str, Any]], metric: str = "needle_rouge1"
) -> tuple[list[int], list[float], list[list[float]]]:
    """``(lengths, depths, scores)``: the mean ``metric`` of each (depth, length) cell of a
    needle run (``scores[i][j]``: depth ``i``, length ``j``; NaN for an empty cell)."""
    cells: dict[tuple[float, int], list[float]] = defaultdict(list)
    for row in _rows(predictions):
        meta = row.get("meta") or {}
        if "depth" in meta and "length" in meta and row.get(metric) is not None:
            cells[(float(meta["depth"]), int(meta["length"]))].append(float(row[metric]))
    if not cells:
        raise ConfigError(
            f"needle_heatmap: no prediction has meta.depth, meta.length and a '{metric}' score; plot the "
            "predictions of a needle_haystack run (or name the metric it was scored with)."
        )
    lengths = sorted({length for _, length in cells})
    depths = sorted({depth for depth, _ in cells})
    scores = [
        [sum(cells[(d, n)]) / len(cells[(d, n)]) if cells.get((d, n)) else float("nan") for n in lengths]
        for d in depths
    ]
    return lengths, depths, scores


def needle_heatmap(
    predictions_path_or_rows: str | Path | Sequence[dict[str, Any]],
    out_png: str | Path,
    metric: str = "needle_rouge1",
    title: str | None = None,
) -> Path:
    """Draw the needle-in-a-haystack heatmap of a run and save it as ``out_png``.

    Args:
        predictions_path_or_rows: a run directory, its ``predictions.jsonl``, or its records.
        out_png: the image file to write (parent directories are created).
        metric: the per-sample score to average in each cell (in [0, 1]).
        title: the figure title (default: the metric and the overall mean).

    Returns:
        The path written. Depth is on the vertical axis (0% at the top), context length in tokens
        on the horizontal axis; the colour scale runs red (0) - yellow - green (1), as in the
        reference's figures, with a colour bar.
    """
    import matplotlib  # matplotlib: optional (the dev extra), needed only to draw the heatmap

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap

    lengths, depths, scores = needle_grid(predictions_path_or_rows, metric)
    values = [v for row in scores for v in row if v == v]
    mean = sum(values) / len(values)
    cmap = LinearSegmentedColormap.from_list("needle", ["#F0496E", "#EBB839", "#0CD79F"])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(lengths) + 3), max(4.0, 0.35 * len(depths) + 2)))
    image = ax.imshow(scores, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], rotation=45, ha="right")
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("Context length (tokens)")
    ax.set_ylabel("Needle depth (%)")
    ax.set_title(title or f"Needle in a haystack: {metric} (mean {mean:.2f})")
    fig.colorbar(image, ax=ax, label=metric)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
