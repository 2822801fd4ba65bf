"""``math500`` and ``aime25``: math reasoning, scored by an established answer checker.

MATH-500 (Lightman et al. 2023, "Let's Verify Step by Step": 500 problems of Hendrycks et al.'s
MATH test set; ``HuggingFaceH4/MATH-500``, split ``test``: ``problem``, ``solution``, ``answer``,
``subject``, ``level``, ``unique_id``) and AIME 2025 (the 30 problems of the 2025 American
Invitational Mathematics Examination I and II; e.g. ``math-ai/aime25``, split ``test``:
``problem``, ``answer``, ``id``; a ``question`` column is read as the problem too). Both are
what decode-time KV compression papers report (R-KV, Cai et al. 2025; kvpress' decoding
presses): long generations from a short prompt, so the protocols that matter are
``query_aware`` (nothing to compress but the prompt) and ``decode_time`` (the cache compressed
while the model reasons; ``docs/protocols.md``).

Neither benchmark ships a prompt: kvlab uses the one DeepSeek-AI recommends for evaluating
DeepSeek-R1 (``{problem}`` followed by "Please reason step by step, and put your final answer
within \\boxed{}."), the common choice for reasoning models. ``max_new_tokens`` is the dataset's
parameter (default 4096). Scored by ``math_verify_accuracy`` (Hugging Face's Math-Verify,
:mod:`kvlab.metrics.suites.math`).

``path``: a JSON-lines file, a directory holding ``test.jsonl`` (or ``<name>.jsonl``), a
``save_to_disk`` directory, or the Hub id (offline runs need a cached copy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.config.errors import ConfigError
from kvlab.data.benchmarks.common import check_count, read_task_rows
from kvlab.data.datasets import DATASETS, check_metrics
from kvlab.data.sample import Sample

__all__ = ["MATH_PROMPT", "Aime25Dataset", "Math500Dataset"]

#: DeepSeek-R1's recommended evaluation prompt
MATH_PROMPT = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def _rows(path: str, name: str) -> list[dict[str, Any]]:
    local = Path(path).expanduser()
    if local.is_file():
        return read_task_rows(str(local.parent), name, [local.name], None, "test")
    return read_task_rows(path, name, ["test.jsonl", f"{name}.jsonl"], None, "test")


@dataclass
class _MathDataset:
    """Problems read from ``path`` (see the module docstring); ``limit``: the first N;
    ``max_new_tokens``: each sample's generation limit."""

    path: str
    limit: int | None = None
    max_new_tokens: int = 4096
    metrics: tuple[str, ...] = ("math_verify_accuracy",)
    _rows: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)

    NAME = "math"

    def __post_init__(self) -> None:
        check_count(self.limit, "limit", allow_none=True)
        check_count(self.max_new_tokens, "max_new_tokens")
        self.metrics = check_metrics(self.metrics)
        rows = _rows(self.path, self.NAME)
        rows = rows[: self.limit] if self.limit is not None else rows
        for index, row in enumerate(rows):
            problem = row.get("problem", row.get("question"))
            answer = row.get("answer")
            if (
                not isinstance(problem, str)
                or not problem.strip()
                or answer is None
                or str(answer).strip() == ""
            ):
                raise ConfigError(
                    f"data.dataset.path: {self.NAME} row {index} needs a 'problem' (or 'question') and an "
                    f"'answer' (fields: {', '.join(row)})."
                )
        if not rows:
            raise ConfigError(f"data.dataset.path: {self.path} has no {self.NAME} problems.")
        self._rows = rows

    def samples(self) -> list[Sample]:
        """One sample per problem, the answer as its reference (``meta``: the row's other fields)."""
        out = []
        for index, row in enumerate(self._rows):
            problem = row.get("problem", row.get("question"))
            source_id = row.get("unique_id", row.get("id", index))
            meta = {"suite": self.NAME, "task": self.NAME, "source_id": source_id}
            meta.update({k: row[k] for k in ("subject", "level") if k in row})
            out.append(
                Sample(
                    id=f"{self.NAME}-{index:04d}",
                    prompt=MATH_PROMPT.format(problem=problem.strip()),
                    answers=[str(row["answer"]).strip()],
                    max_new_tokens=self.max_new_tokens,
                    meta=meta,
                )
            )
        return out


@DATASETS.register("math500")
@dataclass
class Math500Dataset(_MathDataset):
    """MATH-500 (``HuggingFaceH4/MATH-500`` or a local copy), scored by ``math_verify_accuracy``."""

    NAME = "math500"


@DATASETS.register("aime25")
@dataclass
class Aime25Dataset(_MathDataset):
    """AIME 2025 (e.g. ``math-ai/aime25`` or a local copy), scored by ``math_verify_accuracy``."""

    NAME = "aime25"
